"""Restart trials: SIGKILL one rank of a `torchrun --max-restarts 1` training job once its
first checkpoint exists, and see whether the restarted job finishes. The same trial backs the
restart test (once) and `tools/restart_trials.py` (N times, with the time each took).

A job recovers when torchrun exits 0 and the last checkpoint is of the last step. The time
reported runs from the kill to the end of the job: the agent noticing the death, stopping the
other ranks, rendezvousing again, the new ranks importing torch and resuming, and the steps
since the checkpoint replayed.

    python -m megalite.benchmarks.restarts --trials 10 [--rdzv c10d]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from megalite.checkpoint.sharded import complete_checkpoints
from megalite.launch import free_port

TRIAL_CONFIG = (
    "model.n_layers=2",
    "model.hidden=64",
    "model.n_heads=4",
    "model.vocab_size=500",
    "model.seq_len=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
    "train.eval_interval=1000",
    "train.log_interval=1",
    "optim.lr=3e-3",
    "optim.warmup_steps=2",
    "logging.progress=false",
)
"""A model small enough that start-up, not training, dominates a trial."""


@dataclass
class TrialResult:
    recovered: bool
    """torchrun exited 0 and the last checkpoint is of the last step."""
    exit_code: int
    killed_at_step: int | None
    """The newest checkpoint when the rank was killed (None: the job ended before the kill)."""
    seconds_to_finish: float
    """From the kill to the end of the job."""
    log: Path
    """torchrun's console output."""


def torchrun_command(
    nproc: int, out_dir: Path, steps: int, interval: int, rdzv: str, max_restarts: int = 1
) -> list[str]:
    """A torchrun training command on this machine, with a fresh port for its rendezvous:
    `static` (torchrun's default: `--master-port`) or `c10d` (`--rdzv-backend c10d`)."""
    port = free_port()
    rendezvous = (
        ["--master-port", str(port)]
        if rdzv == "static"
        else ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    )
    return [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)),
        *("--max-restarts", str(max_restarts), *rendezvous),
        *("-m", "megalite", "train", *TRIAL_CONFIG),
        *(f"train.steps={steps}", f"checkpoint.interval={interval}", f"train.out_dir={out_dir}"),
    ]


def worker_pids(agent_pid: int) -> dict[int, int]:
    """Global rank -> pid of the workers torchrun's agent (`agent_pid`) started (Linux)."""
    children = Path(f"/proc/{agent_pid}/task/{agent_pid}/children").read_text().split()
    ranks = {}
    for pid in map(int, children):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # ended meanwhile
            continue
        for entry in environ:
            if entry.startswith(b"RANK="):
                ranks[int(entry[5:])] = pid
    return ranks


def kill_one_rank_trial(
    out_dir: Path,
    nproc: int = 4,
    steps: int = 30,
    interval: int = 5,
    rank: int = 1,
    rdzv: str = "static",
    timeout_s: float = 300.0,
) -> TrialResult:
    """Train under `torchrun --max-restarts 1`; SIGKILL global rank `rank` as soon as the first
    checkpoint is complete; wait for the job to end."""
    out_dir = Path(out_dir)
    log = out_dir / "torchrun.log"
    out_dir.mkdir(parents=True, exist_ok=True)
    command = torchrun_command(nproc, out_dir, steps, interval, rdzv)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as console:
        job = subprocess.Popen(
            command, stdout=console, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            killed_at = _kill_after_first_checkpoint(job, out_dir / "checkpoints", rank)
            killed = time.monotonic()
            exit_code = job.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_job(job)
            exit_code = job.wait()
    saved = complete_checkpoints(out_dir / "checkpoints")
    last_step = int(saved[-1].name.removeprefix("step_")) if saved else 0
    return TrialResult(
        recovered=exit_code == 0 and last_step == steps and killed_at is not None,
        exit_code=exit_code,
        killed_at_step=killed_at,
        seconds_to_finish=time.monotonic() - killed,
        log=log,
    )


def _kill_job(job: subprocess.Popen) -> None:
    """SIGKILL a hung job: its workers (torchrun starts each in a session of its own), then the
    agent's session."""
    for pid in worker_pids(job.pid).values():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.killpg(job.pid, signal.SIGKILL)


def _kill_after_first_checkpoint(job: subprocess.Popen, root: Path, rank: int) -> int | None:
    """SIGKILL `rank` once a checkpoint is complete; the step it had, or None if the job ended
    first."""
    while job.poll() is None:
        saved = complete_checkpoints(root) if root.is_dir() else []
        pid = worker_pids(job.pid).get(rank) if saved else None
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            return int(saved[-1].name.removeprefix("step_"))
        time.sleep(0.02)
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--nproc", type=int, default=4, help="ranks (all on this machine)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--interval", type=int, default=5, help="checkpoint interval")
    parser.add_argument("--rank", type=int, default=1, help="the rank to kill")
    parser.add_argument("--rdzv", choices=("static", "c10d"), default="static")
    args = parser.parse_args(argv)
    recovered = 0
    for trial in range(1, args.trials + 1):
        out_dir = Path(tempfile.mkdtemp(prefix="megalite-restart-"))
        result = kill_one_rank_trial(
            out_dir, args.nproc, args.steps, args.interval, args.rank, args.rdzv
        )
        recovered += result.recovered
        if result.recovered:  # a trial's checkpoints are kept only for a failure's post-mortem
            shutil.rmtree(out_dir)
            status = "recovered"
        else:
            status = f"FAILED (exit {result.exit_code}; log {result.log})"
        print(
            f"trial {trial}: killed rank {args.rank} after checkpoint step "
            f"{result.killed_at_step}; {status} in {result.seconds_to_finish:.1f}s",
            flush=True,
        )
    print(f"{recovered} of {args.trials} trials recovered ({args.rdzv} rendezvous)")


if __name__ == "__main__":
    main()
