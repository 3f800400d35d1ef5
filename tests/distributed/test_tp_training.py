"""Tensor (and sequence) parallel training equals the single-process run: GPT and Llama,
tp in {2, 4}, SP on and off, 10 steps."""

import pytest
from equivalence import TINY, assert_equivalent, run_layout

from megalite.config import load_config
from megalite.errors import MegaliteError
from megalite.launch import run_ranks
from megalite.training.loop import train

GPT = ("model.arch=gpt",)
LLAMA = ("model.arch=llama", "model.n_kv_heads=2")  # tp = 4 > kv heads: shared kv heads


@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
def test_tp_matches_single_process(builtin_corpus, tmp_path, model, tp, sp):
    assert_equivalent(tp, model, (f"parallel.tp={tp}", f"parallel.sp={str(sp).lower()}"), tmp_path)


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_tp_sp_with_recompute_matches_single_process(builtin_corpus, tmp_path, recompute):
    """Under SP each row-parallel backward gathers its output gradient and its partner column's
    input in one all-gather; under full recompute that input comes from the recomputed region,
    and with selective recompute from the forward itself."""
    layout = ("parallel.tp=2", "parallel.sp=true", f"train.recompute={recompute}")
    assert_equivalent(2, LLAMA, layout, tmp_path)


def test_sp_shards_straddling_samples_match_single_process(builtin_corpus, tmp_path):
    """Under SP a rank holds a contiguous run of the micro-batch's tokens: at micro-batch 3 over
    tp 2 each run ends inside the middle sample, and with document masking GPT's learned
    positions restart at every document, so each token's position must go with it."""
    model = (*GPT, "train.micro_batch_size=3", "train.global_batch_size=6")
    model += ("data.document_mask=true",)
    assert_equivalent(2, model, ("parallel.tp=2", "parallel.sp=true"), tmp_path)


def test_dropout_run_is_reproducible(builtin_corpus, tmp_path):
    """With dropout the masks differ from tp = 1's, so the run cannot equal it; it must be
    reproducible from the seed, and dropout must actually act. (GPT's: every architecture's
    dropout is the shared one of `models/layers.py`, drawn by `tensor_parallel.random`.)"""
    model = GPT
    layout = model + ("parallel.tp=2", "parallel.sp=true", "model.dropout=0.1")
    first, _ = run_layout(2, TINY + layout, tmp_path / "first")
    second, _ = run_layout(2, TINY + layout, tmp_path / "second")
    without, _ = run_layout(
        2, TINY + model + ("parallel.tp=2", "parallel.sp=true"), tmp_path / "off"
    )
    assert first == second
    assert all(a[0] != b[0] for a, b in zip(first, without))


def _train_and_report(overrides, out_dir):
    try:
        train(load_config(None, [*overrides, f"train.out_dir={out_dir}"]))
    except MegaliteError as exc:
        return str(exc)
    return "trained"


def test_world_size_that_does_not_factor_fails_before_any_collective(builtin_corpus, tmp_path):
    """3 processes cannot hold tp=2: every rank says so (no rank hangs in a collective)."""
    messages = run_ranks(3, _train_and_report, TINY + ("parallel.tp=2",), str(tmp_path), timeout=60)
    assert all("world size 3 is not divisible by tp*pp = 2*1" in m for m in messages), messages
