"""Randomness: weights that do not depend on the parallel layout, and dropout streams kept as
Megatron-LM's RNG tracker keeps them (the masks, like Megatron's, do depend on the layout).

- Weights: a parameter's global tensor is cut into blocks of whole slices along its tp split
  dim (dim 0 when it is replicated), and block k is drawn from its own generator, seeded by
  hash(global seed, global name) + k. A rank draws only the blocks its shard overlaps, so
  start-up work falls with tp, and the values never depend on the layout: every
  tp/pp/dp/sp/vpp layout starts from the same global weights (`tests/unit/test_init.py`
  proves it bit for bit). Resuming from a checkpoint draws nothing (`build_run`).
- Dropout: activations replicated over tp ranks must drop the same elements (torch's default
  generator, seeded identically on every tp rank); activations split over tp ranks (local
  attention heads, sequence shards under SP) must drop different ones (`TPRandom.fork()`, a
  stream seeded per tp rank), as in Megatron-LM's RNG tracker. Both seeds differ per pipeline
  stage (`stage_seed`), or a later stage's layers would draw an earlier stage's masks.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megalite.parallel_state import ParallelState
from megalite.tensor_parallel.layers import ParamMeta, global_tensors

VALUES_PER_BLOCK = 2**16
"""About this many values share one stream: enough that the per-block cost (a generator, a
call) vanishes beside drawing them, few enough that a shard rarely starts inside a block."""


def param_seed(seed: int, name: str) -> int:
    """The seed of a parameter's first block; block k's is this + k. torch's CPU generator
    (mt19937) keeps only the low 32 bits of a seed, so counting up rather than hashing each
    block means a parameter's blocks never share a stream, and two parameters only if their
    ranges of seeds overlap."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def slices_per_block(slice_numel: int, values_per_block: int = VALUES_PER_BLOCK) -> int:
    """The largest power of two of slices holding at most `values_per_block` values (at least
    one slice): shards cut by a power-of-two tp then start on a block boundary."""
    fit = max(1, values_per_block // slice_numel)
    return 1 << (fit.bit_length() - 1)


@torch.no_grad()
def draw_shard(
    meta: ParamMeta,
    name: str,
    seed: int,
    tp_rank: int,
    tp_size: int,
    values_per_block: int = VALUES_PER_BLOCK,
) -> torch.Tensor:
    """Tp rank `tp_rank`'s piece of the global tensor `name` (all of it when replicated), on
    CPU, drawing only the blocks the piece overlaps; tp_size=1 draws the full tensor.

    Drawn on CPU rather than on the rank's GPU because CUDA's generator gives other values
    (which can even depend on the GPU's number of multiprocessors): CPU draws make a GPU run
    start from exactly the weights a CPU test run checks. A block is drawn in the tensor's own
    layout, so a parameter of one block (every tensor of the tiny test models) is one draw of
    the whole tensor.
    """
    split = meta.tp_split_dim is not None
    # A replicated tensor is cut along dim 0, the dim its column-parallel form splits: GQA's
    # K/V weights are replicated when n_kv_heads < tp and split otherwise, with equal values.
    dim = meta.tp_split_dim if split else 0
    length = meta.global_shape[dim] // tp_size if split else meta.global_shape[dim]
    start = tp_rank * length if split else 0
    real = meta.init_rows or meta.global_shape[dim]  # padded vocabulary rows stay zero
    end = max(min(start + length, real), start)  # a rank of padding rows alone draws nothing

    def along_dim(size: int) -> list[int]:
        return [size if d == dim else n for d, n in enumerate(meta.global_shape)]

    shard = torch.zeros(along_dim(length))
    per_block = slices_per_block(math.prod(along_dim(1)), values_per_block)
    first_seed = param_seed(seed, name)
    for k in range(start // per_block, -(-end // per_block) if end > start else 0):
        lo, hi = k * per_block, min((k + 1) * per_block, real)  # the block's global slices
        block = torch.empty(along_dim(hi - lo))
        meta.init(block, torch.Generator().manual_seed((first_seed + k) % 2**32))
        keep_lo, keep_hi = max(lo, start), min(hi, end)  # the part inside this shard
        kept = block.narrow(dim, keep_lo - lo, keep_hi - keep_lo)
        shard.narrow(dim, keep_lo - start, keep_hi - keep_lo).copy_(kept)
    return shard


@torch.no_grad()
def init_parameters(
    model: nn.Module, seed: int, ps: ParallelState, values_per_block: int = VALUES_PER_BLOCK
) -> None:
    """Fill every parameter with this rank's piece of its global tensor. A copy of a tied
    parameter (GPT's head on the last pipeline stage) draws from the tied name's streams.
    Tests pass a small `values_per_block` to put block boundaries inside tiny shards. A fused
    parameter's parts are drawn as the separate tensors they were before fusing."""
    for name, piece in global_tensors(dict(model.named_parameters())).items():
        source = piece.meta.tied_name or name
        shard = draw_shard(
            piece.meta, source, seed, ps.coord("tp"), ps.size("tp"), values_per_block
        )
        piece.copy_(shard)


def stage_seed(seed: int, pp_rank: int) -> int:
    """The dropout seed of a pipeline stage (Megatron-LM's seed + 100 * pp rank)."""
    return seed + 100 * pp_rank


def seed_dropout(seed: int, ps: ParallelState) -> None:
    """Seed torch's default generator, which drops tp-replicated activations: the same on the
    stage's tp ranks, another on each stage."""
    torch.manual_seed(stage_seed(seed, ps.coord("pp")))


class TPRandom:
    """The dropout stream for tensor-parallel-split activations, distinct on each tp rank and
    pipeline stage."""

    def __init__(self, seed: int, ps: ParallelState) -> None:
        self.device = ps.device
        generator = torch.Generator(device=ps.device)
        generator.manual_seed(stage_seed(seed, ps.coord("pp")) + 2718 + 1009 * ps.coord("tp"))
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
            global _replaying
            after = self.state
            self.state, _replaying = start, True
            try:
                yield
            finally:
                self.state, _replaying = after, False

        return contextlib.nullcontext(), replay()


_replaying = False


def replaying() -> bool:
    """Whether a recomputed forward is running (backward replaying a `recompute`d block): what a
    layer counts once per forward (an MoE router's load) it must not count again."""
    return _replaying


recompute_observers: list[Callable[[tuple[torch.Tensor, ...], torch.Tensor], None]] = []
"""Called with (inputs, output) of every `recompute`: the inputs are what it keeps for backward
in place of the activations, hidden from saved-tensor hooks (profiling.memory counts them)."""


def recompute(fn: Callable[..., torch.Tensor], *args: torch.Tensor, tp_random: TPRandom):
    """fn(*args) without keeping its activations: backward runs fn again. Both torch's RNG and
    the tp stream replay, so dropout masks match the original forward."""
    output = checkpoint(fn, *args, use_reentrant=False, context_fn=tp_random.recompute_context)
    for observe in recompute_observers:
        observe(args, output)
    return output
