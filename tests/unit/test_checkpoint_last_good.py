"""The last good state on disk: what pruning keeps, what a fatal streak demotes, and the
pointers and hints that lead a user back to it when files are damaged."""

import json
from pathlib import Path

import pytest
from run_configs import ONE_LAYER

import megalite.checkpoint.writer as writer
from megalite.checkpoint.reader import corrupt
from megalite.checkpoint.sharded import (
    MANIFEST,
    MANIFEST_CHECKSUM,
    is_good,
    manifest_checksum,
    newest_good_checkpoint,
)
from megalite.config import load_config
from megalite.parallel_state import ParallelState
from megalite.pipeline.executor import StepTimes
from megalite.training.hooks import StepRecord
from megalite.training.loop import train
from megalite.training.preemption import Preempted, Preemption, StopSignals
from megalite.training.step import StepMetrics


def _checkpoints(root: Path, goodness: dict[int, bool], latest: int | None = None) -> None:
    """Step directories with a manifest saying whether each is good, and `latest`."""
    for step, good in goodness.items():
        path = root / f"step_{step:06d}"
        path.mkdir(parents=True)
        manifest = {"step": step, "good": good}
        manifest[MANIFEST_CHECKSUM] = manifest_checksum(manifest)
        (path / MANIFEST).write_text(json.dumps(manifest))
    if latest is not None:
        (root / "latest").write_text(f"step_{latest:06d}")


def _names(paths) -> list[str]:
    return [p.name for p in paths]


def test_pruning_keeps_the_newest_good_and_the_good_one_before_it(tmp_path):
    _checkpoints(tmp_path, {2: True, 4: True, 6: False, 8: True, 10: False}, latest=8)
    assert _names(writer.last_good_states(tmp_path)) == ["step_000004", "step_000008"]
    _checkpoints(tmp_path / "one", {3: False, 5: True})
    assert _names(writer.last_good_states(tmp_path / "one")) == ["step_000005"]
    _checkpoints(tmp_path / "none", {3: False})
    assert writer.last_good_states(tmp_path / "none") == []


def test_a_fatal_streak_demotes_the_saves_of_its_weights_and_points_latest_before_them(tmp_path):
    _checkpoints(tmp_path, {2: True, 4: True, 6: True, 7: False}, latest=6)
    last_good = writer.demote_from(tmp_path, 6, ParallelState.single())
    assert last_good == tmp_path / "step_000004"
    assert [is_good(tmp_path / f"step_{s:06d}") for s in (2, 4, 6, 7)] == [1, 1, 0, 0]
    manifest = json.loads((tmp_path / "step_000006" / MANIFEST).read_text())
    assert manifest[MANIFEST_CHECKSUM] == manifest_checksum(manifest)  # still intact
    assert (tmp_path / "latest").read_text() == "step_000004"
    assert newest_good_checkpoint(tmp_path) == last_good
    assert writer.demote_from(tmp_path, 1, ParallelState.single()) is None  # none left


def test_a_rewind_by_name_marks_the_rewound_runs_newer_checkpoints_bad(tmp_path, capsys):
    """Resumed by name from step 4 past a corrupt (or diverged) step 6 that a streak kept this
    run from overwriting, its save at step 8 under keep=1 keeps step 4, not step 6, as the
    good state before the newest, and a fatal streak from step 8 names step 4."""
    _checkpoints(tmp_path, {2: True, 4: True, 6: True}, latest=6)
    writer.adopt_as_latest(tmp_path, tmp_path / "step_000004", ParallelState.single())
    assert [is_good(tmp_path / f"step_{s:06d}") for s in (2, 4, 6)] == [1, 1, 0]
    assert "marked" in capsys.readouterr().out
    assert (tmp_path / "latest").read_text() == "step_000004"
    _checkpoints(tmp_path, {8: True}, latest=8)
    assert _names(writer.last_good_states(tmp_path)) == ["step_000004", "step_000008"]
    assert writer.demote_from(tmp_path, 8, ParallelState.single()) == tmp_path / "step_000004"


