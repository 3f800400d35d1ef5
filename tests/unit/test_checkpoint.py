"""Checkpoints as a run sees them, driven through `megalite.training.loop.train`: the on-disk
layout, retention, `latest`, refusal of corrupt or foreign state with a message that names the
file and the way out, and no pickle anywhere."""

import json
import shutil
import struct
from pathlib import Path

import pytest
from run_configs import TWO_LAYERS, snapshot
from safetensors import safe_open

from megalite.checkpoint.sharded import CheckpointError, read_manifest
from megalite.config import load_config
from megalite.hardware import peak_flops
from megalite.training.loop import TrainingError, train

STEPS, INTERVAL, KEEP = 6, 2, 2


def tiny_config(out_dir: Path, *extra: str):
    schedule = [f"train.steps={STEPS}", "optim.warmup_steps=2", f"checkpoint.interval={INTERVAL}"]
    return load_config(
        None,
        [*TWO_LAYERS, *schedule, f"checkpoint.keep={KEEP}", f"train.out_dir={out_dir}", *extra],
    )


def metrics(out_dir: Path) -> list[dict]:
    rows = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(row) for row in rows]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, builtin_corpus):
    """One finished run: checkpoints at steps 2, 4, 6, of which the newest KEEP remain."""
    out_dir = tmp_path_factory.mktemp("ckpt") / "run"
    train(tiny_config(out_dir))
    return out_dir


@pytest.fixture
def run_copy(trained, tmp_path):
    """A private copy of the finished run, free to damage."""
    out_dir = tmp_path / "run"
    shutil.copytree(trained, out_dir)
    return out_dir


# ----------------------------------------------------------------------------- layout


def test_checkpoint_layout_latest_and_retention(trained):
    root = trained / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000004", "step_000006"]
    assert (root / "latest").read_text() == "step_000006"
    newest = root / "step_000006"
    names = sorted(p.name for p in newest.iterdir())
    assert names == [
        "manifest.json",
        "model_tp00_pp00.safetensors",
        "optim_tp00_pp00_dp00.safetensors",
        "rng_rank00000.safetensors",
        "tokenizer.model",
    ]
    manifest = read_manifest(newest)  # checksums verify
    assert manifest["format"] == "megalite-checkpoint-v4" and manifest["good"] is True
    assert manifest["step"] == 6 and manifest["optimizer_step"] == 6
    assert manifest["layout"] == {"tp": 1, "pp": 1, "dp": 1} and manifest["world_size"] == 1
    assert set(manifest["files"]) == set(names) - {"manifest.json"}
    assert manifest["trainer"]["step"] == 6
    assert manifest["trainer"]["config"]["model"]["vocab_size"] == 500
    # Every parameter comes with its Adam state, stored under its global name.
    tensors = manifest["tensors"]
    assert {
        "wte.weight",
        "wte.weight.master",
        "wte.weight.exp_avg",
        "wte.weight.exp_avg_sq",
    } <= set(tensors)
    assert any(name.startswith("layers.1.") for name in tensors)
    assert "lm_head.weight" not in tensors  # the tied head is saved once, as wte.weight
    assert (trained / "config.yaml").is_file()
    assert [r["step"] for r in metrics(trained)] == list(range(1, STEPS + 1))


def test_checkpoint_files_hold_no_pickle(trained):
    for step in (trained / "checkpoints").glob("step_*"):
        for path in step.iterdir():
            data = path.read_bytes()
            if path.suffix != ".safetensors":  # (whose first byte is the header size's)
                assert not data.startswith(b"\x80"), f"{path} looks like a pickle"
            assert not data.startswith(b"PK"), f"{path} looks like a torch.save zip"
            if path.suffix == ".safetensors":
                (header_len,) = struct.unpack("<Q", data[:8])
                header = json.loads(data[8 : 8 + header_len])
                assert header and all(
                    "dtype" in v for k, v in header.items() if k != "__metadata__"
                )
                with safe_open(str(path), framework="pt") as f:
                    assert list(f.keys())
            elif path.name == "manifest.json":
                json.loads(data)
            else:
                assert path.name == "tokenizer.model"  # a sentencepiece protobuf
                assert data[:1] == b"\n"  # protobuf field 1, length-delimited (the pieces)


def test_keep_one_and_final_step_is_saved(tmp_path, builtin_corpus):
    out_dir = tmp_path / "run"
    train(tiny_config(out_dir, "train.steps=3", "checkpoint.keep=1"))
    root = out_dir / "checkpoints"
    # interval 2 saves step 2; the end of training saves step 3. keep=1 keeps step 2 besides:
    # no step has run with step 3's weights yet, so step 2 is the last good state it can prove.
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002", "step_000003"]
    assert (root / "latest").read_text() == "step_000003"


# ----------------------------------------------------------------------------- resume


def test_auto_resume_continues_the_run(run_copy):
    before = metrics(run_copy)
    final = train(tiny_config(run_copy, "train.steps=8"))
    assert final["step"] == 8
    rows = metrics(run_copy)
    assert [r["step"] for r in rows] == [*range(1, STEPS + 1), 7, 8]
    assert rows[: len(before)] == before
    assert sorted(p.name for p in (run_copy / "checkpoints").glob("step_*")) == [
        "step_000006",
        "step_000008",
    ]


