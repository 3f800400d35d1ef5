"""HSDP (`parallel.dp_replicate`): ZeRO shards within groups of dp / dp_replicate ranks and keeps
dp_replicate copies of each shard. Equivalence with the single process at zero 1, 2 and 3
(HSDP 2 x 2 on dp 4; cp 2 x dp 2 with the copies over dp; mixtral's experts over ep 2 beside
it); what crosses the copies (one all-reduce of the owned shards a step, every gather and
reduce-scatter within a shard group); checkpoints saved under HSDP resumed without it and back;
and what a rank holds, as `megalite estimate` counts it."""

import shutil
from pathlib import Path

import pytest
import torch
from equivalence import (
    SAVE_AT_5,
    TINY,
    assert_equals_reference,
    assert_same_losses,
    read_run,
    reference,
    rewind_to_step_5,
    train_each,
)

from megalite import comm
from megalite.config import load_config
from megalite.errors import ConfigError
from megalite.launch import run_ranks
from megalite.parallel_dims import ParallelDims
from megalite.parallel_state import build_parallel_state
from megalite.profiling.estimate import estimate_layout
from megalite.profiling.memory import live_bytes
from megalite.training.setup import build_run
from megalite.training.step import train_step

GPT = ("model.arch=gpt",)
LLAMA = ("model.arch=llama", "model.n_kv_heads=2")
MIXTRAL = ("model.arch=mixtral", "model.n_kv_heads=2", "model.moe_experts=4", "model.ffn_hidden=96")
HSDP = ("parallel.dp_replicate=2",)
LAYOUTS = {
    "zero1-2x2": (LLAMA, ("parallel.zero=1",)),
    "zero2-cp2-dp2": (LLAMA, ("parallel.zero=2", "parallel.cp=2")),
    "zero3-2x2": (GPT, ("parallel.zero=3",)),
    "zero3-mixtral-ep2": (MIXTRAL, ("parallel.zero=3", "parallel.ep=2")),
}
"""4 ranks each, with two copies of every dense shard: (model, layout)."""
NORM_RTOL = {"zero3-mixtral-ep2": 1e-4}
"""Top-k routing ties move the gradient norm by ~1e-5 (`test_moe.NORM_RTOL`)."""


@pytest.fixture(scope="module")
def layouts(builtin_corpus, tmp_path_factory) -> dict[str, Path]:
    """Every layout of LAYOUTS trained, in one launch."""
    root = tmp_path_factory.mktemp("hsdp")
    runs = [
        (TINY + model + layout + HSDP, str(root / name))
        for name, (model, layout) in LAYOUTS.items()
    ]
    run_ranks(4, train_each, runs, timeout=600)
    return {name: root / name for name in LAYOUTS}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_hsdp_matches_single_process(layouts, name):
    model = LAYOUTS[name][0]
    losses, weights = read_run(layouts[name])
    assert_equals_reference(model, losses, weights, norm_rtol=NORM_RTOL.get(name))


def _shards(_) -> dict:
    """Where each rank's dense buffer shards and keeps copies, at zero 3 on dp 4 with 2 copies."""
    cfg = load_config(None, [*TINY, *GPT, "parallel.zero=3", *HSDP])
    run = build_run(cfg, build_parallel_state(1, 1, torch.device("cpu"), dp_replicate=2))
    (buffer,) = run.buffers
    return {
        "shard": (buffer.shard_size, buffer.shard_rank),
        "first copy": buffer.first_copy,
        "owned": buffer.params_owned.clone(),
    }


def test_each_shard_has_two_copies():
    """dp rank = dp_replicate rank * dp_shard + dp_shard rank: ranks 0 and 1 hold the two
    shards, ranks 2 and 3 their copies (the same parameters), and each copy is the first on
    ranks 0 and 1 alone."""
    found = run_ranks(4, _shards, None)
    assert [f["shard"] for f in found] == [(2, 0), (2, 1), (2, 0), (2, 1)]
    assert [f["first copy"] for f in found] == [True, True, False, False]
    assert torch.equal(found[0]["owned"], found[2]["owned"])
    assert torch.equal(found[1]["owned"], found[3]["owned"])
    assert not torch.equal(found[0]["owned"], found[1]["owned"])


def _step_traffic(_) -> dict[str, list[tuple[int, int]]]:
    """(bytes, group size) of each collective of a steady step at zero 3 on dp 4, with and
    without HSDP's two copies, by kind."""
    found = {}
    for name, layout in (("zero3", ()), ("hsdp", HSDP)):
        cfg = load_config(
            None, [*TINY, *GPT, "train.micro_batch_size=2", "parallel.zero=3", *layout]
        )
        ps = build_parallel_state(1, 1, torch.device("cpu"), dp_replicate=2 if layout else 1)
        run = build_run(cfg, ps)
        tokens = torch.randint(0, 500, (2, cfg.model.seq_len + 1))
        train_step(run, tokens, 1e-3)
        with comm.record_collectives() as log:
            train_step(run, tokens, 1e-3)
        kinds: dict[str, list[tuple[int, int]]] = {}
        for record in log:
            kinds.setdefault(record.op, []).append((record.bytes, record.group_size))
        found[name] = kinds
    return found


