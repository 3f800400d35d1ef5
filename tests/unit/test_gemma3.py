"""Gemma 3 (its text model) in and out of Hugging Face. A random `Gemma3ForCausalLM` with both
kinds of layer (a window of 8 over the sequence of 32 on layers 0, 1 and 3, layer 2 global),
a head width of its own (24 at hidden 64 and 4 heads), a softmax scale that is not head_dim's
(query_pre_attn_scalar 20), local and global rotary bases and the global layers' linear
scaling, every norm weight random, comes in through `checkpoint.init_from` computing
transformers' logits, and goes out and back bit for bit; at tp 2 + SP x pp 2 and at cp 2 its
first evaluation is transformers' loss; each of those settings changes transformers' logits
(so the tests above would see one lost); transformers 4's config form reads as 5's; the
estimate's parameters and matmul weights are the built model's; and what megalite does not
implement is refused, on import and in the config."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from hf_round_trip import assert_round_trip, randomised
from megalite.models.formulas import formulas_of
from megalite.models.hugging_face import hf_mapping

from megalite.config import ConfigError, load_config
from megalite.launch import run_ranks
from megalite.profiling.parameters import chunk_parameters
from megalite.training.loop import open_data, train

GEMMA = [
    "model.arch=gemma3",
    "model.n_layers=4",
    "model.hidden=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.head_dim=24",  # q is 96 wide: not the hidden size
    "model.ffn_hidden=96",
    "model.tie_embeddings=true",
    "model.sliding_window=8",
    "model.sliding_window_pattern=3",  # layer 2 global, the others local
    "model.query_scale=20",
    "model.rope_theta=1000000",
    "model.rope_local_theta=10000",
    "model.rope_linear_factor=8",
    "model.norm_eps=1e-6",
    "model.vocab_size=500",  # the test corpus' vocabulary (tests/conftest.py)
    "model.seq_len=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.eval_interval=1000",
    "logging.progress=false",
]
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def hf_config(**changes):
    from transformers import Gemma3TextConfig

    settings = dict(
        vocab_size=500,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        query_pre_attn_scalar=20,
        sliding_window=8,
        layer_types=LAYER_TYPES,
        sliding_window_pattern=3,  # what transformers 4 before 4.53 reads
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    config = Gemma3TextConfig(**(settings | changes))
    config._attn_implementation = "eager"  # the one that applies the window on CPU
    return config


def hf_gemma3(**changes):
    from transformers import Gemma3ForCausalLM

    return randomised(Gemma3ForCausalLM(hf_config(**changes)))


def test_hugging_face_gemma3_in_and_out(builtin_corpus, tmp_path, monkeypatch):
    back = assert_round_trip(hf_gemma3(), GEMMA, tmp_path, monkeypatch)
    written = json.loads((back / "config.json").read_text())
    assert written["model_type"] == "gemma3_text"
    assert written["tie_word_embeddings"] is True
    assert (written["query_pre_attn_scalar"], written["sliding_window"]) == (20, 8)
    assert written["layer_types"] == LAYER_TYPES
    assert hf_mapping("gemma3").config_from_hf(written)["rope_linear_factor"] == 8.0


@pytest.mark.parametrize(
    "change",
    [
        dict(query_pre_attn_scalar=24),
        dict(rope_local_base_freq=1e6),
        dict(rope_scaling=None),
        dict(sliding_window=32),
        dict(layer_types=["sliding_attention"] * 4),
    ],
    ids=["query-scale", "local-base", "linear-scaling", "window", "layer-types"],
)
def test_each_setting_changes_the_logits(change):
    """The same weights under a changed setting compute other logits: a setting the round
    trip lost would show."""
    ids = torch.randint(0, 500, (1, 32), generator=torch.Generator().manual_seed(1))
    model, changed = hf_gemma3(), hf_gemma3(**change)
    with torch.no_grad():
        assert (model(ids).logits - changed(ids).logits).abs().max() > 1e-3


def _train(overrides: list[str]) -> None:
    train(load_config(None, overrides))


@pytest.mark.parametrize(
    "layout",
    [["parallel.tp=2", "parallel.sp=true", "parallel.pp=2"], ["parallel.cp=2"]],
    ids=["tp2-sp-pp2", "cp2"],
)
def test_gemma3_in_a_layout_evaluates_as_transformers_does(layout, builtin_corpus, tmp_path):
    """The first evaluation after one step at a vanishing learning rate (1e-12: the weights
    move by about that) is transformers' mean loss on the same held-out windows."""
    hf_gemma3().save_pretrained(tmp_path / "hf", safe_serialization=True)
    out = tmp_path / "layout"
    overrides = [*GEMMA, f"checkpoint.init_from={tmp_path / 'hf'}", "train.steps=1",
                 "train.eval_interval=1", "train.eval_steps=1", "optim.lr=1e-12",
                 "optim.min_lr=0", *layout, f"train.out_dir={out}"]  # fmt: skip
    run_ranks(4 if "parallel.pp=2" in layout else 2, _train, overrides)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val_loss = next(row["val_loss"] for row in rows if row.get("val_loss") is not None)
    cfg = load_config(None, overrides)
    val = open_data(cfg).val
    batch = val.read(val.evaluation_pairs(0, cfg.train.global_batch_size), True, True)
    with torch.no_grad():
        logits = hf_gemma3()(batch.inputs).logits
    expected = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten()).item()
    assert val_loss == pytest.approx(expected, rel=1e-4)


