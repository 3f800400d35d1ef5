"""Randomness that does not depend on the parallel layout.

- Weights: every parameter is drawn as its full global tensor from a stream seeded by
  (global seed, its global name), and each rank keeps its shard. Any tp/pp/dp layout therefore
  starts from the same model.
- Dropout: activations replicated over tp ranks must drop the same elements (torch's default
  generator, seeded identically on every tp rank); activations split over tp ranks (local
  attention heads, sequence shards under SP) must drop different ones (`TPRandom.fork()`, a
  stream seeded per tp rank), as in Megatron-LM's RNG tracker.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megalite.parallel_state import ParallelState


def param_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed for one parameter's init stream."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, ps: ParallelState) -> None:
    """Fill every parameter from its global tensor's stream and keep this rank's shard."""
    for name, param in model.named_parameters():
        meta = param.meta
        generator = torch.Generator().manual_seed(param_seed(seed, meta.tied_name or name))
        full = torch.zeros(meta.global_shape)
        meta.init(full if meta.init_rows is None else full[: meta.init_rows], generator)
        if meta.tp_split_dim is not None:
            full = full.chunk(ps.tp_size, dim=meta.tp_split_dim)[ps.tp_rank]
        param.copy_(full)


class TPRandom:
    """The dropout stream for tensor-parallel-split activations, distinct on each tp rank."""

    def __init__(self, seed: int, ps: ParallelState) -> None:
        self.device = ps.device
        generator = torch.Generator(device=ps.device)
        generator.manual_seed(seed + 2718 + 1009 * ps.tp_rank)
        self.state = generator.get_state()

    def _default_state(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set_default_state(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Run the block on this stream, then give the default generator its state back."""
        outer = self._default_state()
        self._set_default_state(self.state)
        try:
            yield
        finally:
            self.state = self._default_state()
            self._set_default_state(outer)

    def recompute_context(self) -> tuple[contextlib.AbstractContextManager, ...]:
        """Contexts for torch.utils.checkpoint(context_fn=...): the recomputed forward replays
        the stream from where the original forward started, then the stream moves on as if
        recompute had not happened."""
        start = self.state

        @contextlib.contextmanager
        def replay() -> Iterator[None]:
            after = self.state
            self.state = start
            try:
                yield
            finally:
                self.state = after

        return contextlib.nullcontext(), replay()


checkpoint_input_logs: list[list[torch.Tensor]] = []
"""Lists that `recompute` appends its inputs to (profiling.memory counts them)."""


def recompute(fn: Callable[..., torch.Tensor], *args: torch.Tensor, tp_random: TPRandom):
    """fn(*args) without keeping its activations: backward runs fn again. Both torch's RNG and
    the tp stream replay, so dropout masks match the original forward."""
    for log in checkpoint_input_logs:
        log.extend(args)
    return checkpoint(fn, *args, use_reentrant=False, context_fn=tp_random.recompute_context)
