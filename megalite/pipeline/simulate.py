"""Run pipeline schedules without tensors: check them and measure their bubble and memory.

All ranks' action lists run together as an event simulation with NCCL's p2p semantics, the
strictest a backend has: the p2p actions between two compute steps are one batch
(`schedule.p2p_batches`, exactly as the executor posts them); each rank's batches run one after
another on one stream; a send completes only when the peer's stream has reached the batch with
the matching receive, and a batch completes when all of its messages have. Compute runs on its
own stream and waits only for the batch holding its input. (gloo buffers sends, so a schedule
that passes here also runs there.) A schedule that passes has matching p2p, cannot deadlock, and
has the bubble and activation memory reported here. Schedules with a split backward (W steps)
run B as the input gradient alone and W as the weight gradients.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from megalite.pipeline.schedule import (
    Action,
    Op,
    ScheduleError,
    p2p_batches,
    peer_of,
    stage_owner,
    virtual_stage,
)


@dataclass(frozen=True)
class SimResult:
    """Timing and memory of one simulated step; lists are indexed by pp rank.

    Costs are per chunk: with vpp chunks of equal cost a rank's compute per micro-batch is
    vpp * (forward_cost + backward_cost); with per-stage costs, the sum over its chunks. A split
    backward costs the same in all: B plus W.
    """

    makespan: float
    """Time from the first action to the last one on any rank."""
    bubble_fraction: float
    """Idle share of the whole pipeline: 1 - sum(busy) / (P * makespan)."""
    busy: list[float]
    """Compute time per rank."""
    idle: list[float]
    """makespan - busy per rank: waiting for messages, before the start and after the end."""
    peak_in_flight: list[int]
    """Most (micro-batch, chunk) forwards whose backward has not run yet (activations held)."""
    peak_in_flight_microbatches: list[float]
    """peak_in_flight / vpp: micro-batches' worth of the rank's layers held at the peak."""

    @property
    def bubble_ratio(self) -> float:
        """Idle time relative to compute time, sum(idle) / sum(busy): the papers' bubble,
        (P - 1) / m for 1F1B and (P - 1) / (vpp * m) interleaved."""
        return sum(self.idle) / sum(self.busy)


class Message(NamedTuple):
    """What travels between two virtual stages: an activation forward or a gradient back."""

    is_activation: bool
    microbatch: int
    src_stage: int
    dst_stage: int

    def __str__(self) -> str:
        what = "activation" if self.is_activation else "gradient"
        return f"{what} of mb {self.microbatch} from stage {self.src_stage} to {self.dst_stage}"


def message_of(
    action: Action, pp_rank: int, pp_size: int, vpp: int, v_shape: bool = False
) -> Message:
    """The message a send puts on the wire, or the one a receive expects."""
    is_activation, src, dst, _ = _link(action.op, action.chunk, pp_rank, pp_size, vpp, v_shape)
    return Message(is_activation, action.microbatch, src, dst)


@functools.lru_cache(maxsize=4096)
def _link(
    op: Op, chunk: int, pp_rank: int, pp_size: int, vpp: int, v_shape: bool
) -> tuple[bool, int, int, int]:
    """(is activation, source stage, destination stage, peer rank) of a p2p action on a chunk
    (cached: a simulation asks for every message)."""
    peer_rank, peer_chunk = peer_of(Action(op, 0, chunk), pp_rank, pp_size, vpp, v_shape)
    here = virtual_stage(pp_rank, chunk, pp_size, v_shape)
    there = virtual_stage(peer_rank, peer_chunk, pp_size, v_shape)
    src, dst = (here, there) if op.is_send else (there, here)
    return op in (Op.SEND_FORWARD, Op.RECV_FORWARD), src, dst, peer_rank


def check_p2p_order(
    schedules: Sequence[list[Action]], pp_size: int, vpp: int, v_shape: bool = False
) -> None:
    """Per ordered pair of ranks, the sends of one must equal the receives of the other in order.

    NCCL matches p2p messages between two ranks by posting order, whatever their tags, so a
    difference here would silently swap tensors (or hang) on GPUs.
    """
    sent: dict[tuple[int, int], list[Message]] = {}
    received: dict[tuple[int, int], list[Message]] = {}
    for rank, actions in enumerate(schedules):
        for action in actions:
            if action.op.is_compute:
                continue
            message = message_of(action, rank, pp_size, vpp, v_shape)
            book = sent if action.op.is_send else received
            src_rank = stage_owner(message.src_stage, pp_size, v_shape)[0]
            pair = (src_rank, stage_owner(message.dst_stage, pp_size, v_shape)[0])
            book.setdefault(pair, []).append(message)
    for src, dst in sorted(set(sent) | set(received)):
        sends, recvs = sent.get((src, dst), []), received.get((src, dst), [])
        for i, (out, into) in enumerate(zip(sends, recvs)):
            if out != into:
                raise ScheduleError(
                    f"p2p mismatch from rank {src} to rank {dst}, message {i}: rank {src} sends "
                    f"the {out}, rank {dst} expects the {into}"
                )
        if len(sends) != len(recvs):
            raise ScheduleError(
                f"p2p mismatch from rank {src} to rank {dst}: {len(sends)} sends but "
                f"{len(recvs)} receives"
            )


def validate(
    schedules: Sequence[list[Action]], pp_size: int, vpp: int, m: int, v_shape: bool = False
) -> None:
    """Every rank runs each (mb, chunk) forward and backward exactly once, backward after
    forward (and W after B when the backward is split, as soon as any rank has a W), with
    exactly the p2p its stage boundaries need, received before and sent after; a boundary
    inside a rank (the middle of a V) hands over in order, without messages."""
    if len(schedules) != pp_size:
        raise ScheduleError(f"expected {pp_size} schedules (one per pp rank), got {len(schedules)}")
    split = any(a.op is Op.WEIGHT for actions in schedules for a in actions)
    for rank, actions in enumerate(schedules):
        chains = [
            _chain(rank, mb, chunk, pp_size, vpp, v_shape, split)
            for mb in range(m)
            for chunk in range(vpp)
        ]
        chains += _handovers(rank, m, pp_size, vpp, v_shape)
        expected = {action for chain in chains for action in chain}
        counts = Counter(actions)
        wrong = {a for a, n in counts.items() if n > 1} | (expected ^ set(counts))
        if wrong:
            action = min(wrong, key=lambda a: (a.microbatch, a.chunk, a.op.value))
            raise ScheduleError(
                f"rank {rank}: {action} appears {counts[action]} times, expected "
                f"{int(action in expected)}"
            )
        position = {action: i for i, action in enumerate(actions)}
        for chain in chains:
            for before, after in zip(chain, chain[1:]):
                if position[before] > position[after]:
                    raise ScheduleError(f"rank {rank}: {after} comes before {before}")


def _chain(
    rank: int, mb: int, chunk: int, pp_size: int, vpp: int, v_shape: bool, split: bool
) -> list[Action]:
    """The actions of one (mb, chunk) in the order they must run; no p2p on the outer side of
    the first and last virtual stage, nor towards a stage on the same rank."""
    stage = virtual_stage(rank, chunk, pp_size, v_shape)
    before = stage > 0 and stage_owner(stage - 1, pp_size, v_shape)[0] != rank
    after = stage < pp_size * vpp - 1 and stage_owner(stage + 1, pp_size, v_shape)[0] != rank
    ops = [Op.RECV_FORWARD] * before + [Op.FORWARD] + [Op.SEND_FORWARD] * after
    ops += [Op.RECV_BACKWARD] * after + [Op.BACKWARD] + [Op.SEND_BACKWARD] * before
    ops += [Op.WEIGHT] * split
    return [Action(op, mb, chunk) for op in ops]


def _handovers(rank: int, m: int, pp_size: int, vpp: int, v_shape: bool) -> list[list[Action]]:
    """Forward of a stage before the next stage's, backward after it, where both are chunks
    of this rank."""
    pairs = []
    for chunk in range(vpp):
        stage = virtual_stage(rank, chunk, pp_size, v_shape)
        if stage + 1 < pp_size * vpp:
            next_rank, next_chunk = stage_owner(stage + 1, pp_size, v_shape)
            if next_rank == rank:
                pairs.append((chunk, next_chunk))
    return [
        [Action(op, mb, a), Action(op, mb, b)][:: 1 if op is Op.FORWARD else -1]
        for a, b in pairs
        for mb in range(m)
        for op in (Op.FORWARD, Op.BACKWARD)
    ]


def simulate(
    schedules: Sequence[list[Action]],
    pp_size: int,
    vpp: int,
    forward_cost: float | Sequence[float] = 1.0,
    backward_cost: float | Sequence[float] = 2.0,
    p2p_cost: float = 0.0,
    weight_cost: float | Sequence[float] | None = None,
    v_shape: bool = False,
) -> SimResult:
    """Run all ranks' schedules together; raise ScheduleError on mismatched p2p or deadlock.

    Costs are per chunk forward / backward (the whole backward, input and weight gradients):
    one number for every chunk, or one per virtual stage (pp * vpp, in stage order:
    `partition.stage_costs` gives a stage's share of the FLOPs, embedding and head included),
    so the bubble is that of the actual stages. `weight_cost` is the weight gradients' part of
    the backward (default: half, the papers' F = B = W), which a split backward runs as W. A
    message takes `p2p_cost` once both of its ends have started their batches. Every time
    depends only on earlier events, so the order in which the simulation visits ranks does not
    change the result. `v_shape`: the chunks lie in a V (zb-v).
    """
    if len(schedules) != pp_size:
        raise ScheduleError(f"expected {pp_size} schedules (one per pp rank), got {len(schedules)}")
    check_p2p_order(schedules, pp_size, vpp, v_shape)
    n_stages = pp_size * vpp
    forward = _per_stage(forward_cost, n_stages, "forward_cost")
    backward = _per_stage(backward_cost, n_stages, "backward_cost")
    weight = (
        [b / 2 for b in backward]
        if weight_cost is None
        else _per_stage(weight_cost, n_stages, "weight_cost")
    )
    costs = [
        _rank_costs(rank, pp_size, vpp, v_shape, forward, backward, weight, schedules[rank])
        for rank in range(pp_size)
    ]
    sim = _Simulation(schedules, pp_size, vpp, costs, p2p_cost, v_shape)
    ready = set(range(pp_size))
    while ready:
        ready |= sim.advance(ready.pop())
    if not sim.finished():
        raise ScheduleError(f"pipeline schedule deadlocks under NCCL semantics: {sim.stuck()}")
    makespan = max(max([clock, *done]) for clock, done in zip(sim.clock, sim.done))
    busy = sim.busy
    return SimResult(
        makespan=makespan,
        bubble_fraction=1 - sum(busy) / (pp_size * makespan),
        busy=busy,
        idle=[makespan - b for b in busy],
        peak_in_flight=sim.peak,
        peak_in_flight_microbatches=[p / vpp for p in sim.peak],
    )


def _per_stage(cost: float | Sequence[float], n_stages: int, name: str) -> list[float]:
    """One cost per virtual stage from a scalar or a per-stage sequence."""
    if isinstance(cost, (int, float)):
        return [float(cost)] * n_stages
    if len(cost) != n_stages:
        raise ValueError(f"{name} has {len(cost)} entries, expected one per stage ({n_stages})")
    return [float(c) for c in cost]


class _Simulation:
    """Per rank: the host walking its steps (compute clock), and its p2p stream: when each
    batch was posted, started (reached the head of the stream) and completed."""

    def __init__(
        self,
        schedules: Sequence[list[Action]],
        pp_size: int,
        vpp: int,
        costs: list[dict[tuple[Op, int], tuple[float, int]]],
        p2p_cost: float,
        v_shape: bool,
    ) -> None:
        self.p2p_cost = p2p_cost
        steps = [p2p_batches(actions) for actions in schedules]
        self.batches = [
            [s for s in rank_steps if not isinstance(s, Action)] for rank_steps in steps
        ]
        self.partners = _partners(self.batches, pp_size, vpp, v_shape)
        self.program = [
            _program(rank_steps, rank_costs) for rank_steps, rank_costs in zip(steps, costs)
        ]
        self.position = [0] * pp_size
        self.clock = [0.0] * pp_size
        self.busy = [0.0] * pp_size
        self.in_flight = [0] * pp_size
        self.peak = [0] * pp_size
        self.posted: list[list[float]] = [[] for _ in range(pp_size)]
        self.started: list[list[float]] = [[] for _ in range(pp_size)]
        self.done: list[list[float]] = [[] for _ in range(pp_size)]

    def finished(self) -> bool:
        return all(len(d) == len(b) for d, b in zip(self.done, self.batches))

    def advance(self, rank: int) -> set[int]:
        """Move `rank`'s host and stream as far as they can go; returns the ranks to look at
        again (the partners of each batch that started)."""
        woken = set()
        done, started, posted = self.done[rank], self.started[rank], self.posted[rank]
        while True:
            self._run_host(rank)
            head = len(done)
            if head == len(posted):
                return woken
            partners = self.partners[rank][head]
            if len(started) == head:  # the head batch starts once posted and its previous done
                started.append(max(posted[head], done[-1] if head else 0.0))
                woken.update(peer for peer, _, _ in partners)
            meet = started[head]
            for peer, index, _ in partners:
                if index >= len(self.started[peer]):
                    return woken
                meet = max(meet, self.started[peer][index])
            done.append(meet + self.p2p_cost)

    def _run_host(self, rank: int) -> None:
        """Post batches and run compute until a compute needs a batch not yet complete."""
        program, done = self.program[rank], self.done[rank]
        position, clock = self.position[rank], self.clock[rank]
        while position < len(program):
            cost, needs, in_flight = program[position]
            if cost is None:
                self.posted[rank].append(clock)
            else:
                if needs is not None:
                    if needs >= len(done):
                        break
                    clock = max(clock, done[needs])
                clock += cost
                self.busy[rank] += cost
                self.in_flight[rank] += in_flight
                self.peak[rank] = max(self.peak[rank], self.in_flight[rank])
            position += 1
        self.position[rank], self.clock[rank] = position, clock

    def stuck(self) -> str:
        """The cycle of ranks whose stream heads wait on each other, each with the action it
        is stuck at and the action of the next rank it waits for."""
        waits = {}
        for rank, batches in enumerate(self.batches):
            head = len(self.done[rank])
            if head < len(batches):
                for action, (peer, index, other) in zip(batches[head], self.partners[rank][head]):
                    if index >= len(self.started[peer]):
                        waits[rank] = (action, peer, other)
                        break
        rank, seen = next(iter(waits)), []
        while rank not in seen:
            seen.append(rank)
            rank = waits[rank][1]
        return "; ".join(
            f"rank {r} is stuck at {waits[r][0]} until rank {waits[r][1]} reaches {waits[r][2]}"
            for r in seen[seen.index(rank) :]
        )


def _rank_costs(
    rank: int,
    pp_size: int,
    vpp: int,
    v_shape: bool,
    forward: list[float],
    backward: list[float],
    weight: list[float],
    actions: list[Action],
) -> dict[tuple[Op, int], tuple[float, int]]:
    """(cost, change of activations held) of each compute op on each of `rank`'s chunks; a
    rank that runs W steps runs B as the backward less its weight gradients."""
    split = any(a.op is Op.WEIGHT for a in actions)
    costs = {}
    for chunk in range(vpp):
        stage = virtual_stage(rank, chunk, pp_size, v_shape)
        costs[Op.FORWARD, chunk] = (forward[stage], 1)
        costs[Op.BACKWARD, chunk] = (backward[stage] - weight[stage] * split, -1)
        costs[Op.WEIGHT, chunk] = (weight[stage], 0)
    return costs


def _program(
    steps: list[Action | tuple[Action, ...]], costs: dict[tuple[Op, int], tuple[float, int]]
) -> list[tuple[float | None, int | None, int]]:
    """One rank's steps for the host: (cost, batch holding its input, change of activations
    held) per compute; (None, None, 0) per batch, which the host only posts."""
    program: list[tuple[float | None, int | None, int]] = []
    batch_of: dict[tuple[Op, int, int], int] = {}
    batches = 0
    for step in steps:
        if not isinstance(step, Action):
            batch_of.update({(a.op, a.microbatch, a.chunk): batches for a in step})
            batches += 1
            program.append((None, None, 0))
        else:
            receive = _RECEIVE_OF.get(step.op)
            cost, in_flight = costs[step.op, step.chunk]
            program.append((cost, batch_of.get((receive, step.microbatch, step.chunk)), in_flight))
    return program


_RECEIVE_OF = {Op.FORWARD: Op.RECV_FORWARD, Op.BACKWARD: Op.RECV_BACKWARD}
"""The receive whose batch a compute waits for (W waits for none)."""


def _partners(
    batches: list[list[tuple[Action, ...]]], pp_size: int, vpp: int, v_shape: bool
) -> list[list[list[tuple[int, int, Action]]]]:
    """For each action of each batch: (peer rank, peer batch, peer action) of its other end.
    The k-th send from a to b meets b's k-th receive from a (their order is checked before)."""
    ends: dict[tuple[int, int, bool, int], tuple[int, int, Action]] = {}
    keys = []
    for rank, rank_batches in enumerate(batches):
        count: Counter = Counter()
        for index, batch in enumerate(rank_batches):
            for action in batch:
                peer = _link(action.op, action.chunk, rank, pp_size, vpp, v_shape)[3]
                pair = (rank, peer, True) if action.op.is_send else (peer, rank, False)
                key = (*pair, count[pair])
                count[pair] += 1
                ends[key] = (rank, index, action)
                keys.append((rank, index, key))
    partners: list[list[list]] = [[[] for _ in rank_batches] for rank_batches in batches]
    for rank, index, (src, dst, is_send, k) in keys:
        partners[rank][index].append(ends[(src, dst, not is_send, k)])
    return partners
