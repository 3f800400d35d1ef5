"""Pipeline schedules as data: one list of actions per pipeline rank, built by pure functions.

The model is cut into `pp_size * vpp` chunks of consecutive layers ("virtual stages"). Pipeline
rank p holds chunks p, p + P, p + 2P, ...: its local chunk c is virtual stage `c * P + p`.
A schedule says, for one rank, in which order to run the forward and backward of each
(micro-batch, local chunk) and where to send and receive activations and their gradients.

Keeping schedules as plain lists (no tensors, no processes) lets tests check them exhaustively
(`megalite.pipeline.simulate`) and keeps the executor a dumb loop over actions. The executor
issues sends asynchronously and waits on a receive at the point it is listed. Under NCCL the
p2p messages between two ranks match in posting order, so every list is built such that, for
each ordered pair of ranks, the sends of one side equal the receives of the other, message by
message.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

from megalite.errors import MegaliteError

KINDS = ("gpipe", "1f1b", "interleaved")


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


@dataclass(frozen=True)
class Action:
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
    one group of all m micro-batches. A receive sits right before the compute step that needs
    it (or earlier, see `_receive_in_send_order`), a send right after the step producing it.

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
    n = _check_layout(kind, pp_size, pp_rank, num_microbatches, vpp, group_size)
    senders = {(pp_rank - 1) % pp_size, (pp_rank + 1) % pp_size} - {pp_rank}
    placed = {q: _placed(kind, pp_size, q, num_microbatches, vpp, n) for q in senders | {pp_rank}}
    return _receive_in_send_order(placed, pp_rank, pp_size, vpp)


def interleaved_warmup(pp_size: int, pp_rank: int, vpp: int, group_size: int) -> int:
    """Forwards that rank p runs before its first backward (before capping at m * vpp).

    Megatron's count: (P - p - 1) * 2 for the gradient of the first micro-batch to travel back
    from the last stage, plus (vpp - 1) * N for the first group to pass the other chunks.
    """
    return (pp_size - pp_rank - 1) * 2 + (vpp - 1) * group_size


def _check_layout(
    kind: str, pp_size: int, pp_rank: int, m: int, vpp: int, group_size: int | None
) -> int:
    """Reject impossible layouts with one message naming the rule and a fix; return N."""
    if kind not in KINDS:
        raise ScheduleError(f"unknown pipeline schedule {kind!r}: choose one of {', '.join(KINDS)}")
    if pp_size < 1 or not 0 <= pp_rank < pp_size:
        raise ScheduleError(f"pp rank {pp_rank} is not in 0..pp-1 (pp={pp_size})")
    if m < 1:
        raise ScheduleError(
            f"a pipeline needs num_microbatches >= 1 (got m={m}): raise train.global_batch_size"
        )
    if vpp < 1:
        raise ScheduleError(f"vpp must be >= 1 (got vpp={vpp}): set parallel.vpp to 1 or more")
    if vpp > 1 and pp_size == 1:
        raise ScheduleError(
            f"virtual stages need a pipeline (got pp=1, vpp={vpp}): set parallel.vpp=1 or "
            "raise parallel.pp"
        )
    if kind == "1f1b" and vpp != 1:
        raise ScheduleError(
            f"1f1b runs one chunk per rank (got vpp={vpp}): use parallel.schedule=interleaved "
            "or set parallel.vpp=1"
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
def _placed(kind: str, pp_size: int, pp_rank: int, m: int, vpp: int, n: int) -> tuple[Action, ...]:
    """The compute order of `pp_rank` with p2p placed around each step (cached: building a
    rank's list needs its neighbours' lists too)."""
    forwards = _forward_order(m, vpp, n)
    if kind == "gpipe":
        warmup = len(forwards)
    elif kind == "1f1b" or vpp == 1:
        warmup = pp_size - pp_rank - 1
    else:
        warmup = interleaved_warmup(pp_size, pp_rank, vpp, n)
    compute = _one_forward_one_backward(forwards, vpp, min(warmup, len(forwards)))
    return tuple(_place_p2p(compute, pp_rank, pp_size, vpp))


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


def _place_p2p(compute: list[Action], pp_rank: int, pp_size: int, vpp: int) -> list[Action]:
    """Receive right before the compute that needs it, send right after the one producing it.

    Only stage boundaries communicate: the first virtual stage receives no input, the last
    sends no output (and receives no output gradient: its loss starts the backward).
    """
    last = pp_size * vpp - 1
    steps: list[Action] = []
    for action in compute:
        stage = virtual_stage(pp_rank, action.chunk, pp_size)
        mb, chunk = action.microbatch, action.chunk
        if action.op is Op.FORWARD:
            if stage > 0:
                steps.append(Action(Op.RECV_FORWARD, mb, chunk))
            steps.append(action)
            if stage < last:
                steps.append(Action(Op.SEND_FORWARD, mb, chunk))
        else:
            if stage < last:
                steps.append(Action(Op.RECV_BACKWARD, mb, chunk))
            steps.append(action)
            if stage > 0:
                steps.append(Action(Op.SEND_BACKWARD, mb, chunk))
    return steps


def matching_receive(send: Action, pp_rank: int, pp_size: int, vpp: int) -> tuple[int, Action]:
    """(receiving rank, its receive action) for a send action of `pp_rank`."""
    peer_rank, peer_chunk = peer_of(send, pp_rank, pp_size, vpp)
    op = Op.RECV_FORWARD if send.op is Op.SEND_FORWARD else Op.RECV_BACKWARD
    return peer_rank, Action(op, send.microbatch, peer_chunk)


def _receive_in_send_order(
    placed: dict[int, tuple[Action, ...]], pp_rank: int, pp_size: int, vpp: int
) -> list[Action]:
    """`pp_rank`'s list, with receives moved earlier where needed so that each peer's messages
    are received in the order that peer sends them (`placed` holds the peers' lists too).

    Only with pp=2 do activations and gradients share a rank pair, and there (with groups larger
    than pp, or a last partial group) the sender can emit a gradient before an activation that
    the receiver needs first. Receiving the earlier-sent message first costs no time: it was
    sent, hence arrives, before the one the receiver waits for. The executor must therefore
    keep a received tensor until its compute step, which may come a few steps later.
    """
    pending: dict[int, list[Action]] = {}
    for sender, actions in placed.items():
        for send in actions:
            if send.op.is_send:
                receiver, receive = matching_receive(send, sender, pp_size, vpp)
                if receiver == pp_rank:
                    pending.setdefault(sender, []).append(receive)
    in_send_order = {sender: iter(receives) for sender, receives in pending.items()}
    received: set[Action] = set()
    steps: list[Action] = []
    for action in placed[pp_rank]:
        if action.op.is_compute or action.op.is_send:
            steps.append(action)
        elif action not in received:
            for earlier in in_send_order[peer_of(action, pp_rank, pp_size, vpp)[0]]:
                steps.append(earlier)
                received.add(earlier)
                if earlier == action:
                    break
    return steps
