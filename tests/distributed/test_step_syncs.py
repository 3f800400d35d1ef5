"""A steady-state training step makes the host wait for the device nowhere (issue 47): at every
layout the suite runs (dense, MoE, tp + SP, cp, every pipeline schedule, ZeRO 0-2, recompute,
fp16's loss scaler, bf16 moments), `launch_step` (the step but its one read of the metrics)
counts no host sync on any rank, by `megalite.profiling.launch_count`'s count. The one
exception is MoE across ep ranks: `all_to_all_single` takes its split sizes on the host, one
copy per MoE layer and micro-batch. Offload is aside: its update runs on the host."""

from __future__ import annotations

import pytest
import torch
from run_configs import ONE_LAYER

from megalite.config import load_config
from megalite.launch import run_ranks
from megalite.parallel_state import build_parallel_state
from megalite.profiling.launch_count import counting
from megalite.training.setup import build_run
from megalite.training.step import launch_step

TWO_LAYERS = (*ONE_LAYER, "model.n_layers=2", "train.global_batch_size=4")
MIXTRAL = ("model.arch=mixtral", "model.moe_experts=4", "model.moe_top_k=2", "model.n_kv_heads=2")
PP = ("parallel.pp=2", "train.micro_batch_size=1")
VPP = (*PP, "parallel.vpp=2", "model.n_layers=4")

LAYOUTS = {
    "single": (1, ()),
    "single-full-recompute": (1, ("train.recompute=full",)),
    "single-fp16-bf16-moments": (1, ("train.precision=fp16", "optim.state_dtype=bf16")),
    "dp2-zero1": (2, ("parallel.zero=1",)),
    "dp2-zero2-segments": (2, ("parallel.zero=2", "train.recompute=segments")),
    "tp2-sp": (2, ("parallel.tp=2", "parallel.sp=true")),
    "cp2": (2, ("parallel.cp=2",)),
    "pp2-gpipe": (2, (*PP, "parallel.schedule=gpipe")),
    "pp2-1f1b": (2, (*PP, "parallel.schedule=1f1b")),
    "pp2-interleaved": (2, (*VPP, "parallel.schedule=interleaved")),
    "pp2-zb-h1": (2, (*PP, "parallel.schedule=zb-h1")),
    "pp2-zb-v": (2, (*VPP, "parallel.schedule=zb-v")),
    "mixtral-capped": (1, (*MIXTRAL, "model.moe_capacity_factor=1.0")),
    "mixtral-ep2": (2, (*MIXTRAL, "parallel.ep=2")),
}


def _syncs(overrides: tuple[str, ...]) -> tuple[dict[str, int], int]:
    """This rank's host syncs in its third step, by site, and the step's MoE layers times its
    micro-batches."""
    cfg = load_config(None, [*TWO_LAYERS, *overrides])
    cfg.layout_for_world(torch.distributed.get_world_size())
    p = cfg.parallel
    ps = build_parallel_state(p.tp, p.pp, torch.device("cpu"), cp=p.cp, ep=p.ep)
    run = build_run(cfg, ps)
    rows = cfg.train.global_batch_size // ps.size("dp")
    generator = torch.Generator().manual_seed(ps.coord("dp"))
    tokens = torch.randint(0, cfg.model.vocab_size, (rows, cfg.model.seq_len + 1), generator=generator)
    for _ in range(2):
        launch_step(run, tokens, 1e-3).read()
    with counting(ps.device) as tally:
        launch_step(run, tokens, 1e-3)
    micro_batches = rows // cfg.train.micro_batch_size
    return tally.counts.sync_sites, len(run.moe_layers) * micro_batches


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_steady_step_waits_for_the_device_nowhere(layout):
    world, overrides = LAYOUTS[layout]
    for sites, moe_calls in run_ranks(world, _syncs, overrides):
        if "parallel.ep=2" in overrides:  # the split sizes of each layer's exchange
            assert sum(sites.values()) <= moe_calls and moe_calls > 0, sites
            assert all("dispatch.py" in site for site in sites), sites
        else:
            assert sites == {}, sites
