"""Mixture-of-experts models compute what the single process computes, in every layout that
shards the dense parts: tensor parallelism with and without SP (experts split over tp like the
dense MLP, routing on each rank's own tokens), pipeline stages, context parallelism, ZeRO over
data-parallel ranks and recompute; expert parallelism (experts sharded over ep ranks carved
out of dp, tokens exchanged all-to-all) alone and with each of those; Mixtral's softmax router
and DeepSeek-V3's sigmoid router with shared experts, z-loss and bias balancing."""

import json

import pytest
import torch
from equivalence import (
    TINY,
    assert_equivalent,
    assert_same_losses,
    reference,
    rewind_to_step_5,
    run_layout,
)

from megalite.context_parallel.layout import local_chunks, shard_sequence
from megalite.launch import run_ranks

MIXTRAL = (
    "model.arch=mixtral",
    "model.n_kv_heads=2",
    "model.moe_experts=4",
    "model.ffn_hidden=96",
)
DEEPSEEK = (
    *MIXTRAL,
    "model.moe_router=sigmoid",
    "model.moe_shared_experts=1",
    "model.moe_routed_scale=2.5",
    "model.moe_z_loss_coef=0.001",
    "model.moe_bias_update_rate=0.01",
)

NORM_RTOL = 1e-4
"""Top-k routing is discontinuous: where a token's k-th and (k+1)-th router logits tie to
within fp32 rounding, the layouts' different summation orders can pick different experts. The
output barely moves (the two gates are nearly equal, so the loss stays within 1e-7), but that
token's gradient goes to another expert: the gradient norm jumps by about 1e-5 at such a step
(seen at step 5 of mixtral-tp2-sp, after 1.6e-7 before it)."""


@pytest.mark.parametrize(
    "world,model,layout",
    [
        (2, MIXTRAL, ("parallel.tp=2", "parallel.sp=true")),
        (2, DEEPSEEK, ("parallel.tp=2",)),
        (2, MIXTRAL, ("parallel.pp=2", "train.recompute=full")),
        (2, DEEPSEEK, ("parallel.zero=1",)),
        (2, MIXTRAL, ("parallel.cp=2",)),
        (4, DEEPSEEK, ("parallel.tp=2", "parallel.sp=true", "parallel.pp=2")),
        (2, MIXTRAL, ("parallel.ep=2",)),
        (4, DEEPSEEK, ("parallel.ep=4",)),
        (4, MIXTRAL, ("parallel.ep=2", "parallel.tp=2", "parallel.sp=true")),
        (
            4,
            DEEPSEEK,
            ("parallel.ep=2", "parallel.pp=2", "parallel.schedule=interleaved", "parallel.vpp=2"),
        ),
        (4, MIXTRAL, ("parallel.ep=2", "parallel.zero=1")),
        (4, DEEPSEEK, ("parallel.ep=2", "parallel.zero=2", "train.recompute=full")),
        (4, MIXTRAL, ("parallel.ep=2", "parallel.cp=2")),
        (4, MIXTRAL, ("parallel.ep=2", "parallel.pp=2", "parallel.schedule=gpipe")),
        (4, DEEPSEEK, ("parallel.ep=2", "parallel.pp=2", "parallel.schedule=zb-h1")),
        (
            4,
            MIXTRAL,
            ("parallel.ep=2", "parallel.pp=2", "parallel.vpp=2", "parallel.schedule=zb-v"),
        ),
    ],
    ids=[
        "mixtral-tp2-sp",
        "deepseek-tp2",
        "mixtral-pp2-recompute",
        "deepseek-dp2-zero1",
        "mixtral-cp2",
        "deepseek-tp2-sp-pp2",
        "mixtral-ep2",
        "deepseek-ep4",
        "mixtral-ep2-tp2-sp",
        "deepseek-ep2-pp2-interleaved",
        "mixtral-ep2-dp2-zero1",
        "deepseek-ep2-dp2-zero2-recompute",
        "mixtral-ep2-cp2",
        "mixtral-ep2-pp2-gpipe",
        "deepseek-ep2-pp2-zb-h1",
        "mixtral-ep2-pp2-zb-v",
    ],
)
def test_moe_layout_equals_single_process(builtin_corpus, tmp_path, world, model, layout):
    assert_equivalent(world, model, layout, tmp_path, norm_rtol=NORM_RTOL)


SAVE_AT_5 = ("checkpoint.interval=5", "checkpoint.keep=5", "parallel.zero=1")


