"""Issue 23's bad-step streak at the shipped gpt-tiny config, through the `megalite` command line
(in-process): a run resumed with lr 1e6 diverges (a finite 5.8e12 loss, then NaN) and stops;
no checkpoint is saved during its streak, so the last good one survives `checkpoint.keep=2` and
the stop names it; the stopping step has its metrics row; the next run, with a lower
max_bad_steps, continues from that good checkpoint, trains to the end, and leaves a good
checkpoint that resumes and trains again."""

import json
import re
from pathlib import Path

from megalite.checkpoint.sharded import Checkpoint, newest_good_checkpoint
from megalite.cli import main

TINY_GPT = [
    "--config",
    "configs/gpt-tiny.yaml",
    "model.n_layers=2",
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
    "train.log_interval=1",
    "train.eval_interval=100000",
    "train.precision=fp32",
    "logging.wandb=false",
    "logging.progress=false",
    "checkpoint.interval=5",
]


def megalite_train(capsys, out_dir: Path, *overrides: str) -> tuple[int, str, str]:
    """`megalite train` with the scenario's settings: (exit code, stdout, stderr)."""
    code = main(["train", *TINY_GPT, *overrides, f"train.out_dir={out_dir}"])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_diverged_streak_keeps_the_last_good_checkpoint(builtin_corpus_8000, tmp_path, capsys):
    checkpoints = tmp_path / "checkpoints"
    assert megalite_train(capsys, tmp_path, "train.steps=7")[0] == 0
    step_7 = checkpoints / "step_000007"

    code, out, err = megalite_train(
        capsys, tmp_path, "train.steps=30", "optim.lr=1e6", "fault.max_bad_steps=12"
    )
    assert code == 2
    # The default spike guard calls step 9's finite 5.8e12 loss bad: the streak is 9..20.
    assert re.search(r"12 bad steps in a row, the last at step 20 \(loss", err), err
    assert f"Last good checkpoint: {step_7} (checkpoint.resume={step_7} continues" in err
    assert out.count("no checkpoint during a bad-step streak") == 1, out  # said once
    assert "step 10: no checkpoint during a bad-step streak (2 in a row)" in out
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_000005", "step_000007"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 20 and rows[-1]["bad_steps"] == 12  # the stopping step's row

    code, out, err = megalite_train(capsys, tmp_path, "train.steps=30", "fault.max_bad_steps=3")
    assert code == 0, err
    assert f"resumed from {step_7} at step 7" in out
    newest = newest_good_checkpoint(checkpoints)
    assert newest == checkpoints / "step_000030" and Checkpoint(newest).good

    code, out, err = megalite_train(capsys, tmp_path, "train.steps=32")
    assert code == 0, err
    assert f"resumed from {newest} at step 30" in out and "trained to step 32" in out
