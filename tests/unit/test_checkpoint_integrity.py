"""What keeps a run's checkpoints trustworthy, in one process: a resume refuses another model
(naming what differs) and an edited manifest, one run per out_dir at a time (and a killed run's
lock never blocks), metrics keep one row per step after a resume, and asynchronous saves write
exactly what synchronous ones do while training goes on."""

import hashlib
import json
import math
import multiprocessing
import os
import shutil
import signal
import threading
from pathlib import Path

import pytest
import torch
from run_configs import ONE_LAYER, TWO_LAYERS
from safetensors.torch import load_file

import megalite.checkpoint.files as files
import megalite.checkpoint.saver as saver_module
import megalite.training.step as step_module
from megalite.checkpoint.files import safetensors_chunks, write_atomic
from megalite.checkpoint.saver import CheckpointSaver
from megalite.checkpoint.sharded import Checkpoint, CheckpointError, read_manifest
from megalite.config import load_config
from megalite.data import GlobalBatchSampler
from megalite.parallel_state import ParallelState
from megalite.testing.faults import stall_save
from megalite.training.loop import TrainingError, run_state, train
from megalite.training.metrics import drop_rows_after
from megalite.training.run_lock import LOCK_FILE, RunLock, RunLockError
from megalite.training.setup import build_run

STEPS = 4


def config(out_dir: Path, *extra: str):
    return load_config(
        None,
        [
            *TWO_LAYERS,
            f"train.steps={STEPS}",
            "checkpoint.interval=2",
            f"train.out_dir={out_dir}",
            *extra,
        ],
    )


def metrics(out_dir: Path) -> list[dict]:
    return [json.loads(row) for row in (out_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, builtin_corpus):
    """A finished synchronous run: checkpoints at steps 2 and 4."""
    out_dir = tmp_path_factory.mktemp("integrity") / "run"
    train(config(out_dir))
    return out_dir


@pytest.fixture
def halfway(trained, tmp_path):
    """A copy of the run as if it had stopped after the checkpoint of step 2."""
    out_dir = tmp_path / "run"
    shutil.copytree(trained, out_dir)
    shutil.rmtree(out_dir / "checkpoints" / "step_000004")
    (out_dir / "checkpoints" / "latest").write_text("step_000002")
    return out_dir


# ----------------------------------------------------------------------------- resume refusals


@pytest.mark.parametrize(
    "change, named",
    [
        (["model.n_layers=1"], ["model.n_layers 2 -> 1"]),
        (["model.n_heads=2"], ["model.n_heads 4 -> 2", "model.n_kv_heads 4 -> 2"]),
    ],
)
def test_a_resume_of_another_model_is_refused_naming_the_fields(halfway, change, named):
    before = (halfway / "metrics.jsonl").read_text()
    with pytest.raises(CheckpointError) as info:
        train(config(halfway, *change))
    message = str(info.value)
    assert "step_000002" in message and "another model" in message
    for field in named:
        assert field in message
    assert (halfway / "checkpoints" / "latest").read_text() == "step_000002"
    assert not (halfway / "checkpoints" / "step_000004").exists()
    assert (halfway / "metrics.jsonl").read_text() == before


def test_an_edited_manifest_is_refused_naming_the_file(halfway):
    manifest_path = halfway / "checkpoints" / "step_000002" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["step"] = 40  # would skip steps and outlive the good checkpoints
    manifest_path.write_text(json.dumps(manifest, indent=1))
    with pytest.raises(CheckpointError) as info:
        train(config(halfway, "train.steps=50"))
    assert f"{manifest_path} fails its checksum" in str(info.value)
    with pytest.raises(CheckpointError, match="fails its checksum"):
        Checkpoint(manifest_path.parent, verify_files=False)


# ----------------------------------------------------------------------------- one run per out_dir


def _hold_lock(out_dir: str, ready) -> None:
    RunLock.acquire(Path(out_dir))
    ready.set()
    signal.pause()  # until killed


def test_a_second_run_on_an_out_dir_is_refused_and_a_killed_runs_lock_does_not_block(halfway):
    ready = multiprocessing.get_context("fork").Event()
    holder = multiprocessing.get_context("fork").Process(
        target=_hold_lock, args=(str(halfway), ready)
    )
    holder.start()
    try:
        assert ready.wait(30)
        before = (halfway / "metrics.jsonl").read_text()
        with pytest.raises(RunLockError) as info:
            train(config(halfway))
        assert f"another run is using {halfway} (pid {holder.pid} on " in str(info.value)
        assert (halfway / "metrics.jsonl").read_text() == before
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.join()
    assert f"pid {holder.pid}" in (halfway / LOCK_FILE).read_text()  # stale, and harmless
    final = train(config(halfway))
    assert final["step"] == STEPS
    assert not (halfway / LOCK_FILE).exists()  # a run that ends removes its lock


def test_an_out_dir_that_cannot_be_made_is_one_error(tmp_path):
    """Under a file, or where mkdir is refused: one line naming the directory, before any work."""
    (tmp_path / "file").write_text("")
    for out_dir in (tmp_path / "file" / "run", Path("/proc/megalite-run")):
        with pytest.raises(RunLockError, match=rf"cannot use train.out_dir={out_dir}: .*another"):
            train(config(out_dir))


# ----------------------------------------------------------------------------- metrics rows


def test_a_resumed_run_leaves_one_metrics_row_per_step(halfway, trained):
    assert [r["step"] for r in metrics(halfway)] == [1, 2, 3, 4]  # 3 and 4 outlived their save
    train(config(halfway))
    rows = metrics(halfway)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["loss"] for r in rows] == [r["loss"] for r in metrics(trained)]


