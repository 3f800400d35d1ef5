"""What comes in from, and goes out to, Hugging Face, where it is not what megalite builds or
what it wrote: a GPT-2 with a head of its own, a Mixtral asked to be another router, shards
missing or damaged, a directory beside the export that is the user's, and a megalite MoE model
started from or sampled with the routing it was trained under."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from run_configs import ONE_LAYER

from megalite.checkpoint.hf import check_hf_config, export_hf, read_hf
from megalite.checkpoint.sharded import Checkpoint, CheckpointError, check_same_model
from megalite.config import config_to_dict, load_config
from megalite.generate import generate
from megalite.training.loop import train

SHAPE = ["model.hidden=32", "model.n_layers=1", "model.n_heads=4", "model.n_kv_heads=2"]
SHAPE += ["model.ffn_hidden=64", "model.vocab_size=100"]
HF_SHAPE = dict(
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    vocab_size=100,
)
"""One tiny model's shape, as megalite's overrides and as transformers' config fields."""
LLAMA = ["model.arch=llama", *SHAPE, "model.seq_len=16", "model.norm_eps=1e-6"]


def _gpt2(tmp_path: Path, **settings) -> dict:
    from transformers import GPT2Config

    raw = GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=100, **settings).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return raw


def test_a_gpt2_with_a_head_of_its_own_is_refused(tmp_path):
    m = load_config(None, ["model.hidden=32", "model.n_layers=1", "model.n_heads=4"]).model
    raw = _gpt2(tmp_path, tie_word_embeddings=False)
    with pytest.raises(CheckpointError, match="an LM head of its own .*: GPT's is wte"):
        check_hf_config(raw, tmp_path, m)


def test_a_mixtral_asked_to_route_otherwise_names_the_settings(tmp_path):
    from transformers import MixtralConfig

    raw = MixtralConfig(**HF_SHAPE, num_local_experts=4, num_experts_per_tok=2).to_dict()
    overrides = ["model.arch=mixtral", *SHAPE, "model.moe_experts=4", "model.moe_router=sigmoid"]
    overrides += ["model.moe_shared_experts=1"]
    m = load_config(None, overrides).model
    with pytest.raises(
        CheckpointError, match="model.moe_router=softmax model.moe_shared_experts=0"
    ):
        check_hf_config(raw, tmp_path, m)


def test_an_exported_mixtral_weighs_its_balancing_loss_as_megalite_did():
    """transformers' Mixtral balancing loss is top_k times megalite's, so the exported
    coefficient is megalite's over top_k: fine-tuning the export weighs the loss the same."""
    from megalite.models.mixtral.hf import MAPPING
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from megalite.expert_parallel.router import balancing_loss, softmax_top_k

    moe = ["model.moe_experts=8", "model.moe_top_k=2", "model.moe_aux_loss_coef=0.02"]
    m = load_config(None, ["model.arch=mixtral", *SHAPE, *moe]).model
    exported = MAPPING.hf_config(m)
    logits = torch.randn(64, m.moe_experts)
    routing = softmax_top_k(logits, m.moe_top_k)
    ours = m.moe_aux_loss_coef * balancing_loss(routing.probs, routing.experts, 8, 64)
    theirs = exported.router_aux_loss_coef * load_balancing_loss_func((logits,), 8, 2)
    assert torch.allclose(ours, theirs, rtol=1e-5), (ours, theirs)


def test_a_resume_that_routes_otherwise_is_refused():
    overrides = ["model.arch=mixtral", "model.n_kv_heads=2", "model.moe_experts=4"]
    saved = config_to_dict(load_config(None, overrides))
    now = config_to_dict(load_config(None, [*overrides, "model.moe_top_k=1"]))
    ckpt = SimpleNamespace(config=saved, path=Path("step_000004"))
    with pytest.raises(CheckpointError, match="model.moe_top_k 2 -> 1"):
        check_same_model(ckpt, now)


