"""Pipeline schedules as data: one list of actions per pipeline rank, built by pure functions.

The model is cut into `pp_size * vpp` chunks of consecutive layers ("virtual stages"). Pipeline
rank p holds chunks p, p + P, p + 2P, ...: its local chunk c is virtual stage `c * P + p`;
except under zb-v, whose two chunks per rank lie in a V: rank p holds stages p and 2P - 1 - p,
so the last rank holds the middle two and hands activations between them without a message.
A schedule says, for one rank, in which order to run the forward and backward of each
(micro-batch, local chunk) and where to send and receive activations and their gradients.
Zero-bubble schedules split the backward in two (`zero_bubble`): B, the input gradient that
the previous stage waits for, and W, the weight gradients, which nothing waits for.

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
import functools
from collections.abc import Sequence

from megalite.errors import MegaliteError
from megalite.pipeline.actions import Action, Op
from megalite.pipeline.zero_bubble import zb_h1, zb_v

KINDS = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
"""The schedules there are: the values of `parallel.schedule`."""


class ScheduleError(MegaliteError, ValueError):
    """An impossible pipeline layout, or a schedule whose p2p does not match or deadlocks."""


def v_shaped(kind: str) -> bool:
    """Whether `kind` lays its chunks in a V (rank p: stages p and 2P - 1 - p) rather than in
    a loop (rank p: stages p, p + P, ...)."""
    return kind == "zb-v"


def splits_backward(kind: str) -> bool:
    """Whether `kind` splits each backward into B and W (zero-bubble): the tensor-parallel
    linears then defer their weight gradients (`tensor_parallel.deferred`)."""
    return kind in ("zb-h1", "zb-v")


def virtual_stage(pp_rank: int, chunk: int, pp_size: int, v_shape: bool = False) -> int:
    """Global position of local `chunk` of `pp_rank` in the model (0 = embedding side)."""
    if v_shape:
        return pp_rank if chunk == 0 else 2 * pp_size - 1 - pp_rank
    return chunk * pp_size + pp_rank


def stage_owner(stage: int, pp_size: int, v_shape: bool = False) -> tuple[int, int]:
    """(pp rank, local chunk) holding virtual stage `stage`: `virtual_stage`'s inverse."""
    if v_shape:
        return (stage, 0) if stage < pp_size else (2 * pp_size - 1 - stage, 1)
    return stage % pp_size, stage // pp_size


def peer_of(
    action: Action, pp_rank: int, pp_size: int, vpp: int, v_shape: bool = False
) -> tuple[int, int]:
    """(peer pp rank, peer local chunk) that a send/receive action on `pp_rank` talks to.

    Activations and the gradients of outputs come from / go to the next virtual stage;
    inputs and their gradients the previous one. In a loop the last rank's chunk c feeds rank
    0's c + 1; in a V rank p's chunk 1 feeds rank p - 1's.
    """
    if action.op.is_compute:
        raise ScheduleError(f"{action} is a compute step, it has no p2p peer")
    towards_next = action.op is Op.SEND_FORWARD or action.op is Op.RECV_BACKWARD
    stage = virtual_stage(pp_rank, action.chunk, pp_size, v_shape) + (1 if towards_next else -1)
    if not 0 <= stage < pp_size * vpp:
        raise ScheduleError(
            f"{action} on pp rank {pp_rank} has no peer: virtual stage {stage} is outside "
            f"0..{pp_size * vpp - 1} (pp={pp_size}, vpp={vpp})"
        )
    return stage_owner(stage, pp_size, v_shape)


def build_schedule(
    kind: str,
    pp_size: int,
    pp_rank: int,
    num_microbatches: int,
    vpp: int = 1,
    group_size: int | None = None,
    forward_only: bool = False,
) -> list[Action]:
    """The action list of `pp_rank` for one training step, for `kind` in KINDS; with
    `forward_only`, for evaluation: GPipe's forwards (chunk-major) on the kind's chunk layout.

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
    zb-h1, zb-v (Qi et al. 2024, and their V-shaped follow-up): see `zero_bubble`.
    """
    if forward_only:  # evaluation: the kind's chunks, any micro-batch count, one group
        check_chunks(kind, pp_size, vpp)
        n = _group_size("gpipe", pp_size, pp_rank, num_microbatches, vpp, None)
    else:
        n = _group_size(kind, pp_size, pp_rank, num_microbatches, vpp, group_size)
    every_rank = _every_rank(kind, pp_size, num_microbatches, vpp, n, forward_only)
    return list(every_rank[pp_rank])


