"""Run pipeline schedules without tensors: check them and measure their bubble and memory.

Each rank's action list runs as an event simulation. A compute step takes its cost; a send never
blocks (its message arrives `p2p_cost` later); a receive waits for its message. This is the
executor's model (asynchronous sends, receives as blocking waits), so a schedule that passes
here has matching p2p, no deadlock, and the bubble and activation memory reported here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from megalite.pipeline.schedule import Action, Op, ScheduleError, peer_of, virtual_stage


@dataclass(frozen=True)
class SimResult:
    """Timing and memory of one simulated step; lists are indexed by pp rank.

    Costs are per chunk: with vpp chunks a rank's compute per micro-batch is
    vpp * (forward_cost + backward_cost).
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


def message_of(action: Action, pp_rank: int, pp_size: int, vpp: int) -> Message:
    """The message a send puts on the wire, or the one a receive expects."""
    peer_rank, peer_chunk = peer_of(action, pp_rank, pp_size, vpp)
    here = virtual_stage(pp_rank, action.chunk, pp_size)
    there = virtual_stage(peer_rank, peer_chunk, pp_size)
    is_activation = action.op in (Op.SEND_FORWARD, Op.RECV_FORWARD)
    src, dst = (here, there) if action.op.is_send else (there, here)
    return Message(is_activation, action.microbatch, src, dst)


def check_p2p_order(schedules: Sequence[list[Action]], pp_size: int, vpp: int) -> None:
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
            message = message_of(action, rank, pp_size, vpp)
            book = sent if action.op.is_send else received
            pair = (message.src_stage % pp_size, message.dst_stage % pp_size)
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


def validate(schedules: Sequence[list[Action]], pp_size: int, vpp: int, m: int) -> None:
    """Every rank runs each (mb, chunk) forward and backward exactly once, backward after
    forward, with exactly the p2p its stage boundaries need, received before and sent after."""
    if len(schedules) != pp_size:
        raise ScheduleError(f"expected {pp_size} schedules (one per pp rank), got {len(schedules)}")
    for rank, actions in enumerate(schedules):
        chains = [_chain(rank, mb, chunk, pp_size, vpp) for mb in range(m) for chunk in range(vpp)]
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


def _chain(rank: int, mb: int, chunk: int, pp_size: int, vpp: int) -> list[Action]:
    """The actions of one (mb, chunk) in the order they must run; stage boundaries (the first
    and last virtual stage) have no p2p on their outer side."""
    stage = virtual_stage(rank, chunk, pp_size)
    first, last = stage == 0, stage == pp_size * vpp - 1
    ops = [Op.RECV_FORWARD] * (not first) + [Op.FORWARD] + [Op.SEND_FORWARD] * (not last)
    ops += [Op.RECV_BACKWARD] * (not last) + [Op.BACKWARD] + [Op.SEND_BACKWARD] * (not first)
    return [Action(op, mb, chunk) for op in ops]


def simulate(
    schedules: Sequence[list[Action]],
    pp_size: int,
    vpp: int,
    forward_cost: float = 1.0,
    backward_cost: float = 2.0,
    p2p_cost: float = 0.0,
) -> SimResult:
    """Run all ranks' schedules together; raise ScheduleError on mismatched p2p or deadlock.

    Costs are per chunk forward / backward. A rank runs its list in order, each receive
    completing at max(its clock, the message's arrival); the greedy order of ranks does not
    change the times, since every time depends only on earlier events.
    """
    if len(schedules) != pp_size:
        raise ScheduleError(f"expected {pp_size} schedules (one per pp rank), got {len(schedules)}")
    check_p2p_order(schedules, pp_size, vpp)
    sim = _Simulation(schedules, pp_size, vpp, forward_cost, backward_cost, p2p_cost)
    while not sim.finished():
        if not any([sim.advance(rank) for rank in range(pp_size)]):
            raise ScheduleError(f"pipeline schedule deadlocks: {sim.stuck()}")
    makespan = max(sim.clock)
    busy = sim.busy
    return SimResult(
        makespan=makespan,
        bubble_fraction=1 - sum(busy) / (pp_size * makespan),
        busy=busy,
        idle=[makespan - b for b in busy],
        peak_in_flight=sim.peak,
        peak_in_flight_microbatches=[p / vpp for p in sim.peak],
    )


class _Simulation:
    """Per-rank clocks and positions, plus the messages in flight on each ordered rank pair."""

    def __init__(
        self,
        schedules: Sequence[list[Action]],
        pp_size: int,
        vpp: int,
        forward_cost: float,
        backward_cost: float,
        p2p_cost: float,
    ) -> None:
        self.schedules, self.pp_size, self.vpp = schedules, pp_size, vpp
        self.cost = {Op.FORWARD: forward_cost, Op.BACKWARD: backward_cost}
        self.p2p_cost = p2p_cost
        self.position = [0] * pp_size
        self.clock = [0.0] * pp_size
        self.busy = [0.0] * pp_size
        self.in_flight = [0] * pp_size
        self.peak = [0] * pp_size
        self.arrivals: dict[tuple[int, int], list[float]] = {}  # (src, dst) -> arrival times
        self.consumed: dict[tuple[int, int], int] = {}  # (src, dst) -> messages received

    def finished(self) -> bool:
        return all(p == len(s) for p, s in zip(self.position, self.schedules))

    def advance(self, rank: int) -> bool:
        """Run `rank` until it finishes or waits for a message; True if it moved at all."""
        start = self.position[rank]
        actions = self.schedules[rank]
        while self.position[rank] < len(actions):
            action = actions[self.position[rank]]
            if action.op.is_compute:
                self._compute(rank, action)
            elif action.op.is_send:
                peer = peer_of(action, rank, self.pp_size, self.vpp)[0]
                arrival = self.clock[rank] + self.p2p_cost
                self.arrivals.setdefault((rank, peer), []).append(arrival)
            elif not self._receive(rank, action):
                break
            self.position[rank] += 1
        return self.position[rank] > start

    def _compute(self, rank: int, action: Action) -> None:
        cost = self.cost[action.op]
        self.clock[rank] += cost
        self.busy[rank] += cost
        self.in_flight[rank] += 1 if action.op is Op.FORWARD else -1
        self.peak[rank] = max(self.peak[rank], self.in_flight[rank])

    def _receive(self, rank: int, action: Action) -> bool:
        """Take the next message from the peer if it was sent (the order was checked before)."""
        pair = (peer_of(action, rank, self.pp_size, self.vpp)[0], rank)
        index = self.consumed.get(pair, 0)
        arrivals = self.arrivals.get(pair, [])
        if index >= len(arrivals):
            return False
        self.clock[rank] = max(self.clock[rank], arrivals[index])
        self.consumed[pair] = index + 1
        return True

    def stuck(self) -> str:
        """Where each unfinished rank waits, for the deadlock message."""
        waits = []
        for rank, actions in enumerate(self.schedules):
            if self.position[rank] < len(actions):
                action = actions[self.position[rank]]
                peer, chunk = peer_of(action, rank, self.pp_size, self.vpp)
                waits.append(f"rank {rank} waits at {action} for rank {peer} chunk {chunk}")
        return "; ".join(waits)
