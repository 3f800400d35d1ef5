"""Expert-parallel dispatch: send each routed row to the rank holding its expert, and bring the
experts' outputs back (GShard's all-to-all; Megatron-LM's `MoEAlltoAllTokenDispatcher`).

A rank's rows arrive sorted by (global) expert, so the rows for ep rank r, which holds experts
r*E/ep ... (r+1)*E/ep - 1, are one consecutive block: one all-to-all sends every block. First
the per-expert row counts are exchanged (every rank learns how many rows each source sends for
each of its experts); the received rows come grouped by source, and are regrouped by local
expert for the grouped GEMMs. `combine` undoes both steps. Backward is the same exchange in
the other direction.

`all_to_all_single` takes its split sizes as host integers, so a plan copies counts to the host
once: the rows sent to and received from each rank, in one copy (on a GPU, the one wait for the
device an MoE layer makes per micro-batch; a recomputed forward plans again); backward reuses
them. Everything else stays on the device.
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
    received_by_source: torch.Tensor
    """Rows received from each ep rank, on the device."""

    @classmethod
    def plan(cls, counts: torch.Tensor, group: Any) -> Dispatch:
        """The exchange for this rank's rows, `counts` (E,) rows per global expert."""
        ep = comm.size(group)
        local = counts.numel() // ep
        # received[s, e]: rows source s sends for this rank's local expert e
        sent = counts.view(ep, local)
        received = comm.all_to_all(sent, group, [1] * ep, [1] * ep)
        by_source = received.sum(1)
        sizes = torch.cat([sent.sum(1), by_source]).tolist()  # the one device-to-host copy
        send, receive = sizes[:ep], sizes[ep:]
        expert_of_row = torch.arange(local, device=counts.device).repeat(ep)
        expert_of_row = expert_of_row.repeat_interleave(
            received.flatten(), output_size=sum(receive)
        )
        regroup = torch.argsort(expert_of_row, stable=True)
        inverse = torch.argsort(regroup)
        return cls(group, send, receive, regroup, inverse, received.sum(0), by_source)

    def sources(self) -> torch.Tensor:
        """(received rows,) int64: the ep rank each row of this rank's experts (in local-expert
        order) came from, whose micro-batch it is of (float8's per-source scales)."""
        ep, rows = len(self.receive), sum(self.receive)
        ranks = torch.arange(ep, device=self.regroup.device)
        return ranks.repeat_interleave(self.received_by_source, output_size=rows)[self.regroup]

    def dispatch(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's rows (sorted by expert) -> the rows of its experts (by local expert)."""
        received = _AllToAll.apply(rows, self.group, self.send, self.receive)
        return received[self.regroup]

    def combine(self, outputs: torch.Tensor) -> torch.Tensor:
        """The experts' outputs (by local expert) -> this rank's rows, in `dispatch`'s order."""
        by_source = outputs[self.ungroup]  # indexing keeps no rows for backward
        return _AllToAll.apply(by_source, self.group, self.receive, self.send)