@pytest.mark.parametrize(
    "world,ep", [(1, 1), (4, 4), (4, 2)], ids=["to-ep1", "to-ep4", "to-ep2-dp4"]
)
def test_resume_at_another_ep(builtin_corpus, tmp_path, world, ep):
    """Saved at ep 2 x dp 2 with the optimizer sharded (dense state over 4 ranks, the experts'
    over 2), resumed at ep 1, at ep 4, and at ep 2 over 4 ranks: steps 6-10 are the
    uninterrupted single process's. The checkpoint names every expert by its global index."""
    run_layout(4, TINY + MIXTRAL + SAVE_AT_5 + ("parallel.ep=2",), tmp_path)
    checkpoints = tmp_path / "checkpoints"
    manifest = json.loads((checkpoints / "step_000005" / "manifest.json").read_text())
    assert "model_tp00_ep01_pp00.safetensors" in manifest["files"]  # ep rank 1's experts
    rewind_to_step_5(tmp_path)
    resumed, _ = run_layout(world, TINY + MIXTRAL + SAVE_AT_5 + (f"parallel.ep={ep}",), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(6, 11))
    ref_losses, _ = reference(TINY + MIXTRAL)
    assert_same_losses(resumed, ref_losses[5:], norm_rtol=NORM_RTOL)


def test_routing_metrics_and_capacity_drops(builtin_corpus, tmp_path):
    """metrics.jsonl reports the busiest expert's load over the mean (>= 1) and the pairs
    dropped over capacity: none dropless, some at capacity factor 0.5, at ep 2 as at ep 1."""
    for name, world, extra in [
        ("dropless", 2, ()),
        ("capped", 2, ("model.moe_capacity_factor=0.5",)),
    ]:
        out = tmp_path / name
        run_layout(world, TINY + MIXTRAL + extra + ("parallel.ep=2",), out)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert all(row["expert_imbalance"] >= 1.0 for row in rows)
        dropped = [row["dropped_tokens"] for row in rows]
        assert (sum(dropped) == 0) == (name == "dropless"), dropped


def test_bias_balancing_moves_the_routing_bias(builtin_corpus):
    """DeepSeek-V3's auxiliary-loss-free balancing: after a step every layer's bias moved by
    exactly the rate, up for the experts that got fewer than the mean of the step's tokens and
    down for those that got more."""
    import torch

    from megalite.config import load_config
    from megalite.parallel_state import ParallelState
    from megalite.training.setup import build_run
    from megalite.training.step import train_step

    cfg = load_config(None, [*TINY, *DEEPSEEK, "model.moe_aux_loss_coef=0"])
    run = build_run(cfg, ParallelState.single())
    tokens = torch.randint(0, cfg.model.vocab_size, (8, cfg.model.seq_len + 1))
    moes = list(run.moe_layers.values())
    loads = []
    for moe in moes:  # record each layer's load as the step hands it over

        def recorded(load, updated, original=moe.take_load):
            loads.append(load.clone())
            return original(load, updated)

        moe.take_load = recorded
    metrics = train_step(run, tokens, lr=1e-3)
    assert metrics.expert_imbalance >= 1.0 and metrics.dropped_tokens == 0
    for moe, load in zip(moes, loads, strict=True):
        expected = 0.01 * torch.sign(load.float().mean() - load)
        assert torch.allclose(moe.expert_bias, expected), (moe.expert_bias, load)
        assert load.sum() == 8 * cfg.model.seq_len * cfg.model.moe_top_k


def test_a_skipped_step_leaves_the_routing_bias(builtin_corpus):
    """A step the bad-step policy skips changes no state: the routing bias stays where it was
    (and the next step counts its load afresh), as the weights do."""
    import torch

    from megalite.config import load_config
    from megalite.parallel_state import ParallelState
    from megalite.training.setup import build_run
    from megalite.training.step import train_step

    cfg = load_config(None, [*TINY, *DEEPSEEK, "model.moe_aux_loss_coef=0"])
    run = build_run(cfg, ParallelState.single())
    tokens = torch.randint(0, cfg.model.vocab_size, (8, cfg.model.seq_len + 1))
    from megalite.optimizer.bad_steps import SPIKE

    judge = run.bad_steps.judge
    run.bad_steps.judge = lambda *args: judge(*args).index_fill_(0, torch.tensor(0), SPIKE)
    metrics = train_step(run, tokens, lr=1e-3)
    assert metrics.bad.startswith("loss spike")
    for moe in run.moe_layers.values():
        assert not moe.expert_bias.any() and not moe.load.any()


def test_resume_restores_the_routing_biases(builtin_corpus, tmp_path):
    """DeepSeek-V3's balancing biases (not parameters: moved by the step's load, not the
    optimizer) are saved with the weights, once per pipeline stage: saved at ep 2 x dp 2 after
    step 5 and resumed at ep 1 on one rank, steps 6-10 are the uninterrupted run's."""
    run_layout(4, TINY + DEEPSEEK + SAVE_AT_5 + ("parallel.ep=2", "parallel.pp=2"), tmp_path)
    checkpoints = tmp_path / "checkpoints"
    manifest = json.loads((checkpoints / "step_000005" / "manifest.json").read_text())
    assert {"layers.0.mlp.expert_bias", "layers.3.mlp.expert_bias"} <= manifest["tensors"].keys()
    rewind_to_step_5(tmp_path)
    resumed, _ = run_layout(1, TINY + DEEPSEEK + SAVE_AT_5, tmp_path)
    ref_losses, _ = reference(TINY + DEEPSEEK)
    assert_same_losses(resumed, ref_losses[5:], norm_rtol=NORM_RTOL)


