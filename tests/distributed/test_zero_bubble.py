"""Zero-bubble pipelines equal the single-process run (fp32, 1e-5 per step), with p2p that
blocks as NCCL's does: zb-h1 and zb-v at pp 2 and 4, each beside tp 2 + SP, ZeRO-1 and ZeRO-2
(small buckets: several per chunk, each reduced once its W steps are done) and recompute, GPT
(whose tied embedding and head are both on zb-v's first rank) and Llama, evaluation included."""

import pytest
from equivalence import EVAL, assert_equivalent, assert_same_val_losses

GPT = ("model.arch=gpt",)
LLAMA = ("model.arch=llama", "model.n_kv_heads=2")
M8 = ("train.micro_batch_size=1",)  # m = 8: past zb-v's warmup at pp 2 (2pp - 1)
ZB_H1 = ("parallel.schedule=zb-h1",)
ZB_V = ("parallel.schedule=zb-v", "parallel.vpp=2")
SMALL_BUCKETS = ("parallel.bucket_mb=0.02",)


@pytest.mark.parametrize(
    "world,model,layout",
    [
        (
            4,
            LLAMA,
            (*ZB_H1, "parallel.pp=2", "parallel.tp=2", "parallel.sp=true", "train.recompute=full"),
        ),
        (
            4,
            GPT,
            (
                *ZB_V,
                "parallel.pp=2",
                "parallel.tp=2",
                "parallel.sp=true",
                "train.recompute=selective",
            ),
        ),
        (
            4,
            GPT + M8,
            (
                *ZB_H1,
                "parallel.pp=2",
                "parallel.zero=2",
                *SMALL_BUCKETS,
                "train.recompute=segments",
            ),
        ),
        (4, LLAMA + M8, (*ZB_V, "parallel.pp=2", "parallel.zero=1", *SMALL_BUCKETS)),
        (
            4,
            GPT + M8,
            (*ZB_V, "parallel.pp=2", "parallel.zero=2", *SMALL_BUCKETS, "train.recompute=full"),
        ),
    ],
    ids=["h1-tp-sp-full", "v-tp-sp-selective", "h1-zero2-segments", "v-zero1", "v-zero2-full"],
)
def test_zero_bubble_matches_single_process(builtin_corpus, tmp_path, world, model, layout):
    assert_equivalent(world, model, layout, tmp_path)


@pytest.mark.parametrize(
    "layout",
    [(*ZB_H1, "parallel.pp=4"), (*ZB_V, "parallel.pp=4", "model.n_layers=8")],
    ids=["h1", "v"],
)
def test_zero_bubble_pp4_with_evaluation(builtin_corpus, tmp_path, layout):
    """Evaluation runs GPipe's forwards on the schedule's chunk layout (a V for zb-v)."""
    model = GPT + EVAL + M8 + tuple(o for o in layout if o.startswith("model."))
    assert_equivalent(4, model, tuple(o for o in layout if not o.startswith("model.")), tmp_path)
    assert_same_val_losses(model, tmp_path)
