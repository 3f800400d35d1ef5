"""Single-process training throughput: megalite against Hugging Face transformers.

For each architecture (GPT-2 style and Llama style) this builds megalite's model and the
matching Hugging Face model (`GPT2LMHeadModel` / `LlamaForCausalLM`, from a config, offline)
of the same dimensions, and trains both in this process, fp32 on CPU, on the same batches with
the same optimizer: AdamW (same lr, betas, eps, weight decay on matrices only), global-norm
clipping at 1.0, a constant learning rate. Steps of the two are interleaved (and which goes
first alternates) so that the noise of a shared machine hits both alike; the table reports
medians over the steps after warm-up. After them each contender runs one more step, untimed,
whose kernel launches and host syncs are counted (`profiling.launch_count`; with `--compile`
the compiled kernels too, each carrying a profiler mark): what a GPU would wait for.

    python tools/bench_single.py                    # both architectures
    python tools/bench_single.py --arch llama --kv-heads 2 --threads 2
    python tools/bench_single.py --compile          # + megalite and transformers compiled
    python -m megalite.benchmarks.single            # the same, from an installed megalite

The batches are drawn from a fixed Zipf-like unigram distribution (seeded), so the loss has
something to learn within a few steps and a reader can see both implementations train. They
start from different initial weights, so their losses differ slightly.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from megalite.architectures import architecture
from megalite.benchmarks import harness
from megalite.benchmarks.torch_gpt import ADAMW_IMPLEMENTATIONS, torch_adamw
from megalite.checkpoint.hf import hf_config
from megalite.config import Config
from megalite.parallel_state import ParallelState
from megalite.profiling.launch_count import (
    StepCounts,
    count_step,
    counting,
    graph_breaks,
    host_step_counts,
    kernel_markers,
)
from megalite.tensor_parallel import padded_vocab_size
from megalite.training.compile import compile_seconds, compiled_graphs, recompile_limit_hits
from megalite.training.setup import build_run
from megalite.training.step import train_step

LABELS = {"gpt": "GPT-2", "llama": "Llama"}


def options() -> argparse.ArgumentParser:
    """This benchmark's command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=("gpt", "llama", "both"), default="both")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=None, help="llama only (default: heads)")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per contender")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also megalite with train.compile=true and transformers under torch.compile",
    )
    parser.add_argument(
        "--hf-adamw",
        choices=tuple(ADAMW_IMPLEMENTATIONS),
        default="default",
        help="torch.optim.AdamW implementation for the HF models (default: torch's choice)",
    )
    return parser


def megalite_config(args: argparse.Namespace, arch: str, compiled: bool = False) -> Config:
    """The benchmark model as megalite's config: one micro-batch of the whole batch."""
    overrides = [f"model.arch={arch}", f"train.compile={str(compiled).lower()}"]
    if architecture(arch).grouped_query and args.kv_heads is not None:
        overrides.append(f"model.n_kv_heads={args.kv_heads}")
    return harness.megalite_config(args, args.batch, args.batch, *overrides)


def megalite_contender(cfg: Config, lr: float) -> harness.Contender:
    training = build_run(cfg, ParallelState.single("cpu"))
    params = sum(p.numel() for p in training.named_parameters().values())

    def step(tokens: torch.Tensor) -> dict[str, float]:
        return {"loss": train_step(training, tokens, lr).loss}

    def counted(tokens: torch.Tensor) -> StepCounts:
        return count_step(training, tokens, lr)

    name = "megalite" + (" compiled" if cfg.train.compile else "")
    return harness.Contender(name, step, info={"params": params}, counted=counted)


