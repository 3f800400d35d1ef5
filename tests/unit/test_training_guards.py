"""The training loop's guards: a NaN loss stops the run with a clear error, and Weights &
Biases without an API key logs offline instead of failing or hanging."""

import math

import pytest
from run_configs import ONE_LAYER

import megalite.training.loop as loop
from megalite.config import load_config

TINY = ONE_LAYER


def test_nan_loss_stops_training_clearly(builtin_corpus, tmp_path, monkeypatch):
    real_step = loop.train_step

    def diverging_step(run, tokens, lr):
        metrics = real_step(run, tokens, lr)
        metrics.loss = math.nan if run.optimizer.step_count == 3 else metrics.loss
        return metrics

    monkeypatch.setattr(loop, "train_step", diverging_step)
    cfg = load_config(None, [*TINY, "train.steps=5", f"train.out_dir={tmp_path}"])
    with pytest.raises(loop.TrainingError, match=r"loss became nan at step 3: lower optim.lr"):
        loop.train(cfg)


def test_wandb_without_api_key_logs_offline(builtin_corpus, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = load_config(
        None, [*TINY, "train.steps=2", "logging.wandb=true", f"train.out_dir={tmp_path}"]
    )
    loop.train(cfg)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((tmp_path / "wandb").iterdir())
