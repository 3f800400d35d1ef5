"""Gemma 3 in every layout equals the single process: TINY's 4 layers as Gemma 3 builds them
(sandwich norms scaling by 1 + weight, QK-norm, GeGLU, the embedding scaled by sqrt(hidden) and
tied to the head), a window of 6 tokens over 32 on layers 0, 1 and 3 (pattern 3: layer 2
global), q wider than the model (4 heads x 24 at hidden 64), a softmax scale of its own and
rotary bases that differ between the local and the (linearly scaled) global layers. tp 2 + SP,
pp 2 (the tied embedding a copy on the last stage), cp 2 by ring (the query scaled before the
block attention) and zero 3 over dp 2.

Losses and gradient norms are held as `assert_equivalent` holds them (1e-5; measured: losses
within 3.4e-7, norms within 5.8e-6, at the first step, from the same weights, within 1.4e-8,
which `FIRST_NORM_RTOL` holds: a norm weight's gradient left unsummed over tp moves it by
2.6e-5). The final weights part by more than Llama's do: the post-norms make attention's and
the MLP's output projections scale-invariant, and Adam turns fp32 rounding into larger moves
of them, so that merely regrouping the single process's micro-batches moves them by 1.1e-5
(Llama's: 2e-6), tp 2 + SP by 6.4e-5 (7.1e-5 at half the learning rate, 1.9e-5 at a quarter)
and cp 2 by 4.5e-5: `WEIGHT_RTOL`. A norm's weight w starts at 0 (it scales by 1 + w), so w
is Adam's steps alone and is held to the scale it applies, 1 + w."""

import pytest
from equivalence import TINY, assert_same_losses, reference, relative_error, run_layout

GEMMA = (
    "model.arch=gemma3",
    "model.n_kv_heads=2",
    "model.head_dim=24",
    "model.tie_embeddings=true",
    "model.sliding_window=6",
    "model.sliding_window_pattern=3",
    "model.query_scale=20",
    "model.rope_theta=1e6",
    "model.rope_local_theta=1e4",
    "model.rope_linear_factor=8",
)
WEIGHT_RTOL = 1e-4
FIRST_NORM_RTOL = 1e-6
LAYOUTS = {
    "tp2-sp": ("parallel.tp=2", "parallel.sp=true"),
    "pp2": ("parallel.pp=2", "train.micro_batch_size=1"),
    "cp2-ring": ("parallel.cp=2",),
    "dp2-zero3": ("parallel.zero=3",),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gemma3_layouts_train_as_one_process_does(name, tmp_path):
    losses, weights = run_layout(2, TINY + GEMMA + LAYOUTS[name], tmp_path)
    ref_losses, ref_weights = reference(TINY + GEMMA)
    assert ref_losses[-1][0] < ref_losses[0][0] - 0.1, "the reference run did not learn"
    assert_same_losses(losses, ref_losses)
    (_, first), (_, ref_first) = losses[0], ref_losses[0]
    assert abs(first - ref_first) <= FIRST_NORM_RTOL * ref_first
    assert weights.keys() == ref_weights.keys()
    for key, ref in ref_weights.items():
        ours, ref = weights[key].float(), ref.float()
        if key.endswith("norm.weight"):  # the scale it applies
            ours, ref = 1 + ours, 1 + ref
        error = relative_error(ours, ref)
        assert error <= WEIGHT_RTOL, f"{key}: relative error {error:.2e} vs single-process"
