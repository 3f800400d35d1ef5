"""A blend of two corpora is drawn identically in every layout and after a resume: train 5 steps
with dp = 2 (ZeRO-1), stop, resume steps 6-10 with tp = 2, and the losses are the single
process's on the same blend."""

import json

import pytest
from equivalence import SAVE_AT_5, TINY, assert_same_losses, reference, rewind_to_step_5, run_layout

from megalite.data import Tokenizer, builtin_corpus_text, prepare_corpus


@pytest.fixture(scope="module")
def blend(builtin_corpus, tmp_path_factory) -> tuple[str, ...]:
    """The builtin corpus at 0.7 and a second corpus (the last books, as JSONL) at 0.3."""
    prefix, tokenizer = builtin_corpus
    root = tmp_path_factory.mktemp("blend")
    books = builtin_corpus_text()[-400_000:].split("\n\n\n")
    (root / "late.jsonl").write_text("".join(json.dumps({"text": b}) + "\n" for b in books))
    prepare_corpus([root / "late.jsonl"], Tokenizer(tokenizer), root / "late", progress=False)
    return ("model.arch=gpt", f"data.source=0.7 {prefix} 0.3 {root / 'late'}")


def test_blend_is_the_same_in_every_layout_and_after_resume(blend, tmp_path):
    run_layout(2, TINY + blend + SAVE_AT_5 + ("parallel.zero=1",), tmp_path)
    first_half = [json.loads(row) for row in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rewind_to_step_5(tmp_path)
    resumed, _ = run_layout(2, TINY + blend + SAVE_AT_5 + ("parallel.tp=2",), tmp_path)
    ref_losses, _ = reference(TINY + blend)
    before = [(row["loss"], row["grad_norm"]) for row in first_half[:5]]
    assert_same_losses(before + resumed, ref_losses)
    without_blend, _ = reference(TINY + ("model.arch=gpt",))
    assert [loss for loss, _ in ref_losses] != [loss for loss, _ in without_blend]
