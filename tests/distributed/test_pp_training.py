"""Pipeline-parallel training equals the single-process run: every schedule, pp in {2, 4},
vpp in {1, 2}, GPT (tied embeddings across the first and last stage) and Llama, a partial
micro-batch group, and pp = 2 combined with tp = 2 and sequence parallelism."""

import pytest
from equivalence import assert_equivalent

GPT = ("model.arch=gpt",)
LLAMA = ("model.arch=llama", "model.n_kv_heads=2")
EIGHT_LAYERS = ("model.n_layers=8",)  # pp * vpp = 8 chunks need 8 layers


@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize(
    "pp,vpp,schedule",
    [
        (2, 1, "gpipe"),
        (2, 1, "1f1b"),
        (2, 2, "interleaved"),
        (4, 1, "1f1b"),
        (4, 1, "gpipe"),
        (4, 2, "interleaved"),
    ],
)
def test_pp_matches_single_process(builtin_corpus, tmp_path, model, pp, vpp, schedule):
    layers = EIGHT_LAYERS if pp * vpp > 4 else ()
    layout = (f"parallel.pp={pp}", f"parallel.vpp={vpp}", f"parallel.schedule={schedule}")
    assert_equivalent(pp, model + layers, layout, tmp_path)


def test_interleaved_with_a_partial_microbatch_group(builtin_corpus, tmp_path):
    """m = 5 micro-batches in groups of N = 3: the last group has 2 >= pp micro-batches."""
    batch = ("train.global_batch_size=10",)
    layout = (
        "parallel.pp=2",
        "parallel.vpp=2",
        "parallel.schedule=interleaved",
        "parallel.microbatch_group_size=3",
    )
    assert_equivalent(2, GPT + batch, layout, tmp_path)


@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt", "llama"])
def test_pp_with_tp_and_sp(builtin_corpus, tmp_path, model):
    layout = ("parallel.pp=2", "parallel.tp=2", "parallel.sp=true")
    assert_equivalent(4, model, layout, tmp_path)