def test_only_the_owned_shards_cross_the_copies():
    """Under HSDP every all-gather and reduce-scatter runs within a shard group of 2 ranks, and
    the copies exchange each owned shard's gradient once (an all-reduce of 1/2 of the
    reduce-scattered bytes over the 2 copies); without it they run over all 4 replicas. The
    rest of the all-reduces (loss, norm, verdict) are scalars over the world."""
    found = run_ranks(4, _step_traffic, None)[0]
    plain, hsdp = found["zero3"], found["hsdp"]
    assert {size for _, size in plain["all_gather"] + plain["reduce_scatter"]} == {4}
    assert {size for _, size in hsdp["all_gather"] + hsdp["reduce_scatter"]} == {2}
    gathered = sum(n for n, _ in hsdp["all_gather"])
    scattered = sum(n for n, _ in hsdp["reduce_scatter"])
    assert gathered == 2 * scattered  # fp32 parameters: twice a step, as at zero 3
    over_copies = [n for n, size in hsdp["all_reduce"] if size == 2]
    assert sum(over_copies) * 2 == scattered
    assert len(over_copies) == len(hsdp["reduce_scatter"])  # one a bucket
    assert not [n for n, size in plain["all_reduce"] if size == 2]


def test_checkpoints_resume_with_and_without_hsdp(builtin_corpus, tmp_path):
    """Steps 1-5 under HSDP at zero 3, 6-10 from its step-5 checkpoint at zero 1 on dp 4 and at
    zero 2 under HSDP; steps 1-5 at zero 1 on dp 4, 6-10 under HSDP at zero 3: the single
    process's losses, each. A copy writes nothing its first copy writes."""
    saved = {"hsdp": tmp_path / "hsdp", "zero1": tmp_path / "zero1"}
    first = {"hsdp": ("parallel.zero=3", *HSDP), "zero1": ("parallel.zero=1",)}
    runs = [(TINY + GPT + SAVE_AT_5 + first[name], str(d)) for name, d in saved.items()]
    run_ranks(4, train_each, runs, timeout=300)
    step5 = saved["hsdp"] / "checkpoints" / "step_000005"
    assert sorted(p.name for p in step5.glob("optim_*")) == [
        "optim_tp00_pp00_dp00.safetensors",
        "optim_tp00_pp00_dp01.safetensors",
    ]
    for directory in saved.values():
        rewind_to_step_5(directory)
    resumes = {
        "hsdp -> zero 1": (saved["hsdp"], ("parallel.zero=1",)),
        "hsdp -> hsdp zero 2": (tmp_path / "hsdp-zero2", ("parallel.zero=2", *HSDP)),
        "zero 1 -> hsdp": (saved["zero1"], ("parallel.zero=3", *HSDP)),
    }
    shutil.copytree(saved["hsdp"], tmp_path / "hsdp-zero2")
    runs = [(TINY + GPT + SAVE_AT_5 + layout, str(d)) for d, layout in resumes.values()]
    run_ranks(4, train_each, runs, timeout=300)
    ref_losses, _ = reference(TINY + GPT)
    for name, (directory, _) in resumes.items():
        losses, _ = read_run(directory)
        assert len(losses) == 5, name
        assert_same_losses(losses, ref_losses[5:])


def _model_states(zero: int) -> dict[str, int]:
    cfg = load_config(
        None, [*TINY, *GPT, "parallel.bucket_mb=0.05", f"parallel.zero={zero}", *HSDP]
    )
    run = build_run(cfg, build_parallel_state(1, 1, torch.device("cpu"), dp_replicate=2))
    train_step(run, torch.randint(0, 500, (2, cfg.model.seq_len + 1)), 1e-3)
    return live_bytes(run)


@pytest.mark.parametrize("zero", [1, 3])
def test_a_rank_holds_what_the_estimate_counts(zero):
    """Parameters, gradients and optimizer state on each of dp 4 ranks with 2 copies: the
    estimate's to the byte, each a half (not a quarter) of the padded buckets where sharded."""
    cfg = load_config(
        None, [*TINY, *GPT, "parallel.bucket_mb=0.05", f"parallel.zero={zero}", *HSDP]
    )
    stage = estimate_layout(cfg, 4, device="cpu").stages[0]
    for live in run_ranks(4, _model_states, zero):
        for part, name in (("params", "parameters"), ("grads", "gradients"), ("optimizer",) * 2):
            assert live[part] == stage.part(name), part
    # fp32 parameters are their own masters: Adam's m and v for each owned element, half of
    # the padded buckets
    assert stage.part("optimizer") == 8 * stage.parameters // 2


def test_the_grid_of_hsdp():
    """dp 4 as dp_shard 2 x dp_replicate 2 under tp 2: shard groups of consecutive dp ranks,
    copies a shard group apart."""
    dims = ParallelDims.for_world(8, dp_replicate=2, tp=2)
    named = dims.named_groups()
    assert named["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert named["dp_shard_cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert named["dp_replicate"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.shard_and_replicate(("cp", "dp")) == (("cp", "dp_shard"), ("dp_replicate",))
    assert dims.shard_and_replicate(("cp", "edp")) == (("cp", "edp"), ())


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        (("parallel.dp_replicate=2",), 4, "parallel.zero=0 shards nothing"),
        (("parallel.dp_replicate=3", "parallel.zero=1"), 4, "does not divide the data-parallel"),
    ],
)
def test_bad_hsdp_layouts_say_what_to_change(overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*TINY, *overrides]).layout_for_world(world)
