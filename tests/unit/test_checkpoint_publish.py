"""What a checkpoint is published with and resumed from: every rank's index or nothing, a full
disk as one line that leaves `latest` and a relaunch exact, checkpoints saved as bad never
resumed from nor pruned past, every listed file present before use, older formats loading,
and one host staging arena."""

import errno
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from run_configs import ONE_LAYER, TWO_LAYERS

import megalite.checkpoint.writer as writer
from megalite.checkpoint.files import TensorFile, write_atomic
from megalite.checkpoint.sharded import (
    MANIFEST_CHECKSUM,
    CheckpointError,
    find_checkpoint,
    load_checkpoint,
    manifest_checksum,
    newest_good_checkpoint,
)
from megalite.checkpoint.staging import HostStaging
from megalite.checkpoint.writer import (
    index_file,
    publish,
    save_checkpoint,
    take_snapshot,
    write_snapshot,
)
from megalite.config import load_config
from megalite.data import GlobalBatchSampler
from megalite.host_memory import ALIGNMENT
from megalite.launch import run_ranks
from megalite.parallel_state import ParallelState, build_parallel_state
from megalite.training.loop import run_state, train
from megalite.training.setup import build_run


def _state(ps: ParallelState | None = None):
    cfg = load_config(None, ONE_LAYER)
    run = build_run(cfg, ps or ParallelState.single())
    return run_state(run, GlobalBatchSampler(50, 2, cfg.train.seed))


# ----------------------------------------------------------------------------- every index


def _lose_an_index(root: str) -> str:
    ps = build_parallel_state(1, 1, torch.device("cpu"))
    state = _state(ps)
    state.step = 1
    save_checkpoint(Path(root), state, keep=1)
    state.step = 2
    snapshot = take_snapshot(Path(root), state, None)
    write_snapshot(snapshot)
    if ps.rank == 1:  # as if its files never reached the filesystem rank 0 sees
        (snapshot.tmp_dir / index_file(1)).unlink()
    try:
        publish(snapshot, ps, keep=1)
    except CheckpointError as exc:
        return str(exc)
    return "published"


def test_a_missing_index_refuses_to_publish_on_every_rank(tmp_path, monkeypatch):
    monkeypatch.setattr(writer, "INDEX_WAIT_S", 0.0)
    messages = run_ranks(2, _lose_an_index, str(tmp_path), timeout=120)
    for message in messages:
        assert "step 2 was not published" in message and "no index from rank(s) [1]" in message
        assert "nothing was pruned" in message and "still names step_000001" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000001"]
    assert (tmp_path / "latest").read_text() == "step_000001"


# ----------------------------------------------------------------------------- a full disk

STEPS = 4


def _config(out_dir: Path):
    extra = [f"train.steps={STEPS}", "checkpoint.interval=2", f"train.out_dir={out_dir}"]
    return load_config(None, [*TWO_LAYERS, *extra])


def _losses(out_dir: Path) -> list[float]:
    rows = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(row)["loss"] for row in rows]


def test_a_full_disk_is_one_line_and_the_relaunch_continues_exactly(
    tmp_path, monkeypatch, builtin_corpus
):
    train(_config(tmp_path / "whole"))
    real_write = writer.write_atomic

    def disk_full_at_step_4(path: Path, *chunks):
        if path.parent.name == "step_000004.tmp" and path.name.startswith("optim"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(path, *chunks)

    out_dir = tmp_path / "run"
    monkeypatch.setattr(writer, "write_atomic", disk_full_at_step_4)
    with pytest.raises(CheckpointError) as info:
        train(_config(out_dir))
    message, root = str(info.value), out_dir / "checkpoints"
    assert "\n" not in message and "step 4 was not saved" in message
    assert "No space left on device" in message and "MiB free" in message
    needed = float(message.split("it needs ")[1].split(" MiB")[0])
    assert needed > 0.1  # the model alone is ~0.2 MiB in fp32
    assert "still names step_000002" in message
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002"]
    monkeypatch.setattr(writer, "write_atomic", real_write)  # space freed: relaunch
    train(_config(out_dir))
    assert _losses(out_dir) == _losses(tmp_path / "whole")
    assert (root / "latest").read_text() == "step_000004"


# ----------------------------------------------------------------------------- good and bad


def test_checkpoints_saved_as_bad_are_never_resumed_from_nor_pruned_past(tmp_path):
    state = _state()
    for step, good in [(1, True), (2, False), (3, False)]:
        state.step = step
        save_checkpoint(tmp_path, state, keep=1, good=good)
    # keep=1 keeps the newest (step 3) and the newest good one (step 1), which latest names.
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000001", "step_000003"]
    assert (tmp_path / "latest").read_text() == "step_000001"
    assert newest_good_checkpoint(tmp_path) == tmp_path / "step_000001"
    assert find_checkpoint(tmp_path, "auto") == tmp_path / "step_000001"
    (tmp_path / "latest").unlink()  # without the pointer: the highest good step
    assert newest_good_checkpoint(tmp_path) == tmp_path / "step_000001"
    shutil.rmtree(tmp_path / "step_000001")
    assert newest_good_checkpoint(tmp_path) is None
    with pytest.raises(CheckpointError, match="holds only checkpoints saved as bad"):
        find_checkpoint(tmp_path, "auto")
    assert find_checkpoint(tmp_path, str(tmp_path / "step_000003")) == tmp_path / "step_000003"


def test_a_step_directory_without_its_manifest_is_refused_and_never_pruned(tmp_path):
    state = _state()
    state.step = 1
    save_checkpoint(tmp_path, state, keep=1)
    (tmp_path / "step_000001" / "manifest.json").unlink()
    with pytest.raises(CheckpointError) as info:
        find_checkpoint(tmp_path, "auto")
    assert "step_000001 has no manifest.json" in str(info.value)
    state.step = 2
    save_checkpoint(tmp_path, state, keep=1)  # prunes complete checkpoints only
    assert (tmp_path / "step_000001").is_dir()


# ----------------------------------------------------------------------------- every file


@pytest.mark.parametrize(
    "lost",
    ["rng_rank00000.safetensors", "tokenizer.model", "optim_tp00_pp00_dp00.safetensors"],
)
def test_a_missing_file_is_refused_naming_it(tmp_path, lost, builtin_corpus):
    state = _state()
    path = save_checkpoint(tmp_path, state, keep=1, tokenizer=builtin_corpus[1])
    (path / lost).unlink()
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, _state())
    assert f"{lost} is missing" in str(info.value) and "\n" not in str(info.value)


