"""What a steady-state MoE forward and backward makes the host wait for, counted on CPU by name
as a GPU would wait (issue 47): nothing without expert parallelism, dropless or under a
capacity, either router; across ep ranks one device-to-host copy per MoE layer and
micro-batch, the split sizes the token all-to-all takes on the host."""

from __future__ import annotations

import pytest
import torch
from megalite.models.layers import BuildContext
from megalite.models.moe import MoE

from megalite.config import load_config
from megalite.launch import run_ranks
from megalite.parallel_state import ParallelState, build_parallel_state
from megalite.profiling.launch_count import counting
from megalite.tensor_parallel import TPRandom
from megalite.tensor_parallel.random import init_parameters


def test_the_count_sees_how_the_moe_path_used_to_wait():
    """So that a count of none means none: each way the MoE path waited before (a second
    `tolist`, an unsized `repeat_interleave`, a scalar read of the kept count)."""
    counts = torch.tensor([2, 0, 1])
    with counting("cpu") as tally:
        counts.tolist()
        int(counts[0])
        torch.arange(3).repeat_interleave(counts)
        torch.arange(3).repeat_interleave(counts, output_size=3)  # told its size: no wait
    kinds = sorted(site.split(" at ")[0] for site in tally.counts.sync_sites)
    assert kinds == ["item", "output size", "tolist"]


MIXTRAL_TINY = (  # configs/mixtral-tiny.yaml's MoE widths, over 2 x 64 tokens
    "model.arch=mixtral",
    "model.hidden=256",
    "model.ffn_hidden=512",
    "model.n_heads=4",
    "model.moe_experts=8",
    "model.moe_top_k=2",
    "model.seq_len=64",
)
ROUTINGS = {
    "dropless": (),
    "capacity 1.0": ("model.moe_capacity_factor=1.0",),
    "capacity 0.5, deepseek": (
        "model.moe_capacity_factor=0.5",
        "model.moe_router=sigmoid",
        "model.moe_shared_experts=1",
        "model.moe_z_loss_coef=0.001",
    ),
}


def _syncs_of_a_step(ps: ParallelState, overrides: tuple[str, ...]) -> dict[str, int]:
    """The host syncs of one MoE layer's forward and backward on this rank's 2 x 64 tokens,
    after one such step uncounted (the steady state)."""
    cfg = load_config(None, [*MIXTRAL_TINY, *overrides]).model
    moe = MoE(BuildContext(cfg, ps, TPRandom(0, ps)))
    init_parameters(moe, 0, ps)
    x = torch.randn(2, cfg.seq_len, cfg.hidden, generator=torch.Generator().manual_seed(ps.rank))
    x.requires_grad_()
    moe(x).sum().backward()
    with counting(ps.device) as tally:
        moe(x).sum().backward()
    assert moe.dropped.item() > 0 or cfg.moe_capacity_factor in (None, 1.0)
    return tally.counts.sync_sites


@pytest.mark.parametrize("routing", ROUTINGS)
def test_without_expert_parallelism_nothing_waits(routing):
    assert _syncs_of_a_step(ParallelState.single(), ROUTINGS[routing]) == {}


def _syncs_at_ep(ep: int, overrides: tuple[str, ...]) -> dict[str, int]:
    return _syncs_of_a_step(build_parallel_state(1, 1, torch.device("cpu"), ep=ep), overrides)


@pytest.mark.parametrize("routing", ["dropless", "capacity 0.5, deepseek"])
def test_across_ep_ranks_one_copy_of_the_counts(routing):
    """At ep 2 the counts come to the host once per layer and micro-batch, the send and
    receive sizes in one copy; backward reuses them."""
    for syncs in run_ranks(2, _syncs_at_ep, 2, ROUTINGS[routing]):
        ((site, count),) = syncs.items()
        assert count == 1 and site.startswith("tolist at megalite/expert_parallel/dispatch.py")
