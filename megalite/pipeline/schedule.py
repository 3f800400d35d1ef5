"""Pipeline schedules as data: one list of actions per pipeline rank, built by pure functions.

The model is cut into `pp_size * vpp` chunks of consecutive layers ("virtual stages"). Pipeline
rank p holds chunks p, p + P, p + 2P, ...: its local chunk c is virtual stage `c * P + p`.
A schedule says, for one rank, in which order to run the forward and backward of each
(micro-batch, local chunk) and where to send and receive activations and their gradients.

Keeping schedules as plain lists (no tensors, no processes) lets tests check them exhaustively
(`megalite.pipeline.simulate`) and keeps the executor a dumb loop over actions. The p2p actions
listed between two compute steps are one batch (`p2p_batches`): the executor posts them together
and waits for a received tensor only at the compute that needs it, as Megatron-LM's schedules
post send-forward, receive-forward, send-backward and receive-backward together. Under NCCL the
p2p messages between two ranks match in posting order, so every list is built such that, for
each ordered pair of ranks, the sends of one side equal the receives of the other, message by
message; and a send completes only when the receiver's stream reaches the receive, so where a
receive is listed decides whether two ranks can wait on each other (`_place_p2p`).
"""

from __future__ import annotations

import bisect
import enum
import functools
from collections.abc import Sequence
from typing import NamedTuple

from megalite.errors import MegaliteError

KINDS = ("gpipe", "1f1b", "interleaved")
"""The schedules there are: the values of `parallel.schedule`."""


class ScheduleError(MegaliteError, ValueError):
    """An impossible pipeline layout, or a schedule whose p2p does not match or deadlocks."""


class Op(enum.Enum):
    """One kind of schedule step; the values are the short codes used in logs and tests."""

    FORWARD = "F"
    BACKWARD = "B"
    RECV_FORWARD = "RF"  # receive the input activation of (mb, chunk) from the previous stage
    SEND_FORWARD = "SF"  # send the output activation of (mb, chunk) to the next stage
    RECV_BACKWARD = "RB"  # receive the gradient of the output of (mb, chunk) from the next stage
    SEND_BACKWARD = "SB"  # send the gradient of the input of (mb, chunk) to the previous stage

    def __init__(self, code: str) -> None:
        # Plain attributes, not properties: simulations test these a million times.
        self.is_compute = code in ("F", "B")
        self.is_send = code.startswith("S")

    # Members are singletons, so identity is their hash: C-fast, where Enum's hashes the name
    # in Python (simulations hash millions of Actions).
    __hash__ = object.__hash__


class Action(NamedTuple):
    """One step of a rank's schedule; `chunk` is the LOCAL chunk index on that rank."""

    op: Op
    microbatch: int
    chunk: int

    def __str__(self) -> str:
        return f"{self.op.name}(mb={self.microbatch}, chunk={self.chunk})"


def virtual_stage(pp_rank: int, chunk: int, pp_size: int) -> int:
    """Global position of local `chunk` of `pp_rank` in the model (0 = embedding side)."""
    return chunk * pp_size + pp_rank


def peer_of(action: Action, pp_rank: int, pp_size: int, vpp: int) -> tuple[int, int]:
    """(peer pp rank, peer local chunk) that a send/receive action on `pp_rank` talks to.

    Activations and the gradients of outputs come from / go to the next virtual stage;
    inputs and their gradients the previous one. The last rank's chunk c feeds rank 0's c + 1.
    """
    if action.op.is_compute:
        raise ScheduleError(f"{action} is a compute step, it has no p2p peer")
    towards_next = action.op is Op.SEND_FORWARD or action.op is Op.RECV_BACKWARD
    stage = virtual_stage(pp_rank, action.chunk, pp_size) + (1 if towards_next else -1)
    if not 0 <= stage < pp_size * vpp:
        raise ScheduleError(
            f"{action} on pp rank {pp_rank} has no peer: virtual stage {stage} is outside "
            f"0..{pp_size * vpp - 1} (pp={pp_size}, vpp={vpp})"
        )
    return stage % pp_size, stage // pp_size


