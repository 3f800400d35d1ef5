"""Shared parts of the parallel benchmarks (`bench_tp.py`, `bench_pp.py`, `bench_zero.py`).

- `launch` starts the gloo ranks on localhost (spawned, one intra-op thread each) and hands
  rank 0's result back to the parent process; under `torchrun` the process is one rank already.
- `TorchGPT` is the plain `nn.Module` twin of megalite's GPT (learned positions, LayerNorm,
  tanh-GELU MLP of width 4h, biases, tied embeddings) that the PyTorch contenders parallelise
  with PyTorch's own tools.
- `Contender` + `measure` run the implementations step by step, interleaved and alternating who
  goes first, so the noise of a shared machine hits all of them alike; a step's time is the
  slowest rank's. `print_table` prints the result.
"""

from __future__ import annotations

import argparse
import datetime
import math
import multiprocessing as mp
import os
import queue
import socket
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from megalite.config import Config, load_config
from megalite.parallel_state import ParallelState
from megalite.training.setup import Run, build_run
from megalite.training.step import train_step

# ----------------------------------------------------------------------------- arguments


def parser(description: str, microbatches: int) -> argparse.ArgumentParser:
    """The options every benchmark shares; `microbatches` is the script's default m."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--micro-batch", type=int, default=4, help="samples per micro-batch")
    p.add_argument(
        "--microbatches", type=int, default=microbatches, help="micro-batches per step per replica"
    )
    p.add_argument("--steps", type=int, default=10, help="timed steps per contender")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--torch-adamw",
        choices=("default", "foreach", "fused"),
        default="default",
        help="torch.optim.AdamW implementation of the PyTorch contenders (default: torch's pick)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a rank gives up")
    return p


def global_batch(args: argparse.Namespace, dp: int = 1) -> int:
    return args.micro_batch * args.microbatches * dp


# ----------------------------------------------------------------------------- launching


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world_size, port, worker, args, results, timeout_s) -> None:
    torch.set_num_threads(1)  # two cores, two ranks: no fighting over them
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        results.put((rank, "ok", worker(args)))
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def launch(worker: Callable[[argparse.Namespace], Any], world_size: int, args) -> Any:
    """Run `worker(args)` on `world_size` gloo ranks and return rank 0's result.

    Started by `python tools/bench_x.py`, this spawns the ranks itself (tcp:// rendezvous on a
    free port). Under `torchrun --nproc-per-node N` it joins torchrun's world instead and
    returns rank 0's result on rank 0 and None elsewhere.
    """
    if "TORCHELASTIC_RUN_ID" in os.environ:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
        if dist.get_world_size() != world_size:
            raise SystemExit(f"this benchmark needs --nproc-per-node {world_size}")
        result = worker(args)
        dist.destroy_process_group()
        return result if int(os.environ["RANK"]) == 0 else None
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_rank_main, args=(rank, world_size, port, worker, args, results, args.timeout)
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outcome: dict[int, tuple[str, Any]] = {}
    try:
        while len(outcome) < world_size:
            rank, status, payload = results.get(timeout=args.timeout + 60)
            outcome[rank] = (status, payload)
            if status == "error":
                raise SystemExit(f"rank {rank} failed:\n{payload}")
    except queue.Empty:
        raise SystemExit(f"no result within {args.timeout + 60:.0f} s: ranks hung") from None
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
    return outcome[0][1]


# ----------------------------------------------------------------------------- data


def make_batches(args: argparse.Namespace, count: int, batch: int) -> list[torch.Tensor]:
    """`count` global batches of (batch, seq + 1) token ids, identical on every rank: draws from
    a fixed Zipf-like unigram distribution (seeded), so the loss visibly falls in a few steps."""
    generator = torch.Generator().manual_seed(args.seed)
    weights = 1.0 / torch.arange(1, args.vocab + 1, dtype=torch.float64)
    weights = weights[torch.randperm(args.vocab, generator=generator)]
    n = batch * (args.seq + 1)
    return [
        torch.multinomial(weights, n, True, generator=generator).view(batch, args.seq + 1)
        for _ in range(count)
    ]


# ----------------------------------------------------------------------------- megalite


def megalite_config(args: argparse.Namespace, dp: int, **parallel: Any) -> Config:
    """megalite's config for the benchmark model; `parallel` sets `parallel.*` keys."""
    overrides = [
        "model.arch=gpt",
        f"model.n_layers={args.layers}",
        f"model.hidden={args.hidden}",
        f"model.n_heads={args.heads}",
        f"model.vocab_size={args.vocab}",
        f"model.seq_len={args.seq}",
        "model.dropout=0.0",
        f"train.micro_batch_size={args.micro_batch}",
        f"train.global_batch_size={global_batch(args, dp)}",
        "train.precision=fp32",
        "train.device=cpu",
        f"train.seed={args.seed}",
        f"optim.lr={args.lr}",
        "optim.grad_clip=1.0",
    ]
    overrides += [f"parallel.{key}={str(value).lower()}" for key, value in parallel.items()]
    return load_config(None, overrides)


