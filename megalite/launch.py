"""Run a function on N gloo ranks on this machine: the one launcher of the multi-process tests
and the benchmarks.

Ranks are forked from the (already imported) calling process, which starts 8 ranks in about two
seconds where `torchrun` takes ~9 (each of its ranks imports torch again); no thread that takes
a lock the ranks need may run across the fork (tqdm's monitor is stopped first). They meet at
a store the parent hosts, as torchrun's agent does: were it rank 0's, a rank 0 that finished
first would take it away from ranks still creating their process groups ("Connection reset by
peer"). Each rank uses one intra-op thread (forked OpenMP pools are not safe, and ranks sharing
a few cores gain nothing from more), never collects the garbage it inherits (`gc.freeze`),
sends back its result or its traceback through a pipe, and exits hard so the parent's exit
handlers (pytest's) never run twice. A run that does not finish
within `timeout` is killed and fails, so a deadlock cannot hang a test suite or a benchmark.

Every run records each rank's collectives and p2p messages (`megalite.comm_trace`) and fails if
the ranks of a group disagree on them, naming the first divergent call: a rank-local quantity
shaping a collective is caught here even where gloo happens to let it pass, and is reported
before the abort or time-out it causes.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import multiprocessing as mp
import os
import pickle
import shutil
import socket
import tempfile
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import TMonitor, tqdm

from megalite import comm_trace
from megalite.parallel_state import init_distributed


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_tqdm_monitors() -> None:
    """Stop tqdm's monitor threads and start no more, before forking ranks.

    A monitor (started by the first bar of a tqdm class: a single-process reference run, a
    Hugging Face download) takes tqdm's lock every 10 s. A rank forked at that moment inherits
    the lock held by a thread it does not have: its first progress bar waits forever, and the
    other ranks with it. The monitor only forces refreshes of bars that rarely refresh;
    megalite's refresh on every update."""
    tqdm.monitor_interval = 0  # inherited by the subclasses other libraries draw with
    for thread in threading.enumerate():
        if isinstance(thread, TMonitor):
            thread.exit()


def _child(
    rank: int,
    world_size: int,
    port: int,
    trace_dir: str,
    fn: Callable,
    args: tuple,
    conn: Connection,
    timeout: float,
) -> None:
    status, payload = "error", None
    # A rank still running just before the parent gives up prints every thread's stack, so a
    # hang names where it waits.
    faulthandler.dump_traceback_later(max(1.0, timeout - 10), exit=False)
    try:
        torch.set_num_threads(1)
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            **{comm_trace.ENV: trace_dir},
        )
        limit = datetime.timedelta(seconds=timeout)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=limit)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=limit
        )
        # Every rank's gloo mesh is whole before any rank may return and exit: a rank whose
        # side of the mesh connected can finish first and close a pair its peer is still
        # handshaking on (the peer's init then fails). Through the store: no collective.
        store.set(f"joined/{rank}", "1")
        store.wait([f"joined/{r}" for r in range(world_size)])
        payload = fn(*args)
        status = "ok"
    except BaseException:  # report everything, including assertion errors, to the parent
        payload = traceback.format_exc()
    try:
        # By value: Connection.send would share a tensor's storage as a file descriptor that
        # the parent fetches from this process, which may have exited by then.
        conn.send_bytes(pickle.dumps((rank, status, payload)))
        conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        os._exit(0)


def _collect(pipes: list[Connection], world_size: int, timeout: float) -> tuple[dict, list[str]]:
    """Each rank's result until all reported, one failed, or the time is up: (results, errors)."""
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    open_pipes = list(pipes)
    while open_pipes and not errors:
        left = (deadline - datetime.datetime.now()).total_seconds()
        ready = wait(open_pipes, timeout=max(left, 0))
        if not ready:
            errors.append(
                f"{len(open_pipes)} of {world_size} ranks did not finish in "
                f"{timeout:.0f}s (deadlock?)"
            )
            break
        for conn in ready:
            open_pipes.remove(conn)
            try:
                rank, status, payload = pickle.loads(conn.recv_bytes())
            except EOFError:
                errors.append("a rank died without reporting")
                continue
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
    return results, errors


class RanksFailed(AssertionError):
    """A rank raised, died or timed out, or the ranks disagreed on a collective. An
    AssertionError, so that pytest shows it as a failed test with every rank's traceback."""


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = 180.0) -> list[Any]:
    """fn(*args) on `world_size` forked gloo ranks; returns the per-rank results in rank order.

    Raises RanksFailed with the tracebacks, the time-out, or the first collective the ranks
    disagree on (named first: it is the cause of whatever the ranks then hit)."""
    ctx = mp.get_context("fork")
    _stop_tqdm_monitors()
    trace_dir = tempfile.mkdtemp(prefix="megalite-trace-")
    pipes, procs = [], []
    # The store's socket listens before the fork (the ranks connect at once, and no other process
    # can take its port); its server thread starts after (no child inherits a running thread).
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    # The caller's garbage is the ranks' too, and theirs to collect: a store an earlier test
    # left in a reference cycle would be destroyed in a rank, joining a server thread the rank
    # does not have (an abort, or a hang in its first collective). Frozen, it never is.
    gc.freeze()
    try:
        for rank in range(world_size):
            receive, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child, args=(rank, world_size, port, trace_dir, fn, args, send, timeout)
            )
            proc.start()
            send.close()
            pipes.append(receive)
            procs.append(proc)
    finally:
        gc.unfreeze()  # the caller collects its own garbage as before
    store = None
    try:
        store = dist.TCPStore(
            "127.0.0.1",
            port,
            world_size,
            is_master=True,
            wait_for_workers=False,
            master_listen_fd=listener.detach(),  # the store closes it
        )
        results, errors = _collect(pipes, world_size, timeout)
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        del store  # the server stops with it
    try:
        # Ranks stopped early have shorter records: then only compare the calls both made.
        comm_trace.check_traces(Path(trace_dir), complete=not errors)
    except comm_trace.CollectiveMismatch as mismatch:
        errors.insert(0, str(mismatch))  # the cause of whatever the ranks reported
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)
    if errors:
        raise RanksFailed("\n".join(errors))
    return [results[r] for r in range(world_size)]


def run_or_join(world_size: int, fn: Callable, *args: Any, timeout: float = 600.0) -> Any:
    """fn(*args) on `world_size` gloo ranks, returning rank 0's result.

    Started as a plain process, this forks the ranks itself (`run_ranks`). Under `torchrun
    --nproc-per-node N` the process is one rank already: it joins torchrun's world instead, and
    returns rank 0's result on rank 0 and None on the others."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        try:
            return run_ranks(world_size, fn, *args, timeout=timeout)[0]
        except RanksFailed as failure:  # a command-line tool: the message, not our traceback
            raise SystemExit(str(failure)) from None
    torch.set_num_threads(1)
    init_distributed(torch.device("cpu"), timeout)  # gloo, in a key space of this start's own
    if dist.get_world_size() != world_size:
        raise SystemExit(f"this needs --nproc-per-node {world_size}")
    result = fn(*args)
    rank = dist.get_rank()
    dist.destroy_process_group()
    return result if rank == 0 else None
