"""The mixture-of-experts MLP, a block any architecture's layers can take in place of the dense
MLP (Shazeer et al. 2017; Mixtral, Jiang et al. 2024; DeepSeek-V3): a router sends each token to
its top-k experts, each a SwiGLU MLP, and adds their outputs weighted by the router's gates;
DeepSeek's shared experts run on every token beside them.

How it is laid out over tensor parallelism: every expert is split over tp ranks as the dense MLP
is (gate and up by columns, down by rows), so a tp rank computes its slice of every expert for
all the tokens of its tp group and one reduction combines the partial sums, as after a dense
MLP. The router runs before the tokens are gathered, on the tokens this rank holds (its sequence
shard under SP; the replicated tokens without), and its gates travel with the tokens exactly as
the activations do (`tp_input`): the gradient of a gate is the sum of every tp rank's partial
contribution, which is what the gather's backward computes.

Dispatch: the (token, choice) pairs are sorted by expert, so each expert's tokens are
consecutive rows, and two grouped GEMMs (`kernels.grouped_mm`) run every expert at once; the
gated rows are added back to their tokens.

Parameters: each expert's weights are global tensors of their own, named by the expert's global
index (`experts.<e>.gate.weight` ...), held as blocks of rows of one parameter per kind (like the
fused q/k/v), so init, checkpoints and Hugging Face conversion see per-expert tensors while the
GEMMs see one (experts, rows, columns) weight.

Under `train.compile` every collective runs outside the block's graphs: the expert path and the
capacity decision are eager, and the routing counts are summed by `comm.all_reduce_eagerly`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from megalite.kernels import grouped_mm, swiglu
from megalite.models.layers import BuildContext
from torch import nn

from megalite import comm
from megalite.config import ModelConfig
from megalite.context_parallel.layout import gather_windows, local_chunks, shard_sequence
from megalite.eager_boundary import eager_only
from megalite.expert_parallel.aux_loss import attach_aux_loss
from megalite.expert_parallel.dispatch import Dispatch
from megalite.expert_parallel.router import (
    Routing,
    balancing_loss,
    capacity,
    drop_over_capacity,
    expert_counts,
    sigmoid_top_k,
    softmax_top_k,
    update_bias,
    z_loss,
)
from megalite.float8.experts import ExpertRows, ExpertSplits, float8_grouped_mm
from megalite.tensor_parallel import (
    ParamMeta,
    all_gather_sequence,
    constant_init,
    make_param,
    normal_init,
)
from megalite.tensor_parallel.layers import Part, tp_input, tp_output
from megalite.tensor_parallel.random import replaying


class Weight(nn.Module):
    """A module holding one parameter as `weight`, so it is named like a linear's."""

    def __init__(self, param: nn.Parameter) -> None:
        super().__init__()
        self.weight = param


def expert_weight(
    ctx: BuildContext,
    experts: list[str],
    kinds: list[tuple[str, tuple[int, int], int | None]],
    init,
    expert: bool = True,
) -> Weight:
    """One parameter holding, for each expert name and each (kind, global shape, tp split dim)
    in turn, this rank's piece of that global tensor as a block of rows. `expert`: routed
    experts, sharded over ep (the shared ones are on every ep rank, like the dense weights)."""
    tp, parts = ctx.ps.size("tp"), []
    for name in experts:
        for kind, shape, split in kinds:
            meta = ParamMeta(shape, init, tp_split_dim=split, expert=expert)
            rows = shape[0] // tp if split == 0 else shape[0]
            parts.append(Part(f"{name}.{kind}.weight", meta, rows))
    columns = shape[1] // tp if split == 1 else shape[1]
    local = (sum(part.rows for part in parts), columns)
    fused = ParamMeta(local, init, expert=expert, parts=tuple(parts))
    return Weight(make_param(local, fused, ctx.ps))


class Kept(NamedTuple):
    """The (token, choice) pairs within capacity: their (tokens, k) `mask`, and `at_most`, a
    bound on how many there are that the shapes alone give (the experts times the capacity, or
    every pair), so that a shape can be set without reading the mask on the host."""

    mask: torch.Tensor
    at_most: int


def _last_takes_the_rest(counts: torch.Tensor, rows: int) -> torch.Tensor:
    """`counts` with the last group also taking the rows past their sum, up to `rows`."""
    return torch.cat([counts[:-1], rows - counts[:-1].sum(0, keepdim=True)])


