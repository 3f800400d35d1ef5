"""Issue 23's bad-step streak at the shipped gpt-tiny widths (two layers, one micro-batch of 2 a
step), through the `megalite` command line (in-process): a run resumed with lr 1e6 diverges
(finite losses near 6e12) and stops; no checkpoint is saved during its streak, so the last
good one survives `checkpoint.keep=2` and the stop names it; the stopping step has its metrics
row; the next run, with a lower max_bad_steps, continues from that good checkpoint, trains to
the end, and leaves a good checkpoint that resumes and trains again."""

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
    "train.global_batch_size=2",
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
    # The default spike guard calls step 9's finite 6e12 loss bad: the streak is 9..20.
    assert re.search(r"12 bad steps in a row, the last at step 20 \(loss", err), err
    assert f"Last good checkpoint: {step_7} (checkpoint.resume={step_7} continues" in err
    assert out.count("no checkpoint during a bad-step streak") == 1, out  # said once
    assert "step 10: no checkpoint during a bad-step streak (2 in a row)" in out
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_000005", "step_000007"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 20 and rows[-1]["bad_steps"] == 12  # the stopping step's row

    code, out, err = megalite_train(capsys, tmp_path, "train.steps=12", "fault.max_bad_steps=3")
    assert code == 0, err
    assert f"resumed from {step_7} at step 7" in out
    newest = newest_good_checkpoint(checkpoints)
    assert newest == checkpoints / "step_000012" and Checkpoint(newest).good

    code, out, err = megalite_train(capsys, tmp_path, "train.steps=14")
    assert code == 0, err
    assert f"resumed from {newest} at step 12" in out and "trained to step 14" in out


def test_a_streak_right_after_a_good_save_demotes_it_and_keeps_the_one_before(
    builtin_corpus_8000, tmp_path, capsys
):
    """Faults in combination: lr 1e6 diverges step 8's update, and step 8 is saved (as good:
    its loss was) with those weights, every step, under keep=2. The streak that follows spans
    saves and pruning: step 7, the good save before the newest, survives them. The run reaches
    its last step in the streak; the next run continues from step 8's weights and stops, which
    demotes step 8 and names step 7; the run after that continues from step 7."""
    checkpoints = tmp_path / "checkpoints"
    assert megalite_train(capsys, tmp_path, "train.steps=7")[0] == 0

    every_step = ("checkpoint.interval=1", "fault.max_bad_steps=3")
    code, out, err = megalite_train(capsys, tmp_path, "train.steps=10", "optim.lr=1e6", *every_step)
    assert code == 0, err  # steps 9 and 10 bad: fewer than 3, the run reaches its end
    assert out.rstrip().endswith(
        f"checkpoint {checkpoints / 'step_000010'} (saved in a bad-step streak, so marked bad; "
        f"the newest good one: {checkpoints / 'step_000008'})"
    ), out
    names = ["step_000007", "step_000008", "step_000010"]
    assert sorted(p.name for p in checkpoints.glob("step_*")) == names
    assert [Checkpoint(checkpoints / name).good for name in names] == [True, True, False]
    assert (checkpoints / "latest").read_text() == "step_000008"

    code, out, err = megalite_train(capsys, tmp_path, "train.steps=30", *every_step)
    assert code == 2
    assert f"resumed from {checkpoints / 'step_000008'} at step 8" in out
    step_7 = checkpoints / "step_000007"
    assert re.search(r"3 bad steps in a row, the last at step 11 \(loss spike", err), err
    assert f"Last good checkpoint: {step_7} (checkpoint.resume={step_7} continues" in err
    assert not Checkpoint(checkpoints / "step_000008").good
    assert newest_good_checkpoint(checkpoints) == step_7

    code, out, err = megalite_train(capsys, tmp_path, "train.steps=12", *every_step)
    assert code == 0, err
    assert f"resumed from {step_7} at step 7" in out and "trained to step 12" in out


def test_a_rewound_run_keeps_and_continues_from_the_checkpoint_it_rewound_to(
    builtin_corpus_8000, tmp_path, capsys
):
    """A run resumed by name from step 4 (the way back past a newer checkpoint) points `latest`
    at it: its own streak's bad last save and the pruning after it keep step 4, and the next
    run continues from step 4, not from the newer step 6 of the run it rewound."""
    checkpoints = tmp_path / "checkpoints"
    every_other = ("checkpoint.interval=2",)
    assert megalite_train(capsys, tmp_path, "train.steps=6", *every_other)[0] == 0
    step_4 = checkpoints / "step_000004"
    code, out, err = megalite_train(
        capsys,
        tmp_path,
        "train.steps=9",
        "optim.lr=1e6",
        f"checkpoint.resume={step_4}",
        *every_other,
    )
    assert code == 0, err  # a streak from step 6 on, the last step saved bad
    assert not Checkpoint(checkpoints / "step_000009").good
    assert (checkpoints / "latest").read_text() == "step_000004"
    assert step_4.is_dir()
    code, out, err = megalite_train(capsys, tmp_path, "train.steps=10", *every_other)
    assert code == 0, err
    assert f"resumed from {step_4} at step 4" in out
