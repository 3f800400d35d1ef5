"""Hugging Face Qwen3 and Qwen3-MoE in and out: a random `Qwen3ForCausalLM` (QK-norm, q wider
than the model, a tied head, every norm random too) or `Qwen3MoeForCausalLM` (its experts and a
router sharp enough to matter) comes in through `checkpoint.init_from` computing transformers'
logits; at tp 2 + SP x pp 2 (ep 2 for the experts) its first evaluation is transformers' loss on
the same windows; `megalite export-hf` writes it back, which transformers loads to the same
logits; export, import and export again gives bit-identical tensors."""

import json

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F

import megalite.training.loop as loop
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


def hf_qwen3(tied: bool = True, moe: bool = False):
    """A random Hugging Face Qwen3 (Qwen3-MoE with `moe`) at QWEN3's widths."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

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
    if moe:
        experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, **experts, norm_topk_prob=True))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**shape))
    torch.manual_seed(0)
    with torch.no_grad():  # every tensor random, the norms' included, the router sharp
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.5 if name.endswith("mlp.gate.weight") else 0.1)
    return model.eval()


def _train(overrides: list[str]) -> None:
    train(load_config(None, overrides))


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3-moe"])
def test_hugging_face_qwen3_in_and_out(moe, builtin_corpus, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    original = hf_qwen3(moe=moe)
    family = [*QWEN3, *(MOE if moe else [])]
    original.save_pretrained(tmp_path / "hf", safe_serialization=True)
    monkeypatch.setattr(loop, "learning_rate", lambda step, optim, total: 0.0)
    run = tmp_path / "run"
    init = [f"checkpoint.init_from={tmp_path / 'hf'}", "train.steps=1", f"train.out_dir={run}"]
    assert main(["train", *family, *init]) == 0
    ours = Checkpoint(resolve_checkpoint(run)).model()
    ids = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = original(ids).logits
        assert (ours(ids) - expected).abs().max().item() < 1e-4

    back = tmp_path / "back"
    assert main(["export-hf", "--checkpoint", str(run), "--out", str(back)]) == 0
    assert json.loads((back / "config.json").read_text())["tie_word_embeddings"] is True
    theirs = AutoModelForCausalLM.from_pretrained(back).eval()
    with torch.no_grad():
        assert (theirs(ids).logits - expected).abs().max().item() < 1e-4

    again = tmp_path / "again"
    assert main(["train", *family, f"checkpoint.init_from={back}", "train.steps=1",
                 f"train.out_dir={again}"]) == 0  # fmt: skip
    assert main(["export-hf", "--checkpoint", str(again), "--out", str(tmp_path / "b2")]) == 0
    first = safetensors.torch.load_file(next(back.glob("*.safetensors")))
    second = safetensors.torch.load_file(next((tmp_path / "b2").glob("*.safetensors")))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)


@pytest.mark.parametrize(
    "moe, layout",
    [(False, ["parallel.pp=2"]), (True, ["parallel.ep=2"])],
    ids=["qwen3-tp2-sp-pp2", "qwen3-moe-tp2-sp-ep2"],
)
def test_qwen3_in_a_layout_evaluates_as_transformers_does(moe, layout, builtin_corpus, tmp_path):
    """The first evaluation after one step at a vanishing learning rate (1e-12: the weights
    move by about that) is transformers' mean loss on the same held-out windows."""
    hf_qwen3(moe=moe).save_pretrained(tmp_path / "hf", safe_serialization=True)
    out = tmp_path / "layout"
    family = [*QWEN3, *(MOE if moe else [])]
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
        logits = hf_qwen3(moe=moe)(batch.inputs).logits
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
        (["model.arch=llama", "model.head_dim=24"], "model.head_dim .* only qwen3"),
        (["model.arch=llama", "model.tie_embeddings=true"], "tie_embeddings is for qwen3"),
        (["model.arch=qwen3", "model.hidden=64", "model.n_heads=5"], "or set model.head_dim"),
        (["model.arch=qwen3", "model.head_dim=7"], "model.head_dim must be even"),
    ],
)
def test_head_settings_that_do_not_fit_name_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