CAPPED = (*MIXTRAL, "model.moe_capacity_factor=1.0")


def _dropped(out_dir) -> list[int]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["dropped_tokens"] for row in rows]


@pytest.mark.parametrize(
    "world,layout",
    [
        (2, ("parallel.tp=2", "parallel.sp=true")),
        (2, ("parallel.cp=2",)),
        (4, ("parallel.ep=2", "parallel.cp=2")),
    ],
    ids=["tp2-sp", "cp2", "ep2-cp2"],
)
def test_capacity_is_taken_over_the_micro_batch_in_every_layout(
    builtin_corpus, tmp_path, world, layout
):
    """GShard's capacity is over a micro-batch's tokens in window order, as one process takes
    it, whichever ranks hold them (SP shards, cp chunks): the same pairs are dropped, and the
    same count is reported. (Weights within 5e-5, not 3e-5: seen 3.2e-5 at tp 2 + SP, against
    6.6e-6 dropless, in the expert whose tokens the capacity cuts, whose few gradients Adam's
    division by sqrt(v) magnifies; the losses are equal, and the keep masks are the single
    process's mask for mask: `test_capacity_keeps_the_pairs_one_process_keeps`.)"""
    assert_equivalent(
        world, CAPPED, layout, tmp_path / "layout", weight_rtol=5e-5, norm_rtol=NORM_RTOL
    )
    run_layout(1, TINY + CAPPED, tmp_path / "single")
    assert _dropped(tmp_path / "layout") == _dropped(tmp_path / "single")
    assert sum(_dropped(tmp_path / "single")) > 0


def test_a_capacity_bounds_the_rows_computed(builtin_corpus, monkeypatch):
    """A capacity bounds the experts' work: the grouped GEMMs see at most the experts times
    the capacity rows (the kept pairs, then a static number of dropped ones, masked out)."""
    import math

    import megalite.models.moe as moe_module
    import torch

    from megalite.config import load_config
    from megalite.parallel_state import ParallelState
    from megalite.training.setup import build_run
    from megalite.training.step import train_step

    rows, real = [], moe_module.grouped_mm

    def counted(x, weight, counts):
        rows.append(x.shape[0])
        return real(x, weight, counts)

    monkeypatch.setattr(moe_module, "grouped_mm", counted)
    cfg = load_config(None, [*TINY, *MIXTRAL, "model.moe_capacity_factor=0.5"])
    run = build_run(cfg, ParallelState.single())
    metrics = train_step(run, torch.randint(0, 500, (8, cfg.model.seq_len + 1)), 1e-3)
    m = cfg.model
    tokens = cfg.train.micro_batch_size * m.seq_len
    most = m.moe_experts * math.ceil(0.5 * tokens * m.moe_top_k / m.moe_experts)
    assert metrics.dropped_tokens > 0 and rows and max(rows) <= most


def _keep_masks(tp: int, cp: int) -> list:
    """Every training forward's keep mask (this rank's tokens) over 4 steps of fixed windows."""
    import megalite.models.moe as moe_module

    from megalite.config import load_config
    from megalite.parallel_state import build_parallel_state
    from megalite.training.setup import build_run
    from megalite.training.step import train_step

    layout = [f"parallel.tp={tp}", f"parallel.sp={str(tp > 1).lower()}", f"parallel.cp={cp}"]
    cfg = load_config(None, [*TINY, *CAPPED, *layout])
    run = build_run(cfg, build_parallel_state(tp, 1, torch.device("cpu"), cp=cp))
    masks, decide = [], moe_module.MoE.within_capacity

    def recorded(moe, experts):
        kept = decide(moe, experts)
        if moe.training:
            keep = kept.mask
            masks.append(keep.view(-1, cfg.model.seq_len // cp, keep.shape[-1]).clone())
        return kept

    moe_module.MoE.within_capacity = recorded
    generator = torch.Generator().manual_seed(3)
    for _ in range(4):
        train_step(
            run, torch.randint(0, 500, (8, cfg.model.seq_len + 1), generator=generator), 3e-3
        )
    return masks


@pytest.mark.parametrize("tp, cp", [(2, 1), (1, 2)], ids=["tp2-sp", "cp2"])
def test_capacity_keeps_the_pairs_one_process_keeps(tp, cp):
    """Mask for mask, every layer and micro-batch: the tp group's tokens under SP, and under cp
    this rank's chunks of the single process's windows."""
    (single,) = run_ranks(1, _keep_masks, 1, 1)
    assert sum(int((~mask).sum()) for mask in single) > 0
    for rank, masks in enumerate(run_ranks(tp * cp, _keep_masks, tp, cp)):
        chunks = local_chunks(single[0].shape[1], cp, rank if cp > 1 else 0)
        expected = [shard_sequence(mask, chunks) for mask in single]
        assert len(masks) == len(expected)
        assert all(map(torch.equal, masks, expected)), rank