def _llama_shards(tmp_path: Path) -> Path:
    """A tiny Llama saved in two shards with their index, as published models are."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**HF_SHAPE, max_position_embeddings=16)
    LlamaForCausalLM(config).save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    return tmp_path


def test_missing_or_damaged_shards_are_named(tmp_path):
    m = load_config(None, LLAMA).model
    path = _llama_shards(tmp_path)
    assert len(read_hf(path, m)) > 0
    first, second = sorted(path.glob("model-*.safetensors"))[:2]
    first.write_bytes(first.read_bytes()[:100])  # an interrupted download
    with pytest.raises(CheckpointError, match=rf"{first.name} cannot be read .*download"):
        read_hf(path, m)
    second.unlink()
    with pytest.raises(CheckpointError, match=rf"lacks {second.name}, which its .*index"):
        read_hf(path, m)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, builtin_corpus) -> Path:
    out = tmp_path_factory.mktemp("hf") / "run"
    train(load_config(None, [*ONE_LAYER, "train.steps=2", f"train.out_dir={out}"]))
    return out


def test_an_export_leaves_a_directory_of_the_users_beside_it_alone(trained, tmp_path):
    theirs = tmp_path / "model.tmp"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    export_hf(trained, tmp_path / "model")
    assert (theirs / "notes.txt").read_text() == "mine"
    assert (tmp_path / "model" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "model.tmp"]


def test_top_k_zero_samples_from_every_token(trained):
    model = Checkpoint(trained / "checkpoints" / "step_000002").model()
    ids = torch.zeros((2, 3), dtype=torch.int64)
    out = generate(model, ids, 5, 1.0, 0, torch.Generator().manual_seed(0))
    assert out.shape == (2, 8) and torch.equal(out[:, :3], ids)


def test_sampling_refuses_a_negative_temperature(trained):
    model = Checkpoint(trained / "checkpoints" / "step_000002").model()
    with pytest.raises(ValueError, match="temperature must be 0 .greedy. or more, not -0.5"):
        generate(model, torch.zeros((1, 2), dtype=torch.int64), 1, -0.5)


def test_an_empty_prompt_starts_where_training_documents_start(trained, monkeypatch):
    """Prepared data separates documents by EOS alone: that, not BOS (which training never
    saw, and which a tokenizer may lack), is what unprompted sampling continues from."""
    import megalite.generate as sampling

    started = []
    monkeypatch.setattr(sampling, "generate", lambda model, ids, *rest: started.append(ids) or ids)
    checkpoint = trained / "checkpoints" / "step_000002"
    sampling.sample_text(checkpoint, "", 4, 0.0, None, 0)
    assert started[0].tolist() == [[Checkpoint(checkpoint).tokenizer.eos_id]]


def test_a_sigmoid_routed_model_is_sampled_and_started_from_with_its_routing_biases(
    builtin_corpus, tmp_path
):
    deepseek = ["model.arch=mixtral", "model.n_kv_heads=2", "model.moe_experts=4"]
    deepseek += ["model.moe_router=sigmoid", "model.moe_bias_update_rate=0.05"]
    out = tmp_path / "run"
    train(load_config(None, [*ONE_LAYER, *deepseek, "train.steps=3", f"train.out_dir={out}"]))
    checkpoint = Checkpoint(out / "checkpoints" / "step_000003")
    saved = checkpoint.tensor("layers.0.mlp.expert_bias")
    assert saved.abs().min() > 0  # three moves of +-0.05 each
    sampled = checkpoint.model()
    assert torch.equal(sampled.layers["0"].mlp.expert_bias, saved)

    from megalite.parallel_state import ParallelState
    from megalite.training.setup import build_run

    cfg = load_config(None, [*ONE_LAYER, *deepseek, f"checkpoint.init_from={checkpoint.path}"])
    run = build_run(cfg, ParallelState.single(), init_from=checkpoint.path)
    assert torch.equal(run.moe_layers["layers.0.mlp"].expert_bias, saved)
