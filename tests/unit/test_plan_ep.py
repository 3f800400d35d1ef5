"""`megalite plan` with expert parallelism: ep is searched for mixture-of-experts models (among
the divisors of dp that divide the experts), and proposed where the experts' weights and state
do not fit on a rank without it: Mixtral 8x7B on 64 GPUs of 40 GB. The all-to-all's time grows
with ep's share of the rows that leave a rank, and with the link its group spans."""

from __future__ import annotations

import dataclasses

from test_plan import machine

from megalite.config import load_config
from megalite.profiling import plan as planner
from megalite.profiling.plan import estimated_peak_bytes, expert_parallel_sizes, plan, validated
from megalite.profiling.throughput import ep_transfer, predict

MIXTRAL = "configs/mixtral-8x7b.yaml"


def test_ep_sizes_divide_dp_and_the_experts():
    mixtral = load_config(MIXTRAL)
    assert expert_parallel_sizes(mixtral, 16) == [1, 2, 4, 8]
    assert expert_parallel_sizes(mixtral, 6) == [1, 2]
    assert expert_parallel_sizes(load_config("configs/llama-7b.yaml"), 16) == [1]


def test_plan_proposes_expert_parallelism_where_the_experts_do_not_fit(monkeypatch):
    """The search cut to full recompute and 1F1B with one chunk (seconds instead of a minute):
    every layout that fits shards the experts."""
    monkeypatch.setattr(planner, "RECOMPUTE", ("full",))
    monkeypatch.setattr(planner, "schedules", lambda pp, vpp: ("1f1b",) if vpp == 1 else ())
    hardware = machine("cuda", 64, 8, "40GB")
    base = load_config(MIXTRAL)
    proposals = plan(MIXTRAL, [], base, hardware, top=3)
    assert proposals and all(p.layout.ep > 1 for p in proposals)
    best = proposals[0]
    assert f"parallel.ep={best.layout.ep}" in best.command
    assert "(ep " in best.layout.describe(best.dp)
    # the same layout with every expert on every rank does not fit
    dense = dataclasses.replace(best.layout, ep=1)
    found = validated(base, dense, 64, "cuda")
    assert found is not None and estimated_peak_bytes(found[1], hardware) > hardware.memory_bytes
    assert predict(best.config, hardware).ep_comm_s > 0


def test_all_to_all_time_grows_with_the_rows_that_leave_a_rank():
    hardware = machine("cuda", 64, 8, "80GB")
    times = []
    for ep in (1, 2, 4, 8):
        cfg = load_config(MIXTRAL, [f"parallel.ep={ep}"])
        times.append(ep_transfer(cfg, hardware, cfg.parallel.dims(64), 2))
    assert times[0] == 0 and times[1] < times[2] < times[3]
    # ep 2 and 4 (over tp 2: 4 and 8 consecutive ranks) talk inside a node: the same link
    assert times[2] / times[1] == (3 / 4) / (1 / 2)
    # ep 8 spans 16 ranks, two nodes: the slower link on top of the larger share
    assert times[3] / times[1] > (7 / 8) / (1 / 2)
