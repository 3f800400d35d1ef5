"""Llama 3.1's rope scaling (`model.rope_scaling=llama3`): the scaled frequencies are
transformers' own, the config refuses what does not fit with one error naming the fix (GPT has
no rotary embeddings to scale), a Hugging Face Llama with `rope_scaling: {rope_type: llama3}`
comes in through `checkpoint.init_from` (its positions and rotary settings adopted) computing
transformers' logits, and `megalite export-hf` writes it back out as transformers reads it. The
scaling is part of a checkpoint's model identity: a resume that changes it is refused."""

import copy
import json
import math

import pytest
import torch
from megalite.models.layers import Llama3Scaling, rotary_tables

import megalite.training.loop as loop
from megalite.checkpoint.hf import read_hf
from megalite.checkpoint.initial import init_from_settings
from megalite.checkpoint.sharded import Checkpoint, CheckpointError, resolve_checkpoint
from megalite.cli import main
from megalite.config import ConfigError, load_config

HEAD_DIM, THETA = 16, 10000.0
SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
ORIGINAL, POSITIONS, SEQ = 32, 128, 32
"""Pretrained at 32 positions, scaled to 128: at theta 10000 and head_dim 16 the eight
frequencies' wavelengths run from 6.3 to 19,000 positions, so one is kept (shorter than
32 / 4), one interpolated and six slowed 8 times (longer than 32 / 1), and a 128-token sequence
turns the slow ones through angles where their scaling shows in the logits."""
LLAMA = [
    "model.arch=llama",
    "model.n_layers=2",
    "model.hidden=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.vocab_size=500",  # the test corpus' vocabulary (tests/conftest.py)
    f"model.seq_len={SEQ}",
    "train.micro_batch_size=1",
    "train.global_batch_size=1",
    "train.eval_interval=1000",
    "logging.progress=false",
]
LLAMA3 = [
    "model.rope_scaling=llama3",
    f"model.rope_original_max_positions={ORIGINAL}",
    f"model.max_positions={POSITIONS}",
]


def error_of(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    return str(info.value)


def hf_llama_config(**rope):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=500,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=POSITIONS,
        rms_norm_eps=1e-5,
        rope_theta=THETA,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        **rope,
    )


ORIGINAL_KEY = {"original_max_position_embeddings": ORIGINAL}
LLAMA3_HF = {"rope_type": "llama3", **SCALING, **ORIGINAL_KEY}


# ----------------------------------------------------------------------------- frequencies


def test_scaled_frequencies_are_transformers_llama3():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = Llama3Scaling(8.0, 1.0, 4.0, ORIGINAL)
    plain = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    ours = scaling.scale(plain)
    assert ours.dtype == torch.float64
    theirs, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](
        hf_llama_config(rope_scaling=dict(LLAMA3_HF), head_dim=HEAD_DIM), "cpu"
    )
    assert attention_factor == 1.0  # llama3 leaves cos and sin unscaled
    # transformers derives its frequencies in float32: equal to float32's precision
    torch.testing.assert_close(ours, theirs.double(), rtol=1e-6, atol=0.0)
    # all three bands occur: kept, interpolated, slowed by the whole factor
    ratio = (ours / plain).tolist()
    assert ratio[0] == 1.0 and 1 / 8 < ratio[1] < 1
    assert ratio[2:] == pytest.approx([1 / 8] * 6, rel=1e-12)

    cos, sin = rotary_tables(HEAD_DIM, POSITIONS, THETA, scaling)
    angles = torch.outer(torch.arange(POSITIONS, dtype=torch.float64), ours)
    torch.testing.assert_close(cos, torch.cat([angles, angles], -1).cos().float())
    torch.testing.assert_close(sin, torch.cat([angles, angles], -1).sin().float())
    unscaled, _ = rotary_tables(HEAD_DIM, POSITIONS, THETA)
    assert not torch.allclose(cos, unscaled, atol=1e-3)


# ----------------------------------------------------------------------------- config


