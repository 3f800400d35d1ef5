"""Checkpoints load into any layout: train 5 steps with tp=2 x pp=2 (GPT, tied embeddings split
across stages), stop, resume steps 6-10 with dp=2 and ZeRO-1 (and the other way round), and the
losses are the single-process run's. Model weights and Adam state are stored per global name,
so they are cut and glued for the new layout."""

import json
import shutil

import pytest
from equivalence import SAVE_AT_5, TINY, assert_same_losses, reference, rewind_to_step_5, run_layout

GPT = ("model.arch=gpt",)


@pytest.mark.parametrize(
    "first,second",
    [
        ((4, ("parallel.tp=2", "parallel.pp=2")), (2, ("parallel.zero=1",))),
        ((2, ("parallel.zero=1",)), (4, ("parallel.tp=2", "parallel.sp=true", "parallel.pp=2"))),
    ],
    ids=["tp2pp2-to-dp2zero1", "dp2zero1-to-tp2sp-pp2"],
)
def test_resume_in_another_layout(builtin_corpus, tmp_path, first, second):
    (world_a, layout_a), (world_b, layout_b) = first, second
    run_layout(world_a, TINY + GPT + SAVE_AT_5 + layout_a, tmp_path)
    rewind_to_step_5(tmp_path)
    resumed, _ = run_layout(world_b, TINY + GPT + SAVE_AT_5 + layout_b, tmp_path)
    ref_losses, _ = reference(TINY + GPT)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(6, 11))
    for (loss, _), (ref_loss, _) in zip(resumed, ref_losses[5:]):
        assert abs(loss - ref_loss) <= 1e-5 * ref_loss


def test_resume_in_another_precision_gives_every_replica_the_saved_masters(
    builtin_corpus, tmp_path
):
    """Saved by a bf16 run (weights rounded to bf16, fp32 masters beside them) and resumed in
    fp32 with ZeRO-1 over two replicas: each replica owns half the masters, and the other half
    must come from its peer, not stay bf16-rounded, or the replicas run different models. The
    resumed steps are the single process's resumed from the same checkpoint."""
    zero1 = ("parallel.zero=1",)
    run_layout(2, TINY + GPT + SAVE_AT_5 + zero1 + ("train.precision=bf16",), tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    for out in (tmp_path / "a", tmp_path / "b"):
        shutil.rmtree(out / "checkpoints" / "step_000010")
        (out / "checkpoints" / "latest").write_text("step_000005")
        (out / "metrics.jsonl").write_text("")
    fp32 = TINY + GPT + SAVE_AT_5 + ("train.precision=fp32",)
    replicas, _ = run_layout(2, fp32 + zero1, tmp_path / "a")
    single, _ = run_layout(1, fp32, tmp_path / "b")
    assert_same_losses(replicas, single)
