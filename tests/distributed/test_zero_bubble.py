"""Zero-bubble pipelines equal the single-process run (fp32, 1e-5 per step), with p2p that
blocks as NCCL's does: zb-h1 and zb-v at pp 2 and 4, each beside tp 2 + SP, ZeRO-1 and ZeRO-2
(small buckets: several per chunk, each reduced once its W steps are done) and recompute, GPT
(whose tied embedding and head are both on zb-v's first rank) and Llama, evaluation included.
Every layout runs on 4 ranks."""

import pytest
import torch
from equivalence import EVAL, TINY, assert_equivalent, assert_same_val_losses, relative_error

from megalite.config import load_config
from megalite.launch import run_ranks
from megalite.parallel_state import build_parallel_state
from megalite.training.setup import build_run
from megalite.training.step import train_step

GPT = ("model.arch=gpt",)
LLAMA = ("model.arch=llama", "model.n_kv_heads=2")
M8 = ("train.micro_batch_size=1",)  # m = 8 per pipeline: past zb-v's warmup (2 pp - 1)
ZB_H1 = ("parallel.schedule=zb-h1",)
ZB_V = ("parallel.schedule=zb-v", "parallel.vpp=2")
PP2, PP4 = ("parallel.pp=2",), ("parallel.pp=4",)
TP_SP = ("parallel.tp=2", "parallel.sp=true")
SMALL_BUCKETS = ("parallel.bucket_mb=0.02",)

LAYOUTS = {  # name: (model, layout)
    "h1-tp-sp-full": (LLAMA, ZB_H1 + PP2 + TP_SP + ("train.recompute=full",)),
    "v-tp-sp-selective": (GPT, ZB_V + PP2 + TP_SP + ("train.recompute=selective",)),
    "h1-zero2-segments": (
        GPT + M8,
        ZB_H1 + PP2 + SMALL_BUCKETS + ("parallel.zero=2", "train.recompute=segments"),
    ),
    "v-zero1": (LLAMA + M8, ZB_V + PP2 + SMALL_BUCKETS + ("parallel.zero=1",)),
    "v-zero2-full": (
        GPT + M8,
        ZB_V + PP2 + SMALL_BUCKETS + ("parallel.zero=2", "train.recompute=full"),
    ),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_zero_bubble_matches_single_process(builtin_corpus, tmp_path, name):
    model, layout = LAYOUTS[name]
    assert_equivalent(4, model, layout, tmp_path)


@pytest.mark.parametrize(
    "model,layout",
    [(GPT, ZB_H1 + PP4), (GPT + ("model.n_layers=8",), ZB_V + PP4)],
    ids=["h1", "v"],
)
def test_zero_bubble_pp4_with_evaluation(builtin_corpus, tmp_path, model, layout):
    """Evaluation runs GPipe's forwards on the schedule's chunk layout (a V for zb-v)."""
    model = model + EVAL + M8
    assert_equivalent(4, model, layout, tmp_path)
    assert_same_val_losses(model, tmp_path)


def _grad_norms(schedule: str, precision: str) -> tuple[float, torch.Tensor]:
    """One step of GPT at pp 2, 8 micro-batches: the gradient norm and this rank's fp32 main
    grads (as the optimizer left them: clipped alike in both schedules)."""
    overrides = [*TINY, *GPT, *M8, *PP2, f"parallel.schedule={schedule}"]
    cfg = load_config(None, [*overrides, f"train.precision={precision}"])
    ps = build_parallel_state(1, 2, torch.device("cpu"))
    run = build_run(cfg, ps)
    torch.manual_seed(0)
    norm = train_step(run, torch.randint(0, 500, (8, 33)), 0.0).grad_norm
    return norm, torch.cat([buffer.grads_flat for buffer in run.buffers])


def test_split_backward_sums_16_bit_gradients_in_fp32():
    """bf16: a B that runs before the W of an earlier micro-batch must not add its norm and
    embedding gradients into that micro-batch's 16-bit `.grad` (a sum in bf16, or an fp16
    overflow the plain schedules never see): every micro-batch's gradient reaches the fp32
    main grad on its own, as under 1F1B, so both schedules sum the same values in fp32."""
    plain = run_ranks(2, _grad_norms, "1f1b", "bf16")
    split = run_ranks(2, _grad_norms, "zb-h1", "bf16")
    assert split[0][0] == pytest.approx(plain[0][0], rel=1e-6)
    for (_, plain_grads), (_, split_grads) in zip(plain, split):
        assert relative_error(split_grads, plain_grads) < 1e-6