def test_llama3_defaults_are_llama_3_1s():
    m = load_config(None, ["model.arch=llama", "model.rope_scaling=llama3"]).model
    assert (
        m.rope_scaling_factor,
        m.rope_low_freq_factor,
        m.rope_high_freq_factor,
        m.rope_original_max_positions,
    ) == (8.0, 1.0, 4.0, 8192)
    plain = load_config(None, ["model.arch=llama"]).model
    assert plain.rope_scaling == "none" and plain.rope_scaling_factor is None


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["model.arch=llama", "model.rope_scaling=yarn"],
            "model.rope_scaling must be none or llama3, got 'yarn'",
        ),
        (
            ["model.arch=gpt", "model.rope_scaling=llama3"],
            "model.rope_scaling=llama3, but rope scaling is only in llama or mixtral "
            "(model.arch=gpt has no rotary embeddings to scale): set model.rope_scaling=none",
        ),
        (
            ["model.arch=llama", "model.rope_scaling_factor=4"],
            "model.rope_scaling_factor is set, but model.rope_scaling=none: set "
            "model.rope_scaling=llama3 to scale, or leave it out",
        ),
        (
            ["model.rope_low_freq_factor=2", "model.rope_original_max_positions=64"],
            "model.rope_low_freq_factor or model.rope_original_max_positions are set, but "
            "model.rope_scaling=none: set model.rope_scaling=llama3 to scale, or leave them out",
        ),
        (
            ["model.arch=llama", "model.rope_scaling=llama3", "model.rope_scaling_factor=0.5"],
            "model.rope_scaling_factor must be >= 1 (the context is that many times "
            "pretraining's), got 0.5",
        ),
        (
            ["model.arch=llama", "model.rope_scaling=llama3", "model.rope_high_freq_factor=1"],
            "need 0 < model.rope_low_freq_factor < model.rope_high_freq_factor, got 1.0 and "
            "1.0: set both (Llama 3.1: 1 and 4)",
        ),
        (
            [
                "model.arch=llama",
                "model.rope_scaling=llama3",
                "model.rope_original_max_positions=0",
            ],
            "model.rope_original_max_positions must be >= 1",
        ),
    ],
)
def test_rope_scaling_that_does_not_fit_names_the_fix(overrides, expected):
    assert error_of(overrides) == expected


# ----------------------------------------------------------------------------- Hugging Face


@pytest.mark.parametrize(
    "stored",
    [
        {"rope_parameters": {"rope_theta": THETA, **LLAMA3_HF}},  # transformers 5
        {"rope_theta": THETA, "rope_scaling": LLAMA3_HF},  # transformers 4
        {"rope_theta": THETA, "rope_scaling": {**SCALING, "type": "llama3"} | ORIGINAL_KEY},
    ],
)
def test_both_config_forms_read_as_llama3(stored):
    """Transformers 5 writes one `rope_parameters`; 4 wrote `rope_theta` and `rope_scaling`
    (whose `rope_type` was `type` in its first releases)."""
    from megalite.models.llama.hf import MAPPING

    stored = copy.deepcopy(stored)

    raw = hf_llama_config().to_dict()
    raw = {k: v for k, v in raw.items() if k not in ("rope_parameters", "rope_scaling")}
    settings = MAPPING.config_from_hf({**raw, **stored})
    assert {k: v for k, v in settings.items() if k.startswith("rope")} == {
        "rope_theta": THETA,
        "rope_scaling": "llama3",
        "rope_scaling_factor": 8.0,
        "rope_low_freq_factor": 1.0,
        "rope_high_freq_factor": 4.0,
        "rope_original_max_positions": ORIGINAL,
    }
    # without original_max_position_embeddings: pretrained at all of its positions
    del (stored.get("rope_parameters") or stored["rope_scaling"])[
        "original_max_position_embeddings"
    ]
    assert MAPPING.config_from_hf({**raw, **stored})["rope_original_max_positions"] == POSITIONS


