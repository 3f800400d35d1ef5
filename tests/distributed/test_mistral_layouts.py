"""Mistral's sliding window in every layout equals the single process: a window of 6 tokens
over TINY's 32, on every layer or (pattern 2) on alternate layers. tp 2 + SP, pp 2, cp 2 by
ring (chunks of 8: the ring skips the key chunks before every query's window) and by
all-gather with document masks (each row's keys bounded by both), and zero 3 over dp 2. The
gradient norm is held to NORM_RTOL: at tp 2 + SP it moves by 2e-5 at step 8 of 10, with the
losses within 1e-7, and is back within 1e-7 at step 9, as rounding noise is (Qwen's layouts
show the same, `test_qwen_layouts.py`)."""

import pytest
from equivalence import assert_equivalent

MISTRAL = ("model.arch=mistral", "model.n_kv_heads=2", "model.sliding_window=6")
ALTERNATING = (*MISTRAL, "model.sliding_window_pattern=2")
NORM_RTOL = 1e-4
LAYOUTS = {
    "tp2-sp": (2, MISTRAL, ("parallel.tp=2", "parallel.sp=true")),
    "pp2-alternating": (2, ALTERNATING, ("parallel.pp=2", "train.micro_batch_size=1")),
    "cp2-ring": (2, MISTRAL, ("parallel.cp=2",)),
    "cp2-allgather-documents": (
        2,
        ALTERNATING,
        ("parallel.cp=2", "parallel.cp_comm=allgather", "data.document_mask=true"),
    ),
    "dp2-zero3": (2, MISTRAL, ("parallel.zero=3",)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_mistral_layouts_train_as_one_process_does(name, tmp_path):
    world, model, layout = LAYOUTS[name]
    assert_equivalent(world, model, layout, tmp_path, norm_rtol=NORM_RTOL)
