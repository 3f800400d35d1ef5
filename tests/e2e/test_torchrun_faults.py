"""Failures under torchrun, at the shipped gpt-tiny config on 2 ranks: what the job prints and
how it ends. An error every rank hits is one line, printed once; a rank that loses the out_dir
lock race ends like a single process would; a stopped rank ends the job within the watchdog's
time-out plus a few seconds (not after the agent's 30 s SIGTERM grace); the survivors of a
killed rank print one line each, no traceback."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megalite.benchmarks.restarts import _kill_job, worker_pids
from megalite.launch import free_port
from megalite.training.run_lock import RunLock
from megalite.training.watchdog import HANG_EXIT_CODE

REPO = Path(__file__).resolve().parents[2]
GPT_TINY = [
    "--config",
    str(REPO / "configs" / "gpt-tiny.yaml"),
    "train.micro_batch_size=4",  # dp=2: a global batch of 8 is 2 x 4
    "train.log_interval=1",
    "logging.progress=false",
    "checkpoint.interval=0",
]
WATCHDOG_S = 5.0


def torchrun(out_dir: Path, *overrides: str) -> subprocess.Popen:
    """`torchrun --nproc-per-node 2 -m megalite train` on gpt-tiny, its console merged."""
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"),
        *("--master-port", str(free_port()), "-m", "megalite", "train", *GPT_TINY),
        f"train.out_dir={out_dir}",
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=REPO,
        start_new_session=True,
    )


def finish(job: subprocess.Popen, timeout: float = 180) -> str:
    try:
        out, _ = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_job(job)
        out, _ = job.communicate()
        pytest.fail(f"torchrun did not end in {timeout} s:\n{out[-4000:]}")
    return out


def worker_exit_codes(console: str) -> list[int]:
    """The workers' exit codes in torchrun's failure summary."""
    return sorted(int(code) for code in re.findall(r"exitcode\s*: (-?\d+)", console))


def error_lines(console: str) -> list[str]:
    return [line for line in console.splitlines() if "error:" in line]


def no_worker_traceback(console: str) -> bool:
    """torchrun prints its own traceback on failure; no frame of megalite's may appear."""
    return not re.search(r'File ".*megalite/(?!\.venv)', console.replace("torch/distributed", ""))


def test_a_config_error_is_printed_once_on_a_line_of_its_own(tmp_path):
    console = finish(torchrun(tmp_path / "run", "model.max_positions=8"))
    lines = error_lines(console)
    assert len(lines) == 1 and lines[0].startswith("error: "), console
    assert "model.max_positions" in lines[0], console
    assert worker_exit_codes(console) and set(worker_exit_codes(console)) <= {2, -15}, console
    assert no_worker_traceback(console), console


def test_a_yaml_syntax_error_under_torchrun_is_one_line_naming_line_and_column(tmp_path):
    config = tmp_path / "broken.yaml"
    config.write_text("model:\n  n_layers: 2\n  hidden: [64\ntrain:\n  steps: 3\n")
    console = finish(torchrun(tmp_path / "run", "--config", str(config)))
    assert error_lines(console) == [
        f"error: config file {config} is not valid YAML: line 4, column 6: expected ',' or "
        "']', but got ':' (while parsing a flow sequence from line 3, column 11)"
    ], console


def test_the_run_that_loses_the_out_dir_lock_prints_one_clean_line(tmp_path):
    out_dir = tmp_path / "run"
    holder = RunLock.acquire(out_dir)  # another run, in this process, holds it
    try:
        console = finish(torchrun(out_dir))
    finally:
        holder.release()
    assert error_lines(console) == [
        f"error: another run is using {out_dir} (pid {os.getpid()} on {os.uname().nodename}, "
        + console.split(f"(pid {os.getpid()} on {os.uname().nodename}, ", 1)[1].split("\n")[0]
    ], console
    assert "terminate called" not in console, console
    assert set(worker_exit_codes(console)) <= {2, -15}, console
    assert no_worker_traceback(console), console


def test_a_missing_data_source_is_one_line_and_leaves_no_directory(tmp_path):
    missing = tmp_path / "nowhere" / "tokens"
    console = finish(torchrun(tmp_path / "run", f"data.source={missing}"))
    lines = error_lines(console)
    assert len(lines) == 1 and str(missing) in lines[0], console
    assert not (tmp_path / "run").exists(), sorted(p for p in tmp_path.rglob("*"))
    assert no_worker_traceback(console), console


def _training(job: subprocess.Popen, out_dir: Path, rows: int = 2) -> dict[int, int]:
    """Wait until `rows` steps are logged; the workers' pids by global rank."""
    metrics, deadline = out_dir / "metrics.jsonl", time.monotonic() + 240
    while not (metrics.is_file() and metrics.read_text().count("\n") >= rows):
        if job.poll() is not None or time.monotonic() > deadline:
            _kill_job(job) if job.poll() is None else None
            pytest.fail(f"the run never got going:\n{job.communicate()[0][-4000:]}")
        time.sleep(0.1)
    return worker_pids(job.pid)


@pytest.mark.serial
def test_a_stopped_rank_ends_the_job_within_the_watchdog_time_out(builtin_corpus_8000, tmp_path):
    """Before: the watchdog's rank exited 124 after the time-out, and the stopped rank ignored
    the agent's SIGTERM until its SIGKILL 30 s later. Now a watchdog on its host kills it."""
    out_dir = tmp_path / "run"
    job = torchrun(out_dir, "train.steps=100000", f"fault.watchdog_timeout_s={WATCHDOG_S}")
    pids = _training(job, out_dir)
    os.kill(pids[1], signal.SIGSTOP)
    stopped = time.monotonic()
    console = finish(job)
    took = time.monotonic() - stopped
    print(f"job ended {took:.1f} s after the stop (watchdog time-out {WATCHDOG_S} s)")
    assert took <= WATCHDOG_S + 10, (took, console[-4000:])
    assert job.returncode != 0
    assert f"killed rank 1 (pid {pids[1]}), silent on this host" in console, console
    assert re.search(r"\nrank 1 \(.* pid \d+\) went silent", console), console
    assert HANG_EXIT_CODE in worker_exit_codes(console), console  # a hang, not a crash
    assert -signal.SIGKILL in worker_exit_codes(console), console


@pytest.mark.serial
def test_the_survivors_of_a_killed_rank_print_one_line_each(builtin_corpus_8000, tmp_path):
    out_dir = tmp_path / "run"
    job = torchrun(out_dir, "train.steps=100000")
    pids = _training(job, out_dir)
    os.kill(pids[1], signal.SIGKILL)
    console = finish(job)
    lines = error_lines(console)
    assert len(lines) == 1 and lines[0].startswith("error: rank 0: "), console
    assert " failed: " in lines[0], console
    assert no_worker_traceback(console), console
    assert 1 in worker_exit_codes(console), console  # a crash: not 2 (bad input) nor 124
