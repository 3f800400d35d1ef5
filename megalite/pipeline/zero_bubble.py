"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): the
compute order of one rank, as pure functions (`schedule` places the messages).

Each backward is split in two: B computes the gradient of the chunk's input, which the
previous stage waits for, and W the gradients of its weights, which nothing waits for. Moving
the W passes into the time a rank would otherwise wait fills the pipeline's bubble. With F, B
and W of equal cost (the papers' assumption):

zb-h1 (section 3.1, "ZB-H1"): 1F1B's warmup and steady state, but rank p delays its W passes by
    p micro-batches, so the last ones fill the cooldown. Every rank then holds at most P
    micro-batches between F and W, 1F1B's peak on its first rank, and the bubble shrinks from
    (P - 1)(F + B + W) per rank to about (P - 1)(F + B - W): a third of 1F1B's.
zb-v (the same authors' V-shaped schedule, "ZB-V"; torch's ScheduleZBVZeroBubble): two
    chunks per rank in a V, rank p holding stages p and 2P - 1 - p, so each rank starts and
    ends the pipeline's work on a micro-batch at nearly the same time. Warmup fills the V,
    then a steady state of F, B, W on each chunk; the cooldown defers W passes into the
    drain. Peak activations: 2P chunks of half a stage, 1F1B's P stages' worth; bubble near zero.
"""

from __future__ import annotations

from collections import Counter

from megalite.pipeline.actions import Action, Op


def zb_h1(pp_size: int, pp_rank: int, m: int) -> list[Action]:
    """Rank `pp_rank`'s F, B and W steps under ZB-H1 (one chunk per rank)."""
    warmup = min(pp_size - pp_rank - 1, m)  # 1F1B's: fill the pipeline below this rank
    delay = pp_rank  # W passes this rank keeps back for its cooldown
    steps = [Action(Op.FORWARD, mb, 0) for mb in range(warmup)]
    for mb in range(m):
        if mb + warmup < m:
            steps.append(Action(Op.FORWARD, mb + warmup, 0))
        steps.append(Action(Op.BACKWARD, mb, 0))
        if mb >= delay:
            steps.append(Action(Op.WEIGHT, mb - delay, 0))
    steps += [Action(Op.WEIGHT, mb, 0) for mb in range(max(m - delay, 0), m)]
    return steps


class _Steps:
    """A rank's steps, each on the next micro-batch of its (op, chunk): the V schedule reads as
    "F, B and W on chunk 1", as the paper draws it."""

    def __init__(self) -> None:
        self.steps: list[Action] = []
        self.next: Counter[tuple[Op, int]] = Counter()

    def __call__(self, chunk: int, *ops: Op) -> None:
        for op in ops:
            self.steps.append(Action(op, self.next[op, chunk], chunk))
            self.next[op, chunk] += 1

    def count(self, op: Op, chunk: int) -> int:
        return self.next[op, chunk]


def zb_v(pp_size: int, pp_rank: int, m: int) -> list[Action]:
    """Rank `pp_rank`'s F, B and W steps under ZB-V (chunk 0: stage p, chunk 1: 2P - 1 - p).

    Written for at least 2P - 1 micro-batches (enough to fill the V); with fewer, the steps of
    the micro-batches that do not exist are dropped, which keeps every dependency in order.
    """
    n = max(m, 2 * pp_size - 1)
    run = _Steps()
    F, B, W = Op.FORWARD, Op.BACKWARD, Op.WEIGHT
    # Warmup: chunk 0 fills the V's way down, then chunk 1 joins as the way back reaches it,
    # then this rank's first backwards on chunk 1, each with its W at once.
    for _ in range(2 * (pp_size - pp_rank) - 1):
        run(0, F)
    for _ in range(pp_rank):
        run(1, F)
        run(0, F)
    for _ in range(pp_size - pp_rank):
        run(1, F, B, W)
    # Steady state: F, B, W on chunk 0, then on chunk 1, until every forward has run.
    while run.count(F, 1) < run.count(F, 0) or run.count(F, 0) < n:
        if run.count(F, 0) < n:
            run(0, F)
        run(0, B, W)
        run(1, F, B, W)
    # Cooldown: the remaining backwards first, the deferred W passes filling the drain.
    for _ in range(pp_rank):
        run(0, B)
        run(1, B)
    for _ in range(pp_size - pp_rank):
        run(0, B, W)
    for chunk in (1, 0):
        while run.count(W, chunk) < run.count(B, chunk):
            run(chunk, W)
    return [step for step in run.steps if step.microbatch < m]
