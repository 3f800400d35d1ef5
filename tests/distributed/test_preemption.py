"""Preemption: SIGTERM or SIGUSR1 makes every rank finish its step, save it and exit with
PREEMPTED_EXIT_CODE, even when only one rank got the signal; a second signal during the save
changes nothing; the run continues from that checkpoint with the uninterrupted run's losses."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megalite.benchmarks.restarts import TRIAL_CONFIG
from megalite.checkpoint.sharded import complete_checkpoints, step_dir
from megalite.config import load_config
from megalite.launch import run_ranks
from megalite.training.preemption import PREEMPTED_EXIT_CODE, Preempted

CONFIG = (*TRIAL_CONFIG, "checkpoint.interval=0")


def _losses(out_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [(row["step"], row["loss"]) for row in rows]


def _train(overrides: tuple[str, ...]) -> None:
    from megalite.training.loop import train

    train(load_config(None, list(overrides)))


def _signalled_run(overrides: tuple[str, ...], signal_rank: int, at_step: int):
    """Train; rank `signal_rank` sends itself SIGTERM during step `at_step`, and SIGUSR1 while
    saving. Returns what stopped the run: (exit code, step, checkpoint), or None."""
    import megalite.training.loop as loop

    launch_step, save = loop.launch_step, loop.CheckpointSaver.save
    steps_done = []

    def step_then_signal(run, batch, lr):
        steps_done.append(1)
        if run.ps.rank == signal_rank and len(steps_done) == at_step:
            os.kill(os.getpid(), signal.SIGTERM)  # mid-step: the step still finishes
        return launch_step(run, batch, lr)

    def save_under_fire(self, state, **options):
        if state.ps.rank == signal_rank:
            os.kill(os.getpid(), signal.SIGUSR1)  # a second signal while saving: ignored
        return save(self, state, **options)

    loop.launch_step, loop.CheckpointSaver.save = step_then_signal, save_under_fire
    try:
        _train(overrides)
    except Preempted as stop:
        return stop.code, stop.step, stop.checkpoint
    return None


@pytest.mark.parametrize("log_interval, stops_at", [(1, 3), (4, 4)])
def test_a_signal_to_one_rank_stops_all_after_one_saved_step_and_resume_continues(
    builtin_corpus, tmp_path, log_interval, stops_at
):
    """Signalled during step 3, the ranks agree at the next step the loop reads: step 3 itself
    when it reads every step, else the next log step (the steps between are launched without
    waiting for the device)."""
    steps, at_step = 6, 3
    out, plain = tmp_path / "preempted", tmp_path / "plain"
    run = (*CONFIG, f"train.steps={steps}", f"train.log_interval={log_interval}")
    stops = run_ranks(2, _signalled_run, (*run, f"train.out_dir={out}"), 1, at_step)
    saved = step_dir(out / "checkpoints", stops_at)
    assert stops == [(PREEMPTED_EXIT_CODE, stops_at, saved)] * 2
    assert complete_checkpoints(out / "checkpoints") == [saved]
    assert _losses(out)[-1][0] == stops_at

    run_ranks(2, _train, (*run, f"train.out_dir={out}"))  # resumes from the preempted step
    run_ranks(2, _train, (*run, f"train.out_dir={plain}"))
    assert _losses(out) == _losses(plain)


def test_sigterm_to_a_process_exits_with_the_preemption_code_after_saving(builtin_corpus, tmp_path):
    command = [sys.executable, "-m", "megalite", "train", *CONFIG, "train.steps=100000"]
    job = subprocess.Popen(
        [*command, f"train.out_dir={tmp_path}"], stdout=subprocess.PIPE, text=True
    )
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        assert job.poll() is None and time.monotonic() < deadline, "the run never got going"
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)
    out, _ = job.communicate(timeout=120)
    assert job.returncode == PREEMPTED_EXIT_CODE, out
    last_step = _losses(tmp_path)[-1][0]
    assert complete_checkpoints(tmp_path / "checkpoints") == [
        step_dir(tmp_path / "checkpoints", last_step)
    ]
    assert f"preempted (SIGTERM) after step {last_step}" in out


LATE_SIGNAL = """
import os, signal, sys
from megalite.checkpoint.saver import CheckpointSaver
finish = CheckpointSaver.finish
def signalled(self):  # the signal arrives while the last step's save is still being written
    if self._pending is not None:
        os.kill(os.getpid(), signal.SIGTERM)
    return finish(self)
CheckpointSaver.finish = signalled
from megalite.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_signal_while_the_last_save_is_written_waits_for_it(builtin_corpus, tmp_path):
    """After the last step, the handlers stay in until its (background) save is published: a
    preemption signal then finds a finished run, which exits 0 with its checkpoint, rather
    than one killed with the save half written."""
    extra = ["train.steps=3", "checkpoint.async_save=true", f"train.out_dir={tmp_path}"]
    job = subprocess.run(
        [sys.executable, "-c", LATE_SIGNAL, "train", *CONFIG, *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert job.returncode == 0, job.stdout + job.stderr
    assert complete_checkpoints(tmp_path / "checkpoints")[-1] == step_dir(
        tmp_path / "checkpoints", 3
    )


LAST_STEP_SIGNAL = """
import os, signal, sys
import megalite.training.loop as loop
launch_step, steps = loop.launch_step, []
def signalled(run, batch, lr):  # the signal arrives during the run's last step
    steps.append(1)
    if len(steps) == run.cfg.train.steps:
        os.kill(os.getpid(), signal.SIGTERM)
    return launch_step(run, batch, lr)
loop.launch_step = signalled
from megalite.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_signal_during_the_last_step_ends_the_run_as_finished(builtin_corpus, tmp_path):
    """The run ends after that step anyway: it saves it and exits 0, not with the code that
    asks a scheduler to requeue a run that has nothing left to do."""
    extra = ["train.steps=3", "checkpoint.async_save=true", f"train.out_dir={tmp_path}"]
    job = subprocess.run(
        [sys.executable, "-c", LAST_STEP_SIGNAL, "train", *CONFIG, *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert job.returncode == 0, job.stdout + job.stderr
    assert "SIGTERM received" in job.stderr and "preempted" not in job.stdout
    assert complete_checkpoints(tmp_path / "checkpoints") == [step_dir(tmp_path / "checkpoints", 3)]