def megalite_run(cfg: Config, ps: ParallelState) -> Run:
    _, num_microbatches = cfg.layout_for_world(ps.world_size)
    return build_run(cfg, ps, num_microbatches)


def megalite_step(run: Run, lr: float) -> Callable[[torch.Tensor], dict[str, float]]:
    """One megalite `train_step` on this dp rank's slice of the global batch."""
    ps = run.ps

    def step(tokens: torch.Tensor) -> dict[str, float]:
        per_rank = tokens.shape[0] // ps.dp_size
        mine = tokens[ps.dp_rank * per_rank : (ps.dp_rank + 1) * per_rank]
        metrics = train_step(run, mine, lr)
        return {"loss": metrics.loss, "bubble": metrics.bubble_fraction}

    return step


# ----------------------------------------------------------------------------- torch model


class Embedding(nn.Module):
    """Token + learned position embeddings."""

    def __init__(self, vocab: int, hidden: int, seq: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.wte(ids) + self.wpe(positions)  # (b, s, h)


class SelfAttention(nn.Module):
    """Causal attention; works on whatever number of heads its (sharded) projections give."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.wq, self.wk, self.wv = (nn.Linear(hidden, hidden) for _ in range(3))
        self.wo = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (
            w(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # (b, local heads, s, hd)
            for w in (self.wq, self.wk, self.wv)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(hidden), SelfAttention(hidden, heads)
        self.ln_2, self.mlp = nn.LayerNorm(hidden), MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TorchGPT(nn.Module):
    """GPT-2 as megalite builds it, in plain PyTorch. `layers` picks a run of the blocks and
    `embed` / `head` whether this piece has the embedding / final norm + tied LM head (pipeline
    stages); by default it is the whole model. Returns logits (b, s, vocab)."""

    def __init__(self, args, layers: range | None = None, embed=True, head=True) -> None:
        super().__init__()
        h, layers = args.hidden, range(args.layers) if layers is None else layers
        self.embed = Embedding(args.vocab, h, args.seq) if embed else None
        self.blocks = nn.ModuleList(Block(h, args.heads) for _ in layers)
        self.ln_f = nn.LayerNorm(h) if head else None
        self.lm_head = nn.Linear(h, args.vocab, bias=False) if head else None
        self.reset_parameters(args, layers)
        if embed and head:
            self.lm_head.weight = self.embed.wte.weight

    def reset_parameters(self, args, layers: range) -> None:
        """GPT-2 init as megalite's: normal(0.02), output projections 0.02/sqrt(2L), zero
        biases, unit norms. Every piece draws from a stream of its own (the embedding, each
        block by its global index), so the weights do not depend on how the model is cut into
        pipeline stages, and the last stage's copy of the tied head equals the embedding."""

        def fill(module: nn.Module, stream: int) -> None:
            generator = torch.Generator().manual_seed(args.seed * 1009 + stream)
            for name, sub in module.named_modules():
                if isinstance(sub, (nn.Linear, nn.Embedding)):
                    scaled = name.endswith(("wo", "proj"))  # they write into the residual
                    std = 0.02 / math.sqrt(2 * args.layers) if scaled else 0.02
                    sub.weight.data.normal_(0.0, std, generator=generator)
                    if getattr(sub, "bias", None) is not None:
                        sub.bias.data.zero_()
                elif isinstance(sub, nn.LayerNorm):
                    sub.reset_parameters()  # ones and zeros

        if self.embed is not None:
            fill(self.embed, 0)
        if self.lm_head is not None:
            fill(self.lm_head, 0)  # wte's stream, drawn first there: the same values
        for block, index in zip(self.blocks, layers):
            fill(block, 1 + index)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        if self.lm_head is None:
            return x
        return self.lm_head(self.ln_f(x))


def torch_adamw(params, args: argparse.Namespace, sharded: bool = False) -> torch.optim.Optimizer:
    """AdamW as megalite's: weight decay 0.1 on matrices only, betas (0.9, 0.95), eps 1e-8;
    `sharded` wraps it in `ZeroRedundancyOptimizer` (inside a process group)."""
    params = list(params)
    # DTensor and plain parameters (tensor parallelism) in separate groups: torch's foreach
    # and fused kernels cannot take a mix of them in one call.
    groups = []
    for matrices in (True, False):
        for dtensor in (True, False):
            chosen = [
                p
                for p in params
                if (p.dim() >= 2) == matrices and isinstance(p, DTensor) == dtensor
            ]
            if chosen:
                groups.append({"params": chosen, "weight_decay": 0.1 if matrices else 0.0})
    impl = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[args.torch_adamw]
    kwargs = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **impl)
    if sharded:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of (b, s, vocab) logits."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


