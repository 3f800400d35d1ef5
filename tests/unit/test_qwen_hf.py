"""Hugging Face Qwen2, Qwen3 and Qwen3-MoE in and out: a random `Qwen3ForCausalLM` (QK-norm, q
wider than the model, a tied head, every norm random too), `Qwen2ForCausalLM` (q, k and v
biases) or `Qwen3MoeForCausalLM` (its experts and a router sharp enough to matter) comes in
through `checkpoint.init_from` computing transformers' logits; at tp 2 + SP x pp 2 (ep 2 for
the experts) its first evaluation is transformers' loss on the same windows; `megalite
export-hf` writes it back, which transformers loads to the same logits; export, import and
export again gives bit-identical tensors."""

import json

import pytest
import torch
import torch.nn.functional as F
from hf_round_trip import assert_round_trip, randomised

from megalite.checkpoint.sharded import Checkpoint, resolve_checkpoint
from megalite.cli import main
from megalite.config import ConfigError, load_config
from megalite.launch import run_ranks
from megalite.training.loop import open_data, train

QWEN3 = [
    "model.arch=qwen3",
    "model.n_layers=2",
    "model.hidden=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.head_dim=24",  # q is 96 wide: not the hidden size
    "model.ffn_hidden=96",
    "model.tie_embeddings=true",
    "model.norm_eps=1e-6",
    "model.vocab_size=500",  # the test corpus' vocabulary (tests/conftest.py)
    "model.seq_len=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.eval_interval=1000",
    "logging.progress=false",
]


MOE = [
    "model.arch=qwen3_moe",
    "model.ffn_hidden=48",
    "model.moe_experts=4",
    "model.moe_top_k=2",
]
"""Qwen3-MoE at the same widths: QWEN3 with these after it."""
FAMILIES = {
    "qwen2": ["model.arch=qwen2", "model.head_dim=16"],  # q, k, v biases; head_dim h / heads
    "qwen3": [],
    "qwen3_moe": MOE,
}
"""Each family as QWEN3's overrides and these after them."""


def hf_qwen3(tied: bool = True, family: str = "qwen3"):
    """A random Hugging Face model of `family` (FAMILIES) at QWEN3's widths."""
    from transformers import (
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    shape = dict(
        vocab_size=500,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=tied,
        bos_token_id=None,
        eos_token_id=None,
    )
    if family == "qwen3_moe":
        experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, **experts, norm_topk_prob=True))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**(shape | dict(head_dim=16))))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**shape))
    return randomised(model, router="mlp.gate.weight")


def _train(overrides: list[str]) -> None:
    train(load_config(None, overrides))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_hugging_face_qwen_in_and_out(name, builtin_corpus, tmp_path, monkeypatch):
    overrides = [*QWEN3, *FAMILIES[name]]
    back = assert_round_trip(hf_qwen3(family=name), overrides, tmp_path, monkeypatch)
    assert json.loads((back / "config.json").read_text())["tie_word_embeddings"] is True


@pytest.mark.parametrize(
    "name, layout",
    [("qwen2", ["parallel.pp=2"]), ("qwen3", ["parallel.pp=2"]), ("qwen3_moe", ["parallel.ep=2"])],
    ids=["qwen2-tp2-sp-pp2", "qwen3-tp2-sp-pp2", "qwen3-moe-tp2-sp-ep2"],
)
def test_qwen_in_a_layout_evaluates_as_transformers_does(name, layout, builtin_corpus, tmp_path):
    """The first evaluation after one step at a vanishing learning rate (1e-12: the weights
    move by about that) is transformers' mean loss on the same held-out windows."""
    hf_qwen3(family=name).save_pretrained(tmp_path / "hf", safe_serialization=True)
    out = tmp_path / "layout"
    family = [*QWEN3, *FAMILIES[name]]
    overrides = [*family, f"checkpoint.init_from={tmp_path / 'hf'}", "train.steps=1",
                 "train.eval_interval=1", "train.eval_steps=1", "optim.lr=1e-12",
                 "optim.min_lr=0", "parallel.tp=2", "parallel.sp=true", *layout,
                 f"train.out_dir={out}"]  # fmt: skip
    run_ranks(4, _train, overrides)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val_loss = next(row["val_loss"] for row in rows if row.get("val_loss") is not None)

    cfg = load_config(None, overrides)
    val = open_data(cfg).val
    batch = val.read(val.evaluation_pairs(0, cfg.train.global_batch_size), True, True)
    with torch.no_grad():
        logits = hf_qwen3(family=name)(batch.inputs).logits
    expected = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten()).item()
    assert val_loss == pytest.approx(expected, rel=1e-4)


def test_an_untied_qwen3_keeps_its_head(builtin_corpus, tmp_path):
    original = hf_qwen3(tied=False)
    original.save_pretrained(tmp_path / "hf", safe_serialization=True)
    run = tmp_path / "run"
    untied = [o for o in QWEN3 if not o.startswith("model.tie_embeddings")]
    init = [f"checkpoint.init_from={tmp_path / 'hf'}", "train.steps=1", f"train.out_dir={run}"]
    assert (
        main(
            [
                "train",
                *untied,
                "model.tie_embeddings=false",
                *init,
                "optim.lr=1e-12",
                "optim.min_lr=0",
            ]
        )
        == 0
    )
    checkpoint = Checkpoint(resolve_checkpoint(run))
    head = checkpoint.tensor("lm_head.weight")[:500]
    assert torch.allclose(head, original.lm_head.weight, atol=1e-9)
    assert not torch.allclose(head, checkpoint.tensor("tok_embeddings.weight")[:500])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.arch=llama", "model.head_dim=24"], "model.head_dim .* mistral, gemma3, qwen3"),
        (["model.arch=llama", "model.tie_embeddings=true"], "tie_embeddings is for gemma3, qwen2"),
        (["model.arch=qwen3", "model.hidden=64", "model.n_heads=5"], "or set model.head_dim"),
        (["model.arch=qwen3", "model.head_dim=7"], "model.head_dim must be even"),
    ],
)
def test_head_settings_that_do_not_fit_name_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