@pytest.mark.parametrize("kind", ["yarn", "dynamic", "linear", "longrope"])
def test_other_rope_types_are_refused(tmp_path, kind):
    config = hf_llama_config().to_dict()
    config["rope_scaling"] = config.pop("rope_parameters", None) or {}
    config["rope_scaling"] |= {"rope_type": kind, "factor": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    m = load_config(None, LLAMA).model
    with pytest.raises(CheckpointError) as error:
        read_hf(tmp_path, m)
    assert str(error.value) == (
        f"{tmp_path}: rope scaling {kind!r} is not supported: megalite implements plain rotary "
        "embeddings and Llama 3.1's llama3 scaling"
    )


def test_hugging_face_llama3_in_and_out(builtin_corpus, tmp_path, monkeypatch, capsys):
    """In through `checkpoint.init_from` with nothing but the dimensions set: the positions
    and rotary settings are the model's; out through `export-hf` as transformers wrote it."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    torch.manual_seed(0)
    original = LlamaForCausalLM(hf_llama_config(rope_scaling=dict(LLAMA3_HF))).eval()
    with torch.no_grad():  # every tensor random; q and k large enough for sharp attention
        for name, param in original.named_parameters():
            param.normal_(0.0, 0.5 if name.endswith(("q_proj.weight", "k_proj.weight")) else 0.1)
    original.save_pretrained(tmp_path / "hf", safe_serialization=True)
    written = json.loads((tmp_path / "hf" / "config.json").read_text())

    # One real step at learning rate 0 changes no weight: the model is the original.
    monkeypatch.setattr(loop, "learning_rate", lambda step, optim, total: 0.0)
    run = tmp_path / "run"
    init = [f"checkpoint.init_from={tmp_path / 'hf'}", "train.steps=1", f"train.out_dir={run}"]
    assert main(["train", *LLAMA, *init]) == 0
    assert (
        "init_from: adopting the model's max_positions=128, rope_scaling=llama3, "
        "rope_scaling_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, "
        "rope_original_max_positions=32 (set model.max_positions, model.rope_scaling, "
        "model.rope_scaling_factor, model.rope_low_freq_factor, model.rope_high_freq_factor, "
        "model.rope_original_max_positions to override)"
    ) in capsys.readouterr().out.splitlines()
    ours = Checkpoint(resolve_checkpoint(run)).model()
    assert ours.ctx.cfg.rope_scaling == "llama3"

    ids = torch.randint(0, 500, (2, POSITIONS), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = original(ids).logits, ours(ids)
        assert (got - expected).abs().max().item() < 1e-4
        unscaled = LlamaForCausalLM(hf_llama_config()).eval()
        unscaled.load_state_dict(original.state_dict())
        # the scaling matters at these positions: unscaled frequencies are 10 tolerances off
        assert (unscaled(ids).logits - expected).abs().max().item() > 1e-3

    back = tmp_path / "back"
    assert main(["export-hf", "--checkpoint", str(run), "--out", str(back)]) == 0
    exported = json.loads((back / "config.json").read_text())
    key = "rope_parameters" if "rope_parameters" in written else "rope_scaling"
    assert exported[key] == written[key]  # the form the installed transformers writes
    assert exported["max_position_embeddings"] == POSITIONS
    theirs = AutoModelForCausalLM.from_pretrained(back).eval()
    with torch.no_grad():
        assert (theirs(ids).logits - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    "scaled, chosen, fix",
    [
        (
            True,
            ["model.rope_scaling=none"],
            "model.rope_scaling=llama3 model.rope_scaling_factor=8.0 "
            "model.rope_low_freq_factor=1.0 model.rope_high_freq_factor=4.0 "
            f"model.rope_original_max_positions={ORIGINAL}",
        ),
        (
            True,
            ["model.rope_scaling=llama3", "model.rope_scaling_factor=4"],
            "model.rope_scaling_factor=8.0",
        ),
        (True, ["model.rope_theta=500000"], "model.rope_theta=10000.0"),
        (True, ["model.max_positions=64"], f"model.max_positions={POSITIONS}"),
        (False, ["model.rope_scaling=llama3"], "model.rope_scaling=none"),
    ],
)
def test_rotary_settings_the_config_sets_must_be_the_models(tmp_path, scaled, chosen, fix):
    """What the config sets is not adopted: where the model differs, the error names the
    overrides (before any data is read), as for every other model setting."""
    hf_llama_config(rope_scaling=dict(LLAMA3_HF) if scaled else None).save_pretrained(tmp_path)
    cfg = load_config(None, [*LLAMA, *chosen, f"checkpoint.init_from={tmp_path}"])
    with pytest.raises(CheckpointError) as error:
        init_from_settings(cfg, None)
    assert str(error.value) == (
        f"the Hugging Face model in {tmp_path} does not match the config: set {fix}"
    )
    agreeing = [*LLAMA, *LLAMA3, f"checkpoint.init_from={tmp_path}"]
    if scaled:  # the same settings, set: nothing to adopt
        assert init_from_settings(load_config(None, agreeing), None)[1] == {}


def test_a_resume_that_changes_the_scaling_is_refused(builtin_corpus, tmp_path):
    run = [*LLAMA, *LLAMA3, f"train.out_dir={tmp_path}"]
    loop.train(load_config(None, [*run, "train.steps=1"]))
    with pytest.raises(CheckpointError) as error:
        loop.train(load_config(None, [*run, "train.steps=2", "model.rope_scaling_factor=4"]))
    assert "another model than this run's config: model.rope_scaling_factor 8.0 -> 4.0" in str(
        error.value
    )
    assert math.isclose(
        Checkpoint(resolve_checkpoint(tmp_path)).config["model"]["rope_scaling_factor"], 8.0
    )