def build_schedule(
    kind: str,
    pp_size: int,
    pp_rank: int,
    num_microbatches: int,
    vpp: int = 1,
    group_size: int | None = None,
) -> list[Action]:
    """The action list of `pp_rank` for one training step, for `kind` in KINDS.

    `group_size` (N) only matters to interleaved with vpp > 1 (default pp); the other kinds run
    one group of all m micro-batches. A send sits right after the step producing it; a receive
    in the batch the rank posts when its sender has sent (`_place_p2p`).

    gpipe:
        All forwards, then all backwards (with vpp > 1: chunk-major, one group of m). Simplest,
        but every stage holds the activations of all m micro-batches at once. Bubble (P - 1) / m
        of the compute time. Evaluation runs the forward actions of this list alone.
    1f1b (PipeDream-Flush, Narayanan et al. 2021):
        Warmup: rank p runs P - p - 1 forwards, enough to fill the pipeline below it.
        Steady: one forward, then one backward, so at most P - p micro-batches are in flight.
        Cooldown: the remaining backwards. Same bubble as GPipe, but the first stage holds at
        most P micro-batches' activations instead of m.
    interleaved (Narayanan et al. 2021, section 2.2):
        Each rank holds vpp chunks. Forwards go in groups of N micro-batches: chunk 0 for every
        micro-batch of the group, then chunk 1, ...; backwards in the same order with the chunks
        reversed. Warmup: (P - p - 1) * 2 + (vpp - 1) * N forwards (`interleaved_warmup`), then
        the 1F1B steady state and cooldown over these (micro-batch, chunk) sequences. The bubble
        shrinks to (P - 1) / (vpp * m) for vpp times more p2p messages; the first stage holds
        P + (P - 1) / vpp micro-batches' worth of activations (N = P < m). With vpp = 1 this is
        exactly 1f1b.
    """
    n = _group_size(kind, pp_size, pp_rank, num_microbatches, vpp, group_size)
    return list(_every_rank(kind, pp_size, num_microbatches, vpp, n)[pp_rank])


def compute_order(
    kind: str,
    pp_size: int,
    pp_rank: int,
    num_microbatches: int,
    vpp: int = 1,
    group_size: int | None = None,
) -> list[Action]:
    """The forwards and backwards of `build_schedule`'s list, without its messages: what a walk
    over the activations a rank holds needs, without placing every rank's receives (the memory
    estimate runs it for thousands of candidate layouts)."""
    n = _group_size(kind, pp_size, pp_rank, num_microbatches, vpp, group_size)
    return _compute_order(kind, pp_size, pp_rank, num_microbatches, vpp, n)


def _group_size(
    kind: str, pp_size: int, pp_rank: int, m: int, vpp: int, group_size: int | None
) -> int:
    """The micro-batch group size N of a valid layout; ScheduleError names the broken rule."""
    if pp_size < 1 or not 0 <= pp_rank < pp_size:
        raise ScheduleError(f"pp rank {pp_rank} is not in 0..pp-1 (pp={pp_size})")
    check_chunks(kind, pp_size, vpp)
    return check_microbatches(kind, pp_size, m, vpp, group_size)


def p2p_batches(actions: Sequence[Action]) -> list[Action | tuple[Action, ...]]:
    """The list as the executor runs it and the simulator checks it: each compute step (an
    Action), and between two of them the p2p actions listed there as one batch (a plain tuple,
    posted together in list order)."""
    steps: list[Action | tuple[Action, ...]] = []
    batch: list[Action] = []
    for action in actions:
        if action.op.is_compute:
            if batch:
                steps.append(tuple(batch))
                batch = []
            steps.append(action)
        else:
            batch.append(action)
    if batch:
        steps.append(tuple(batch))
    return steps


def interleaved_warmup(pp_size: int, pp_rank: int, vpp: int, group_size: int) -> int:
    """Forwards that rank p runs before its first backward (before capping at m * vpp).

    Megatron's count: (P - p - 1) * 2 for the gradient of the first micro-batch to travel back
    from the last stage, plus (vpp - 1) * N for the first group to pass the other chunks.
    """
    return (pp_size - pp_rank - 1) * 2 + (vpp - 1) * group_size


