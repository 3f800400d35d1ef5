"""Expert-parallel dispatch: send each routed row to the rank holding its expert, and bring the
experts' outputs back (GShard's all-to-all; Megatron-LM's `MoEAlltoAllTokenDispatcher`).

A rank's rows arrive sorted by (global) expert, so the rows for ep rank r, which holds experts
r*E/ep ... (r+1)*E/ep - 1, are one consecutive block: one all-to-all sends every block. First
the per-expert row counts are exchanged (every rank learns how many rows each source sends for
each of its experts); the received rows come grouped by source, and are regrouped by local
expert for the grouped GEMMs. `combine` undoes both steps. Backward is the same exchange in
the other direction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megalite import comm


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, group, send, receive):
        ctx.group, ctx.send, ctx.receive = group, send, receive
        return comm.all_to_all(rows, group, send, receive)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_to_all(grad, ctx.group, ctx.receive, ctx.send), None, None, None


@dataclass
class Dispatch:
    """One micro-batch's exchange over the ep group: who sends how many rows where."""

    group: Any
    send: list[int]
    """Rows this rank sends to each ep rank."""
    receive: list[int]
    """Rows this rank receives from each ep rank."""
    regroup: torch.Tensor
    """Received rows in local-expert order: row i of the regrouped rows is received row
    regroup[i]."""
    ungroup: torch.Tensor
    """Its inverse: received row i is regrouped row ungroup[i]."""
    local_counts: torch.Tensor
    """Rows per local expert, over every source."""

    @classmethod
    def plan(cls, counts: torch.Tensor, group: Any) -> Dispatch:
        """The exchange for this rank's rows, `counts` (E,) rows per global expert."""
        ep = comm.size(group)
        local = counts.numel() // ep
        # received[s, e]: rows source s sends for this rank's local expert e
        received = comm.all_to_all(counts.view(ep, local), group, [1] * ep, [1] * ep)
        send = counts.view(ep, local).sum(1).tolist()
        receive = received.sum(1).tolist()
        expert_of_row = torch.arange(local, device=counts.device).repeat(ep)
        expert_of_row = expert_of_row.repeat_interleave(received.flatten())
        regroup = torch.argsort(expert_of_row, stable=True)
        return cls(group, send, receive, regroup, torch.argsort(regroup), received.sum(0))

    def dispatch(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's rows (sorted by expert) -> the rows of its experts (by local expert)."""
        received = _AllToAll.apply(rows, self.group, self.send, self.receive)
        return received[self.regroup]

    def combine(self, outputs: torch.Tensor) -> torch.Tensor:
        """The experts' outputs (by local expert) -> this rank's rows, in `dispatch`'s order."""
        by_source = outputs[self.ungroup]  # indexing keeps no rows for backward
        return _AllToAll.apply(by_source, self.group, self.receive, self.send)