class MoE(nn.Module):
    """Routed experts (and DeepSeek's shared ones, `moe_shared_experts`) in place of the MLP."""

    def __init__(self, ctx: BuildContext) -> None:
        super().__init__()
        cfg, ps = ctx.cfg, ctx.ps
        self.ctx, self.cfg = ctx, cfg
        h, f, n = cfg.hidden, cfg.ffn_hidden, cfg.moe_experts
        init, out_init = normal_init(cfg.init_std), ctx.out_proj_init
        # Under SP each rank routes its own tokens: the router's gradient is partial over tp.
        router = ParamMeta((n, h), init, tp_grad_reduce=ctx.sequence_parallel)
        self.router = Weight(make_param((n, h), router, ps))
        # DeepSeek-V3's routing bias (fp32), and the step's load that moves it
        # (`take_load`): plain tensors on the rank's device, not module buffers, so the
        # model's cast to 16 bits leaves them exact (a bf16 count stops at 256); a few bytes
        # per layer that the estimate leaves out.
        self.expert_bias = torch.zeros(n, device=ps.device)
        self.expert_bias.meta = ParamMeta((n,), constant_init(0.0))  # saved, replicated
        self.load = torch.zeros(n, dtype=torch.int64, device=ps.device)
        self.dropped = torch.zeros((), dtype=torch.int64, device=ps.device)
        self.aux_loss_scale = torch.ones((), device=ps.device)  # `scale_aux_loss`
        per_rank = n // ps.size("ep")  # this ep rank's experts, by global index
        self.local_experts = range(ps.coord("ep") * per_rank, (ps.coord("ep") + 1) * per_rank)
        names = [f"experts.{e}" for e in self.local_experts]
        self.gate_up = expert_weight(ctx, names, [("gate", (f, h), 0), ("up", (f, h), 0)], init)
        self.down = expert_weight(ctx, names, [("down", (h, f), 1)], out_init)
        self.float8 = ctx.float8 if ctx.float8 and ctx.float8.applies(h, f) else None
        """`train.fp8` for the experts' GEMMs (`float8.experts`), where they pass its
        `fp8_min_dim`."""
        self.shared_gate_up = self.shared_down = None
        if cfg.moe_shared_experts:
            fs = cfg.moe_shared_experts * f
            shared = [("gate", (fs, h), 0), ("up", (fs, h), 0)]
            self.shared_gate_up = expert_weight(ctx, ["shared"], shared, init, expert=False)
            down = [("down", (h, fs), 1)]
            self.shared_down = expert_weight(ctx, ["shared"], down, out_init, expert=False)

    def route(self, tokens: torch.Tensor) -> tuple[Routing, torch.Tensor]:
        """The router's choices and gates for `tokens` (n, h), and its logits."""
        logits = tokens @ self.router.weight.t()
        cfg = self.cfg
        if cfg.moe_router == "softmax":
            return softmax_top_k(logits, cfg.moe_top_k), logits
        bias = self.expert_bias
        return sigmoid_top_k(logits, cfg.moe_top_k, bias, cfg.moe_routed_scale), logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (b, s, h), or this rank's sequence shard (b, s/tp, h) under SP; the same shape
        back."""
        ctx, cfg = self.ctx, self.cfg
        b, s, h = x.shape
        routing, logits = self.route(x.flatten(0, 1))
        aux = self.aux_loss(routing, logits, b)
        # the tokens of the whole tp group, and their gates and choices with them
        tokens = tp_input(x, ctx.ps, ctx.sequence_parallel).flatten(0, 1)
        gates = tp_input(routing.gates.view(b, s, -1).to(x.dtype), ctx.ps, ctx.sequence_parallel)
        experts = self.gather_choices(routing.experts.view(b, s, -1))
        kept = None if cfg.moe_capacity_factor is None else self.within_capacity(experts)
        out = self.experts(tokens, experts.flatten(0, 1), gates.flatten(0, 1), kept)
        if self.shared_gate_up is not None:
            out = out + self.shared(tokens)
        out = tp_output(out.view(b, -1, h), ctx.ps, ctx.sequence_parallel)
        return attach_aux_loss(out, aux, self.aux_loss_scale)

    def gather_choices(self, experts: torch.Tensor) -> torch.Tensor:
        """The expert choices of the tp group's tokens (SP: gathered; else already all here)."""
        if not self.ctx.sequence_parallel:
            return experts
        return all_gather_sequence(experts, self.ctx.ps.group("tp"))

    @eager_only  # `train.compile`: data-dependent counts (see `experts`)
    def within_capacity(self, experts: torch.Tensor) -> Kept:
        """Which of the tp group's (token, choice) pairs (b, s', k) fit in their expert's
        capacity over the micro-batch's whole windows, as one process decides it: under cp the
        windows' choices are gathered from the cp ranks and put back in order first, and this
        rank's chunks of the mask are returned. Every rank counts the micro-batch's drops."""
        cfg, ps = self.cfg, self.ctx.ps
        windows = gather_windows(experts, ps.group("cp"))
        b, s, k = windows.shape
        limit = capacity(b * s, cfg.moe_experts, k, cfg.moe_capacity_factor)
        keep, dropped = drop_over_capacity(windows.flatten(0, 1), limit)
        if self.training and not replaying():
            self.dropped += dropped
        chunks = local_chunks(s, comm.size(ps.group("cp")), comm.rank(ps.group("cp")))
        mine = shard_sequence(keep.view(b, s, k), chunks).flatten(0, 1)
        # no expert keeps more than `limit` of the windows' pairs, nor of this rank's
        return Kept(mine, min(mine.numel(), cfg.moe_experts * limit))

    @eager_only
    def experts(
        self,
        tokens: torch.Tensor,
        experts: torch.Tensor,
        gates: torch.Tensor,
        kept: Kept | None = None,
    ) -> torch.Tensor:
        """sum_j gate_j * expert_j(token) for every token (its k choices): this rank's tp slice
        of every expert, a partial sum over tp. With expert parallelism the rows travel to the
        ep rank holding their expert and back (`dispatch.Dispatch`). `kept`: the pairs within
        capacity; the others add nothing to the output.

        No count is read on the host but the exchange's split sizes (`Dispatch.plan`, one copy
        per call), so without expert parallelism nothing here waits for the device. There,
        under a capacity, the rows routed are a number the shapes give (`Kept.at_most`): the
        kept pairs, then dropped ones up to it, which the last expert computes and the mask
        zeroes. With an exchange the plan's sizes count the kept pairs, and only those travel.

        Eager under `train.compile`: the rows per expert (and, with an exchange, the rows)
        differ with every micro-batch, which static shapes would recompile for until dynamo's
        recompile limit sends the frames to eager anyway."""
        k = experts.shape[1]
        local, n = len(self.local_experts), self.cfg.moe_experts
        pairs = experts.flatten()
        if kept is not None:  # dropped pairs sort after every expert's
            pairs = torch.where(kept.mask.flatten(), pairs, n)
        order = torch.argsort(pairs, stable=True)  # (token, choice) pairs by expert
        counts = expert_counts(pairs, n + 1)[:-1]
        exchange, sources = None, ExpertRows(None)  # sources: the rows' micro-batches (float8)
        if self.ctx.ps.size("ep") > 1:
            exchange = Dispatch.plan(counts, self.ctx.ps.group("ep"))
            routed = order[: sum(exchange.send)]  # the kept pairs, counted by the plan
            if self.float8 is not None:
                sources = ExpertRows(exchange.sources(), len(exchange.send), exchange.group)
        elif kept is None:
            routed = order
        else:
            routed = order[: kept.at_most]
            if self.float8 is not None:  # rows past the kept pairs' are computed to be dropped
                dropped = torch.arange(routed.numel(), device=routed.device) >= counts.sum()
                sources = ExpertRows(dropped.long(), 1)
            counts = _last_takes_the_rest(counts, routed.numel())
        rows = tokens[routed // k]
        if exchange is not None:
            rows, counts = exchange.dispatch(rows), exchange.local_counts
        f = self.gate_up.weight.shape[0] // (2 * local)
        gate_up = self.gate_up.weight.view(local, 2 * f, -1)
        gate, up = self.gemm(rows, gate_up, counts, sources, "gate_up").split(f, dim=-1)
        down = self.down.weight.view(local, tokens.shape[1], f)
        y = self.gemm(swiglu(gate, up), down, counts, sources, "down")
        if exchange is not None:
            y = exchange.combine(y)
        if routed.numel() < order.numel():  # the pairs not routed, zero
            y = torch.cat([y, y.new_zeros(order.numel() - routed.numel(), y.shape[1])])
        # back to (token, choice) order, weighted by the gates, summed over the k choices:
        # indexing and sum keep no activation for backward (index_add_ would keep the rows)
        by_token = y[torch.argsort(order)].view(*experts.shape, -1)
        if kept is not None:  # whatever was computed for a dropped pair
            by_token = torch.where(kept.mask.unsqueeze(-1), by_token, 0)
        return (by_token * gates.unsqueeze(-1)).sum(dim=1)

    def gemm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        counts: torch.Tensor,
        sources: ExpertRows,
        kind: str,
        expert: bool = True,
    ) -> torch.Tensor:
        """`grouped_mm(x, weight, counts)` of the experts' `kind` of weight ("gate_up": N split
        over tp; "down": K), in float8 under `train.fp8`. `expert`: routed experts (their
        weights also split over ep)."""
        if self.float8 is None:
            return grouped_mm(x, weight, counts)
        ps, tp = self.ctx.ps, self.ctx.ps.group("tp")
        split = (tp,)
        weight_groups = (tp, ps.group("ep")) if expert else split
        tokens = self.float8.token_groups
        splits = (
            ExpertSplits(tokens, (), split, weight_groups)
            if kind == "gate_up"
            else ExpertSplits(tokens, split, (), weight_groups)
        )
        return float8_grouped_mm(x, weight, counts, sources, splits, self.float8.recipe)

    def shared(self, tokens: torch.Tensor) -> torch.Tensor:
        """The shared experts, one SwiGLU MLP on every token: this rank's tp slice (under
        `train.fp8` one group of the float8 grouped GEMM, its rows the micro-batch's)."""
        if self.float8 is None:
            gate, up = (tokens @ self.shared_gate_up.weight.t()).chunk(2, dim=-1)
            return swiglu(gate, up) @ self.shared_down.weight.t()
        rows, every = ExpertRows(None), torch.full((1,), tokens.shape[0], device=tokens.device)
        weight = self.shared_gate_up.weight.unsqueeze(0)
        gate, up = self.gemm(tokens, weight, every, rows, "gate_up", False).chunk(2, dim=-1)
        down = self.shared_down.weight.unsqueeze(0)
        return self.gemm(swiglu(gate, up), down, every, rows, "down", False)

    def aux_loss(self, routing: Routing, logits: torch.Tensor, batch: int) -> torch.Tensor:
        """This rank's share of the micro-batch's weighted auxiliary losses: the balancing loss
        is defined over all the micro-batch's tokens, which SP and cp spread over ranks, so the
        expert counts are summed over those ranks first and each rank's term is its tokens'
        part (the shares sum to the whole; see `router.balancing_loss`)."""
        cfg, ps = self.cfg, self.ctx.ps
        counts = expert_counts(routing.experts, cfg.moe_experts)
        groups = []  # the ranks holding the micro-batch's other tokens: SP's, then cp's
        if self.ctx.sequence_parallel and ps.size("tp") > 1:
            groups.append(ps.group("tp"))
        if ps.size("cp") > 1:
            groups.append(ps.group("cp"))
        if groups:  # eager, a graph break, only where there is something to sum
            counts = comm.all_reduce_eagerly(counts, *groups)
        if self.training and not replaying():
            self.load += counts
        total = batch * cfg.seq_len
        loss = torch.zeros((), device=logits.device)
        if cfg.moe_aux_loss_coef:
            balance = balancing_loss(routing.probs, routing.experts, cfg.moe_experts, total, counts)
            loss = loss + cfg.moe_aux_loss_coef * balance
        if cfg.moe_z_loss_coef:
            loss = loss + cfg.moe_z_loss_coef * z_loss(logits, total)
        return loss

    def scale_aux_loss(self, scale: float) -> None:
        """Before a step: the gradient of one micro-batch's auxiliary loss in the objective of
        the step's backward passes (`training.step`: its share of the batch x the loss scale)."""
        self.aux_loss_scale.fill_(scale)

    def take_load(self, load: torch.Tensor, updated: torch.Tensor) -> None:
        """After a step, with this step's routed (token, choice) pairs per expert over the whole
        global batch (`training.step.route_balance` sums them): move the routing bias towards
        balance (`moe_bias_update_rate`) where the step `updated` the weights (a float flag on
        the device: a skipped step, an fp16 overflow or a bad step, leaves the bias too), and
        start counting afresh."""
        if self.cfg.moe_bias_update_rate:
            update_bias(self.expert_bias, load, self.cfg.moe_bias_update_rate, updated)
        self.load.zero_()
        self.dropped.zero_()


def active_experts(cfg: ModelConfig) -> int:
    """Expert MLPs each token runs through: its routed ones and the shared."""
    return cfg.moe_top_k + cfg.moe_shared_experts