@functools.lru_cache(maxsize=1024)
def compute_order(
    kind: str,
    pp_size: int,
    pp_rank: int,
    num_microbatches: int,
    vpp: int = 1,
    group_size: int | None = None,
) -> tuple[Action, ...]:
    """The forwards and backwards of `build_schedule`'s list, without its messages: what a walk
    over the activations a rank holds needs, without placing every rank's receives (the memory
    estimate runs it for thousands of candidate layouts, which share schedules: cached)."""
    n = _group_size(kind, pp_size, pp_rank, num_microbatches, vpp, group_size)
    return tuple(_compute_order(kind, pp_size, pp_rank, num_microbatches, vpp, n))


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
    if kind in ("1f1b", "zb-h1") and vpp != 1:
        raise ScheduleError(
            f"parallel.vpp={vpp} needs parallel.schedule=interleaved: {kind} runs one chunk per "
            "rank (or set parallel.vpp=1)"
        )
    if kind == "zb-v" and vpp != 2:
        raise ScheduleError(
            f"zb-v runs two chunks per rank, in a V (got vpp={vpp}): set parallel.vpp=2"
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
        if group_size is not None:
            raise ScheduleError(
                f"parallel.microbatch_group_size groups the micro-batches of the interleaved "
                f"schedule with vpp > 1; {kind} with vpp={vpp} runs them in one group: leave "
                "it unset"
            )
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
    kind: str, pp_size: int, m: int, vpp: int, n: int, forward_only: bool
) -> tuple[tuple[Action, ...], ...]:
    """Every rank's list (cached: placing one rank's receives needs its neighbours' timing)."""
    v_shape = v_shaped(kind)
    if forward_only:
        kind, n = "gpipe", m
    computes = [_compute_order(kind, pp_size, rank, m, vpp, n) for rank in range(pp_size)]
    if forward_only:
        computes = [[a for a in actions if a.op is Op.FORWARD] for actions in computes]
    timeline = _ideal_timeline(computes, pp_size, vpp, v_shape)
    return tuple(
        tuple(_place_p2p(computes, *timeline, rank, pp_size, vpp, v_shape))
        for rank in range(pp_size)
    )


def _compute_order(kind: str, pp_size: int, pp_rank: int, m: int, vpp: int, n: int) -> list[Action]:
    """`pp_rank`'s compute steps in order, for the kinds `build_schedule` describes."""
    if kind == "zb-h1":
        return zb_h1(pp_size, pp_rank, m)
    if kind == "zb-v":
        return zb_v(pp_size, pp_rank, m)
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


def _ideal_cost(op: Op, split: bool) -> int:
    """Costs of the timeline that places receives. Any positive costs give a placement that
    cannot deadlock; these are the usual ratios: a backward does twice a forward's work, and
    split in two, each half one forward's."""
    return 2 if op is Op.BACKWARD and not split else 1


def _producer(
    compute: Action, pp_rank: int, pp_size: int, vpp: int, v_shape: bool
) -> tuple[int, Action] | None:
    """(rank, compute step) whose output `compute` consumes, or None at the pipeline's ends
    and for W (it works on what its B left)."""
    if compute.op is Op.WEIGHT:
        return None
    stage = virtual_stage(pp_rank, compute.chunk, pp_size, v_shape)
    source = stage - 1 if compute.op is Op.FORWARD else stage + 1
    if not 0 <= source < pp_size * vpp:
        return None
    rank, chunk = stage_owner(source, pp_size, v_shape)
    return rank, Action(compute.op, compute.microbatch, chunk)


def _ideal_timeline(
    computes: list[list[Action]], pp_size: int, vpp: int, v_shape: bool
) -> tuple[list[list[int]], dict[tuple[int, Action], int]]:
    """Start time of every compute step (per rank, by position) and the end time of each
    (rank, compute), when every step waits only for its input and messages take no time."""
    starts: list[list[int]] = [[] for _ in computes]
    ends: dict[tuple[int, Action], int] = {}
    clocks = [0] * pp_size
    split = any(a.op is Op.WEIGHT for actions in computes for a in actions)
    while any(len(starts[r]) < len(computes[r]) for r in range(pp_size)):
        moved = False
        for rank, actions in enumerate(computes):
            while len(starts[rank]) < len(actions):
                action = actions[len(starts[rank])]
                producer = _producer(action, rank, pp_size, vpp, v_shape)
                if producer is not None and producer not in ends:
                    break
                start = max(clocks[rank], ends[producer] if producer else 0)
                starts[rank].append(start)
                clocks[rank] = ends[(rank, action)] = start + _ideal_cost(action.op, split)
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
    v_shape: bool,
) -> list[Action]:
    """Send right after the compute producing the message; receive in the first batch the rank
    leaves at or after the moment the message is sent, in the ideal timeline.

    Only stage boundaries between two ranks communicate: the first virtual stage receives no
    input, the last sends no output (and receives no output gradient: its loss starts the
    backward), and the two middle stages of a V, both on the last rank, hand over in memory.

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
        producer = _producer(action, pp_rank, pp_size, vpp, v_shape)
        if producer is not None and producer[0] != pp_rank:
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
        stage = virtual_stage(pp_rank, action.chunk, pp_size, v_shape)
        if action.op is Op.FORWARD and stage < last:
            if stage_owner(stage + 1, pp_size, v_shape)[0] != pp_rank:
                steps.append(Action(Op.SEND_FORWARD, action.microbatch, action.chunk))
        elif action.op is Op.BACKWARD and stage > 0:
            if stage_owner(stage - 1, pp_size, v_shape)[0] != pp_rank:
                steps.append(Action(Op.SEND_BACKWARD, action.microbatch, action.chunk))
    return steps