def test_drop_rows_after_keeps_earlier_rows_and_drops_a_torn_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3)]
    path.write_text("".join(rows) + '{"step": 4, "lo')  # the crash tore the last row
    drop_rows_after(path, 2)
    assert path.read_text() == "".join(rows[:2])
    drop_rows_after(tmp_path / "absent.jsonl", 2)
    assert not (tmp_path / "absent.jsonl").exists()


# ----------------------------------------------------------------------------- async saves


def test_async_saves_write_what_sync_saves_do_while_training_goes_on(trained, tmp_path):
    """The step-2 writer pauses after its first file while steps 3 and 4 train on: the files
    must still hold step 2's state (copied before training went on), byte for byte."""
    out_dir = tmp_path / "async"
    with stall_save(2, 1.0):
        train(config(out_dir, "checkpoint.async_save=true"))
    assert [r["loss"] for r in metrics(out_dir)] == [r["loss"] for r in metrics(trained)]
    for step in ("step_000002", "step_000004"):
        ours = read_manifest(out_dir / "checkpoints" / step)  # every file verifies
        theirs = read_manifest(trained / "checkpoints" / step)
        assert ours["files"] == theirs["files"], step  # the same bytes as the sync run's
    assert (out_dir / "checkpoints" / "latest").read_text() == "step_000004"
    assert not list((out_dir / "checkpoints").glob("*.tmp"))


def test_an_async_save_is_published_after_the_first_step_its_write_is_done(
    tmp_path, monkeypatch, builtin_corpus
):
    """Step 3's background write is done during step 4 (the test waits for it there): after
    step 4 the checkpoint is published, so a crash in step 5 loses 2 steps, not the 5 since
    no checkpoint. Megatron-LM checks each step the same way."""
    real_finalize, latest = step_module.finalize_grads, []

    def finalize_grads(buffers, ps):
        real_finalize(buffers, ps)
        if len(latest) == 3:  # step 4
            for writer in threading.enumerate():
                if writer.name == "checkpoint-3":
                    writer.join()
        path = tmp_path / "checkpoints" / "latest"
        latest.append(path.read_text() if path.exists() else None)

    monkeypatch.setattr(step_module, "finalize_grads", finalize_grads)
    extra = ["train.steps=5", "checkpoint.interval=3", "checkpoint.async_save=true"]
    train(config(tmp_path, *extra))
    assert latest == [None, None, None, None, "step_000003"]