def watch_compiles(contender: harness.Contender) -> harness.Contender:
    """The contender, its info counting the seconds its steps spent compiling ("compile_s"),
    the graphs they compiled ("graphs") and the graph breaks dynamo took for them
    ("graph_breaks"), and its recompiles as `training.compile.CompileWatch` counts them (graphs
    compiled after its first step, frames stopped at dynamo's recompile limit): the
    process-wide counters, read around each of its own steps."""
    step, info, steps_done = contender.step, contender.info, []
    info |= {"compile_s": 0.0, "recompiles": 0, "graphs": 0, "graph_breaks": 0}

    def watched(tokens: torch.Tensor) -> dict[str, float]:
        graphs, seconds, stopped = compiled_graphs(), compile_seconds(), recompile_limit_hits()
        breaks = sum(graph_breaks().values())
        result = step(tokens)
        info["compile_s"] += compile_seconds() - seconds
        info["recompiles"] += recompile_limit_hits() - stopped
        info["graphs"] += compiled_graphs() - graphs
        info["graph_breaks"] += sum(graph_breaks().values()) - breaks
        if steps_done:
            info["recompiles"] += compiled_graphs() - graphs
        steps_done.append(True)
        return result

    contender.step = watched
    return contender


def hf_model(cfg: Config) -> torch.nn.Module:
    """The Hugging Face model with megalite's dimensions (the config `megalite export-hf`
    writes), SDPA attention, no dropout."""
    from transformers import AutoModelForCausalLM

    config = hf_config(cfg.model)
    config.use_cache = False
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation="sdpa", dtype=torch.float32
    )
    return model.train()


def hf_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: Config, compile: bool = False
) -> Callable[[torch.Tensor], dict[str, float]]:
    """One training step of the Hugging Face model, doing what megalite's step does: the mean
    token loss, backward, global-norm clipping, AdamW. With train.precision=bf16 the forward
    runs under bf16 autocast (the weights stay fp32); `compile`: the forward and loss go
    through torch.compile (its first call compiles them)."""
    vocab = cfg.model.vocab_size
    device = next(model.parameters()).device
    bf16 = cfg.train.precision == "bf16"

    def mean_loss(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
            logits = model(input_ids=inputs, use_cache=False).logits  # (b, s, vocab)
        return F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))

    forward = torch.compile(mean_loss) if compile else mean_loss

    def step(tokens: torch.Tensor) -> dict[str, float]:
        optimizer.zero_grad(set_to_none=True)
        loss = forward(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        return {"loss": loss.item()}

    return step


def hf_contender(cfg: Config, lr: float, adamw: str, compiled: bool = False) -> harness.Contender:
    """transformers' model; `compiled`: its forward and loss under torch.compile (the
    optimizer step stays eager)."""
    torch.manual_seed(cfg.train.seed)
    model = hf_model(cfg)
    optimizer = torch_adamw(model.parameters(), lr, adamw)
    params = sum(p.numel() for p in model.parameters())  # tied weights are counted once
    step = hf_step(model, optimizer, cfg, compile=compiled)

    def counted(tokens: torch.Tensor) -> StepCounts:
        device = next(model.parameters()).device
        with counting(device, host=host_step_counts(optimizer)) as tally:
            step(tokens)
        return tally.counts

    name = "transformers" + (" compiled" if compiled else "")
    return harness.Contender(name, step, info={"params": params}, counted=counted)


def run(args: argparse.Namespace) -> list[dict]:
    """Measure in this process: one row per (architecture, implementation), with its step
    times and the loss of every step."""
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    archs = ["gpt", "llama"] if args.arch == "both" else [args.arch]
    batches = harness.make_batches(args, args.warmup + args.steps, args.batch)
    rows = []
    for arch in archs:
        cfg = megalite_config(args, arch)
        contenders = [megalite_contender(cfg, args.lr), hf_contender(cfg, args.lr, args.hf_adamw)]
        if args.compile:
            compiled = megalite_contender(megalite_config(args, arch, compiled=True), args.lr)
            contenders.insert(1, watch_compiles(compiled))
            hf = hf_contender(cfg, args.lr, args.hf_adamw, compiled=True)
            contenders.append(watch_compiles(hf))
        # compiled kernels carry a profiler mark, so that the counted step sees them
        with kernel_markers() if args.compile else contextlib.nullcontext():
            harness.measure(contenders, batches, args.warmup)
            for c in contenders:
                counts = c.counted(batches[-1]).total
                c.info |= {"launches": counts.launches, "host_syncs": counts.host_syncs}
        rows += [
            {"model": LABELS[arch], "implementation": c.name, "times": c.times, "losses": c.losses}
            | c.info
            for c in contenders
        ]
    return rows


def report(args: argparse.Namespace, rows: list[dict]) -> None:
    """Print the table of `run`'s rows."""
    tokens_per_step = args.batch * args.seq
    header = (
        f"{'model':<7} {'implementation':<22} {'params':>11} {'tokens/s':>10} {'step ms':>9} "
        f"{'min ms':>8} {'ratio':>7} {'paired':>7} {'launches':>8} {'syncs':>5} "
        f"{'loss first -> last':>20}"
    )
    print(header)
    print("-" * len(header))
    reference = {r["model"]: r for r in rows if r["implementation"] == "transformers"}
    for r in rows:
        step_s = statistics.median(r["times"])
        ratio = paired = "ref"
        if r["implementation"] != "transformers" and r["model"] in reference:
            hf_times = reference[r["model"]]["times"]
            ratio = f"{statistics.median(hf_times) / step_s:.2f}x"
            paired = f"{statistics.median(h / m for h, m in zip(hf_times, r['times'])):.2f}x"
        losses = f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}"
        rate = tokens_per_step / step_s
        print(
            f"{r['model']:<7} {r['implementation']:<22} {r['params']:>11,} {rate:>10,.0f} "
            f"{step_s * 1e3:>9.1f} {min(r['times']) * 1e3:>8.1f} {ratio:>7} {paired:>7} "
            f"{r['launches']:>8} {r['host_syncs']:>5} {losses:>20}"
        )
    print()
    for note in notes(args, tokens_per_step):
        print(note)
    for r in rows:
        if "compile_s" in r:
            print(
                f"{r['model']} {r['implementation']}: {r['compile_s']:.1f} s compiling (in its "
                f"first step), {r['graphs']} graphs and {r['graph_breaks']} graph breaks in all, "
                f"{r['recompiles']} graphs compiled after it."
            )


