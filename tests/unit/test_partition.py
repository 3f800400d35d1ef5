"""Pipeline stages cut by FLOPs: the default weights of the embedding and head come from the
FLOPs formula, an explicit weight overrides, and the balanced cut lowers the simulated bubble of
the actual stage costs."""

from __future__ import annotations

import pytest
from megalite.models.flops import flops_per_token
from megalite.models.partition import (
    layer_weights,
    part_flops,
    partition_layers,
    stage_costs,
    stage_ranges,
)

from megalite.config import ConfigError, load_config
from megalite.pipeline.schedule import build_schedule
from megalite.pipeline.simulate import simulate

PIPELINE = ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved"]
# gpt, h 256, seq 128, vocab 8000: the head is about 2.4 layers of FLOPs
SMALL = ["model.n_layers=8", "model.seq_len=128", "model.n_heads=8", *PIPELINE]


def test_parts_add_up_to_the_flops_formula():
    for path in ("configs/gpt-tiny.yaml", "configs/llama-7b.yaml"):
        model = load_config(path).model
        parts = part_flops(model)
        whole = model.n_layers * parts.layer + parts.embedding + parts.head
        assert whole == pytest.approx(flops_per_token(model))
        h, v = model.hidden, model.vocab_size
        assert parts.head == 6 * v * h  # the LM head's matmul, forward and backward
        assert parts.layer > 6 * 4 * h * h  # at least the attention projections


def test_default_weights_come_from_flops():
    cfg = load_config(None, SMALL)
    assert cfg.parallel.embedding_layer_weight is None and cfg.parallel.head_layer_weight is None
    parts = part_flops(cfg.model)
    assert layer_weights(cfg) == (0.0, pytest.approx(parts.head / parts.layer))
    assert 2 < layer_weights(cfg)[1] < 3
    # the head's 2.4 layers: the last chunk takes one layer, the one before it three
    assert [len(r) for r in stage_ranges(cfg)] == [2, 2, 3, 1]


def test_explicit_weights_override():
    cfg = load_config(
        None, [*SMALL, "parallel.embedding_layer_weight=0", "parallel.head_layer_weight=0"]
    )
    assert layer_weights(cfg) == (0.0, 0.0)
    assert [len(r) for r in stage_ranges(cfg)] == [2, 2, 2, 2]  # by layer count
    cfg = load_config(None, [*SMALL, "parallel.embedding_layer_weight=1.5"])
    assert layer_weights(cfg)[0] == 1.5 and layer_weights(cfg)[1] > 2
    assert [len(r) for r in stage_ranges(cfg)] == [1, 3, 3, 1]
    with pytest.raises(ConfigError, match="head_layer_weight must be >= 0"):
        load_config(None, ["parallel.head_layer_weight=-1"])


def test_stage_costs_count_embedding_head_and_recompute():
    cfg = load_config(None, SMALL)
    parts, costs = part_flops(cfg.model), stage_costs(cfg)
    assert sum(c.forward + c.backward for c in costs) == pytest.approx(flops_per_token(cfg.model))
    assert costs[-1].forward == pytest.approx((parts.layer + parts.head) / 3)
    assert all(c.backward == pytest.approx(2 * c.forward) for c in costs)
    full = stage_costs(load_config(None, [*SMALL, "train.recompute=full"]))
    for plain, recomputed, layers in zip(costs, full, stage_ranges(cfg)):
        assert recomputed.backward == pytest.approx(plain.backward + len(layers) * parts.layer / 3)


def simulated_idle(cfg, m: int) -> float:
    p = cfg.parallel
    lists = [build_schedule(p.schedule, p.pp, r, m, p.vpp) for r in range(p.pp)]
    costs = stage_costs(cfg)
    return simulate(
        lists, p.pp, p.vpp, [c.forward for c in costs], [c.backward for c in costs]
    ).bubble_fraction


def test_balanced_split_lowers_the_simulated_bubble():
    by_flops = load_config(None, SMALL)
    by_count = load_config(
        None, [*SMALL, "parallel.embedding_layer_weight=0", "parallel.head_layer_weight=0"]
    )
    for m in (4, 8):
        balanced, uneven = simulated_idle(by_flops, m), simulated_idle(by_count, m)
        assert balanced < uneven - 0.05, (m, balanced, uneven)


def test_per_stage_costs_generalise_the_scalar_ones():
    lists = [build_schedule("interleaved", 2, r, 4, 2) for r in range(2)]
    scalar = simulate(lists, 2, 2, 1.0, 2.0)
    assert simulate(lists, 2, 2, [1.0] * 4, [2.0] * 4) == scalar
    heavy_last = simulate(lists, 2, 2, [1, 1, 1, 3], [2, 2, 2, 6])
    assert heavy_last.busy == [4 * 6, 4 * 12] and heavy_last.makespan > scalar.makespan
    with pytest.raises(ValueError, match="one per stage"):
        simulate(lists, 2, 2, [1.0] * 3)


def test_partition_minimises_the_costliest_stage():
    assert partition_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    ranges = partition_layers(10, 3, embedding_weight=0.0, head_weight=4.0)
    assert len(ranges[-1]) == 1 and sorted(len(r) for r in ranges[:-1]) == [4, 5]  # max 5
    with pytest.raises(ValueError):
        partition_layers(3, 4)
