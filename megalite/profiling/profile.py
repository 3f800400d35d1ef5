"""`megalite profile`: the real training step, measured on every rank.

The run is built exactly as `megalite train` builds it (`loop.setup_topology`, `open_data`,
`setup.build_run`) and runs `step.train_step` unchanged: warm-up steps, then measured steps
(`step_timing` cuts each into forward, backward, optimizer, communication and bubble), then
with `--trace` as many steps under torch.profiler, then one more step to count the activations
it keeps for backward, then one more whose kernel launches, host syncs and compiled graphs are
counted (`launch_count`, by phase); nothing is saved. The rates are the median measured step's,
so they are what training logs for the same layout: the profiler's, the activation count's and
the launch count's overheads fall on steps of their own. With `train.compile` the blocks are
compiled with inductor's kernel marks (`launch_count.kernel_markers`: a check per kernel while
no profiler runs). torch is imported only when the command runs.
"""

from __future__ import annotations

import contextlib
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
    on every rank but for `counted_step`'s sync sites and graph breaks, each rank's own), which
    rank 0 also prints, writes to `out` (default
    `<train.out_dir>/profile.json`) and logs to the trackers the config asks for."""
    if warmup_steps < 0 or steps < 1:
        raise ProfileError(
            f"--warmup-steps {warmup_steps} --steps {steps}: profile needs at least one measured "
            "step and no negative warm-up"
        )

    from megalite.data import GlobalBatchSampler, TokenBatch
    from megalite.optimizer.lr_schedule import learning_rate
    from megalite.profiling.launch_count import count_step, kernel_markers
    from megalite.profiling.profile_report import build_report, publish
    from megalite.profiling.step_timing import measure_run
    from megalite.tensor_parallel import seed_dropout
    from megalite.training.loop import open_data, rank_batch, setup_topology
    from megalite.training.metrics import StepCost
    from megalite.training.setup import build_run

    t = cfg.train
    ps = setup_topology(cfg)
    cost = StepCost.of(cfg, ps)
    seed_dropout(t.seed, ps)
    data = open_data(cfg)
    run = build_run(cfg, ps, eos_id=data.train.eos_id)  # documents, where masked
    sampler = GlobalBatchSampler(data.train.sizes, t.global_batch_size, t.seed, data.train.weights)

    def next_tokens() -> TokenBatch:
        return rank_batch(data.train, sampler.next_batch(), run)

    # measure_run's steps: warm-up, measured, traced, the activation count's; then this one
    counted_step = warmup_steps + steps * (2 if trace_dir else 1) + 1
    with kernel_markers() if t.compile else contextlib.nullcontext():
        times, memory = measure_run(run, next_tokens, warmup_steps, steps, trace_dir)
        lr = learning_rate(counted_step, cfg.optim, t.steps)
        counts = count_step(run, next_tokens(), lr)
    report = build_report(run, cost, times, memory, counts)
    if ps.rank == 0:
        publish(report, cfg, out or Path(t.out_dir) / "profile.json")
    return report