# ----------------------------------------------------------------------------- measuring


@dataclass
class Contender:
    """One implementation, ready to run one training step on the global batch."""

    name: str
    step: Callable[[torch.Tensor], dict[str, float]]
    """Runs a full training step on this rank and returns {"loss": ..., other values}."""
    reference: str | None = None
    """The contender this one is compared with (ratio column); None for the references."""
    times: list[float] = field(default_factory=list)
    values: dict[str, list[float]] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    """Static facts for the table (memory, notes)."""


def timed(step: Callable[[], dict[str, float]]) -> tuple[float, dict[str, float]]:
    """Run `step` on every rank at once; its time is the slowest rank's. Its values are then
    averaged over ranks, except "loss", the largest (ranks that do not compute it say 0)."""
    dist.barrier()
    start = time.perf_counter()
    result = step()
    elapsed = torch.tensor([time.perf_counter() - start, result["loss"]], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    others = sorted(key for key in result if key != "loss")
    values = torch.tensor([result[key] for key in others], dtype=torch.float64)
    dist.all_reduce(values)
    averaged = dict(zip(others, (values / dist.get_world_size()).tolist()))
    return elapsed[0].item(), {"loss": elapsed[1].item(), **averaged}


def measure(contenders: list[Contender], batches: list[torch.Tensor], warmup: int) -> None:
    """Interleave the contenders step by step, alternating the order; time every step."""
    for i, tokens in enumerate(batches):
        for contender in contenders if i % 2 == 0 else contenders[::-1]:
            elapsed, result = timed(lambda c=contender, t=tokens: c.step(t))
            if i < warmup:
                continue
            contender.times.append(elapsed)
            for key, value in result.items():
                contender.values.setdefault(key, []).append(value)


def summary(contenders: list[Contender], tokens_per_step: int) -> list[dict[str, Any]]:
    """Plain, picklable rows: medians of the timed steps plus the contenders' static info."""
    rows = []
    for c in contenders:
        step_s = statistics.median(c.times)
        row = {"name": c.name, "reference": c.reference, "step_s": step_s, "min_s": min(c.times)}
        row["tokens_s"] = tokens_per_step / step_s
        row.update({key: statistics.median(v) for key, v in c.values.items()})
        row["loss_last"] = c.values["loss"][-1]
        row.update(c.info)
        rows.append(row)
    return rows


def time_ratio(row: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """megalite step time / its torch reference's ('ref' for references themselves)."""
    if row["reference"] is None:
        return "ref"
    ref = next((r for r in rows if r["name"] == row["reference"]), None)
    return "-" if ref is None else f"{row['step_s'] / ref['step_s']:.2f}"


def print_table(columns: list[str], rows: list[list[str]], notes: list[str]) -> None:
    """A left-aligned first column, right-aligned others, then the notes."""
    widths = [max(len(str(x)) for x in col) for col in zip(columns, *rows)]

    def line(cells) -> str:
        first, *rest = cells
        return "  ".join(
            [f"{first:<{widths[0]}}", *(f"{c:>{w}}" for c, w in zip(rest, widths[1:]))]
        )

    print(line(columns))
    print("-" * len(line(columns)))
    for row in rows:
        print(line(row))
    print()
    for note in notes:
        print(note)


def common_cells(row: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """implementation, step ms (median), min ms, tokens/s, ratio, last loss."""
    return [
        row["name"],
        f"{row['step_s'] * 1e3:.1f}",
        f"{row['min_s'] * 1e3:.1f}",
        f"{row['tokens_s']:,.0f}",
        time_ratio(row, rows),
        f"{row['loss_last']:.3f}",
    ]


COMMON_COLUMNS = ["implementation", "step ms", "min ms", "tokens/s", "ratio m/t", "loss"]


def common_notes(args: argparse.Namespace, world_size: int, tokens: int) -> list[str]:
    return [
        f"fp32 CPU, {world_size} gloo ranks x 1 thread; {tokens} tokens/step "
        f"(micro-batch {args.micro_batch} x seq {args.seq} x {args.microbatches} micro-batches "
        "per replica); model "
        f"{args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab {args.vocab}.",
        f"step ms: median over {args.steps} steps after {args.warmup} warm-up steps, each the "
        "slowest rank's time (min ms: fastest step); contenders interleaved step by step.",
        "ratio m/t = megalite step time / torch step time (<= 1.00: megalite no slower). "
        "loss: the last timed step's (both sides start from different random weights).",
        f"torch side: torch.optim.AdamW ({args.torch_adamw}), clip 1.0, same batches; megalite "
        "pads the vocabulary to a multiple of 128*tp (padded rows' logits are never computed).",
    ]