def test_a_resume_with_dropout_repeats_the_uninterrupted_run(tmp_path, builtin_corpus):
    """Dropout draws from the RNG streams a resume restores: nothing a run does as it starts
    (measuring the CPU's peak FLOP/s draws random numbers) may draw from them after that."""
    out_dir = tmp_path / "run"
    peak_flops.cache_clear()  # every start measures it afresh, as a new process does
    train(tiny_config(out_dir, "model.dropout=0.2"))
    uninterrupted = {r["step"]: r["loss"] for r in metrics(out_dir)}
    peak_flops.cache_clear()
    step_4 = out_dir / "checkpoints" / "step_000004"
    train(tiny_config(out_dir, "model.dropout=0.2", f"checkpoint.resume={step_4}"))
    rows = metrics(out_dir)  # the resumed run replaced the rows of the steps it trained again
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert {r["step"]: r["loss"] for r in rows} == uninterrupted


def test_corrupt_newest_checkpoint_is_refused_and_earlier_one_still_loads(run_copy, trained):
    root = run_copy / "checkpoints"
    target = root / "step_000006" / "model_tp00_pp00.safetensors"
    data = bytearray(target.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    target.write_bytes(bytes(data))

    with pytest.raises(CheckpointError) as info:
        train(tiny_config(run_copy, "train.steps=8"))
    message = str(info.value)
    assert "step_000006" in message and "model_tp00_pp00.safetensors" in message
    assert "checksum" in message and "earlier checkpoint" in message
    assert "checkpoint.resume=" in message and "step_000004" in message

    # The earlier checkpoint loads, and training from it (same config, so the same lr
    # schedule) repeats the original steps 5 and 6 exactly.
    earlier = root / "step_000004"
    final = train(tiny_config(run_copy, f"checkpoint.resume={earlier}"))
    assert final["step"] == STEPS
    rows = metrics(run_copy)  # one row per step: 5 and 6 replaced by the resumed run's
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert {r["step"]: r["loss"] for r in rows} == {r["step"]: r["loss"] for r in metrics(trained)}
    read_manifest(root / "step_000006")  # rewritten intact by the resumed run
    assert (root / "latest").read_text() == "step_000006"


def test_missing_checkpoint_file_is_refused(run_copy):
    newest = run_copy / "checkpoints" / "step_000006"
    (newest / "rng_rank00000.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"rng_rank00000.safetensors is missing"):
        read_manifest(newest)


GARBAGE = {
    "truncated": None,  # the first half of the real manifest
    "empty": b"",
    "binary": bytes(range(256)) * 4,  # not UTF-8
    "not an object": b"[1, 2, 3]",  # valid JSON, wrong shape
}


@pytest.mark.parametrize("damage", list(GARBAGE))
def test_garbage_manifest_gives_a_clear_error(run_copy, damage):
    newest = run_copy / "checkpoints" / "step_000006"
    manifest = newest / "manifest.json"
    text = manifest.read_bytes()
    manifest.write_bytes(GARBAGE[damage] if GARBAGE[damage] is not None else text[: len(text) // 2])
    with pytest.raises(CheckpointError) as info:
        train(tiny_config(run_copy, "train.steps=8"))
    message = str(info.value)
    assert "step_000006" in message and "manifest.json" in message and "corrupt" in message


def test_manifest_of_another_format_is_refused(run_copy):
    newest = run_copy / "checkpoints" / "step_000006"
    (newest / "manifest.json").write_text(json.dumps({"format": "something-else", "files": {}}))
    with pytest.raises(CheckpointError, match=r"unknown checkpoint format 'something-else'"):
        read_manifest(newest)


def test_resume_from_missing_directory(tmp_path, builtin_corpus):
    missing = tmp_path / "no" / "step_000010"
    with pytest.raises(CheckpointError) as info:
        train(tiny_config(tmp_path / "run", f"checkpoint.resume={missing}"))
    assert f"checkpoint.resume={missing}: no such directory" in str(info.value)
    assert not (tmp_path / "run").exists()


def test_resume_from_a_directory_that_is_not_a_checkpoint(tmp_path, builtin_corpus):
    with pytest.raises(CheckpointError) as info:
        train(tiny_config(tmp_path / "run", f"checkpoint.resume={tmp_path}"))
    message = str(info.value)
    assert "not a complete megalite checkpoint (no manifest.json)" in message
    assert "step_* directory" in message


def test_fresh_run_into_a_used_out_dir_is_refused_and_touches_nothing(run_copy):
    before = snapshot(run_copy)
    with pytest.raises(TrainingError) as info:
        train(tiny_config(run_copy, "checkpoint.resume=none"))
    message = str(info.value)
    assert str(run_copy / "checkpoints") in message and "checkpoint.resume=auto" in message
    assert "train.out_dir" in message
    assert snapshot(run_copy) == before