def check_chunks(kind: str, pp_size: int, vpp: int) -> None:
    """Reject a schedule name, or a chunk count that no micro-batch count can fix, with one
    message naming the rule and a fix. Config validation runs this when a config loads (this
    module imports no torch, so the error comes at once)."""
    if kind not in KINDS:
        names = f"{', '.join(KINDS[:-1])} or {KINDS[-1]}"
        raise ScheduleError(
            f"parallel.schedule must be {names}, got {kind!r}: unknown pipeline schedule"
        )
    if vpp < 1:
        raise ScheduleError(f"parallel.vpp must be >= 1 (got vpp={vpp}): set it to 1 or more")
    if vpp > 1 and pp_size == 1:
        raise ScheduleError(
            f"virtual stages need a pipeline (got pp=1, vpp={vpp}): set parallel.vpp=1 or "
            "raise parallel.pp"
        )
    if kind == "1f1b" and vpp != 1:
        raise ScheduleError(
            f"parallel.vpp={vpp} needs parallel.schedule=interleaved: 1f1b runs one chunk per "
            "rank (or set parallel.vpp=1)"
        )


def check_microbatches(
    kind: str, pp_size: int, m: int, vpp: int = 1, group_size: int | None = None
) -> int:
    """Reject a micro-batch count m or group size the schedule cannot run (after
    `check_chunks`); return the group size N. `Config.layout_for_world` runs this once the
    world size gives m, so these errors too come before any work."""
    if m < 1:
        raise ScheduleError(
            f"a pipeline needs num_microbatches >= 1 (got m={m}): raise train.global_batch_size"
        )
    if kind != "interleaved" or vpp == 1:
        return m  # one group: chunk-major order over all micro-batches
    if m < pp_size:
        raise ScheduleError(
            f"interleaved needs num_microbatches >= pp (got m={m}, pp={pp_size}): raise "
            "train.global_batch_size or lower parallel.pp"
        )
    n = pp_size if group_size is None else group_size
    if not pp_size <= n <= m:
        raise ScheduleError(
            f"interleaved needs pp <= microbatch_group_size <= num_microbatches (got "
            f"group size {n}, pp={pp_size}, m={m}): set parallel.microbatch_group_size "
            f"between {pp_size} and {m}"
        )
    if 0 < m % n < pp_size:
        raise ScheduleError(
            f"interleaved needs num_microbatches % microbatch_group_size to be 0 or >= pp, so "
            f"the last group still fills the pipeline (got m={m}, group size {n}, pp="
            f"{pp_size}: remainder {m % n}): use a multiple of {n} micro-batches or another "
            "parallel.microbatch_group_size"
        )
    return n


def _forward_order(m: int, vpp: int, group_size: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) in forward order: per group, all of chunk 0, then chunk 1, ...

    The last group may be shorter. Megatron calls this the schedule table.
    """
    order = []
    for start in range(0, m, group_size):
        group = range(start, min(start + group_size, m))
        order += [(mb, chunk) for chunk in range(vpp) for mb in group]
    return order


@functools.lru_cache(maxsize=64)
def _every_rank(
    kind: str, pp_size: int, m: int, vpp: int, n: int
) -> tuple[tuple[Action, ...], ...]:
    """Every rank's list (cached: placing one rank's receives needs its neighbours' timing)."""
    computes = [_compute_order(kind, pp_size, rank, m, vpp, n) for rank in range(pp_size)]
    starts, ends = _ideal_timeline(computes, pp_size, vpp)
    return tuple(
        tuple(_place_p2p(computes, starts, ends, rank, pp_size, vpp)) for rank in range(pp_size)
    )


def _compute_order(kind: str, pp_size: int, pp_rank: int, m: int, vpp: int, n: int) -> list[Action]:
    """`pp_rank`'s forwards and backwards in order, for the kinds `build_schedule` describes."""
    forwards = _forward_order(m, vpp, n)
    if kind == "gpipe":
        warmup = len(forwards)
    elif kind == "1f1b" or vpp == 1:
        warmup = pp_size - pp_rank - 1
    else:
        warmup = interleaved_warmup(pp_size, pp_rank, vpp, n)
    return _one_forward_one_backward(forwards, vpp, min(warmup, len(forwards)))


def _one_forward_one_backward(
    forwards: list[tuple[int, int]], vpp: int, warmup: int
) -> list[Action]:
    """Warmup forwards, then alternate forward k + warmup / backward k, then the rest.

    Backward k is forward k's micro-batch with the chunk mirrored (vpp - 1 - chunk): gradients
    enter each group at the last chunk. warmup == len(forwards) gives GPipe.
    """
    backwards = [(mb, vpp - 1 - chunk) for mb, chunk in forwards]
    steps = [Action(Op.FORWARD, mb, c) for mb, c in forwards[:warmup]]
    for k in range(len(forwards)):
        if k + warmup < len(forwards):
            steps.append(Action(Op.FORWARD, *forwards[k + warmup]))
        steps.append(Action(Op.BACKWARD, *backwards[k]))
    return steps