def notes(args: argparse.Namespace, tokens_per_step: int) -> list[str]:
    """How the table was measured and how to read it."""
    round_to = Config().model.vocab_round_to
    return [
        f"fp32 CPU, {torch.get_num_threads()} threads; batch {args.batch} x seq {args.seq} = "
        f"{tokens_per_step} tokens/step; tokens/s and step ms are medians over {args.steps} steps "
        f"after {args.warmup} warm-up steps (min ms: fastest step); contenders interleaved.",
        "ratio = a row's tokens/s / eager transformers' (>= 1.00x: at least as fast);"
        " paired = median over steps of the same ratio\nfor the two back-to-back steps on one "
        "batch (robust to load that drifts during the run on a shared machine).",
        f"megalite pads the vocabulary to a multiple of {round_to} rows "
        f"({args.vocab} -> {padded_vocab_size(args.vocab, 1, round_to)}; the padded rows' logits "
        "are masked out of the loss), so its params include the extra rows.",
        "launches, syncs: one more step, untimed: its operator calls that launch a kernel (ATen "
        "operators less views and allocations, compiled kernels) and host syncs (scalar reads,\n"
        "tolist, blocking copies, data-dependent sizes; torch.optim's host-side step counts "
        "aside), counted by megalite.profiling.launch_count.",
        "transformers: attn_implementation='sdpa' (its fastest CPU path), dropout 0, train mode, "
        f"torch.optim.AdamW ({args.hf_adamw}); loss = F.cross_entropy, the mean over all tokens "
        "(megalite: the same mean, from its LM head fused with the loss).",
    ]


def main(argv: list[str] | None = None) -> None:
    harness.command_line(options(), run, report, argv)


if __name__ == "__main__":
    main()
