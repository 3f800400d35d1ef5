"""Runs killed (SIGKILL, as by a preemption or the OOM killer) in the middle of writing a
checkpoint, synchronously or asynchronously, and in the middle of their first one. The kill is
made deterministic by the tests' fault injection (`megalite.testing.faults.stall_save`): the
writer of the named step sleeps after its first file, and the test kills the process once that
file is on disk. Afterwards the previous checkpoint is still `latest` and loads, and a relaunch
removes the unfinished directory, says so, and trains to the uninterrupted run's losses.

The three runs to kill are started at once, as `python -m megalite train` processes, to share
their start-up time; the relaunches run in this process."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from run_configs import TWO_LAYERS

from megalite.checkpoint.sharded import read_manifest
from megalite.config import load_config
from megalite.testing import subprocess_hooks
from megalite.training.loop import train

STEPS = 4
FIRST_FILE = "model_tp00_pp00.safetensors"
TIMEOUT_S = 180
SCENARIOS = {  # name: (step whose save is killed, extra settings)
    "sync": (4, []),
    "async": (4, ["checkpoint.async_save=true"]),
    "first save": (2, []),
}


def settings(out_dir: Path, *extra: str) -> list[str]:
    return [
        *TWO_LAYERS,
        f"train.steps={STEPS}",
        "checkpoint.interval=2",
        f"train.out_dir={out_dir}",
        *extra,
    ]


def metrics(out_dir: Path) -> list[dict]:
    return [json.loads(row) for row in (out_dir / "metrics.jsonl").read_text().splitlines()]


def kill_when_stalled(proc: subprocess.Popen, stalled_file: Path) -> None:
    """SIGKILL `proc` once its checkpoint writer has written `stalled_file` and stalls."""
    deadline = time.monotonic() + TIMEOUT_S
    while not stalled_file.is_file():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{proc.args} never reached {stalled_file}:\n{proc.communicate()[0]}")
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL


@pytest.fixture(scope="module")
def killed(tmp_path_factory, builtin_corpus) -> dict[str, Path]:
    """Each scenario's out_dir, its run killed in the middle of the save it names."""
    root = tmp_path_factory.mktemp("crash")
    procs = {}
    for name, (step, extra) in SCENARIOS.items():
        # as many threads as this process, which trains the reference and the relaunches:
        # another count sums in another order, and the losses would differ in the last bits
        threads = str(torch.get_num_threads())
        hooks = subprocess_hooks.environment(stall_save=(step, 600))
        env = {**os.environ, "OMP_NUM_THREADS": threads, **hooks}
        command = [sys.executable, "-m", "megalite", "train", *settings(root / name, *extra)]
        procs[name] = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
    for name, proc in procs.items():
        step = SCENARIOS[name][0]
        kill_when_stalled(proc, root / name / "checkpoints" / f"step_{step:06d}.tmp" / FIRST_FILE)
    return {name: root / name for name in SCENARIOS}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, builtin_corpus) -> list[float]:
    out_dir = tmp_path_factory.mktemp("crash") / "uninterrupted"
    train(load_config(None, settings(out_dir)))
    return [row["loss"] for row in metrics(out_dir)]


def relaunch(out_dir: Path, capsys) -> str:
    """Train the killed run again, as its user would; returns what it printed."""
    capsys.readouterr()
    train(load_config(None, settings(out_dir)))
    return capsys.readouterr().out


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_kill_mid_save_keeps_the_previous_checkpoint_and_the_relaunch_resumes_from_it(
    killed, uninterrupted, mode, capsys
):
    root = killed[mode] / "checkpoints"
    assert (root / "latest").read_text() == "step_000002"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000002", "step_000004.tmp"]
    assert read_manifest(root / "step_000002")["step"] == 2  # every file verifies
    assert [row["step"] for row in metrics(killed[mode])] == [1, 2, 3, 4]

    out = relaunch(killed[mode], capsys)
    assert f"removed {root / 'step_000004.tmp'}: an unfinished checkpoint" in out
    assert f"resumed from {root / 'step_000002'} at step 2" in out
    rows = metrics(killed[mode])
    assert [row["step"] for row in rows] == [1, 2, 3, 4]  # steps 3 and 4 replaced, not repeated
    assert [row["loss"] for row in rows] == uninterrupted
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000002", "step_000004"]
    assert (root / "latest").read_text() == "step_000004"


def test_a_kill_during_the_first_save_does_not_block_the_relaunch(killed, uninterrupted, capsys):
    root = killed["first save"] / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_000002.tmp"]

    out = relaunch(killed["first save"], capsys)
    assert f"removed {root / 'step_000002.tmp'}: an unfinished checkpoint" in out
    assert "resumed" not in out
    assert [row["loss"] for row in metrics(killed["first save"])] == uninterrupted
    assert (root / "latest").read_text() == "step_000004"
