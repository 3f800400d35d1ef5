"""A rank stopped with SIGSTOP (it cannot speak) no longer hangs the job: a peer's watchdog ends
it within `fault.watchdog_timeout_s`, naming the silent rank, its step and the last collective it
entered. The time to detect is measured from the stop to the report."""

import os
import signal
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from run_configs import ONE_LAYER

import megalite.training.loop as loop
import megalite.training.watchdog as watchdog
from megalite.config import load_config
from megalite.launch import RanksFailed, run_ranks

TIMEOUT_S = 2.0
STOP_BEFORE_STEP = 3


def _train_until_a_rank_stops(out_dir: str, stopped_rank: int, marks: str) -> None:
    """Train; `stopped_rank` stops itself before STOP_BEFORE_STEP, stamping the time, and the
    rank whose watchdog ends the job stamps the time and its report."""
    rank = dist.get_rank()
    real_end_job, real_step, steps = watchdog.end_job, loop.train_step, []

    def end_job(report: str) -> None:
        Path(marks, f"detected_by_{rank}").write_text(f"{time.time()}\n{report}")
        real_end_job(report)

    def train_step(run, tokens, lr):
        steps.append(lr)
        if rank == stopped_rank and len(steps) == STOP_BEFORE_STEP:
            Path(marks, "stopped").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)
        return real_step(run, tokens, lr)

    watchdog.end_job, loop.train_step = end_job, train_step
    overrides = [
        *ONE_LAYER,
        "train.steps=50",
        "train.global_batch_size=4",
        f"fault.watchdog_timeout_s={TIMEOUT_S}",
        f"train.out_dir={out_dir}",
    ]
    loop.train(load_config(None, overrides))


def test_a_stopped_rank_is_named_within_the_timeout(builtin_corpus, tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    with pytest.raises(RanksFailed, match="a rank died without reporting"):
        run_ranks(2, _train_until_a_rank_stops, str(tmp_path / "run"), 1, str(marks), timeout=60)
    stopped_at = float((marks / "stopped").read_text())
    detected_at, report = (marks / "detected_by_0").read_text().split("\n", 1)
    time_to_detect = float(detected_at) - stopped_at
    print(f"time to detect: {time_to_detect:.2f} s (watchdog time-out {TIMEOUT_S} s)")
    assert TIMEOUT_S <= time_to_detect <= TIMEOUT_S + 3.0, report
    first = report.splitlines()[0]
    assert first.startswith("watchdog: rank 0 made no progress for "), report
    assert f"at step {STOP_BEFORE_STEP}: waits in " in first, report
    silent = report.splitlines()[1]
    assert silent.startswith("rank 1 (") and "went silent" in silent, report
    # Its last heartbeat was published between steps or, by the heartbeat thread, while the
    # previous step's last collective ran: either way it names the step and that collective.
    assert f"its last heartbeat: step {STOP_BEFORE_STEP}, " in silent, report
    assert "the last collective it entered: " in silent, report
    assert "over ranks 0,1 (" in silent and ", call #" in silent, report
