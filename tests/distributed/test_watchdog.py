"""A rank stopped with SIGSTOP (it cannot speak) no longer hangs the job: a peer's watchdog ends
it within `fault.watchdog_timeout_s`, naming the silent rank, its step and the last collective it
entered. The time to detect is measured from the stop to the report."""

import dataclasses
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

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
    real_end_job, real_launch, steps = watchdog.end_job, loop.launch_step, []

    def end_job(report: str) -> None:
        Path(marks, f"detected_by_{rank}").write_text(f"{time.time()}\n{report}")
        real_end_job(report)

    def launch_step(run, tokens, lr):
        steps.append(lr)
        if rank == stopped_rank and len(steps) == STOP_BEFORE_STEP:
            Path(marks, "stopped").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)
        return real_launch(run, tokens, lr)

    watchdog.end_job, loop.launch_step = end_job, launch_step
    overrides = [
        *ONE_LAYER,
        "train.steps=50",
        "train.global_batch_size=4",
        f"fault.watchdog_timeout_s={TIMEOUT_S}",
        f"train.out_dir={out_dir}",
    ]
    loop.train(load_config(None, overrides))


@pytest.mark.serial
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


class CountingStore:
    """A store client that counts the requests made through it."""

    def __init__(self, store: dist.Store) -> None:
        self.store, self.requests = store, []

    def __getattr__(self, name: str):
        method = getattr(self.store, name)

        def counted(*args):
            self.requests.append(name)
            return method(*args)

        return counted


WORLD = 1024
SILENT = 517


def _heartbeats_of_a_big_job(store: dist.Store, now: float, missing: int | None = None) -> None:
    """1,024 ranks' heartbeats: all fresh but SILENT's (30 s old); `missing` never wrote one."""
    beats = {
        rank: watchdog.Heartbeat(rank, 7, "all_reduce", "all_reduce", 0.1, now, "node", 1000 + rank)
        for rank in range(WORLD)
        if rank != missing
    }
    beats[SILENT] = dataclasses.replace(beats[SILENT], wrote_at=now - 30.0, blocked_in=None)
    store.multi_set(
        [watchdog.heartbeat_key(r) for r in beats], [b.to_json() for b in beats.values()]
    )


def _big_job_watchdog(rank: int) -> watchdog.Watchdog:
    return watchdog.Watchdog(10.0, SimpleNamespace(rank=rank, world_size=WORLD), step=7)


@pytest.fixture
def job_store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield dist.PrefixStore("megalite/generation1/", server)  # as under torchrun


def test_the_first_rank_to_detect_reads_1024_heartbeats_in_two_requests(job_store, monkeypatch):
    """The reporter names the silent rank from one add, one check and one multi_get (the old
    report read every key with a check and a get: 2,046 requests on each detecting rank); a
    later detector reads only its node's 8 heartbeats and prints one line."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    _heartbeats_of_a_big_job(job_store, time.time())
    first, later = CountingStore(job_store.clone()), CountingStore(job_store.clone())
    wd = _big_job_watchdog(3)
    monkeypatch.setenv("LOCAL_RANK", "3")
    start = time.monotonic()
    report = wd.report(first)
    took = time.monotonic() - start
    assert first.requests == ["add", "check", "multi_get"], first.requests
    assert took < 3 * wd.interval_s, took  # well within the join window
    assert f"\nrank {SILENT} (node pid {1000 + SILENT}) went silent 30." in report, report
    assert f"{WORLD - 2} other rank(s) alive and waiting in a collective" in report, report
    assert report.endswith(f"ending the job (exit status {watchdog.HANG_EXIT_CODE})")

    monkeypatch.setenv("LOCAL_RANK", "5")  # global rank 517's node: ranks 512-519
    line = _big_job_watchdog(SILENT + 3).report(later)
    assert later.requests == ["add", "check", "multi_get"], later.requests
    assert line.startswith(f"watchdog: rank {SILENT + 3} made no progress for "), line
    assert "the first rank to detect names the silent rank(s)" in line and "\n" not in line


def test_a_heartbeat_never_written_is_found_in_a_bounded_number_of_requests(job_store):
    """multi_get would wait for a missing key, so the reader halves the key set: about 2 log2 W
    requests more, not W."""
    _heartbeats_of_a_big_job(job_store, time.time(), missing=1000)
    store = CountingStore(job_store.clone())
    report = _big_job_watchdog(0).report(store)
    assert "rank 1000 went silent: no heartbeat from it ever arrived" in report, report
    assert f"rank {SILENT} (node pid" in report, report
    assert len(store.requests) <= 2 + 4 * 10, store.requests


def test_a_reporter_stuck_outside_the_collectives_names_itself_and_where(job_store):
    """The rank whose own work stopped (I/O, a lock) times out first, while its peers wait in a
    collective for it: the report blames it, with its training thread's stack, instead of
    saying that the ranks disagree on a collective."""
    now = time.time()
    waiting = watchdog.Heartbeat(1, 7, "all_reduce", "all_reduce", 0.5, now, "node", 1001)
    job_store.set(watchdog.heartbeat_key(1), waiting.to_json())
    wd = watchdog.Watchdog(10.0, SimpleNamespace(rank=0, world_size=2), step=7)
    report = wd.report(job_store.clone())
    assert "rank 0 (this one) is the only rank outside a collective" in report, report
    assert "disagree" not in report, report
    stack = report.split("the training thread's stack, innermost call last:\n", 1)[1]
    assert "test_a_reporter_stuck_outside_the_collectives_names_itself_and_where" in stack
    assert "1 other rank(s) alive and waiting in a collective" in report, report


def test_only_a_silent_sibling_on_this_host_is_killed():
    """A stale heartbeat naming a process that is not this one's sibling (here: its child) is
    left alone: the pid in a heartbeat is trusted only under the same parent."""
    child = subprocess.Popen(["sleep", "30"])
    try:
        stale = watchdog.Heartbeat(1, 0, None, None, 9.0, 0.0, socket.gethostname(), child.pid)
        assert watchdog.kill_silent_siblings({1: stale}, now=100.0, stale_after_s=5.0) == []
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()
