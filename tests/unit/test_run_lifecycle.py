"""What a run says about itself on the command line: one summary line at the end of every run,
a finished run that is started again says so and touches nothing, a resume that changes the
schedule or the batch says what changed (and a new batch size continues the data order), and
metrics.jsonl stays strict JSON."""

import json
import shutil
from pathlib import Path

import pytest
from run_configs import ONE_LAYER, snapshot

import megalite.training.loop as loop
import megalite.training.metrics as metrics
from megalite.cli import main
from megalite.config import load_config

TINY = [*ONE_LAYER, "train.steps=3", "train.eval_steps=1", "optim.warmup_steps=2"]


def train(capsys, out_dir: Path, *extra: str) -> tuple[int, list[str], str]:
    """`megalite train` in this process: exit code, stdout lines, stderr."""
    code = main(["train", *TINY, f"train.out_dir={out_dir}", *extra])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def test_a_run_ends_with_one_summary_line_and_a_second_start_does_nothing(
    builtin_corpus, tmp_path, capsys
):
    code, lines, _ = train(capsys, tmp_path)
    assert code == 0 and len(lines) == 1, lines
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert lines[0].startswith(
        f"trained to step 3 (3 steps in this run): loss {last['loss']:.4f}, "
    )
    assert "val_loss" not in lines[0]
    assert lines[0].endswith(f"tokens/s; checkpoint {tmp_path / 'checkpoints' / 'step_000003'}")

    before = snapshot(tmp_path)
    code, lines, _ = train(capsys, tmp_path)
    assert code == 0
    assert lines == [
        f"already trained to step 3 (out_dir {tmp_path}); raise train.steps to continue"
    ]
    assert snapshot(tmp_path) == before


def test_a_resume_that_changes_the_schedule_says_what_changed(builtin_corpus, tmp_path, capsys):
    assert train(capsys, tmp_path)[0] == 0
    code, lines, _ = train(
        capsys,
        tmp_path,
        "train.steps=4",
        "optim.lr=5e-4",
        "optim.decay_steps=10",
        "train.eval_interval=4",
    )
    assert code == 0
    assert lines[:2] == [
        f"resumed from {tmp_path / 'checkpoints' / 'step_000003'} at step 3",
        "changed since the checkpoint: train.steps 3 -> 4, optim.lr 0.001 -> 0.0005, "
        "optim.decay_steps null -> 10",
    ]
    assert lines[-1].startswith("trained to step 4 (1 step in this run): loss ")
    assert ", val_loss " in lines[-1] and sum(line.startswith("trained") for line in lines) == 1

    # A new batch size continues the data order at the first window not yet consumed.
    code, lines, _ = train(
        capsys,
        tmp_path,
        *("train.steps=5", "train.global_batch_size=4", "optim.lr=5e-4", "optim.decay_steps=10"),
    )
    assert code == 0 and lines[1] == (
        "changed since the checkpoint: train.steps 4 -> 5, train.global_batch_size 2 -> 4"
    )
    assert lines[-1].startswith("trained to step 5 (1 step in this run): loss ")


def test_a_larger_batch_after_a_resume_takes_the_windows_the_smaller_ones_would_have(
    builtin_corpus, tmp_path, capsys
):
    """From one checkpoint, with the weights held still (lr 1e-30): one step of 4 windows has the
    mean loss of two steps of 2, so it trained on the same windows, in the stream's order."""
    assert train(capsys, tmp_path / "a")[0] == 0
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    still = ("optim.lr=1e-30", "optim.min_lr=0")
    assert train(capsys, tmp_path / "a", "train.steps=5", *still)[0] == 0
    assert (
        train(capsys, tmp_path / "b", "train.steps=4", "train.global_batch_size=4", *still)[0] == 0
    )
    small = [row["loss"] for row in _rows(tmp_path / "a")[3:]]
    (large,) = [row["loss"] for row in _rows(tmp_path / "b")[3:]]
    assert large == pytest.approx(sum(small) / 2, rel=1e-6)


def _rows(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_metrics_are_strict_json_when_mfu_is_unknown(builtin_corpus, tmp_path, monkeypatch):
    """A GPU without a datasheet peak has no MFU: the row says null, never NaN."""
    monkeypatch.setattr(metrics, "peak_flops", lambda device, precision: None)
    loop.train(load_config(None, [*TINY, "train.steps=2", f"train.out_dir={tmp_path}"]))

    def refuse(constant):
        raise AssertionError(f"{constant} in metrics.jsonl")

    rows = [
        json.loads(line, parse_constant=refuse)
        for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    assert [row["mfu"] for row in rows] == [None, None]
    assert all(row["tflops"] > 0 for row in rows)


@pytest.mark.parametrize(
    "saved, expected",
    [
        ({"train": {"steps": 3}, "optim": {"lr": 0.001}}, []),
        (
            {"train": {"steps": 2, "micro_batch_size": 1}},
            ["train.steps 2 -> 3", "train.micro_batch_size 1 -> 2"],
        ),
        (
            {"optim": {"warmup_steps": 0, "min_lr": 0.0}},
            ["optim.min_lr 0.0 -> 0.0001", "optim.warmup_steps 0 -> 2"],
        ),
        ({}, []),  # a checkpoint without a stored config: nothing to compare
    ],
)
def test_config_changes(saved, expected):
    assert loop.config_changes(saved, load_config(None, TINY)) == expected
