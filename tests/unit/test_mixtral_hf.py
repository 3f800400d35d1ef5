"""Hugging Face Mixtral in and out (`hf_round_trip`): a `MixtralForCausalLM` comes in through
`checkpoint.init_from` computing transformers' logits (routing included), trains in a
tensor- and pipeline-parallel layout, and `megalite export-hf` writes it back in the published
checkpoints' layout, which transformers loads to the same logits; export, import and export
again gives bit-identical tensors."""

import tempfile
from pathlib import Path

import pytest
from hf_round_trip import assert_round_trip, randomised

from megalite.cli import main
from megalite.config import ConfigError, load_config
from megalite.launch import run_ranks
from megalite.training.loop import train

MIXTRAL = [
    "model.arch=mixtral",
    "model.n_layers=2",
    "model.hidden=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_hidden=96",
    "model.moe_experts=4",
    "model.vocab_size=500",  # the test corpus' vocabulary (tests/conftest.py)
    "model.seq_len=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.eval_interval=1000",
    "logging.progress=false",
]


def hf_mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=500,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
    )
    return randomised(MixtralForCausalLM(config))


def _train(overrides: list[str]) -> None:
    train(load_config(None, overrides))


def test_hugging_face_mixtral_in_train_and_out(builtin_corpus, tmp_path, monkeypatch):
    back = assert_round_trip(hf_mixtral(), MIXTRAL, tmp_path, monkeypatch)

    # and it trains from there in a tp 2 x pp 2 layout
    layout = tmp_path / "layout"
    overrides = [*MIXTRAL, f"checkpoint.init_from={back}", "train.steps=2", "parallel.tp=2",
                 "parallel.sp=true", "parallel.pp=2", f"train.out_dir={layout}"]  # fmt: skip
    run_ranks(4, _train, overrides)
    assert (layout / "checkpoints" / "latest").exists()


def test_export_refuses_what_mixtral_cannot_hold(builtin_corpus, tmp_path, capsys):
    run = Path(tempfile.mkdtemp(dir=tmp_path))
    sigmoid = ["model.moe_router=sigmoid", "train.steps=1", f"train.out_dir={run}"]
    assert main(["train", *MIXTRAL, *sigmoid]) == 0
    assert main(["export-hf", "--checkpoint", str(run), "--out", str(tmp_path / "x")]) != 0
    assert "set model.moe_router=softmax" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.moe_experts=4"], "model.arch=llama has dense MLPs"),
        (["model.arch=mixtral", "model.moe_top_k=3", "model.moe_experts=2"], "moe_top_k"),
        (["model.arch=mixtral"], "needs model.moe_experts"),
        (["model.arch=mixtral", "model.moe_experts=4", "model.moe_bias_update_rate=0.01"],
         "model.moe_router=sigmoid"),
    ],
)  # fmt: skip
def test_moe_settings_that_do_not_fit_name_the_fix(overrides, message):
    base = ["model.arch=llama"] if "model.arch=mixtral" not in overrides else []
    with pytest.raises(ConfigError, match=message):
        load_config(None, base + overrides)
