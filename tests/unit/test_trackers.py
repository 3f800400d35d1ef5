"""Experiment tracking: an offline wandb run carries the run's name, tags, group and config and
a resume continues the same wandb run; TensorBoard event files hold the loss series; wandb goes
online with either kind of login."""

import json
from pathlib import Path

import pytest
from run_configs import ONE_LAYER
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from wandb.proto import wandb_internal_pb2

from megalite.config import load_config
from megalite.training.loop import train
from megalite.training.trackers import wandb_logged_in

TRACKED = [
    *ONE_LAYER,
    "logging.wandb=true",
    "logging.tensorboard=true",
    "logging.run_name=my-run",
    "logging.wandb_tags=tiny, test",
    "logging.wandb_group=trackers",
]


def wandb_records(path: Path) -> list:
    """The records of a wandb run file (a LevelDB-style log of protobuf records in 32 KiB
    blocks after a 7-byte header), parsed."""
    data, block, pos = path.read_bytes(), 1 << 15, 7
    assert data[:4] == b":W&B"
    records, pending = [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if left < 7 or (length == 0 and kind == 0):  # the padded end of a block
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


def run_records(out_dir: Path) -> list:
    runs = []
    for path in sorted(out_dir.glob("wandb/offline-run-*/run-*.wandb")):
        runs += [r.run for r in wandb_records(path) if r.WhichOneof("record_type") == "run"]
    return runs


@pytest.fixture
def no_login(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)


def test_tracked_run_and_its_resume(builtin_corpus, tmp_path, no_login, capsys):
    out_dir = tmp_path / "run"
    train(load_config(None, [*TRACKED, "train.steps=2", f"train.out_dir={out_dir}"]))
    assert "wandb: no API key (WANDB_API_KEY or `wandb login`): logging offline" in (
        capsys.readouterr().out
    )
    (first,) = run_records(out_dir)
    assert first.display_name == "my-run" and list(first.tags) == ["tiny", "test"]
    assert first.run_group == "trackers"
    config = {item.key: json.loads(item.value_json) for item in first.config.update}
    assert config["model"]["hidden"] == 32 and config["logging"]["run_name"] == "my-run"

    train(load_config(None, [*TRACKED, "train.steps=3", f"train.out_dir={out_dir}"]))
    runs = run_records(out_dir)
    assert len({r.run_id for r in runs}) == 1, "a resume continues the same wandb run"

    losses = [
        json.loads(row)["loss"]
        for row in (out_dir / "metrics.jsonl").read_text().split("\n")
        if row
    ]
    events = EventAccumulator(str(out_dir / "tensorboard" / "my-run"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]
    assert [e.value for e in events.Scalars("loss")] == pytest.approx(losses, rel=1e-6)
    assert "config/text_summary" in events.Tags()["tensors"]


def test_wandb_login_from_the_environment_or_netrc(no_login, monkeypatch, tmp_path):
    assert not wandb_logged_in()
    home = tmp_path / "home"
    home.mkdir()
    (home / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    (home / ".netrc").chmod(0o600)
    assert wandb_logged_in()
    (home / ".netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_logged_in()