_IDEAL_COST = {Op.FORWARD: 1, Op.BACKWARD: 2}
"""Costs of the timeline that places receives. Any positive costs give a placement that cannot
deadlock; these are the usual ratio (a backward does twice a forward's work)."""


def _producer(compute: Action, pp_rank: int, pp_size: int, vpp: int) -> tuple[int, Action] | None:
    """(rank, compute step) whose output `compute` consumes, or None at the pipeline's ends."""
    stage = virtual_stage(pp_rank, compute.chunk, pp_size)
    source = stage - 1 if compute.op is Op.FORWARD else stage + 1
    if not 0 <= source < pp_size * vpp:
        return None
    return source % pp_size, Action(compute.op, compute.microbatch, source // pp_size)


def _ideal_timeline(
    computes: list[list[Action]], pp_size: int, vpp: int
) -> tuple[list[list[int]], dict[tuple[int, Action], int]]:
    """Start time of every compute step (per rank, by position) and the end time of each
    (rank, compute), when every step waits only for its input and messages take no time."""
    starts: list[list[int]] = [[] for _ in computes]
    ends: dict[tuple[int, Action], int] = {}
    clocks = [0] * pp_size
    while any(len(starts[r]) < len(computes[r]) for r in range(pp_size)):
        moved = False
        for rank, actions in enumerate(computes):
            while len(starts[rank]) < len(actions):
                action = actions[len(starts[rank])]
                producer = _producer(action, rank, pp_size, vpp)
                if producer is not None and producer not in ends:
                    break
                start = max(clocks[rank], ends[producer] if producer else 0)
                starts[rank].append(start)
                clocks[rank] = ends[(rank, action)] = start + _IDEAL_COST[action.op]
                moved = True
        if not moved:
            raise ScheduleError("pipeline compute order waits on itself (a bug in the schedule)")
    return starts, ends


def _place_p2p(
    computes: list[list[Action]],
    starts: list[list[int]],
    ends: dict[tuple[int, Action], int],
    pp_rank: int,
    pp_size: int,
    vpp: int,
) -> list[Action]:
    """Send right after the compute producing the message; receive in the first batch the rank
    leaves at or after the moment the message is sent, in the ideal timeline.

    Only stage boundaries communicate: the first virtual stage receives no input, the last
    sends no output (and receives no output gradient: its loss starts the backward).

    Why there: under NCCL a send completes only once the receiver's stream reaches the matching
    receive, and a rank's batches run one after another, so a batch waits on its partners'
    batches and, through them, on every batch before those. Time each batch by when its rank
    leaves it in the ideal timeline (the start of the next compute). A send's batch is left no
    earlier than the send; the receive's batch is the first one left at or after it. So each
    side's previous batch is left strictly before the other side's batch: every wait points to
    an earlier time, and no two ranks can wait on each other, whatever the real costs. A receive
    listed right before its compute can come later than that: with interleaving, rank 0 then
    sends a gradient alone that rank 1 receives only after a batch whose send rank 0 receives
    only after its own (issue 13). Receives from one peer come in the order it sends them, as
    NCCL matches them; a received tensor may wait a few steps for its compute.
    """
    mine = computes[pp_rank]
    receives: list[list[tuple[int, Action]]] = [[] for _ in range(len(mine) + 1)]
    for action in mine:
        producer = _producer(action, pp_rank, pp_size, vpp)
        if producer is not None:
            sent = ends[producer]
            # The batch before the first compute that starts at or after the send:
            batch = bisect.bisect_left(starts[pp_rank], sent)
            op = Op.RECV_FORWARD if action.op is Op.FORWARD else Op.RECV_BACKWARD
            receives[batch].append((sent, Action(op, action.microbatch, action.chunk)))
    last = pp_size * vpp - 1
    steps: list[Action] = []
    for index, action in enumerate(mine):
        steps += [receive for _, receive in sorted(receives[index], key=lambda r: r[0])]
        steps.append(action)
        stage = virtual_stage(pp_rank, action.chunk, pp_size)
        if action.op is Op.FORWARD and stage < last:
            steps.append(Action(Op.SEND_FORWARD, action.microbatch, action.chunk))
        elif action.op is Op.BACKWARD and stage > 0:
            steps.append(Action(Op.SEND_BACKWARD, action.microbatch, action.chunk))
    return steps
