"""`resolve_checkpoint`: `generate` and `export-hf` take a run directory, its `checkpoints/`
directory, the `latest` pointer or a step directory, and find the newest complete checkpoint;
anything else is one `error:` line that says what was expected."""

import json

import pytest

from megalite.checkpoint.sharded import (
    FORMAT,
    MANIFEST_CHECKSUM,
    Checkpoint,
    CheckpointError,
    manifest_checksum,
    resolve_checkpoint,
)
from megalite.cli import main


def write_manifest(step_dir, manifest):
    """Write `manifest` with its checksum, as the writer does."""
    manifest = {**manifest, MANIFEST_CHECKSUM: manifest_checksum(manifest)}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def make_checkpoints(run, steps, latest=None, incomplete=()):
    """Step directories as a run leaves them: complete ones hold a manifest.json."""
    root = run / "checkpoints"
    for step in steps:
        (root / f"step_{step:06d}").mkdir(parents=True)
        if step not in incomplete:
            manifest = {"format": FORMAT, "step": step, "files": {}, "tensors": {}, "trainer": {}}
            write_manifest(root / f"step_{step:06d}", manifest)
    if latest is not None:
        (root / "latest").write_text(f"step_{latest:06d}")
    return root


def test_every_way_of_naming_a_run_finds_its_latest_checkpoint(tmp_path):
    root = make_checkpoints(tmp_path / "run", [5, 10], latest=10)
    newest = root / "step_000010"
    for given in (tmp_path / "run", root, root / "latest", newest):
        assert resolve_checkpoint(given) == newest, given
    assert resolve_checkpoint(root / "step_000005") == root / "step_000005"  # asked for by name
    assert Checkpoint(newest, verify_files=False).step == 10


def test_without_a_usable_latest_the_highest_complete_step_is_taken(tmp_path):
    # `latest` names a checkpoint that lost its manifest; step 1000000 sorts after 999999 by
    # number, not by name; a directory still being written (.tmp) is not a checkpoint.
    root = make_checkpoints(
        tmp_path, [999999, 1000000, 1000001], latest=1000001, incomplete=[1000001]
    )
    (root / "step_1000002.tmp").mkdir()
    assert resolve_checkpoint(tmp_path) == root / "step_1000000"
    (root / "latest").unlink()
    assert resolve_checkpoint(root) == root / "step_1000000"


def test_no_checkpoint_is_one_error_that_says_what_was_expected(tmp_path, capsys):
    expected = (
        "expected a run directory (train.out_dir), its checkpoints/ directory, the "
        "checkpoints/latest file, or a step_* directory with a manifest.json"
    )
    make_checkpoints(tmp_path / "crashed", [5], latest=5, incomplete=[5])
    for path, found in [
        (tmp_path / "missing", "no such file or directory"),
        (tmp_path / "crashed", "no complete megalite checkpoint"),
        (tmp_path / "crashed" / "checkpoints" / "latest", "no complete megalite checkpoint"),
    ]:
        with pytest.raises(CheckpointError) as error:
            resolve_checkpoint(path)
        assert str(error.value) == f"{path}: {found}; {expected}"
    # The step directory without its manifest is said to be skipped, never passed over silently.
    damaged = tmp_path / "crashed" / "checkpoints" / "step_000005"
    note = f"note: skipped {damaged}: no manifest.json (not a complete checkpoint)"
    assert capsys.readouterr().err.splitlines() == [note, note]

    missing = str(tmp_path / "missing")
    assert main(["generate", "--checkpoint", missing]) == 2
    assert main(["export-hf", "--checkpoint", missing, "--out", str(tmp_path / "hf")]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [f"error: {missing}: no such file or directory; {expected}"] * 2
    assert not (tmp_path / "hf").exists()


def test_a_manifest_without_a_step_is_refused(tmp_path):
    step = make_checkpoints(tmp_path, [3]) / "step_000003"
    manifest = json.loads((step / "manifest.json").read_text())
    write_manifest(step, {**manifest, "step": None})  # checksummed, as by a faulty writer
    with pytest.raises(CheckpointError, match=r"corrupt manifest.json \(no step\)"):
        _ = Checkpoint(step, verify_files=False).step
    (step / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt manifest.json"):
        Checkpoint(step, verify_files=False)
