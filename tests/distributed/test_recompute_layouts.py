"""sqrt(N) recompute (`train.recompute=segments`) in parallel layouts equals the single-process
run without recompute: recompute changes memory, never the function."""

import pytest
from equivalence import assert_equivalent

GPT = ("model.arch=gpt",)
LLAMA = ("model.arch=llama", "model.n_kv_heads=2")


@pytest.mark.parametrize(
    ("model", "world_size", "layout"),
    [
        (LLAMA, 2, ("parallel.tp=2", "parallel.sp=true")),
        (GPT, 2, ("parallel.pp=2", "parallel.schedule=1f1b", "train.micro_batch_size=1")),
    ],
    ids=["llama-tp2-sp", "gpt-pp2-1f1b"],
)
def test_segments_recompute_matches_single_process(
    builtin_corpus, tmp_path, model, world_size, layout
):
    assert_equivalent(world_size, model, (*layout, "train.recompute=segments"), tmp_path)