def test_transformers_4_config_reads_as_5s():
    """transformers 4 wrote `rope_theta`, `rope_local_base_freq`, the global layers'
    `rope_scaling` and (before 4.53) only `sliding_window_pattern`."""
    raw = hf_config().to_dict()
    old = {k: v for k, v in raw.items() if k not in ("rope_parameters", "layer_types")}
    old |= dict(
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window_pattern=3,
    )
    mapping = hf_mapping("gemma3")
    assert mapping.config_from_hf(old) == mapping.config_from_hf(raw)
    settings = mapping.config_from_hf(raw)
    assert settings["sliding_window_pattern"] == 3 and settings["query_scale"] == 20
    assert (settings["rope_local_theta"], settings["rope_theta"]) == (1e4, 1e6)
    unscaled = hf_config(rope_scaling=None, layer_types=["sliding_attention"] * 4).to_dict()
    unscaled = mapping.config_from_hf(unscaled)
    assert unscaled["rope_linear_factor"] is None and unscaled["sliding_window_pattern"] is None


def test_the_estimate_counts_the_built_model():
    """Parameter names and sizes as built (tp 1: the fused ones whole); a block's matmul
    weights (FLOPs) are its linears': q/k/v, the output projection, gate/up and down."""
    from megalite.models.factory import build_chunks

    from megalite.parallel_state import build_parallel_state
    from megalite.tensor_parallel import TPRandom

    cfg = load_config(None, GEMMA)
    ps = build_parallel_state(1, 1, torch.device("cpu"))
    (model,) = build_chunks(cfg, ps, TPRandom(cfg.train.seed, ps))
    built = [(name, p.numel()) for name, p in model.named_parameters()]
    estimated = chunk_parameters(cfg, range(4), True, True)
    assert built == [(p.name, p.numel) for p in estimated]
    matmuls = sum(n for name, n in built if name.startswith("layers.0.") and "norm" not in name)
    assert formulas_of("gemma3").layer_matmul_weights(cfg.model) == matmuls
    assert all(p.abs().max() == 0 for name, p in model.named_parameters() if "norm" in name)


def _refusal(**changes) -> str:
    raw = copy.deepcopy(hf_config().to_dict()) | changes
    with pytest.raises(ValueError) as refused:
        hf_mapping("gemma3").config_from_hf(raw)
    return str(refused.value)


def test_what_megalite_does_not_implement_is_refused_on_import():
    assert "softcapping" in _refusal(final_logit_softcapping=30.0)
    assert "softcapping" in _refusal(attn_logit_softcapping=50.0)
    assert "gelu_pytorch_tanh" in _refusal(hidden_activation="gelu")
    assert "bidirectional" in _refusal(use_bidirectional_attention=True)
    assert "biases" in _refusal(attention_bias=True)
    irregular = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]
    assert "1 local layers and one global" in _refusal(layer_types=irregular)
    assert "sliding_window is null" in _refusal(sliding_window=None)
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}
    rope = {"full_attention": dynamic, "sliding_attention": {"rope_type": "default"}}
    assert "'dynamic' on the global layers" in _refusal(rope_parameters=rope)
    local = {"full_attention": {"rope_type": "default"}, "sliding_attention": dynamic}
    assert "on the local layers" in _refusal(rope_parameters=local)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.arch=llama", "model.query_scale=20"], "model.query_scale is for gemma3"),
        (["model.arch=mistral", "model.rope_local_theta=1e4"], "rope_local_theta is for gemma3"),
        (["model.arch=qwen3", "model.rope_linear_factor=8"], "rope_linear_factor is for gemma3"),
        ([*GEMMA, "model.query_scale=0"], "model.query_scale must be > 0"),
        ([*GEMMA, "model.rope_local_theta=-1"], "model.rope_local_theta must be > 0"),
        ([*GEMMA, "model.rope_linear_factor=0.5"], "model.rope_linear_factor must be >= 1"),
        ([*GEMMA, "model.rope_scaling=llama3"], "rope scaling is only in"),
    ],
)
def test_configs_that_cannot_be_say_what_to_change(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