def test_a_latest_pointer_that_is_not_text_is_passed_over(tmp_path):
    _checkpoints(tmp_path, {2: True, 4: True, 6: False})
    (tmp_path / "latest").write_bytes(b"\xff\xfe\x00step")
    assert newest_good_checkpoint(tmp_path) == tmp_path / "step_000004"


def test_a_corrupt_checkpoint_points_at_the_earlier_ones_only(tmp_path):
    _checkpoints(tmp_path, {2: True, 4: True, 6: True, 9: False})
    message = str(corrupt(tmp_path / "step_000006", "a file is truncated"))
    assert message.endswith("(earlier checkpoints: step_000002, step_000004)")
    assert "earlier checkpoints" not in str(corrupt(tmp_path / "step_000002", "truncated"))


def test_a_failed_prune_leaves_the_new_checkpoint_published(builtin_corpus, tmp_path, capsys):
    def busy(path: Path) -> None:
        raise OSError(16, "Device or resource busy", str(path))

    real = writer._discard
    writer._discard = busy
    try:
        overrides = ["train.steps=4", "checkpoint.interval=1", "checkpoint.keep=1"]
        train(load_config(None, [*ONE_LAYER, *overrides, f"train.out_dir={tmp_path}"]))
    finally:
        writer._discard = real
    root = tmp_path / "checkpoints"
    assert "checkpoint step_000004 is saved, but pruning failed: OSError" in capsys.readouterr().out
    assert _names(sorted(root.glob("step_*"))) == [f"step_{s:06d}" for s in (1, 2, 3, 4)]
    assert (root / "latest").read_text() == "step_000004"


@pytest.mark.parametrize("earlier_good", [True, False])
def test_a_preemption_during_a_streak_says_where_the_same_command_continues(tmp_path, earlier_good):
    _checkpoints(tmp_path, {2: True, 4: False} if earlier_good else {4: False})
    bad = tmp_path / "step_000004"
    hook = Preemption(ParallelState.single(), lambda: bad, lambda: None, 10, StopSignals())
    hook.signals.received = "SIGTERM"
    try:
        with pytest.raises(Preempted) as stop:
            hook.after_step(_record(4))
    finally:
        hook.close()
    said = str(stop.value)
    assert f"saved as {bad}, marked bad (a bad-step streak was running)" in said
    if earlier_good:
        assert said.endswith(
            f"continues from {tmp_path / 'step_000002'}, the newest good checkpoint"
        )
    else:
        assert (
            f"no good checkpoint to continue from: continue the streak with checkpoint.resume={bad}"
            in said
        )


def _record(step: int) -> StepRecord:
    metrics = StepMetrics(
        3e12, grad_norm=1.0, skipped=False, bubble_fraction=0.0, times=StepTimes()
    )
    metrics.bad = "loss spike"
    return StepRecord(step, metrics, 1e-3, 0.5, {"step": step})


def test_a_complete_checkpoint_that_missed_its_rename_is_published_at_the_next_start(
    tmp_path, capsys
):
    """A kill between the manifest (written once every rank's files are there) and the rename
    leaves a complete `.tmp`: the next start renames it into place. Without a manifest, or set
    aside while a newer save replaced it, it is removed."""
    _checkpoints(tmp_path, {2: True, 4: True, 6: True}, latest=2)
    (tmp_path / "step_000004").rename(tmp_path / "step_000004.tmp")
    (tmp_path / "step_000006").rename(tmp_path / "step_000006.discarded.tmp")
    (tmp_path / "step_000008.tmp").mkdir()  # a save killed before its manifest
    removed = writer.remove_unfinished(tmp_path, ParallelState.single())
    assert _names(removed) == ["step_000006.discarded.tmp", "step_000008.tmp"]
    assert f"published {tmp_path / 'step_000004'}: complete" in capsys.readouterr().out
    assert _names(sorted(tmp_path.glob("step_*"))) == ["step_000002", "step_000004"]
    assert newest_good_checkpoint(tmp_path) == tmp_path / "step_000004"  # latest names it
