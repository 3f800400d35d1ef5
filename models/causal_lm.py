"""`CausalLM`, the pipeline chunk every architecture's model is: the embedding on the first
chunk, a run of blocks keyed by their global index, the final norm + LM head + loss on the
last, and the recompute policies (`train.recompute`) that run the blocks."""

from __future__ import annotations

import math
from functools import partial

import torch
from megalite.models.layers import BuildContext
from torch import nn

from megalite.context_parallel.layout import SequenceLayout
from megalite.tensor_parallel import recompute, sequence_shard


def segment_layers(layers: list[nn.Module]) -> list[list[nn.Module]]:
    """Cut L blocks into consecutive segments of round(sqrt(L)) blocks (the last may be
    shorter): about sqrt(L) segments, the count that minimises inputs kept plus one segment."""
    size = max(1, round(math.sqrt(len(layers))))
    return [layers[i : i + size] for i in range(0, len(layers), size)]


def run_in_order(
    layers: list[nn.Module], x: torch.Tensor, layout: SequenceLayout | None
) -> torch.Tensor:
    for layer in layers:
        x = layer(x, layout)
    return x


class CausalLM(nn.Module):
    """One pipeline chunk of a decoder-only language model (the whole model when pp = 1): the
    embedding if it is the first chunk, a run of blocks keyed by their global index (`layers`),
    and the final norm + LM head + loss if it is the last chunk. Subclasses build those pieces
    and write the forward pass; the pipeline decides which pieces a rank holds, and nothing here
    knows about schedules."""

    layers: nn.ModuleDict

    def __init__(self, ctx: BuildContext, has_embedding: bool, has_head: bool) -> None:
        super().__init__()
        self.ctx, self.has_embedding, self.has_head = ctx, has_embedding, has_head

    def run_layers(self, x: torch.Tensor, layout: SequenceLayout | None) -> torch.Tensor:
        """The blocks in order. Under `train.recompute=full` the first `recompute_layers` of
        them (all by default) keep only their input for backward and run again there. Under
        `segments` (Chen et al. 2016) the blocks run in about sqrt(L) segments of about
        sqrt(L) blocks: only each segment's input is kept, and backward reruns one segment at a
        time, so at most sqrt(L) inputs plus one segment's activations are alive."""
        layers = list(self.layers.values())
        if not self.training or self.ctx.recompute not in ("full", "segments"):
            return run_in_order(layers, x, layout)
        tp_random = self.ctx.tp_random
        if self.ctx.recompute == "segments":
            for segment in segment_layers(layers):
                x = recompute(partial(run_in_order, segment, layout=layout), x, tp_random=tp_random)
            return x
        limit = len(layers) if self.ctx.recompute_layers is None else self.ctx.recompute_layers
        for n, layer in enumerate(layers):
            if n < limit:
                x = recompute(partial(layer, layout=layout), x, tp_random=tp_random)
            else:
                x = layer(x, layout)
        return x

    def sequence_positions(
        self, ids_shape: torch.Size, layout: SequenceLayout | None
    ) -> torch.Tensor:
        """(1 or b, tokens) positions of this rank's tokens of (b, s) token ids: of its chunks of
        the windows (`layout`; all s without one), or of its sequence shard of them under SP."""
        b, seq_len = ids_shape
        if layout is None:
            positions = torch.arange(seq_len, device=self.ctx.ps.device)[None]
        else:
            positions = layout.positions
        if not self.ctx.sequence_parallel:
            return positions
        return sequence_shard(positions.expand(b, -1), self.ctx.ps.group("tp"))
