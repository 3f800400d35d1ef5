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

LAYOUTS = {  # (world, config, overrides); no config: a 2-layer model of toy widths
    "single": (1, None, ()),
    "single-full-recompute": (1, None, ("train.recompute=full",)),
    "single-fp16-bf16-moments": (1, None, ("train.precision=fp16", "optim.state_dtype=bf16")),
    "dp2-zero1": (2, None, ("parallel.zero=1",)),
    "dp2-zero2-segments": (2, None, ("parallel.zero=2", "train.recompute=segments")),
    "tp2-sp": (2, None, ("parallel.tp=2", "parallel.sp=true")),
    "cp2": (2, None, ("parallel.cp=2",)),
    "pp2-gpipe": (2, None, (*PP, "parallel.schedule=gpipe")),
    "pp2-1f1b": (2, None, (*PP, "parallel.schedule=1f1b")),
    "pp2-interleaved": (2, None, (*VPP, "parallel.schedule=interleaved")),
    "pp2-zb-h1": (2, None, (*PP, "parallel.schedule=zb-h1")),
    "pp2-zb-v": (2, None, (*VPP, "parallel.schedule=zb-v")),
    "mixtral-capped": (1, None, (*MIXTRAL, "model.moe_capacity_factor=1.0")),
    "mixtral-ep2": (2, None, (*MIXTRAL, "parallel.ep=2")),
}
LAYOUTS |= {  # shipped configs at their own widths, vocabulary, sequence and micro-batch
    "gpt-tiny-tp2-sp": (2, "configs/gpt-tiny.yaml", ("parallel.tp=2", "parallel.sp=true")),
    "mixtral-tiny-ep2": (
        2,
        "configs/mixtral-tiny.yaml",
        ("parallel.ep=2", "train.micro_batch_size=4"),
    ),
}


def _syncs(overrides: tuple[str, ...], config: str | None = None) -> tuple[dict[str, int], int]:
    """This rank's host syncs in its third step, by site, and the step's MoE layers times its
    micro-batches. Without a `config`: a 2-layer model of toy widths."""
    base = () if config else TWO_LAYERS
    cfg = load_config(config, [*base, *overrides, "train.device=cpu", "train.precision=fp32"])
    cfg.layout_for_world(torch.distributed.get_world_size())
    p = cfg.parallel
    ps = build_parallel_state(p.tp, p.pp, torch.device("cpu"), cp=p.cp, ep=p.ep)
    run = build_run(cfg, ps)
    rows = cfg.train.global_batch_size // ps.size("dp")
    generator = torch.Generator().manual_seed(ps.coord("dp"))
    shape = (rows, cfg.model.seq_len + 1)
    tokens = torch.randint(0, cfg.model.vocab_size, shape, generator=generator)
    for _ in range(2):
        launch_step(run, tokens, 1e-3).read()
    with counting(ps.device) as tally:
        launch_step(run, tokens, 1e-3)
    micro_batches = rows // cfg.train.micro_batch_size
    return tally.counts.sync_sites, len(run.moe_layers) * micro_batches


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_steady_step_waits_for_the_device_nowhere(layout):
    world, config, overrides = LAYOUTS[layout]
    for sites, moe_calls in run_ranks(world, _syncs, overrides, config):
        if "parallel.ep=2" in overrides:  # the split sizes of each layer's exchange
            assert sum(sites.values()) <= moe_calls and moe_calls > 0, sites
            assert all("dispatch.py" in site for site in sites), sites
        else:
            assert sites == {}, sites
