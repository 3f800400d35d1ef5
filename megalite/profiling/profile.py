"""`megalite profile`: the real training step, measured on every rank.

The run is built exactly as `megalite train` builds it (`loop.setup_topology`, `open_data`,
`setup.build_run`) and runs `step.train_step` unchanged: warm-up steps, then measured steps
(`step_timing` cuts each into forward, backward, optimizer, communication and bubble), then
with `--trace` as many steps under torch.profiler, then one more step to count the activations
it keeps for backward; nothing is saved. The rates are the median measured step's, so they are
what training logs for the same layout: the profiler's and the activation count's overheads
fall on steps of their own. torch is imported only when the command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from megalite.config import Config
from megalite.errors import MegaliteError


class ProfileError(MegaliteError):
    pass


def profile(
    cfg: Config,
    warmup_steps: int = 2,
    steps: int = 5,
    trace_dir: Path | None = None,
    out: Path | None = None,
) -> dict[str, Any]:
    """Profile `cfg`'s layout on this world (every rank calls it); returns the report (the same
    on every rank), which rank 0 also prints, writes to `out` (default
    `<train.out_dir>/profile.json`) and logs to the trackers the config asks for."""
    if warmup_steps < 0 or steps < 1:
        raise ProfileError(
            f"--warmup-steps {warmup_steps} --steps {steps}: profile needs at least one measured "
            "step and no negative warm-up"
        )
    import torch

    from megalite.data import GlobalBatchSampler, TokenBatch
    from megalite.profiling.profile_report import build_report, publish
    from megalite.profiling.step_timing import measure_run
    from megalite.training.loop import open_data, rank_batch, setup_topology
    from megalite.training.metrics import StepCost
    from megalite.training.setup import build_run

    t = cfg.train
    ps = setup_topology(cfg)
    cost = StepCost.of(cfg, ps)
    torch.manual_seed(t.seed)  # dropout on tp-replicated activations: same on all ranks
    data = open_data(cfg)
    run = build_run(cfg, ps)
    sampler = GlobalBatchSampler(data.train.sizes, t.global_batch_size, t.seed, data.train.weights)

    def next_tokens() -> TokenBatch:
        return rank_batch(data.train, sampler.next_batch(), run)

    times, memory = measure_run(run, next_tokens, warmup_steps, steps, trace_dir)
    report = build_report(run, cost, times, memory)
    if ps.rank == 0:
        publish(report, cfg, out or Path(t.out_dir) / "profile.json")
    return report


def _run_profile(args: argparse.Namespace) -> int:
    from megalite.config import load_config

    cfg = load_config(args.config, args.overrides)
    profile(cfg, args.warmup_steps, args.steps, args.trace, args.out)
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    """Add `megalite profile`."""
    parser = commands.add_parser(
        "profile",
        help="measure a layout's training step per rank: throughput, MFU, time and memory",
        description="Build the run as `megalite train` does, run warm-up steps, then measure "
        "the training step on every rank (nothing is saved). Launch it like training: plain, or "
        "with `torchrun --nproc-per-node N -m megalite profile ...`.",
    )
    parser.add_argument("--config", help="YAML config (see configs/); defaults when omitted")
    parser.add_argument(
        "overrides", nargs="*", metavar="section.key=value", help="e.g. parallel.pp=2"
    )
    parser.add_argument("--warmup-steps", type=int, default=2, metavar="N")
    parser.add_argument("--steps", type=int, default=5, metavar="M", help="measured steps")
    parser.add_argument(
        "--trace",
        type=Path,
        metavar="DIR",
        help="also trace --steps more steps with torch.profiler, one file per rank here (timed "
        "apart: the profiler's cost stays out of the rates)",
    )
    parser.add_argument(
        "--out", type=Path, metavar="FILE", help="the JSON report (<train.out_dir>/profile.json)"
    )
    parser.set_defaults(func=_run_profile)
