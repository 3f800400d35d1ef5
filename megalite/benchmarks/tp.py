"""Tensor parallelism, tp=2 on two gloo ranks: megalite against PyTorch's own TP (DTensor).

Contenders, all training the same GPT-2-style model on the same global batches with AdamW
(betas 0.9/0.95, weight decay 0.1 on matrices), clipping at 1.0, fp32, m micro-batches of
gradient accumulation per step:

- megalite tp=2 (sequence parallelism off, and a row with it on);
- PyTorch: `torch_gpt.TorchGPT` (a plain nn.Module of the same dims) parallelised with
  `torch.distributed.tensor.parallel.parallelize_module` on a 1-D DeviceMesh("cpu", [0, 1]):
  q/k/v and MLP-up `ColwiseParallel`, attention-out and MLP-down `RowwiseParallel`, the token
  embedding `RowwiseParallel` (vocab-sharded), the tied LM head `ColwiseParallel` with a
  vocab-sharded output and `loss_parallel()` cross-entropy (torchtitan's plan). The "+SP" row
  adds `SequenceParallel` on the LayerNorms with `PrepareModuleInput` / `PrepareModuleOutput`
  redistributions between sequence shards and replicated activations. If a DTensor op of that
  plan fails on gloo/CPU, the table says so in that row instead of a time (on torch 2.13, CPU
  build, both plans run on gloo).

    python tools/bench_tp.py                       # forks its 2 ranks itself
    python tools/bench_tp.py --steps 12 --microbatches 8
    torchrun --nproc-per-node 2 tools/bench_tp.py  # same, launched by torchrun
    python -m megalite.benchmarks.tp               # the same, from an installed megalite

Then the activation layout's tables (`sp_layout`): the SP collectives on megalite's token
shards of (b, s, h) against dim-1 shards of (b, s, h) and (s, b, h), and the layout copies in a
tp 2 + SP step.

Gradient norm on the torch side: `torch.nn.utils.get_total_norm` over the DTensor gradients
(`.full_tensor()` of the result) combined with the norm of the plain-tensor ones (position
embedding, and the LayerNorms without SP), then the gradients are scaled in place: the stock
`clip_grad_norm_` cannot stack DTensor and plain-tensor norms together.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from megalite.benchmarks import harness, sp_layout
from megalite.benchmarks.table import COMMON_COLUMNS, common_cells, common_notes, print_table
from megalite.benchmarks.torch_gpt import TorchGPT, lm_loss, torch_adamw
from megalite.launch import run_or_join
from megalite.parallel_state import build_parallel_state

TP = 2
SP_COST = ("megalite tp=2", "megalite tp=2 + SP")
"""The rows whose step times say what sequence parallelism costs over plain TP."""


def tp_plan(n_layers: int, sequence_parallel: bool) -> dict:
    """PyTorch's TP plan for `TorchGPT`, Megatron's layout (torchtitan's plan, GPT-2 pieces)."""
    seq = Shard(1)  # the activations between layers under SP: (b, s/tp, h)
    between = seq if sequence_parallel else Replicate()
    plan = {
        "embed.wte": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(
            input_layouts=between, output_layouts=Shard(-1), use_local_output=False
        ),
    }
    if sequence_parallel:
        # wte + wpe is replicated; cut it into sequence shards (a local slice, no comm).
        plan["embed"] = PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=seq, use_local_output=True
        )
        plan["ln_f"] = SequenceParallel()
    for i in range(n_layers):
        block = {
            "attn.wq": ColwiseParallel(),
            "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=between),
            "mlp.fc": ColwiseParallel(),
            "mlp.proj": RowwiseParallel(output_layouts=between),
        }
        if sequence_parallel:
            gather = dict(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
            block |= {
                "ln_1": SequenceParallel(),
                "ln_2": SequenceParallel(),
                "attn": PrepareModuleInput(**gather),
                "mlp": PrepareModuleInput(**gather),
            }
        plan |= {f"blocks.{i}.{name}": style for name, style in block.items()}
    return plan


def clip_grads(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Global-norm clipping over a mix of DTensor and plain-tensor gradients."""
    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    sumsq = torch.zeros((), dtype=torch.float32)
    if sharded:
        norm = torch.nn.utils.get_total_norm(sharded)
        sumsq += (norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2
    if plain:
        sumsq += torch.nn.utils.get_total_norm(plain) ** 2
    total = sumsq.sqrt().item()
    coefficient = min(1.0, max_norm / (total + 1e-6))
    if coefficient < 1.0:
        for g in grads:
            g.mul_(coefficient)
    return total


def torch_tp(args: argparse.Namespace, sequence_parallel: bool) -> harness.Contender:
    mesh = init_device_mesh("cpu", (TP,))
    model = TorchGPT(args)
    parallelize_module(model, mesh, tp_plan(args.layers, sequence_parallel))
    model.lm_head.weight = model.embed.wte.weight  # re-tie: both are Shard(0) over the vocab
    params = list(model.parameters())
    optimizer = torch_adamw(params, args.lr, args.torch_adamw)
    m = args.microbatches

    def step(tokens: torch.Tensor) -> dict[str, float]:
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for chunk in tokens.split(args.micro_batch):
            with loss_parallel():
                loss = lm_loss(model(chunk[:, :-1]), chunk[:, 1:]) / m
                loss.backward()
            total += loss.full_tensor().item() if isinstance(loss, DTensor) else loss.item()
        clip_grads(params, 1.0)
        optimizer.step()
        return {"loss": total}

    name = "torch TP" + (" + SP" if sequence_parallel else "")
    return harness.Contender(name, step)


def try_torch_tp(
    args: argparse.Namespace, sequence_parallel: bool, batch: torch.Tensor
) -> harness.Contender | str:
    """The torch contender after one trial step, or the error that step raised (on gloo/CPU a
    DTensor op may be unsupported: report it rather than abort the other rows)."""
    return harness.trial(lambda: torch_tp(args, sequence_parallel), batch)


def worker(args: argparse.Namespace) -> dict:
    """One rank's part: build every contender, time them interleaved, return rank-local rows."""
    torch.manual_seed(args.seed)
    ps = build_parallel_state(TP, 1, torch.device("cpu"))
    batches = harness.make_batches(args, args.warmup + args.steps, harness.global_batch(args))
    contenders, failures = [], {}
    for sp in (False, True):
        cfg = harness.parallel_config(args, 1, tp=TP, sp=sp, pp=1, zero=0)
        training = harness.megalite_run(cfg, ps)
        torch_row = try_torch_tp(args, sp, batches[0])
        torch_name = "torch TP" + (" + SP" if sp else "")
        if isinstance(torch_row, str):
            failures[torch_name] = torch_row
            reference = "torch TP"  # compare with the plain TP row instead
        else:
            contenders.append(torch_row)
            reference = torch_name
        name = "megalite tp=2" + (" + SP" if sp else "")
        megalite = harness.Contender(name, harness.megalite_step(training, args.lr), reference)
        megalite.step(batches[0])  # the same trial step as torch's, so the losses compare
        contenders.append(megalite)
    order = sorted(contenders, key=lambda c: ("SP" in c.name, c.reference is not None))
    # megalite's two rows run back to back, so that each pair of steps whose ratio says what SP
    # costs meets the same state of the machine
    harness.measure(sorted(order, key=lambda c: c.reference is not None), batches, args.warmup)
    plain, sp = (next(c for c in order if c.name == name) for name in SP_COST)
    return {
        "rows": harness.summary(order, harness.global_batch(args) * args.seq),
        "sp_paired": quartiles([s / p for s, p in zip(sp.times, plain.times)]),
        "failures": failures,
        "layouts": sp_layout.collective_layouts(args, ps),
        "layout_steps": sp_layout.copy_share(args, ps),
    }


def quartiles(values: list[float]) -> list[float]:
    """The lower quartile, median and upper quartile of `values` (one value: itself thrice)."""
    return statistics.quantiles(values, n=4) if len(values) > 1 else values * 3


def options() -> argparse.ArgumentParser:
    """This benchmark's command line. 30 timed steps: SP's cost over TP is a few percent, and
    on a shared 2-core machine 10 steps of paired ratios spread over +-5 %."""
    parser = harness.options(__doc__.split("\n\n")[0], microbatches=4)
    parser.set_defaults(steps=30)
    return parser


def run(args: argparse.Namespace) -> dict | None:
    """Measure on TP gloo ranks: {"rows": [...], "failures": {name: traceback}} (None on the
    ranks other than 0 under torchrun)."""
    return run_or_join(TP, worker, args, timeout=args.timeout)


def report(args: argparse.Namespace, result: dict) -> None:
    """Print the table of `run`'s result."""
    rows = result["rows"]
    table = [common_cells(r, rows) for r in rows]
    for name in result["failures"]:
        table.append([f"{name} (failed, see below)", "-", "-", "-", "-", "-"])
    notes = common_notes(args, TP, harness.global_batch(args) * args.seq)
    sp_reference = next(r["reference"] for r in rows if r["name"] == "megalite tp=2 + SP")
    notes.append(f"megalite tp=2 + SP is compared with the {sp_reference!r} row.")
    plain, sp = (next(r for r in rows if r["name"] == name)["step_s"] for name in SP_COST)
    low, middle, high = (ratio - 1 for ratio in result["sp_paired"])
    notes.append(
        f"SP's cost over plain TP in megalite: {sp / plain - 1:+.1%} (median steps), "
        f"{middle:+.1%} paired (median over batches of the ratio of the two steps on one batch: "
        f"robust to load that drifts during the run; quartiles {low:+.1%} to {high:+.1%}, the "
        "spread of this machine's noise)."
    )
    for name, error in result["failures"].items():
        notes.append(f"{name} failed; its last frames:\n{error}")
    print_table(COMMON_COLUMNS, table, notes)
    sp_layout.report(args, result["layouts"], result["layout_steps"])


def main(argv: list[str] | None = None) -> None:
    harness.command_line(options(), run, report, argv)


if __name__ == "__main__":
    main()
