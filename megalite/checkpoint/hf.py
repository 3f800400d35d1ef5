"""Export a checkpoint as a Hugging Face model directory (config.json + model.safetensors) that
`transformers.AutoModelForCausalLM.from_pretrained` loads: GPT as `GPT2LMHeadModel`, Llama as
`LlamaForCausalLM`.

Checkpoint tensors are stored by global name, so a checkpoint of any tp / pp layout exports the
same way. What changes on the way: the names, the vocabulary padding (dropped), and GPT-2's
`Conv1D` layout (q, k and v fused into one `c_attn`, every projection stored transposed). Llama
needs no permutation of q and k, because megalite's rotary embedding already uses the Hugging Face
`rotate_half` convention.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megalite.checkpoint.sharded import TOKENIZER, CheckpointError
from megalite.config import ModelConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def _gpt2_state(params: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    state = {
        "transformer.wte.weight": params["wte.weight"],
        "transformer.wpe.weight": params["wpe"],
        "transformer.ln_f.weight": params["final_norm.weight"],
        "transformer.ln_f.bias": params["final_norm.bias"],
        "lm_head.weight": params["wte.weight"],  # tied
    }
    for i in range(m.n_layers):
        ours, theirs = f"layers.{i}.", f"transformer.h.{i}."
        qkv = [params[f"{ours}attn.{w}.weight"] for w in ("wq", "wk", "wv")]
        state[f"{theirs}attn.c_attn.weight"] = torch.cat(qkv, dim=0).t()
        qkv_bias = [params[f"{ours}attn.{w}.bias"] for w in ("wq", "wk", "wv")]
        state[f"{theirs}attn.c_attn.bias"] = torch.cat(qkv_bias)
        for mine, hf in [
            ("attn_norm", "ln_1"),
            ("mlp_norm", "ln_2"),
            ("attn.wo", "attn.c_proj"),
            ("mlp.fc", "mlp.c_fc"),
            ("mlp.proj", "mlp.c_proj"),
        ]:
            weight = params[f"{ours}{mine}.weight"]
            state[f"{theirs}{hf}.weight"] = weight if weight.dim() == 1 else weight.t()
            state[f"{theirs}{hf}.bias"] = params[f"{ours}{mine}.bias"]
    return state


def _llama_state(params: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    state = {
        "model.embed_tokens.weight": params["tok_embeddings.weight"],
        "model.norm.weight": params["final_norm.weight"],
        "lm_head.weight": params["lm_head.weight"],
    }
    for i in range(m.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for mine, hf in [
            ("attn_norm", "input_layernorm"),
            ("mlp_norm", "post_attention_layernorm"),
            ("attn.wq", "self_attn.q_proj"),
            ("attn.wk", "self_attn.k_proj"),
            ("attn.wv", "self_attn.v_proj"),
            ("attn.wo", "self_attn.o_proj"),
            ("mlp.gate", "mlp.gate_proj"),
            ("mlp.up", "mlp.up_proj"),
            ("mlp.down", "mlp.down_proj"),
        ]:
            state[f"{theirs}{hf}.weight"] = params[f"{ours}{mine}.weight"]
    return state


def hf_config(m: ModelConfig) -> PretrainedConfig:
    """The Hugging Face config of megalite's architecture and dimensions (`GPT2Config` or
    `LlamaConfig`); `AutoModelForCausalLM.from_config` builds the model."""
    from transformers import GPT2Config, LlamaConfig

    if m.arch == "gpt":
        return GPT2Config(
            vocab_size=m.vocab_size,
            n_positions=m.seq_len,
            n_embd=m.hidden,
            n_layer=m.n_layers,
            n_head=m.n_heads,
            n_inner=m.ffn_hidden,
            activation_function="gelu_new",  # the tanh approximation, as megalite's GPT
            layer_norm_epsilon=m.norm_eps,
            resid_pdrop=m.dropout,
            embd_pdrop=m.dropout,
            attn_pdrop=m.dropout,
            bos_token_id=None,  # GPT-2's 50256 would lie outside a megalite vocabulary
            eos_token_id=None,
            tie_word_embeddings=True,
        )
    return LlamaConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden,
        intermediate_size=m.ffn_hidden,
        num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads,
        num_key_value_heads=m.n_kv_heads,
        head_dim=m.head_dim,
        max_position_embeddings=m.seq_len,
        rms_norm_eps=m.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
        attention_dropout=m.dropout,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
    )


def export_hf(checkpoint: Path, out: Path) -> Path:
    """Write the checkpoint's model to `out` (which must not exist yet) as a Hugging Face model
    directory, with the sentencepiece `tokenizer.model` beside it. Written to a temporary
    directory first and renamed into place, so `out` is either complete or absent."""
    from transformers import AutoModelForCausalLM

    from megalite.generate import load_for_inference

    checkpoint, out = Path(checkpoint), Path(out)
    if out.exists():
        raise CheckpointError(f"{out} already exists: choose another --out, or remove it first")
    model, _ = load_for_inference(checkpoint)
    m = model.ctx.cfg
    params = {
        name: p.detach()[: m.vocab_size] if p.meta.init_rows is not None else p.detach()
        for name, p in model.named_parameters()
    }
    state = (_gpt2_state if m.arch == "gpt" else _llama_state)(params, m)
    hf = AutoModelForCausalLM.from_config(hf_config(m))
    hf.load_state_dict(state, strict=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    hf.save_pretrained(tmp, safe_serialization=True)
    shutil.copyfile(checkpoint / TOKENIZER, tmp / TOKENIZER)
    tmp.rename(out)
    return out
