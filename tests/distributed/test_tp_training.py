"""Tensor (and sequence) parallel training equals the single-process run: GPT and Llama,
tp in {2, 4}, SP on and off, 10 steps."""

import pytest
from equivalence import assert_equivalent

GPT = ("model.arch=gpt",)
LLAMA = ("model.arch=llama", "model.n_kv_heads=2")  # tp = 4 > kv heads: shared kv heads


@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
def test_tp_matches_single_process(builtin_corpus, tmp_path, model, tp, sp):
    assert_equivalent(tp, model, (f"parallel.tp={tp}", f"parallel.sp={str(sp).lower()}"), tmp_path)
