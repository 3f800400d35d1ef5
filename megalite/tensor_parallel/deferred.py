"""Weight gradients deferred from a backward to a later step: the split backward of zero-bubble
pipeline schedules (Qi et al. 2024, `pipeline.zero_bubble`).

A model is built with one `Deferral`, which its tensor-parallel linears are handed
(`BuildContext.deferral`, through each layer's `LinearPair`). While the pipeline executor has it
open on a queue (`Deferral.deferring`, the B step of the micro-batch it runs), a linear computes
and communicates only its input gradient and puts the rest of its backward on the queue: its
weight (and bias) gradient, dW = dy^T x added into the fp32 main grad, holding x and dy until
then. The gradient buffers, built with the same `Deferral`, put the arrival of every other
parameter's gradient on the queue too (the parameter keeps its `.grad` until then), so a bucket
completes, and is reduced, only once the W step has run the queue. Deferring only the linears'
GEMMs is what the paper, Megatron's and torchtitan's implementations do: they are the
backward's weight work; norms, biases and the embedding are elementwise or a scatter, and the
fused LM head computes its gradients in its forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

deferral_observers: list[Callable[[Callable[[], None], tuple[torch.Tensor, ...]], None]] = []
"""Called with (work, tensors) for every deferred piece of work: the tensors stay alive until
the work has run and been dropped (profiling.memory counts them; weakly refer to the work)."""


class WeightGradQueue:
    """The deferred gradient work of one (micro-batch, chunk), run in the order it was put:
    the order autograd produced the gradients in, which ZeRO-2's bucket staging relies on."""

    def __init__(self) -> None:
        self.work: list[Callable[[], None]] = []

    def put(self, work: Callable[[], None], *tensors: torch.Tensor) -> None:
        """`work` runs at the W step; `tensors` are what it holds until then."""
        self.work.append(work)
        for observe in deferral_observers:
            observe(work, tensors)

    def run(self) -> None:
        """The W step: every deferred piece, without building a graph (as backward runs)."""
        work, self.work = self.work, []
        with torch.no_grad():
            while work:
                work.pop(0)()


class Deferral:
    """Where the linears of one model put their weight gradients: the queue of the B step
    running now, or None (compute them now). Passed explicitly: the model is built with it and
    hands it to its linears, its gradient buffers are built with it (`GradBuffer.deferral`),
    and the executor that runs a micro-batch's B opens it."""

    def __init__(self) -> None:
        self.queue: WeightGradQueue | None = None

    @contextlib.contextmanager
    def deferring(self, queue: WeightGradQueue) -> Iterator[None]:
        """Put weight gradients on `queue` instead of computing them, for the block (a B step).
        Not per thread: autograd runs a GPU backward on threads of its own."""
        outer, self.queue = self.queue, queue
        try:
            yield
        finally:
            self.queue = outer

    def queue_for(self, *params: torch.Tensor | None) -> WeightGradQueue | None:
        """Where the gradients of `params` go: the open queue if their main grads take the
        gradients directly (`accumulate_main_grad`, so W needs no autograd), else None (now)."""
        if self.queue is None:
            return None
        present = [p for p in params if p is not None]
        return self.queue if all(hasattr(p, "accumulate_main_grad") for p in present) else None
