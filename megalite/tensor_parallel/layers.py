"""Tensor-parallel layers (Megatron-LM, Shoeybi et al. 2019). At tp = 1 they are plain layers.

Every parameter carries a `ParamMeta` saying how it maps onto its full global tensor (which dim
is split over tp, how to initialise it, whether its gradient is only a partial sum on each tp
rank). Initialisation, gradient fix-ups and checkpoints read that metadata, so the layers stay
small and the layout never leaks into model code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megalite.parallel_state import ParallelState
from megalite.tensor_parallel.cross_entropy import vocab_parallel_head_loss
from megalite.tensor_parallel.linear import Rows, column_parallel_linear, row_parallel_linear
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
        return gather_from_sequence_region(x, ps.tp_group)
    return copy_to_tp_region(x, ps.tp_group)


def tp_output(x: torch.Tensor, ps: ParallelState, sequence_parallel: bool) -> torch.Tensor:
    """Combine the partial sums of row-parallel layers: reduce-scatter to sequence shards (SP) or
    all-reduce."""
    if sequence_parallel:
        return reduce_scatter_to_sequence_region(x, ps.tp_group)
    return reduce_from_tp_region(x, ps.tp_group)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output rows: rank r computes output features piece r.

    x is the sequence shard under SP (gathered inside), else the replicated input. Linears that
    read the same input run together through `column_parallel` (one gather for all)."""

    rows: Rows = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        ps: ParallelState,
        *,
        bias: bool,
        init: InitFn,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        tp = ps.tp_size
        self.ps, self.sequence_parallel = ps, sequence_parallel
        self.weight = make_param(
            (out_features // tp, in_features),
            ParamMeta((out_features, in_features), init, tp_split_dim=0),
            ps,
        )
        self.bias = (
            make_param(
                (out_features // tp,),
                ParamMeta((out_features,), constant_init(0.0), 0, weight_decay=False),
                ps,
            )
            if bias
            else None
        )

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """add_bias=False leaves the bias to a fused consumer (bias-GELU)."""
        (y,) = column_parallel(x, [self], self.ps, self.sequence_parallel, add_bias)
        return y  # (b, s, out/tp)


class HeadReplicatedLinear(nn.Module):
    """Key/value projection when there are fewer kv heads than tp ranks (grouped-query attention
    with n_kv_heads < tp): every rank holds the whole weight but computes only the one kv head
    its query heads use; each rank's gradient covers only that head, so it is summed over tp.
    Used through `column_parallel` beside the query projection."""

    bias = None

    def __init__(
        self, in_features: int, n_heads: int, head_dim: int, ps: ParallelState, *, init: InitFn
    ) -> None:
        super().__init__()
        head = ps.tp_rank * n_heads // ps.tp_size
        self.rows: Rows = slice(head * head_dim, (head + 1) * head_dim)
        self.weight = make_param(
            (n_heads * head_dim, in_features),
            ParamMeta((n_heads * head_dim, in_features), init, tp_grad_reduce=True),
            ps,
        )


def column_parallel(
    x: torch.Tensor,
    linears: Sequence[ColumnParallelLinear | HeadReplicatedLinear],
    ps: ParallelState,
    sequence_parallel: bool,
    add_bias: bool = True,
) -> tuple[torch.Tensor, ...]:
    """The outputs (b, s, out_i/tp) of column-parallel linears that read the same input x (the
    sequence shard under SP): one all-gather in forward and one in backward, one reduction of
    the input gradient, and only the shard kept for backward."""
    return column_parallel_linear(
        x,
        [linear.weight for linear in linears],
        [linear.bias if add_bias else None for linear in linears],
        [linear.rows for linear in linears],
        ps.tp_group,
        sequence_parallel,
    )


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by input columns: rank r holds input features piece r and the
    partial products are summed over tp (reduce-scattered to sequence shards under SP)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        ps: ParallelState,
        *,
        bias: bool,
        init: InitFn,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.ps, self.sequence_parallel = ps, sequence_parallel
        self.weight = make_param(
            (out_features, in_features // ps.tp_size),
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = row_parallel_linear(x, self.weight, self.ps.tp_group, self.sequence_parallel)
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
        padded = padded_vocab_size(vocab_size, ps.tp_size, round_to)
        self.rows_per_rank = padded // ps.tp_size
        self.vocab_start = ps.tp_rank * self.rows_per_rank
        self.weight = make_param(
            (self.rows_per_rank, hidden),
            ParamMeta((padded, hidden), init, tp_split_dim=0, init_rows=vocab_size),
            ps,
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.ps.tp_size == 1:
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
        padded = padded_vocab_size(vocab_size, ps.tp_size, round_to)
        self.vocab_start = ps.tp_rank * (padded // ps.tp_size)
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
            self.weight = make_param((padded // ps.tp_size, hidden), meta, ps)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The summed token loss (fp32 scalar) given targets; else full logits (b, s, vocab) for
        sampling."""
        x = tp_input(x, self.ps, self.sequence_parallel)
        if targets is None:
            logits = F.linear(x, self.weight)  # (b, s, padded vocab / tp)
            return gather_from_tp_region(logits, self.ps.tp_group)[..., : self.vocab_size]
        return vocab_parallel_head_loss(
            x, self.weight, targets, self.ps.tp_group, self.vocab_start, self.vocab_size
        )
