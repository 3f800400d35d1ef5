"""ZeRO-3's prefetch overlaps compute, shown on a real training step (GPT, dp 2, four buckets per
block) by rank 0's timestamped log of gathers issued, waits, and each block's compute, while
rank 1 is late.

Rank 1 is late by a handshake, not by a bare sleep: it holds back its issue of one gather until
rank 0 has signalled that it got past the point under test, then sleeps DELAY_S more. Until then
the gather cannot have completed on rank 0, however slow or loaded the machine is, so what rank
0 did before signalling it did with that gather in flight. If a gather were synchronous, or
waited for before the compute, rank 0 would never get to the signal and rank 1 gives up
(HOLD_TIMEOUT_S): the test fails instead of passing. Without the prefetch the next unit's gather
would be issued after the compute, which the order of the events shows. The only time
assertions are lower bounds that rank 1's sleep guarantees.

- forward: block 1's pre-hook waits for its own buckets, then issues block 2's; block 1 computes
  with all of block 2's gathers in flight (rank 1 signalled only at its end); the wait for block
  2 comes after block 1's compute ended, and it is where the late rank's DELAY_S goes.
- backward: block 2's gradient hook waits for its own buckets, then issues block 1's; block 2's
  backward computes with them in flight until its first bucket's gradients are all in (their
  reduce-scatter, where rank 0 signals: later in that backward, folding in a reduction waits on
  rank 1's, which it issues after its late gather on the same group); the wait for block 1 comes
  after block 2's backward ended.
- every bucket is gathered exactly twice per micro-batch (forward, then backward), in one issue
  order on both ranks, as NCCL requires of a group.

gloo as it is (`gloo_as_it_is`): the NCCL emulation finishes a group's earlier operation on the
host before it issues the next, so rank 0 would block issuing the second of block 2's buckets,
where NCCL only queues it on its stream and the host goes on."""

import functools
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from equivalence import TINY

from megalite import comm
from megalite.config import load_config
from megalite.launch import run_ranks
from megalite.parallel_state import build_parallel_state
from megalite.training.setup import build_run
from megalite.training.step import train_step

DELAY_S = 0.3
"""How long rank 1 stays late after rank 0's signal."""
HOLD_TIMEOUT_S = 20.0
"""How long rank 1 waits for the signal: past it, rank 0 was blocked waiting for rank 1."""
FORWARD_LAYER = 1
"""The block whose forward is watched, with block FORWARD_LAYER + 1's gathers in flight."""
BACKWARD_LAYER = 2
"""The block whose backward is watched, with block BACKWARD_LAYER - 1's gathers in flight."""
MICRO_BATCHES = 2


def _hold(signal: Path) -> None:
    """Rank 1: wait until rank 0 signals, then be DELAY_S late."""
    deadline = time.monotonic() + HOLD_TIMEOUT_S
    while not signal.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"rank 0 never signalled {signal.name!r}: it was blocked")
        time.sleep(1e-3)
    time.sleep(DELAY_S)


def _timeline(signals: str) -> dict[str, Any]:
    """One step of MICRO_BATCHES micro-batches at zero 3, rank 1 late for the first micro-batch's
    forward gather of block FORWARD_LAYER + 1 and backward gather of block BACKWARD_LAYER - 1.
    Returns the log of (time, event, block, ...): "issued" and "wait"/"waited" with the bucket,
    "forward start"/"forward end"/"backward start" and "reduce" (a gradient reduce-scatter
    issued) with the buckets whose gathers were in flight then, "backward end"; every gather's
    bucket in issue order; each block's buckets."""
    overrides = [*TINY, "model.arch=gpt", "parallel.bucket_mb=0.05", "parallel.zero=3"]
    run = build_run(load_config(None, overrides), build_parallel_state(1, 1, torch.device("cpu")))
    (buffer,) = run.buffers
    blocks = list(run.chunks[0].layers.values())
    index_of = {id(bucket): i for i, bucket in enumerate(buffer.buckets)}
    layer_of = {
        index_of[id(buffer.bucket_of[p])]: layer
        for layer, block in enumerate(blocks)
        for p in block.parameters()
    }
    late = run.ps.coord("dp") == 1
    # rank 1's: (block, gathers of the bucket so far) of the gather it holds back, and until
    # which signal; the block's first bucket matches, and the entry goes with it
    holds = {(FORWARD_LAYER + 1, 0): "forward", (BACKWARD_LAYER - 1, 1): "backward"}
    log: list[tuple] = []
    issued: list[int] = []

    def event(*what: Any) -> None:
        log.append((time.monotonic(), *what))

    def in_flight() -> tuple[int, ...]:
        return tuple(
            i
            for i, bucket in enumerate(buffer.buckets)
            if bucket.gather is not None and not bucket.gather[0].is_completed()
        )

    def signal(name: str) -> None:
        if not late:
            Path(signals, name).touch()

    real_gather, real_reduce = comm.all_gather_flat, comm.reduce_scatter_flat
    real_wait = buffer.wait_param_gather

    def gather(output, shard, group, async_op=False):
        bucket = next(i for i, b in enumerate(buffer.buckets) if b.full is output)
        layer = layer_of.get(bucket)
        if late and (name := holds.pop((layer, issued.count(bucket)), None)):
            _hold(Path(signals, name))
        handle = real_gather(output, shard, group, async_op)
        issued.append(bucket)
        event("issued", layer, bucket)
        return handle

    def reduce(shard, full, group, async_op=False):
        layer = layer_of.get(next(i for i, b in enumerate(buffer.buckets) if b.staging is full))
        event("reduce", layer, in_flight())
        if layer == BACKWARD_LAYER:
            signal("backward")
        return real_reduce(shard, full, group, async_op)

    def wait(bucket) -> None:
        if bucket.gather is None:  # landed and waited for: nothing to log
            return
        index = index_of[id(bucket)]
        event("wait", layer_of.get(index), index)
        real_wait(bucket)
        event("waited", layer_of.get(index), index)

    def forward_end(layer: int, _module, _args, output: torch.Tensor) -> None:
        """Prepended: before the unit's own hook, whose gradient hook on the output then runs
        after the one registered here."""
        event("forward end", layer, in_flight())
        if layer == FORWARD_LAYER:
            signal("forward")
        # the gradient of this block's output is in: the next block's backward has ended
        output.register_hook(lambda _grad: event("backward end", layer + 1))

    def backward_start(layer: int, _module, _args, output: torch.Tensor) -> None:
        """After the unit's own hook: this gradient hook runs once it gathered the block."""
        output.register_hook(lambda _grad: event("backward start", layer, in_flight()))

    for layer, block in enumerate(blocks):
        block.register_forward_pre_hook(
            lambda *_, layer=layer: event("forward start", layer, in_flight())
        )
        block.register_forward_hook(functools.partial(forward_end, layer), prepend=True)
        block.register_forward_hook(functools.partial(backward_start, layer))
    comm.all_gather_flat, comm.reduce_scatter_flat = gather, reduce
    buffer.wait_param_gather = wait
    try:
        torch.manual_seed(run.ps.coord("dp"))
        train_step(run, torch.randint(0, 500, (MICRO_BATCHES * 2, 33)), 1e-3)
    finally:
        comm.all_gather_flat, comm.reduce_scatter_flat = real_gather, real_reduce
    return {
        "log": log,
        "issued": issued,
        "buckets": len(buffer.buckets),
        "layer buckets": [
            sorted(b for b, at in layer_of.items() if at == layer) for layer in range(len(blocks))
        ],
    }


