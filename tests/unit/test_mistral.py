"""Mistral: sliding-window attention. A random `MistralForCausalLM` whose window (8) is shorter
than the sequence (32) comes in through `checkpoint.init_from` computing transformers' logits,
and goes out and back bit for bit; at tp 2 + SP x pp 2 and at cp 2 (the ring skipping the key
chunks before every query's window) its first evaluation is transformers' loss; the window's
layer pattern and FLOPs; and the configs that cannot be, refused."""

import json

import pytest
import torch
import torch.nn.functional as F
from hf_round_trip import assert_round_trip, randomised
from megalite.models.flops import flops_per_token

from megalite.config import ConfigError, load_config
from megalite.launch import run_ranks
from megalite.training.loop import open_data, train

MISTRAL = [
    "model.arch=mistral",
    "model.n_layers=2",
    "model.hidden=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_hidden=96",
    "model.sliding_window=8",
    "model.norm_eps=1e-5",
    "model.vocab_size=500",  # the test corpus' vocabulary (tests/conftest.py)
    "model.seq_len=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.eval_interval=1000",
    "logging.progress=false",
]


def hf_mistral():
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=500,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        sliding_window=8,
        bos_token_id=None,
        eos_token_id=None,
    )
    config._attn_implementation = "eager"  # the one that applies the window on CPU
    return randomised(MistralForCausalLM(config))


def test_hugging_face_mistral_in_and_out(builtin_corpus, tmp_path, monkeypatch):
    back = assert_round_trip(hf_mistral(), MISTRAL, tmp_path, monkeypatch)
    assert json.loads((back / "config.json").read_text())["sliding_window"] == 8


def test_the_window_matters():
    """The same weights without a window compute other logits: the test above would see a
    window dropped on the way."""
    model = hf_mistral()
    ids = torch.randint(0, 500, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        windowed = model(ids).logits
        model.config.sliding_window = None
        full = model(ids).logits
    assert (windowed[:, :8] - full[:, :8]).abs().max() < 1e-5  # inside the first window
    assert (windowed[:, 8:] - full[:, 8:]).abs().max() > 1e-3


def _train(overrides: list[str]) -> None:
    train(load_config(None, overrides))


@pytest.mark.parametrize(
    "layout",
    [["parallel.tp=2", "parallel.sp=true", "parallel.pp=2"], ["parallel.cp=2"]],
    ids=["tp2-sp-pp2", "cp2"],
)
def test_mistral_in_a_layout_evaluates_as_transformers_does(layout, builtin_corpus, tmp_path):
    """The first evaluation after one step at a vanishing learning rate is transformers' mean
    loss on the same held-out windows."""
    hf_mistral().save_pretrained(tmp_path / "hf", safe_serialization=True)
    out = tmp_path / "layout"
    overrides = [*MISTRAL, f"checkpoint.init_from={tmp_path / 'hf'}", "train.steps=1",
                 "train.eval_interval=1", "train.eval_steps=1", "optim.lr=1e-12",
                 "optim.min_lr=0", *layout, f"train.out_dir={out}"]  # fmt: skip
    run_ranks(4 if "parallel.pp=2" in layout else 2, _train, overrides)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val_loss = next(row["val_loss"] for row in rows if row.get("val_loss") is not None)
    cfg = load_config(None, overrides)
    val = open_data(cfg).val
    batch = val.read(val.evaluation_pairs(0, cfg.train.global_batch_size), True, True)
    with torch.no_grad():
        logits = hf_mistral()(batch.inputs).logits
    expected = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten()).item()
    assert val_loss == pytest.approx(expected, rel=1e-4)


def test_the_layer_pattern_and_the_flops_of_windows():
    """Every layer windowed, or (a pattern of 3) all but each third; a window counts the pairs
    a query sees: W - W^2 / (2 s) keys against the causal s / 2, none fewer with W >= s."""
    cfg = load_config(None, [*MISTRAL, "model.n_layers=6", "model.sliding_window_pattern=3"]).model
    assert [cfg.window_of(i) for i in range(6)] == [8, 8, None, 8, 8, None]
    every = load_config(None, MISTRAL).model
    assert [every.window_of(i) for i in range(2)] == [8, 8]
    full = load_config(None, [*MISTRAL, "model.sliding_window=null"]).model
    wide = load_config(None, [*MISTRAL, "model.sliding_window=64"]).model
    assert flops_per_token(wide) == flops_per_token(full)
    saved = flops_per_token(full) - flops_per_token(every)
    per_layer = 12 * 64 * ((32 / 2) - (8 - 8 * 8 / (2 * 32)))
    assert saved == pytest.approx(2 * per_layer)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.arch=llama", "model.sliding_window=8"], "model.sliding_window is for mistral"),
        (["model.sliding_window=null", "model.sliding_window_pattern=2"], "set model.sliding"),
        (["model.sliding_window=0"], "must be >= 1"),
        (["model.dropout=0.1"], "sliding-window attention never"),
    ],
)
def test_configs_that_cannot_be_say_what_to_change(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*MISTRAL, *overrides])
