"""Hugging Face, both ways: export a checkpoint as a model directory (config.json +
model.safetensors) that `transformers.AutoModelForCausalLM.from_pretrained` loads (GPT as
`GPT2LMHeadModel`, Llama as `LlamaForCausalLM`), and read such a directory back as global
megalite tensors for `checkpoint.init_from`.

Checkpoint tensors are stored by global name, so any tp / pp layout converts the same way. What
changes on the way: the names (one table, `links`, serves both directions), the vocabulary
padding, and GPT-2's `Conv1D` layout (q, k and v fused into one `c_attn`, every projection stored
transposed). Llama needs no permutation of q and k, because megalite's rotary embedding already
uses the Hugging Face `rotate_half` convention.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from megalite.checkpoint.sharded import Checkpoint, CheckpointError, resolve_checkpoint
from megalite.config import ModelConfig
from megalite.tensor_parallel import global_tensors

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class Link:
    """Megalite tensor `ours` is (part `part` of `parts` along dim 0 of) Hugging Face tensor
    `theirs`, stored transposed when `transposed` (GPT-2's Conv1D)."""

    ours: str
    theirs: str
    transposed: bool = False
    part: int = 0
    parts: int = 1


def links(m: ModelConfig) -> list[Link]:
    """The name map between megalite and Hugging Face, used in both directions."""
    if m.arch == "gpt":
        found = [
            Link("wte.weight", "transformer.wte.weight"),
            Link("wpe", "transformer.wpe.weight"),
            Link("final_norm.weight", "transformer.ln_f.weight"),
            Link("final_norm.bias", "transformer.ln_f.bias"),
        ]
        for i in range(m.n_layers):
            ours, theirs = f"layers.{i}.", f"transformer.h.{i}."
            for n, w in enumerate(("wq", "wk", "wv")):  # fused into c_attn
                found.append(
                    Link(f"{ours}attn.{w}.weight", f"{theirs}attn.c_attn.weight", True, n, 3)
                )
                found.append(Link(f"{ours}attn.{w}.bias", f"{theirs}attn.c_attn.bias", False, n, 3))
            for mine, hf, conv1d in [
                ("attn_norm", "ln_1", False),
                ("mlp_norm", "ln_2", False),
                ("attn.wo", "attn.c_proj", True),
                ("mlp.fc", "mlp.c_fc", True),
                ("mlp.proj", "mlp.c_proj", True),
            ]:
                found.append(Link(f"{ours}{mine}.weight", f"{theirs}{hf}.weight", conv1d))
                found.append(Link(f"{ours}{mine}.bias", f"{theirs}{hf}.bias"))
        return found
    found = [
        Link("tok_embeddings.weight", "model.embed_tokens.weight"),
        Link("final_norm.weight", "model.norm.weight"),
        Link("lm_head.weight", "lm_head.weight"),
    ]
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
            found.append(Link(f"{ours}{mine}.weight", f"{theirs}{hf}.weight"))
    return found


def to_hf_state(params: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """Global megalite tensors (real vocabulary rows) -> a Hugging Face state dict."""
    parts: dict[str, list[torch.Tensor]] = {}
    transposed: dict[str, bool] = {}
    for link in links(m):  # parts of a fused tensor come in order
        parts.setdefault(link.theirs, []).append(params[link.ours])
        transposed[link.theirs] = link.transposed
    state = {}
    for name, pieces in parts.items():
        full = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        state[name] = full.t() if transposed[name] else full
    if m.arch == "gpt":
        state["lm_head.weight"] = state["transformer.wte.weight"]  # tied
    return state


def from_hf_state(
    state: dict[str, torch.Tensor], m: ModelConfig, names: Collection[str] | None = None
) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict -> global megalite tensors (real vocabulary rows): all of them,
    or those in `names`."""
    params = {}
    for link in links(m):
        if names is not None and link.ours not in names:
            continue
        if link.theirs not in state:
            raise CheckpointError(f"the Hugging Face weights have no tensor {link.theirs!r}")
        full = state[link.theirs]
        full = full.t() if link.transposed else full
        params[link.ours] = full.chunk(link.parts)[link.part] if link.parts > 1 else full
    return params


def hf_config(m: ModelConfig) -> PretrainedConfig:
    """The Hugging Face config of megalite's architecture and dimensions (`GPT2Config` or
    `LlamaConfig`); `AutoModelForCausalLM.from_config` builds the model."""
    from transformers import GPT2Config, LlamaConfig

    if m.arch == "gpt":
        return GPT2Config(
            vocab_size=m.vocab_size,
            n_positions=m.max_positions,
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
        max_position_embeddings=m.max_positions,
        rms_norm_eps=m.norm_eps,
        rope_theta=m.rope_theta,  # transformers 5 files it under rope_parameters
        attention_dropout=m.dropout,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
    )


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export_hf(checkpoint: Path, out: Path, dtype: str = "fp32") -> Path:
    """Write the model of `checkpoint` (a step directory, or a run's newest: see
    `resolve_checkpoint`) to `out` (which must not exist yet) as a Hugging Face model
    directory with weights in `dtype` (fp32, bf16 or fp16), and its tokenizer as `AutoTokenizer`
    loads it. Written to a temporary directory first and renamed into place, so `out` is either
    complete or absent."""
    from transformers import AutoModelForCausalLM

    out = Path(out)
    if out.exists():
        raise CheckpointError(f"{out} already exists: choose another --out, or remove it first")
    if dtype not in DTYPES:
        raise CheckpointError(f"unknown --dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    saved = Checkpoint(resolve_checkpoint(Path(checkpoint)))
    model, tokenizer = saved.model(), saved.tokenizer
    m = model.ctx.cfg
    params = {  # a fused parameter by parts: q/k/v, gate/up as HF names them (or GPT-2 fuses)
        name: p.detach()[: m.vocab_size] if p.meta.init_rows is not None else p.detach()
        for name, p in global_tensors(dict(model.named_parameters())).items()
    }
    config = hf_config(m)
    config.bos_token_id = tokenizer.bos_id if tokenizer.bos_id >= 0 else None
    config.eos_token_id = tokenizer.eos_id
    hf = AutoModelForCausalLM.from_config(config)
    hf.load_state_dict(to_hf_state(params, m), strict=True)
    hf.to(DTYPES[dtype])
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    hf.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_for_transformers(tmp)
    tmp.rename(out)
    return out


# Megalite model keys and where a Hugging Face config keeps the same number.
_CONFIG_KEYS = {
    "gpt": [
        ("hidden", "n_embd"),
        ("n_layers", "n_layer"),
        ("n_heads", "n_head"),
        ("ffn_hidden", "n_inner"),
        ("vocab_size", "vocab_size"),
        ("norm_eps", "layer_norm_epsilon"),
        ("max_positions", "n_positions"),
    ],
    "llama": [
        ("hidden", "hidden_size"),
        ("n_layers", "num_hidden_layers"),
        ("n_heads", "num_attention_heads"),
        ("n_kv_heads", "num_key_value_heads"),
        ("ffn_hidden", "intermediate_size"),
        ("vocab_size", "vocab_size"),
        ("norm_eps", "rms_norm_eps"),
        ("rope_theta", "rope_theta"),
        ("max_positions", "max_position_embeddings"),
    ],
}
_MODEL_TYPES = {"gpt2": "gpt", "llama": "llama"}


def _hf_values(raw: dict) -> dict:
    """A config.json with the defaults and spellings that vary between releases resolved."""
    values = dict(raw)
    if values.get("model_type") == "gpt2":
        if values.get("n_inner") is None:
            values["n_inner"] = 4 * values["n_embd"]
        values.setdefault("n_positions", 1024)  # transformers' default
    if values.get("model_type") == "llama":
        values.setdefault("num_key_value_heads", values.get("num_attention_heads"))
        values.setdefault("max_position_embeddings", 2048)  # transformers' default
        rope = values.get("rope_parameters") or values.get("rope_scaling") or {}
        values.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
        if rope.get("rope_type", "default") != "default":
            raise CheckpointError(
                f"rope scaling {rope.get('rope_type')!r} is not supported: megalite implements "
                "plain rotary embeddings"
            )
    return values


def check_hf_config(raw: dict, path: Path, m: ModelConfig) -> None:
    """The Hugging Face model must be the architecture and size the config asks for; the error
    lists the overrides that would make it so."""
    arch = _MODEL_TYPES.get(raw.get("model_type"))
    if arch is None:
        raise CheckpointError(
            f"{path}: model_type {raw.get('model_type')!r} is not one megalite builds "
            f"(supported: {', '.join(_MODEL_TYPES)})"
        )
    values = _hf_values(raw)
    wanted = {"model.arch": arch} if arch != m.arch else {}
    for ours, theirs in _CONFIG_KEYS[arch]:
        if getattr(m, ours) != values[theirs]:
            wanted[f"model.{ours}"] = values[theirs]
    positions = values["n_positions" if arch == "gpt" else "max_position_embeddings"]
    if positions < m.seq_len:  # a longer context than the model has positions for
        wanted["model.seq_len"] = positions
    if wanted:
        fix = " ".join(f"{key}={value}" for key, value in wanted.items())
        raise CheckpointError(
            f"the Hugging Face model in {path} does not match the config: set {fix}"
        )
    if arch == "llama" and values.get("head_dim", m.head_dim) != m.head_dim:
        raise CheckpointError(f"{path}: head_dim {values['head_dim']} is not hidden / n_heads")
    if arch == "gpt" and (
        not values.get("scale_attn_weights", True) or values.get("scale_attn_by_inverse_layer_idx")
    ):
        raise CheckpointError(f"{path}: GPT-2 attention scaling other than 1/sqrt(head_dim)")
    activation = values.get("activation_function" if arch == "gpt" else "hidden_act")
    if activation not in ("gelu_new", "gelu_pytorch_tanh", "silu"):
        raise CheckpointError(f"{path}: activation {activation!r} is not one megalite implements")
    if arch == "llama" and (values.get("attention_bias") or values.get("mlp_bias")):
        raise CheckpointError(f"{path}: Llama with attention or MLP biases is not supported")


def read_hf(
    path: Path, m: ModelConfig, names: Collection[str] | None = None
) -> dict[str, torch.Tensor]:
    """Global megalite tensors from a Hugging Face model directory: all of them, or only those
    in `names` (a rank reads just what it holds). Safetensors only: pickled
    `pytorch_model.bin` weights are refused rather than unpickled."""
    config_file = path / "config.json"
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{config_file} cannot be read: {exc}") from None
    check_hf_config(raw, path, m)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(
            f"{path} has no model.safetensors: megalite does not unpickle pytorch_model.bin; "
            "re-save the model with save_pretrained(..., safe_serialization=True)"
        )
    stored: dict[str, tuple[str, str]] = {}  # full Hugging Face name -> (file, name in file)
    for file in files:
        with safe_open(str(path / file), framework="pt") as f:
            stored.update({name: (file, name) for name in f.keys()})
    base = "transformer." if m.arch == "gpt" else "model."
    if not any(name.startswith(base) for name in stored):  # saved from the base model class
        stored = {base + name: where for name, where in stored.items()}
    if m.arch == "llama" and raw.get("tie_word_embeddings") and "lm_head.weight" not in stored:
        stored["lm_head.weight"] = stored["model.embed_tokens.weight"]  # trained untied here
    needed = {link.theirs for link in links(m) if names is None or link.ours in names}
    by_file: dict[str, list[tuple[str, str]]] = {}
    for name in needed & stored.keys():
        file, key = stored[name]
        by_file.setdefault(file, []).append((name, key))
    state = {}
    for file, entries in by_file.items():
        with safe_open(str(path / file), framework="pt") as f:
            state.update({name: f.get_tensor(key) for name, key in entries})
    return from_hf_state(state, m, names)
