"""Which layers each pipeline chunk holds.

The model's P * V chunks ("virtual stages") take consecutive layers; virtual stage v lives on
pipeline rank v % P as its local chunk v // P. Layers are spread so the costliest stage is as
cheap as possible, where the embedding and the head can be counted as a fraction of a layer
(`parallel.embedding_layer_weight`, `parallel.head_layer_weight`) because the first and last
stage also run them.
"""

from __future__ import annotations

from functools import cache


def partition_layers(
    n_layers: int, n_stages: int, embedding_weight: float = 0.0, head_weight: float = 0.0
) -> list[range]:
    """Contiguous layer ranges, one per virtual stage, each non-empty, minimising the largest
    stage cost; ties go to the most even split."""
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
    return [range(s, e) for s, e in zip(starts, ends)]


def chunk_layers(
    n_layers: int, pp_size: int, vpp: int, pp_rank: int, embedding_weight=0.0, head_weight=0.0
) -> list[tuple[int, range]]:
    """(virtual stage, layer range) of each local chunk of `pp_rank`, in local chunk order."""
    ranges = partition_layers(n_layers, pp_size * vpp, embedding_weight, head_weight)
    return [(c * pp_size + pp_rank, ranges[c * pp_size + pp_rank]) for c in range(vpp)]
