"""Run a function on N gloo ranks on localhost: the one launcher every multi-process test uses.

Ranks are forked from the (already imported) test process and meet over a tcp:// rendezvous on a
free port, which starts 8 ranks in about two seconds. Each rank uses one intra-op thread (forked
OpenMP pools are not safe, and 2 cores gain nothing from more), sends back its result or its
traceback through a pipe, and exits hard so pytest's own exit handlers never run twice. A run
that does not finish within `timeout` is killed and fails the test, so a deadlock cannot hang CI.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world_size: int, port: int, fn: Callable, args: tuple, conn, timeout: float):
    status, payload = "error", None
    try:
        torch.set_num_threads(1)
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        payload = fn(*args)
        status = "ok"
    except BaseException:  # report everything, including assertion errors, to the parent
        payload = traceback.format_exc()
    try:
        conn.send((rank, status, payload))
        conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        os._exit(0)


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = 180.0) -> list[Any]:
    """fn(*args) on every rank; returns the per-rank results in rank order."""
    ctx = mp.get_context("fork")
    port = free_port()
    pipes, procs = [], []
    for rank in range(world_size):
        receive, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(rank, world_size, port, fn, args, send, timeout))
        proc.start()
        send.close()
        pipes.append(receive)
        procs.append(proc)
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    open_pipes = list(pipes)
    try:
        while open_pipes:
            left = (deadline - datetime.datetime.now()).total_seconds()
            ready = wait(open_pipes, timeout=max(left, 0))
            if not ready:
                raise TimeoutError(
                    f"{len(open_pipes)} of {world_size} ranks did not finish in "
                    f"{timeout:.0f}s (deadlock?)"
                )
            for conn in ready:
                open_pipes.remove(conn)
                try:
                    rank, status, payload = conn.recv()
                except EOFError:
                    errors.append("a rank died without reporting")
                    continue
                if status == "ok":
                    results[rank] = payload
                else:
                    errors.append(f"rank {rank} failed:\n{payload}")
            if errors:
                break
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
