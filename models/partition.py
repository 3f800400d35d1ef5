"""Which layers each pipeline chunk holds, and what each chunk costs.

The model's P * V chunks ("virtual stages") take consecutive layers; virtual stage v lives on
pipeline rank v % P as its local chunk v // P (under zb-v, in a V: `schedule.stage_owner`).
Layers are spread so the costliest stage is as cheap as possible, counting the embedding and
the head (final norm + LM head + loss) as a fraction of a layer, because the first and last
stage also run them. By default those fractions come from the model's FLOPs
(`models.flops`): on a small model the head over the vocabulary outweighs several layers, and
a split by layer count would leave the last stage the slowest.
`parallel.embedding_layer_weight` / `parallel.head_layer_weight` override them.
"""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import NamedTuple

from megalite.models.flops import flops_per_token, head_flops, mean_attention_flops
from megalite.models.formulas import formulas_of

from megalite.config import Config, ModelConfig
from megalite.pipeline.schedule import v_shaped, virtual_stage


def partition_layers(
    n_layers: int, n_stages: int, embedding_weight: float = 0.0, head_weight: float = 0.0
) -> list[range]:
    """Contiguous layer ranges, one per virtual stage, each non-empty, minimising the largest
    stage cost; ties go to the most even split."""
    return list(_partition(n_layers, n_stages, embedding_weight, head_weight))


@cache  # the planner asks for the same splits across thousands of layouts
def _partition(
    n_layers: int, n_stages: int, embedding_weight: float, head_weight: float
) -> tuple[range, ...]:
    if n_layers < n_stages:
        raise ValueError(f"{n_layers} layers cannot fill {n_stages} pipeline chunks")

    def cost(stage: int, start: int, end: int) -> float:
        extra = (embedding_weight if stage == 0 else 0.0) + (
            head_weight if stage == n_stages - 1 else 0.0
        )
        return end - start + extra

    @cache
    def best(stage: int, start: int) -> tuple[float, float, tuple[int, ...]]:
        """(max cost, sum of squared costs, stage ends) for stages stage.. over layers start.."""
        if stage == n_stages - 1:
            c = cost(stage, start, n_layers)
            return c, c * c, (n_layers,)
        options = []
        for end in range(start + 1, n_layers - (n_stages - stage - 1) + 1):
            c = cost(stage, start, end)
            worst, squares, ends = best(stage + 1, end)
            options.append((max(c, worst), squares + c * c, (end, *ends)))
        return min(options)

    ends = best(0, 0)[2]
    starts = (0, *ends[:-1])
    return tuple(range(s, e) for s, e in zip(starts, ends))


class PartFlops(NamedTuple):
    """Training FLOPs per token (forward + backward) of the model's parts, by the formula
    behind MFU: a layer's matmuls and causal attention, the LM head's matmul. The embedding is
    a lookup (no matmul) and the loss's softmax is elementwise over the logits, under 1 % of
    the head's matmul from hidden 256 up, so the formula counts neither."""

    layer: float
    embedding: float
    head: float


def part_flops(model: ModelConfig) -> PartFlops:
    """Split `flops_per_token` into one layer (the mean layer, where sliding windows make them
    differ), the embedding and the head, so the parts always add up to the whole."""
    return _part_flops(dataclasses.astuple(model))


@cache  # the planner asks for thousands of layouts of one model
def _part_flops(fields: tuple) -> PartFlops:
    model = ModelConfig(*fields)
    head = head_flops(model)
    layer = (flops_per_token(model) - head) / model.n_layers
    return PartFlops(layer=layer, embedding=0.0, head=head)


def layer_weights(cfg: Config) -> tuple[float, float]:
    """(embedding, head) in layers for balancing: the configured values, or from FLOPs where
    they are None."""
    p = cfg.parallel
    flops = part_flops(cfg.model)
    embedding = p.embedding_layer_weight
    head = p.head_layer_weight
    return (
        flops.embedding / flops.layer if embedding is None else embedding,
        flops.head / flops.layer if head is None else head,
    )


def stage_ranges(cfg: Config) -> list[range]:
    """The layers of every virtual stage (pp * vpp of them) of `cfg`'s pipeline."""
    p = cfg.parallel
    return partition_layers(cfg.model.n_layers, p.pp * p.vpp, *layer_weights(cfg))


def rank_stages(cfg: Config) -> list[list[int]]:
    """The virtual stages of each pipeline rank, in local chunk order."""
    p = cfg.parallel
    v_shape = v_shaped(p.schedule)
    return [[virtual_stage(r, c, p.pp, v_shape) for c in range(p.vpp)] for r in range(p.pp)]


def chunk_layers(cfg: Config, pp_rank: int) -> list[tuple[int, range]]:
    """(virtual stage, layer range) of each local chunk of `pp_rank`, in local chunk order."""
    ranges = stage_ranges(cfg)
    return [(stage, ranges[stage]) for stage in rank_stages(cfg)[pp_rank]]


class StageCost(NamedTuple):
    """FLOPs per token of one virtual stage's forward and backward; the backward includes the
    forward that recompute runs again (hardware work, which takes time though MFU ignores it).
    `weight` is the backward's weight-gradient GEMMs of the tensor-parallel linears (a third of
    their matmuls; experts' are no such linears): what a split backward (zb-h1, zb-v) moves to
    its W steps."""

    forward: float
    backward: float
    weight: float


def stage_costs(cfg: Config) -> list[StageCost]:
    """The forward / backward FLOPs per token of every virtual stage, embedding and head
    included, with `train.recompute` (full: `recompute_layers` per chunk, or all, rerun their
    forward; segments: every layer once; selective: the attention scores)."""
    flops, t = part_flops(cfg.model), cfg.train
    m = cfg.model
    attention = mean_attention_flops(m)  # per layer, forward + backward, causal
    if t.recompute in ("full", "segments"):
        rerun = flops.layer / 3
    elif t.recompute == "selective":
        rerun = attention / 3
    else:
        rerun = 0.0
    deferred_weights = formulas_of(m.arch).deferred_matmul_weights(m)
    ranges = stage_ranges(cfg)
    costs = []
    for stage, layers in enumerate(ranges):
        total = len(layers) * flops.layer
        total += flops.embedding if stage == 0 else 0.0
        total += flops.head if stage == len(ranges) - 1 else 0.0
        recomputed = len(layers)
        if t.recompute == "full" and t.recompute_layers is not None:
            recomputed = min(t.recompute_layers, len(layers))
        weight = len(layers) * 2 * deferred_weights  # their weight-gradient GEMMs
        costs.append(StageCost(total / 3, 2 * total / 3 + recomputed * rerun, weight))
    return costs
