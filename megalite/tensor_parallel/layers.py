"""Tensor-parallel layers (Megatron-LM, Shoeybi et al. 2019). At tp = 1 they are plain layers.

Every parameter carries a `ParamMeta` saying how it maps onto its full global tensor (which dim
is split over tp, how to initialise it, whether its gradient is only a partial sum on each tp
rank). Initialisation, gradient fix-ups and checkpoints read that metadata, so the layers stay
small and the layout never leaks into model code.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from megalite.float8.gemm import Float8Training
from megalite.parallel_dims import ParallelDims
from megalite.parallel_state import ParallelState
from megalite.tensor_parallel.cross_entropy import vocab_parallel_head_loss
from megalite.tensor_parallel.linear import (
    LinearPair,
    Rows,
    column_parallel_linear,
    row_parallel_linear,
    traced_linear,
)
from megalite.tensor_parallel.mappings import (
    copy_to_tp_region,
    gather_from_sequence_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
)

InitFn = Callable[[torch.Tensor, torch.Generator], None]
"""Fills a tensor in place with independent values from the generator. Initialisation calls it
once per block of a parameter (`random.draw_shard`), so it must treat every element alike."""


def normal_init(std: float) -> InitFn:
    def init(full: torch.Tensor, generator: torch.Generator) -> None:
        full.normal_(0.0, std, generator=generator)

    return init


def constant_init(value: float) -> InitFn:
    def init(full: torch.Tensor, generator: torch.Generator) -> None:
        full.fill_(value)

    return init


class PieceInGlobal(NamedTuple):
    """Where a rank's piece of a global tensor lies in it, both flattened: the piece's element
    p is the global element offset + p + (p // run) * gap. Split over tp along dim d, a piece
    holds one run of consecutive global elements per index of the dims before d, and the
    other ranks' runs fill the gap after it; a whole (replicated) tensor, or one split along
    its first dim, is a single run (`run` 0: no gaps)."""

    offset: int = 0
    run: int = 0
    gap: int = 0


@dataclass(frozen=True)
class Placement:
    """How a parameter lies along one axis of the grid (torch DTensor's placements, plus what
    its gradient needs).

    - shard: the ranks along the axis hold different pieces, split along tensor dim `dim`
      (None: different tensors altogether, as pp's stages and ep's experts hold).
    - replicate: the same values on every rank of the axis. Along a weight axis (tp) the
      gradient is the same too; along the others, the replica axes, each rank's gradient is
      its data's share, summed over them by the gradient buffer (and ZeRO shards over them).
    - partial: the same values, but each rank's gradient only a part of it, summed over the
      axis by `finalize` (tp under SP or for shared kv heads; pp for the tied embedding)."""

    kind: Literal["shard", "replicate", "partial"]
    dim: int | None = None


REPLICATE = Placement("replicate")
PARTIAL = Placement("partial")


@dataclass
class ParamMeta:
    """How a local parameter relates to its global tensor."""

    global_shape: tuple[int, ...]
    init: InitFn
    tp_split_dim: int | None = None
    """The dim split evenly over tp ranks (rank r holds piece r); None: replicated."""
    tp_grad_reduce: bool = False
    """Replicated, but each tp rank sees only part of its gradient (SP norms, shared KV heads):
    the gradient is summed over tp after backward."""
    init_rows: int | None = None
    """Initialise only the first rows (the real vocabulary); padded rows start at zero."""
    tied_name: str | None = None
    """This is a copy of that (global) parameter held by another pipeline stage (GPT's tied
    embeddings): same init stream, gradients summed over the embedding group, saved once."""
    pp_tied: bool = False
    """Shared by the first and last pipeline stage (GPT's tied embeddings when pp > 1): the two
    copies' gradients are summed over the embedding group."""
    weight_decay: bool = True
    """Matrices decay; norms, biases and embeddings-as-vectors do not."""
    expert: bool = False
    """An MoE expert's weight: sharded over ep ranks (each holds its own experts), so its
    gradient is summed over the ranks holding the same experts (`expert_dp`), not over dp."""
    parts: tuple[Part, ...] = ()
    """A fused parameter (q/k/v, gate/up) holds several global tensors as consecutive blocks of
    rows; each has its own meta and name, and init, gradient fix-ups, the optimizer and
    checkpoints see only those (`param_parts`). The fused tensor itself is never global."""

    @property
    def view(self) -> str:
        """The view of the grid its placements name axes of (`ParallelDims.views`)."""
        return "expert" if self.expert else "dense"

    def placement(self, axis: str) -> Placement:
        """Its placement along `axis`: the weight axes from the fields above; every other axis
        of its view (cp, dp; edp) holds replicas of it."""
        if axis == "tp":
            if self.tp_split_dim is not None:
                return Placement("shard", self.tp_split_dim)
            return PARTIAL if self.tp_grad_reduce else REPLICATE
        if axis == "pp":
            return PARTIAL if self.pp_tied else Placement("shard")
        if axis == "ep" and self.expert:
            return Placement("shard")
        return REPLICATE

    def placements(self, dims: ParallelDims) -> dict[str, Placement]:
        """Its placement along every axis of its view of `dims`, fastest first."""
        return {axis: self.placement(axis) for axis in dims.views[self.view].sizes}

    def replica_axes(self, dims: ParallelDims) -> tuple[str, ...]:
        """The axes of its view it is a replica over, fastest first: its gradient is summed, and
        ZeRO shards its state, over them; their first rank writes it to a checkpoint."""
        weight_axes = dims.views[self.view].weight_axes
        placed = self.placements(dims).items()
        return tuple(a for a, p in placed if a not in weight_axes and p == REPLICATE)

    def piece_in_global(self, tp_rank: int, tp_size: int) -> PieceInGlobal:
        """Where tp rank `tp_rank`'s piece lies in the global tensor, flattened."""
        dim = self.tp_split_dim
        if dim is None or tp_size == 1:
            return PieceInGlobal()
        inner = math.prod(self.global_shape[dim + 1 :])
        local = self.global_shape[dim] // tp_size
        run = local * inner
        if math.prod(self.global_shape[:dim]) == 1:
            return PieceInGlobal(tp_rank * run)
        return PieceInGlobal(tp_rank * run, run, (self.global_shape[dim] - local) * inner)


@dataclass(frozen=True)
class Part:
    """One global tensor inside a fused parameter: `rows` local rows, named `name` beside the
    fused parameter (`wq.weight` beside `wqkv.weight`)."""

    name: str
    meta: ParamMeta
    rows: int


def param_parts(name: str, param: torch.Tensor) -> list[tuple[str, ParamMeta, int, int]]:
    """(global name, meta, flat start, flat end) of each global tensor a local parameter holds:
    the parameter itself, or each part of a fused one."""
    parts = param.meta.parts
    if not parts:
        return [(name, param.meta, 0, param.numel())]
    parent = name.rsplit(".", 2)[0] + "." if name.count(".") >= 2 else ""
    row, found, start = math.prod(param.shape[1:]), [], 0
    for part in parts:
        found.append((parent + part.name, part.meta, start, start + part.rows * row))
        start += part.rows * row
    return found


def global_tensors(params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    """Global name -> this rank's piece, each carrying its `meta`: a fused parameter's parts are
    views of it, so reading or filling them reads or fills the parameter. What init,
    checkpoints and Hugging Face conversion work on: names and values as before fusing."""
    found: dict[str, torch.Tensor] = {}
    for name, param in params.items():
        if not param.meta.parts:
            found[name] = param
            continue
        for part_name, meta, start, end in param_parts(name, param):
            view = param.detach().view(-1)[start:end].view(-1, *param.shape[1:])
            view.meta = meta
            found[part_name] = view
    return found


def make_param(local_shape: tuple[int, ...], meta: ParamMeta, ps: ParallelState) -> nn.Parameter:
    """An uninitialised parameter on the rank's device: `init_parameters` fills it, or a
    checkpoint does (resume, `checkpoint.init_from`) without drawing anything."""
    param = nn.Parameter(torch.empty(local_shape, device=ps.device))
    param.meta = meta
    return param


def tp_input(x: torch.Tensor, ps: ParallelState, sequence_parallel: bool) -> torch.Tensor:
    """Prepare the input of the LM head: all-gather the sequence shards (SP), or mark the
    replicated input so its gradient is all-reduced."""
    if sequence_parallel:
        return gather_from_sequence_region(x, ps.group("tp"))
    return copy_to_tp_region(x, ps.group("tp"))


def tp_output(x: torch.Tensor, ps: ParallelState, sequence_parallel: bool) -> torch.Tensor:
    """Combine the partial sums of row-parallel layers: reduce-scatter to sequence shards (SP) or
    all-reduce."""
    if sequence_parallel:
        return reduce_scatter_to_sequence_region(x, ps.group("tp"))
    return reduce_from_tp_region(x, ps.group("tp"))


@dataclass(frozen=True)
class ColumnOutput:
    """One output of a column-parallel linear, a global tensor of its own (`name` beside the
    fused parameter: "wq" gives `wq.weight`, `wq.bias`)."""

    name: str
    features: int
    shared_heads: int = 0
    """When > 0: the output has this many heads, fewer than tp ranks (grouped-query attention
    with n_kv_heads < tp). Every rank holds all of them but computes only the head its query
    heads use, so each rank's gradient covers that head alone and is summed over tp."""


class FusedColumnParallelLinear(nn.Module):
    """Several column-parallel linears that read the same input (q, k, v; gate, up) as one:
    one parameter holding, per tp rank, [this rank's rows of output 1; of output 2; ...], so
    one all-gather of the sequence shards and one GEMM produce every output.

    The fused rows of rank r are not a cut of any one global tensor, so each output stays a
    global tensor of its own in `ParamMeta.parts`: init draws, and checkpoints store, exactly
    what the separate linears did (see `param_parts`).

    `pair` is shared with the row-parallel linear after it in its layer (`LinearPair`: the SP
    partner, the model's deferral of weight gradients); None: neither. `float8`: the run's
    `train.fp8`, taken where the linear's global features pass its `fp8_min_dim`."""

    def __init__(
        self,
        in_features: int,
        outputs: Sequence[ColumnOutput],
        ps: ParallelState,
        *,
        bias: bool,
        init: InitFn,
        sequence_parallel: bool = False,
        pair: LinearPair | None = None,
        float8: Float8Training | None = None,
    ) -> None:
        super().__init__()
        self.ps, self.sequence_parallel, self.pair = ps, sequence_parallel, pair
        out_features = sum(out.features for out in outputs)
        self.float8 = _float8_for(float8, in_features, out_features)
        weights, biases, used, self.sizes, start = [], [], [], [], 0
        for out in outputs:
            shared = out.shared_heads > 0
            meta = dict(tp_split_dim=None if shared else 0, tp_grad_reduce=shared)
            rows = out.features if shared else out.features // ps.size("tp")
            weight = ParamMeta((out.features, in_features), init, **meta)
            bias_meta = ParamMeta((out.features,), constant_init(0.0), weight_decay=False, **meta)
            weights.append(Part(f"{out.name}.weight", weight, rows))
            biases.append(Part(f"{out.name}.bias", bias_meta, rows))
            if shared:  # the one head this rank's query heads use
                width = out.features // out.shared_heads
                head = ps.coord("tp") * out.shared_heads // ps.size("tp")
                used.append(slice(start + head * width, start + (head + 1) * width))
            else:
                used.append(slice(start, start + rows))
            self.sizes.append(used[-1].stop - used[-1].start)
            start += rows
        self.rows: Rows = _merged(used, start)
        self.weight = _fused_param((start, in_features), weights, ps)
        self.bias = _fused_param((start,), biases, ps) if bias else None
        self.traceable = False
        """Run as a plain linear that torch.compile traces (`train.compile` sets it at tp 1;
        a float8 linear runs eagerly all the same)."""

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> tuple[torch.Tensor, ...]:
        """The outputs (b, s, out_i/tp) for x the sequence shard (SP) or the replicated input:
        one gather in forward and one in backward, one reduction of the input gradient, and
        only the shard kept for backward. add_bias=False leaves the bias to a fused consumer
        (bias-GELU)."""
        bias = self.bias if add_bias else None
        if self.traceable and self.float8 is None:
            y = traced_linear(x, self.weight, bias, self.rows)
        else:
            group, sp, pair = self.ps.group("tp"), self.sequence_parallel, self.pair
            args = (x, self.weight, bias, self.rows, group, sp, pair, self.float8)
            y = column_parallel_linear(*args)
        return y.split(self.sizes, dim=-1)


def _float8_for(
    float8: Float8Training | None, in_features: int, out_features: int
) -> Float8Training | None:
    """The float8 setting a linear of these global features takes (None: the compute dtype)."""
    return float8 if float8 is not None and float8.applies(in_features, out_features) else None


def _merged(used: list[slice], rows: int) -> Rows:
    """The row slices a linear computes, adjacent ones merged; None when that is every row."""
    merged = [used[0]]
    for piece in used[1:]:
        if piece.start == merged[-1].stop:
            merged[-1] = slice(merged[-1].start, piece.stop)
        else:
            merged.append(piece)
    return None if merged == [slice(0, rows)] else tuple(merged)


def _fused_param(shape: tuple[int, ...], parts: list[Part], ps: ParallelState) -> nn.Parameter:
    """The parameter holding `parts` as blocks of rows. A lone split part is a plain parameter
    (a single linear, as before); a fused one has no global tensor of its own, so its meta
    carries only its local shape and the parts."""
    if len(parts) == 1 and parts[0].meta.tp_split_dim == 0:
        return make_param(shape, parts[0].meta, ps)
    first = parts[0].meta
    fused = ParamMeta(shape, first.init, weight_decay=first.weight_decay, parts=tuple(parts))
    return make_param(shape, fused, ps)


class ColumnParallelLinear(FusedColumnParallelLinear):
    """y = x W^T + b with W split by output rows: rank r computes output features piece r.

    x is the sequence shard under SP (gathered inside), else the replicated input."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        ps: ParallelState,
        *,
        bias: bool,
        init: InitFn,
        sequence_parallel: bool = False,
        pair: LinearPair | None = None,
        float8: Float8Training | None = None,
    ) -> None:
        super().__init__(
            in_features,
            [ColumnOutput("", out_features)],
            ps,
            bias=bias,
            init=init,
            sequence_parallel=sequence_parallel,
            pair=pair,
            float8=float8,
        )

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        (y,) = super().forward(x, add_bias)
        return y  # (b, s, out/tp)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by input columns: rank r holds input features piece r and the
    partial products are summed over tp (reduce-scattered to sequence shards under SP).
    `pair` and `float8`: as for FusedColumnParallelLinear."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        ps: ParallelState,
        *,
        bias: bool,
        init: InitFn,
        sequence_parallel: bool = False,
        pair: LinearPair | None = None,
        float8: Float8Training | None = None,
    ) -> None:
        super().__init__()
        self.ps, self.sequence_parallel, self.pair = ps, sequence_parallel, pair
        self.float8 = _float8_for(float8, in_features, out_features)
        self.weight = make_param(
            (out_features, in_features // ps.size("tp")),
            ParamMeta((out_features, in_features), init, tp_split_dim=1),
            ps,
        )
        # The bias is added after the reduction, once; under SP each rank adds it to its own
        # sequence shard, so its gradient is partial.
        self.bias = (
            make_param(
                (out_features,),
                ParamMeta(
                    (out_features,),
                    constant_init(0.0),
                    tp_grad_reduce=sequence_parallel,
                    weight_decay=False,
                ),
                ps,
            )
            if bias
            else None
        )
        self.traceable = False
        """Run as a plain linear that torch.compile traces (`train.compile` sets it at tp 1;
        a float8 linear runs eagerly all the same)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.traceable and self.float8 is None:
            y = traced_linear(x, self.weight)
        else:
            group, sp = self.ps.group("tp"), self.sequence_parallel
            y = row_parallel_linear(x, self.weight, group, sp, self.pair, self.float8)
        return y if self.bias is None else y + self.bias


def padded_vocab_size(vocab_size: int, tp: int, round_to: int) -> int:
    multiple = tp * round_to
    return -(-vocab_size // multiple) * multiple


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the (padded) vocabulary split over tp ranks: each rank looks up the
    ids it owns, zeros the rest, and the pieces are summed (reduce-scattered under SP)."""

    def __init__(
        self,
        vocab_size: int,
        hidden: int,
        ps: ParallelState,
        *,
        round_to: int,
        init: InitFn,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.ps, self.sequence_parallel = ps, sequence_parallel
        self.vocab_size = vocab_size
        padded = padded_vocab_size(vocab_size, ps.size("tp"), round_to)
        self.rows_per_rank = padded // ps.size("tp")
        self.vocab_start = ps.coord("tp") * self.rows_per_rank
        self.weight = make_param(
            (self.rows_per_rank, hidden),
            ParamMeta((padded, hidden), init, tp_split_dim=0, init_rows=vocab_size),
            ps,
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.ps.size("tp") == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # (b, s, h), partial over tp
        return tp_output(out, self.ps, self.sequence_parallel)


class VocabParallelOutput(nn.Module):
    """The LM head: logits for this rank's piece of the padded vocabulary and the loss over them.

    `tied` shares the input embedding's weight (GPT-2) when both live on this rank.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden: int,
        ps: ParallelState,
        *,
        round_to: int,
        init: InitFn,
        sequence_parallel: bool = False,
        tied: VocabParallelEmbedding | None = None,
        tied_name: str | None = None,
    ) -> None:
        super().__init__()
        self.ps, self.sequence_parallel, self.vocab_size = ps, sequence_parallel, vocab_size
        padded = padded_vocab_size(vocab_size, ps.size("tp"), round_to)
        self.vocab_start = ps.coord("tp") * (padded // ps.size("tp"))
        if tied is not None:
            self.weight = tied.weight
        else:
            meta = ParamMeta(
                (padded, hidden),
                init,
                tp_split_dim=0,
                init_rows=vocab_size,
                tied_name=tied_name,
                pp_tied=tied_name is not None,
            )
            self.weight = make_param((padded // ps.size("tp"), hidden), meta, ps)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The summed token loss (fp32 scalar) given targets; else full logits (b, s, vocab) for
        sampling."""
        x = tp_input(x, self.ps, self.sequence_parallel)
        if targets is None:
            logits = F.linear(x, self.weight)  # (b, s, padded vocab / tp)
            return gather_from_tp_region(logits, self.ps.group("tp"))[..., : self.vocab_size]
        return vocab_parallel_head_loss(
            x, self.weight, targets, self.ps.group("tp"), self.vocab_start, self.vocab_size
        )
