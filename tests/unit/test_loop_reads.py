"""The training loop reads the device only where a hook acts (issue 47): every log interval, at
an evaluation, a checkpoint and the last step. Between reads it reads the data and launches
steps with no host sync at all, and at a read the deferred steps reach the hooks with their own
metrics: the rows it logs, and the bad-step stop, are those of a run that reads every step."""

import json
from pathlib import Path

import pytest
from run_configs import ONE_LAYER

import megalite.training.loop as loop
from megalite.config import load_config
from megalite.profiling.launch_count import counting
from megalite.training.hooks import TrainingError

RUN = [*ONE_LAYER, "train.steps=8", "checkpoint.interval=0", "train.device=cpu"]


def _rows(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def _train_watched(monkeypatch, out_dir: Path, *overrides: str) -> tuple[list, list]:
    """Train; returns the steps each read covered and the host syncs of every loop iteration
    between reads but the first (its data and its launch)."""
    reads, syncs = [], []
    real_read, real_launch, real_batch = loop.read_steps, loop.launch_step, loop.rank_batch
    launches = []

    def read_steps(steps):
        reads.append((len(launches), len(steps)))  # (at step, steps read)
        return real_read(steps)

    def rank_batch(data, pairs, run):
        if not launches:
            return real_batch(data, pairs, run)
        with counting(run.ps.device) as tally:
            batch = real_batch(data, pairs, run)
        syncs.append(dict(tally.counts.sync_sites))
        return batch

    def launch_step(run, batch, lr):
        launches.append(1)
        if len(launches) == 1:
            return real_launch(run, batch, lr)
        with counting(run.ps.device) as tally:
            launched = real_launch(run, batch, lr)
        syncs.append(dict(tally.counts.sync_sites))
        return launched

    monkeypatch.setattr(loop, "read_steps", read_steps)
    monkeypatch.setattr(loop, "launch_step", launch_step)
    monkeypatch.setattr(loop, "rank_batch", rank_batch)
    loop.train(load_config(None, [*RUN, *overrides, f"train.out_dir={out_dir}"]))
    return reads, syncs


def test_steps_between_log_intervals_are_launched_without_a_sync(
    builtin_corpus, tmp_path, monkeypatch
):
    reads, syncs = _train_watched(monkeypatch, tmp_path / "every-3", "train.log_interval=3")
    assert reads == [(3, 3), (6, 3), (8, 2)]
    assert syncs and all(not sites for sites in syncs), syncs
    every_step = tmp_path / "every-1"
    reads, _ = _train_watched(monkeypatch, every_step, "train.log_interval=1")
    assert reads == [(step, 1) for step in range(1, 9)]
    by_step = {row["step"]: row for row in _rows(every_step)}
    for row in _rows(tmp_path / "every-3"):  # the deferred steps' own values
        assert [row["step"], row["loss"], row["grad_norm"]] == [
            row["step"],
            by_step[row["step"]]["loss"],
            by_step[row["step"]]["grad_norm"],
        ]
    assert [row["step"] for row in _rows(tmp_path / "every-3")] == [3, 6, 8]


def test_an_evaluation_step_is_read_before_the_next_launch(builtin_corpus, tmp_path, monkeypatch):
    reads, _ = _train_watched(
        monkeypatch, tmp_path, "train.log_interval=5", "train.eval_interval=2", "train.eval_steps=1"
    )
    assert reads == [(2, 2), (4, 2), (5, 1), (6, 1), (8, 2)]


def test_a_bad_step_streak_stops_at_the_read_naming_the_step_it_reached_the_limit(
    builtin_corpus, tmp_path, monkeypatch
):
    """The first update (lr 1e30) leaves weights whose loss is NaN: max_bad_steps 2 is reached at
    step 3, read at step 5 with the steps after it; the stop names step 3 and logs its row."""
    with pytest.raises(TrainingError, match=r"2 bad steps in a row, the last at step 3 "):
        _train_watched(
            monkeypatch,
            tmp_path,
            "train.log_interval=5",
            "fault.max_bad_steps=2",
            "optim.lr=1e30",
            "optim.warmup_steps=0",
        )
    assert [row["step"] for row in _rows(tmp_path)] == [3]