def test_a_damaged_block_is_refused_when_read(tmp_path):
    tensors = {"a": torch.arange(5000, dtype=torch.float32), "b": torch.ones(3000)}
    path = tmp_path / "f.safetensors"
    digest = write_atomic(path, *writer.safetensors_chunks(tensors))
    with TensorFile(path, digest) as file:
        assert torch.equal(file.tensor("a", 1000, 2000), tensors["a"][1000:2000])
        assert torch.equal(file.tensor("b"), tensors["b"])
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # inside b
    path.write_bytes(bytes(data))
    with TensorFile(path, digest) as file:
        assert torch.equal(file.tensor("a", 0, 100), tensors["a"][:100])  # a's blocks are fine
        with pytest.raises(Exception, match="fails its checksum"):
            file.tensor("b")


# ----------------------------------------------------------------------------- older formats


def _as_older_format(path: Path, version: int) -> None:
    """Rewrite a v4 checkpoint as version 1, 2 or 3 wrote it: a sha256 per file; the manifest's
    own checksum from v3; v1 stored each tp piece whole in one file under its name."""
    manifest = json.loads((path / "manifest.json").read_text())
    manifest.pop("good")
    manifest.pop(MANIFEST_CHECKSUM)
    manifest["format"] = f"megalite-checkpoint-v{version}"
    if version == 1:
        pieces = {}
        for name, entry in manifest["tensors"].items():
            parts = []
            for *_, file, key in entry.pop("segments"):
                with TensorFile(path / file, manifest["files"][file]) as f:
                    parts.append(f.tensor(key).reshape(-1))
            pieces[name] = torch.cat(parts)
            entry["files"] = ["v1.safetensors"]
        write_atomic(path / "v1.safetensors", *writer.safetensors_chunks(pieces))
    manifest["files"] = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in path.iterdir()
        if p.name != "manifest.json"
    }
    if version == 3:
        manifest[MANIFEST_CHECKSUM] = manifest_checksum(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("version", [1, 2, 3])
def test_checkpoints_of_older_formats_still_load(tmp_path, version):
    state = _state()
    for *_, views in state.optimizer.owned_pieces():
        for kind, view in views.items():
            if kind != "master":
                view.copy_(torch.randn(view.shape))
    state.step = 5
    path = save_checkpoint(tmp_path, state, keep=1)
    _as_older_format(path, version)
    fresh = _state()
    load_checkpoint(path, fresh)
    assert fresh.step == 5
    for (name, param), loaded in zip(state.params.items(), fresh.params.values()):
        assert torch.equal(param, loaded), name
    for (*_, ours), (*_, theirs) in zip(
        state.optimizer.owned_pieces(), fresh.optimizer.owned_pieces()
    ):
        for kind in ours:
            assert torch.equal(ours[kind], theirs[kind]), kind


# ----------------------------------------------------------------------------- staging


def test_staging_is_one_arena_of_the_summed_sizes_reused_across_saves():
    files = {
        "a": {"w": torch.randn(3, 5), "b": torch.randn(7).bfloat16()},
        "rng": {"s": torch.get_rng_state(), "n": torch.tensor(3)},
    }
    staging = HostStaging()
    staged = staging.stage(files)
    arena = staging.arena
    sizes = [t.numel() * t.element_size() for ts in files.values() for t in ts.values()]
    assert arena.nbytes == sum(-(-n // ALIGNMENT) * ALIGNMENT for n in sizes)
    for name, tensors in files.items():
        for key, tensor in tensors.items():
            view = staged[name][key]
            assert torch.equal(view, tensor) and view.dtype == tensor.dtype
            assert view.untyped_storage().data_ptr() == arena.storage.data_ptr()
    files["a"]["w"] += 1
    again = staging.stage(files)
    assert staging.arena is arena and torch.equal(again["a"]["w"], files["a"]["w"])
    files["a"]["w"] = torch.randn(4, 5)  # another shape: a new arena
    staging.stage(files)
    assert staging.arena is not arena