def test_a_failed_background_write_is_raised_at_finish_and_publishes_nothing(tmp_path, monkeypatch):
    cfg = load_config(None, ONE_LAYER)
    run = build_run(cfg, ParallelState.single())
    state = run_state(run, GlobalBatchSampler(50, 2, cfg.train.seed))
    saver = CheckpointSaver(tmp_path, keep=2, async_save=True)
    state.step = 1
    saver.save(state)
    assert saver.pending and saver.finish() == tmp_path / "step_000001"

    def disk_full(snapshot) -> OSError:
        return OSError(28, "No space left on device")

    monkeypatch.setattr(saver_module, "write_or_error", disk_full)
    state.step = 2
    saver.save(state)  # training goes on; the failure surfaces on the main thread
    with pytest.raises(CheckpointError) as info:
        saver.finish()
    assert "checkpoint of step 2 was not saved (rank 0: OSError" in str(info.value)
    assert "\n" not in str(info.value) and not (tmp_path / "step_000002.tmp").exists()
    assert "No space left on device" in str(info.value)
    assert (tmp_path / "latest").read_text() == "step_000001"
    assert not saver.pending and saver.finish() is None


def test_a_run_stopped_by_bad_steps_publishes_its_pending_async_save(
    tmp_path, monkeypatch, builtin_corpus
):
    """The async save of step 4 is not yet published when steps 6-8 turn bad and stop the run:
    it is published before the error names it as the last good checkpoint (the streak ran
    with step 5's weights)."""
    real_finalize, steps = step_module.finalize_grads, []

    def finalize_grads(buffers, ps):
        real_finalize(buffers, ps)
        steps.append(None)
        if len(steps) in (6, 7, 8):
            buffers[0].owned_grads[0] = math.nan

    monkeypatch.setattr(step_module, "finalize_grads", finalize_grads)
    extra = ["checkpoint.async_save=true", "checkpoint.interval=4", "fault.max_bad_steps=3"]
    with pytest.raises(TrainingError) as info:
        train(config(tmp_path, "train.steps=10", *extra))
    step_4 = tmp_path / "checkpoints" / "step_000004"
    assert f"Last good checkpoint: {step_4}" in str(info.value)
    assert read_manifest(step_4)["step"] == 4
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000004"


def test_streamed_safetensors_files_read_back_exactly(tmp_path):
    """The writer streams each tensor's memory into the file: safetensors reads back every
    dtype and shape it writes (bf16, 0-dim, empty, a non-contiguous view), and the returned
    checksums are those of the file's blocks."""
    tensors = {
        "weight": torch.randn(3, 5),
        "bf16": torch.randn(4, 4).bfloat16(),
        "steps": torch.arange(7, dtype=torch.int64),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
        "mask": torch.tensor([True, False, True]),
        "column": torch.randn(8, 4)[:, 1],
        "rng": torch.get_rng_state(),
    }
    path = tmp_path / "file.safetensors"
    digest = write_atomic(path, *safetensors_chunks(tensors))
    data, block = path.read_bytes(), digest["block"]
    blocks = [data[i : i + block] for i in range(0, len(data), block)]
    assert digest["sha256"] == [hashlib.sha256(b).hexdigest() for b in blocks]
    back = load_file(path)
    assert sorted(back) == sorted(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_each_piece_a_save_writes_is_progress_for_the_watchdog(tmp_path, monkeypatch):
    """A long save (a preemption's, waited for) is not taken for a hang: every piece written
    moves the watchdog's clock, and writing in pieces leaves the blocks' checksums as they were
    (pieces of 1,000 bytes, blocks of 8,192: pieces straddle the blocks)."""
    monkeypatch.setattr(files, "WRITE_PIECE", 1000)
    monkeypatch.setattr(files, "MAX_BLOCKS", 2)
    moves = []
    monkeypatch.setattr(files.progress, "moved_on", lambda: moves.append(len(moves)))
    body = torch.randint(0, 256, (12_500,), dtype=torch.uint8).numpy()
    digest = write_atomic(tmp_path / "f", b"head", body)
    assert len(moves) == 1 + 13
    data = (tmp_path / "f").read_bytes()
    assert data == b"head" + body.tobytes() and digest["block"] == 8192
    blocks = [data[:8192], data[8192:]]
    assert digest["sha256"] == [hashlib.sha256(b).hexdigest() for b in blocks]