def _where(log: list[tuple], name: str, layer: int) -> list[int]:
    """Positions in `log` of the events `name` of block `layer`, in order."""
    return [i for i, e in enumerate(log) if e[1:3] == (name, layer)]


def _show(log: list[tuple]) -> str:
    """The log, an event a line, timed from its first."""
    return "\n".join(f"{t - log[0][0]:7.3f}s " + " ".join(map(str, e)) for t, *e in log)


@pytest.mark.usefixtures("gloo_as_it_is")
def test_the_next_blocks_gather_is_in_flight_while_a_block_computes(tmp_path):
    per_rank = run_ranks(2, _timeline, str(tmp_path), timeout=120)
    log, buckets = per_rank[0]["log"], per_rank[0]["layer buckets"]

    # forward: block i waits for its buckets, issues block i+1's, computes with them in flight
    # (rank 1 issued them only after it), then waits for them: the late rank's DELAY_S goes there
    i, after = FORWARD_LAYER, FORWARD_LAYER + 1
    own, next_ = len(buckets[i]), len(buckets[after])
    waited_own = _where(log, "waited", i)[:own]
    issues = _where(log, "issued", after)[:next_]
    start, end = _where(log, "forward start", i)[0], _where(log, "forward end", i)[0]
    waits = _where(log, "wait", after)[:next_]
    waited = _where(log, "waited", after)[:next_]
    assert max(waited_own) < min(issues), _show(log)
    assert max(issues) < start < end < min(waits), _show(log)
    assert log[start][3] == log[end][3] == tuple(buckets[after]), _show(log)
    assert log[max(waited)][0] - log[end][0] >= DELAY_S, _show(log)

    # backward (each block's second gathers and waits): block i waits for its buckets, issues
    # block i-1's, and computes with them in flight up to its first reduce-scatter
    i, before = BACKWARD_LAYER, BACKWARD_LAYER - 1
    own, previous = len(buckets[i]), len(buckets[before])
    waited_own = _where(log, "waited", i)[own : 2 * own]
    issues = _where(log, "issued", before)[previous : 2 * previous]
    start, reduce = _where(log, "backward start", i)[0], _where(log, "reduce", i)[0]
    end = _where(log, "backward end", i)[0]
    waits = _where(log, "wait", before)[previous : 2 * previous]
    waited = _where(log, "waited", before)[previous : 2 * previous]
    assert max(waited_own) < min(issues), _show(log)
    assert max(issues) < start < reduce < end < min(waits), _show(log)
    assert log[start][3] == log[reduce][3] == tuple(buckets[before]), _show(log)
    assert log[max(waited)][0] - log[reduce][0] >= DELAY_S, _show(log)

    # every bucket twice per micro-batch: in forward order, then once each for the backward;
    # the same order on both ranks
    issued, n = per_rank[0]["issued"], per_rank[0]["buckets"]
    assert per_rank[1]["issued"] == issued
    assert len(issued) == 2 * n * MICRO_BATCHES
    for micro_batch in range(MICRO_BATCHES):
        forward = issued[2 * n * micro_batch : 2 * n * micro_batch + n]
        backward = issued[2 * n * micro_batch + n : 2 * n * (micro_batch + 1)]
        assert forward == list(reversed(range(n))), "buckets lie in backward order"
        assert sorted(backward) == list(range(n))
