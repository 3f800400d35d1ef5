"""Context parallelism computes what the single process computes: each sequence cut into 2*cp
chunks over cp ranks (ring attention or all-gathered K/V), alone and with tensor + sequence
parallelism, every pipeline schedule (the zero-bubble ones' deferred weight GEMMs included),
ZeRO 1 and 2 over dp x cp, recompute and document masking; at long sequences; and checkpoints
that resume at another cp."""

import json

import pytest
from equivalence import (
    TINY,
    assert_equivalent,
    assert_same_losses,
    reference,
    rewind_to_step_5,
    run_in_scratch,
    run_layout,
)

LLAMA = ("model.arch=llama", "model.n_kv_heads=2")


@pytest.mark.parametrize(
    "world,model,layout",
    [
        (2, (), ("parallel.cp=2",)),
        (4, LLAMA, ("parallel.cp=4", "parallel.cp_comm=allgather")),
        (4, LLAMA, ("parallel.cp=2", "parallel.tp=2", "parallel.sp=true")),
        (4, (), ("parallel.cp=2", "parallel.pp=2")),
        (
            4,
            (),
            ("parallel.cp=2", "parallel.pp=2", "parallel.schedule=gpipe", "train.recompute=full"),
        ),
        (
            4,
            LLAMA,
            ("parallel.cp=2", "parallel.pp=2", "parallel.schedule=interleaved", "parallel.vpp=2")
            + ("train.recompute=segments",),
        ),
        (4, (), ("parallel.cp=2", "parallel.pp=2", "parallel.schedule=zb-h1")),
        (
            4,
            LLAMA,
            ("parallel.cp=2", "parallel.pp=2", "parallel.schedule=zb-v", "parallel.vpp=2"),
        ),
        (4, ("data.document_mask=true",), ("parallel.cp=2", "parallel.zero=1")),
        (4, LLAMA, ("parallel.cp=2", "parallel.zero=2")),
    ],
    ids=[
        "gpt-cp2",
        "llama-gqa-cp4-allgather",
        "llama-cp2-tp2-sp",
        "gpt-cp2-pp2-1f1b",
        "gpt-cp2-pp2-gpipe-full-recompute",
        "llama-cp2-pp2-interleaved-segments",
        "gpt-cp2-pp2-zb-h1",
        "llama-cp2-pp2-zb-v",
        "gpt-docmask-cp2-dp2-zero1",
        "llama-cp2-dp2-zero2",
    ],
)
def test_context_parallel_layout_equals_single_process(
    builtin_corpus, tmp_path, world, model, layout
):
    assert_equivalent(world, model, layout, tmp_path)


LONG = (
    "model.n_layers=2",
    "model.hidden=32",
    "model.n_heads=2",
    "model.vocab_size=500",
    "train.steps=3",
    "train.micro_batch_size=1",
    "train.global_batch_size=2",
    "train.eval_interval=1000",
    "optim.lr=3e-3",
    "optim.warmup_steps=1",
    "logging.progress=false",
)


@pytest.mark.parametrize("seq,cp", [(2048, 2), (2048, 4), (4096, 2), (4096, 4)])
def test_long_sequences(builtin_corpus, tmp_path, seq, cp):
    """Chunks of 512 tokens: the kernel's blocks, the ring's steps and the merge at a length
    where attention dominates."""
    config = (*LONG, f"model.seq_len={seq}")
    ref_losses, _ = run_in_scratch(config)
    losses, _ = run_layout(cp, (*config, f"parallel.cp={cp}"), tmp_path)
    assert_same_losses(losses, ref_losses)


SAVE_AT_5 = ("checkpoint.interval=5", "checkpoint.keep=5", "parallel.zero=1")


@pytest.mark.parametrize("world,cp", [(1, 1), (4, 4)], ids=["to-cp1", "to-cp4"])
def test_resume_at_another_cp(builtin_corpus, tmp_path, world, cp):
    """Saved at cp 2 with the optimizer sharded over the two cp ranks, resumed at cp 1 and 4:
    steps 6-10 are the uninterrupted single process's."""
    run_layout(2, TINY + LLAMA + SAVE_AT_5 + ("parallel.cp=2",), tmp_path)
    rewind_to_step_5(tmp_path)
    resumed, _ = run_layout(world, TINY + LLAMA + SAVE_AT_5 + (f"parallel.cp={cp}",), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(6, 11))
    ref_losses, _ = reference(TINY + LLAMA)
    assert_same_losses(resumed, ref_losses[5:])
