"""What every benchmark shares: options, the batches, megalite's side, and interleaved timing.

Contenders run step by step, interleaved and alternating who goes first, so the noise of a
shared machine hits all of them alike. On several ranks a step's time is the slowest rank's.
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megalite.config import Config, load_config
from megalite.parallel_state import ParallelState
from megalite.profiling.launch_count import StepCounts
from megalite.training.setup import Run, build_run
from megalite.training.step import train_step

# ----------------------------------------------------------------------------- options


def options(description: str, microbatches: int) -> argparse.ArgumentParser:
    """The options of the parallel benchmarks; `microbatches` is the benchmark's default m."""
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
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before the run gives up")
    return p


def command_line(
    parser: argparse.ArgumentParser,
    run: Callable[[argparse.Namespace], Any],
    report: Callable[[argparse.Namespace, Any], None],
    argv: list[str] | None = None,
) -> None:
    """A benchmark's `main`: parse, measure, print the table where the result is (rank 0 only
    under torchrun, where `run` returns None on the other ranks)."""
    args = parser.parse_args(argv)
    result = run(args)
    if result is not None:
        report(args, result)


def global_batch(args: argparse.Namespace, dp: int = 1) -> int:
    """Samples per step: m micro-batches on each of dp replicas."""
    return args.micro_batch * args.microbatches * dp


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


def megalite_config(
    args: argparse.Namespace, micro_batch: int, global_batch: int, *overrides: str
) -> Config:
    """megalite's config for the benchmark model (GPT unless `overrides` say otherwise): fp32 on
    CPU, no dropout, clipping at 1.0, the benchmark's dimensions, seed and lr."""
    base = [
        "model.arch=gpt",
        f"model.n_layers={args.layers}",
        f"model.hidden={args.hidden}",
        f"model.n_heads={args.heads}",
        f"model.vocab_size={args.vocab}",
        f"model.seq_len={args.seq}",
        "model.dropout=0.0",
        f"train.micro_batch_size={micro_batch}",
        f"train.global_batch_size={global_batch}",
        "train.precision=fp32",
        "train.device=cpu",
        f"train.seed={args.seed}",
        f"optim.lr={args.lr}",
        "optim.warmup_steps=0",
        "optim.grad_clip=1.0",
    ]
    return load_config(None, base + list(overrides))


def parallel_config(args: argparse.Namespace, dp: int, **parallel: Any) -> Config:
    """`megalite_config` with m micro-batches per replica; `parallel` sets `parallel.*` keys."""
    keys = [f"parallel.{key}={str(value).lower()}" for key, value in parallel.items()]
    return megalite_config(args, args.micro_batch, global_batch(args, dp), *keys)


def megalite_run(cfg: Config, ps: ParallelState) -> Run:
    """This rank's model, buffers and optimizer for `cfg` on the world of `ps`."""
    cfg.layout_for_world(ps.world_size)
    return build_run(cfg, ps)


def megalite_step(run: Run, lr: float) -> Callable[[torch.Tensor], dict[str, float]]:
    """One megalite `train_step` on this dp rank's slice of the global batch."""
    ps = run.ps

    def step(tokens: torch.Tensor) -> dict[str, float]:
        per_rank = tokens.shape[0] // ps.size("dp")
        mine = tokens[ps.coord("dp") * per_rank : (ps.coord("dp") + 1) * per_rank]
        metrics = train_step(run, mine, lr)
        return {"loss": metrics.loss, "bubble": metrics.bubble_fraction}

    return step


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
    """Each value of the timed steps."""
    losses: list[float] = field(default_factory=list)
    """The loss of every step, warm-up included."""
    info: dict[str, Any] = field(default_factory=dict)
    """Static facts for the table (memory, notes)."""
    warmup_times: list[float] = field(default_factory=list)
    """The untimed warm-up steps' times (the first one pays for compilation)."""
    counted: Callable[[torch.Tensor], StepCounts] | None = None
    """Runs one more step on the global batch, untimed, and returns its launches and host
    syncs (`profiling.launch_count`); None where the benchmark does not count them."""


def trial(build: Callable[[], Contender], batch: torch.Tensor) -> Contender | str:
    """The contender `build` makes, after one trial step on every rank; or the error that
    raised, so that a PyTorch feature missing on gloo/CPU fills a row of its own rather than
    ending the benchmark (every rank drops the contender if any rank failed)."""
    contender, error = None, None
    try:
        contender = build()
        contender.step(batch)
    except Exception:
        error = traceback.format_exc(limit=-4)
    ok = torch.tensor(0.0 if error else 1.0)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if ok.item() == 1.0:
        return contender
    return error or "failed on the other rank"


def timed(step: Callable[[], dict[str, float]]) -> tuple[float, dict[str, float]]:
    """Run `step` on every rank at once; its time is the slowest rank's. Its values are then
    averaged over ranks, except "loss", the largest (ranks that do not compute it say 0).
    Without torch.distributed it is one process's time and values."""
    if not dist.is_initialized():
        start = time.perf_counter()
        result = step()
        return time.perf_counter() - start, result
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
    """Interleave the contenders step by step, alternating the order; time every step (one
    contender: a plain loop)."""
    for i, tokens in enumerate(batches):
        for contender in contenders if i % 2 == 0 else contenders[::-1]:
            elapsed, result = timed(lambda c=contender, t=tokens: c.step(t))
            contender.losses.append(result["loss"])
            if i < warmup:
                contender.warmup_times.append(elapsed)
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
