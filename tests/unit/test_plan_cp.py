"""`megalite plan` with context parallelism: cp is searched where the sequence cuts into 2*cp
chunks, proposed where the sequence makes activations dominate memory (llama-7b at 131072
tokens on 64 H100s) and not for a short one (2048 tokens); the ring's transfers hide behind
the attention's compute at long sequences and not at short ones."""

from __future__ import annotations

import dataclasses
import functools

import pytest
from test_plan import machine

from megalite.config import ConfigError, load_config
from megalite.profiling import plan as planner
from megalite.profiling.plan import estimated_peak_bytes, layouts, plan, validated
from megalite.profiling.throughput import cp_transfers, predict

LLAMA = "configs/llama-7b.yaml"
H100S = ("cuda", 64, 8, "80GB")  # 8 nodes of 8


@functools.cache
def _plan(seq: int, with_cp: bool = True, top: int = 3):
    hardware = machine(*H100S)
    overrides = [f"model.seq_len={seq}"]
    base = load_config(LLAMA, overrides)
    saved = planner.context_parallel_sizes
    if not with_cp:
        planner.context_parallel_sizes = lambda base, world: [1]
    try:
        return hardware, base, plan(LLAMA, overrides, base, hardware, top=top)
    finally:
        planner.context_parallel_sizes = saved


def test_long_sequence_plans_context_parallelism():
    """At 131072 tokens the fastest layouts cut the sequence over cp ranks: each runs without
    recompute, its activations cut by cp; the same layout with those ranks as dp instead does
    not fit; and the best layout without cp is slower (its tp all-gathers are exposed where the
    ring hides behind attention)."""
    hardware, base, found = _plan(131072)
    assert all(p.layout.cp > 1 for p in found), [p.layout.describe(p.dp) for p in found]
    best = found[0]
    assert best.layout.recompute == "none"
    assert any(
        r.startswith(f"cp {best.layout.cp}: activations / {best.layout.cp}") for r in best.reasons
    )
    assert f"parallel.cp={best.layout.cp}" in best.command
    as_dp = validated(base, dataclasses.replace(best.layout, cp=1), 64, "cuda")
    assert as_dp is not None and estimated_peak_bytes(as_dp[1], hardware) > hardware.memory_bytes
    _, _, without = _plan(131072, with_cp=False, top=1)
    assert all(p.layout.cp == 1 for p in without)
    assert best.prediction.step_s < without[0].prediction.step_s
    assert best.prediction.cp_comm_s < 0.05 * best.prediction.step_s


def test_short_sequence_plans_no_context_parallelism():
    """At 2048 tokens cp layouts are searched (the sequence cuts into chunks of 256 up to cp 4)
    but none is proposed: the ring's blocks are too small to hide their transfers, and the
    best layout with cp in place of some of its dp is slower."""
    base = load_config(LLAMA, ["model.seq_len=2048"])
    assert {layout.cp for layout in layouts(base, 64)} == {1, 2, 4}
    hardware, _, found = _plan(2048)
    assert all(p.layout.cp == 1 for p in found)
    best = found[0]
    assert best.dp % 2 == 0
    with_cp = validated(base, dataclasses.replace(best.layout, cp=2), 64, "cuda")
    assert with_cp is not None
    slower = predict(with_cp[1], hardware)
    assert slower.step_s > best.prediction.step_s and slower.cp_comm_s > 0


@pytest.mark.parametrize(("seq", "hidden"), [(131072, True), (2048, False)])
def test_ring_transfers_hide_behind_long_attention(seq, hidden):
    """cp 8 of llama-7b, a node's ring: a layer's K/V block per ring step (2 x b x s/cp x 32 kv
    heads x 128 x 2 B) against that step's share of the attention's FLOPs: hidden at 131072
    tokens (but for the last dK/dV's trip home), exposed at 2048; all-gather is never
    overlapped."""
    hardware = machine(*H100S)
    layout = ["parallel.tp=1", "parallel.sp=false", "parallel.cp=8", "parallel.pp=1"]
    layout += ["parallel.vpp=1", "parallel.schedule=1f1b"]
    cfg = load_config(LLAMA, [f"model.seq_len={seq}", *layout])
    dims = cfg.parallel.dims(64)
    assert dims.span("cp") == 8  # within a node
    ring = cp_transfers(cfg, hardware, dims, element=2)
    kv = 2 * seq // 8 * 32 * 128 * 2
    link = hardware.intra_node_bandwidth
    assert ring.forward_moved == pytest.approx(7 * kv / link)
    assert ring.backward_moved == pytest.approx((7 * kv + 8 * 2 * kv) / link)
    assert (ring.forward_messages, ring.backward_messages) == (7, 15)
    assert (ring.forward_exposed == 0) == hidden
    last_home = 2 * kv / link  # the last dK/dV's trip home
    assert (ring.backward_exposed == pytest.approx(last_home)) == hidden
    gather = dataclasses.replace(cfg.parallel, cp_comm="allgather")
    whole = cp_transfers(dataclasses.replace(cfg, parallel=gather), hardware, dims, element=2)
    assert whole.forward_exposed == whole.forward_moved > ring.forward_exposed


def test_cp_sizes_follow_the_sequence_and_dropout():
    """cp divides the world and cuts the sequence into 2*cp chunks of at least MIN_CP_CHUNK
    tokens; none with dropout (cp refuses it); what the planner enumerates validates exactly
    when `megalite train`'s config loading accepts it."""
    sizes = planner.context_parallel_sizes
    assert sizes(load_config(LLAMA), 64) == [1, 2, 4, 8]
    assert sizes(load_config(LLAMA, ["model.seq_len=131072"]), 64) == [1, 2, 4, 8, 16, 32, 64]
    assert sizes(load_config(LLAMA, ["model.seq_len=6144"]), 64) == [1, 2, 4, 8]  # 6144/16 ok
    assert sizes(load_config(LLAMA, ["model.dropout=0.1"]), 64) == [1]
    base = load_config("configs/llama-tiny.yaml", ["model.seq_len=2048"])
    accepted = set()
    for layout in dict.fromkeys(layouts(base, 8)):
        found = validated(base, layout, 8, "cpu")
        chosen = found[0] if found else layout
        try:
            load_config(
                "configs/llama-tiny.yaml", ["model.seq_len=2048", *chosen.settings(base, "cpu")]
            ).layout_for_world(8)
            ok = True
        except ConfigError:
            ok = False
        assert ok == (found is not None), layout
        if ok:
            accepted.add(layout.cp)
    assert accepted == {1, 2, 4}
