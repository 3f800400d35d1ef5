"""Hugging Face, both ways: export a checkpoint as a model directory (config.json +
model.safetensors) that `transformers.AutoModelForCausalLM.from_pretrained` loads, and read such
a directory back as global megalite tensors for `checkpoint.init_from`.

Each architecture maps itself (its `hf.py`, a `models.hugging_face.HFMapping`: the names, fused
and transposed tensors, the config both ways); this module does what is the same for all: the
files, the vocabulary padding, and the check that a Hugging Face model is the one the config
asks for. Checkpoint tensors are stored by global name, so any tp / pp layout converts the same
way.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open

from megalite import architectures
from megalite.checkpoint.sharded import Checkpoint, CheckpointError, resolve_checkpoint
from megalite.config import ROPE_SCALING_KEYS, ModelConfig
from megalite.models.hugging_face import HFMapping, hf_mapping
from megalite.tensor_parallel import global_tensors

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def hf_config(m: ModelConfig) -> PretrainedConfig:
    """The Hugging Face config of megalite's architecture and dimensions."""
    return hf_mapping(m.arch).hf_config(m)


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
    mapping = hf_mapping(m.arch)
    try:
        config = mapping.hf_config(m)
    except ValueError as error:  # a model the Hugging Face class cannot hold
        raise CheckpointError(f"{checkpoint} cannot be exported: {error}") from None
    config.bos_token_id = tokenizer.bos_id if tokenizer.bos_id >= 0 else None
    config.eos_token_id = tokenizer.eos_id
    hf = AutoModelForCausalLM.from_config(config)
    state = mapping.for_model(mapping.to_hf(params, m), hf.state_dict().keys(), m)
    hf.load_state_dict(state, strict=True)
    hf.to(DTYPES[dtype])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))  # this call's own
    try:
        hf.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_for_transformers(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the export is an ordinary directory
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _mapping_of(raw: dict[str, Any], path: Path) -> tuple[str, HFMapping]:
    """The registered architecture whose Hugging Face mapping reads this config.json."""
    mappings = {name: hf_mapping(name) for name in architectures.names()}
    for name, mapping in mappings.items():
        if mapping.model_type == raw.get("model_type"):
            return name, mapping
    supported = ", ".join(mapping.model_type for mapping in mappings.values())
    raise CheckpointError(
        f"{path}: model_type {raw.get('model_type')!r} is not one megalite builds "
        f"(supported: {supported})"
    )


def read_hf_config(path: Path) -> dict[str, Any]:
    """The config.json of a Hugging Face model directory, as a dict."""
    config_file = path / "config.json"
    try:
        return json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{config_file} cannot be read: {exc}") from None


def hf_model_settings(raw: dict[str, Any], path: Path) -> tuple[str, dict[str, Any]]:
    """(model.arch, the other `ModelConfig` settings) of the Hugging Face model in `path` whose
    config.json is `raw`; refused for what megalite does not implement."""
    arch, mapping = _mapping_of(raw, path)
    try:
        return arch, mapping.config_from_hf(raw)
    except ValueError as unsupported:
        raise CheckpointError(f"{path}: {unsupported}") from None


def overrides(wanted: dict[str, Any]) -> str:
    """`model.a=1 model.b=null`: settings as the command line sets them."""
    return " ".join(f"{key}={'null' if value is None else value}" for key, value in wanted.items())


def mismatches(theirs: dict[str, Any], m: ModelConfig) -> dict[str, Any]:
    """The `model.*` overrides that make `m` the model whose settings are `theirs`
    (`ModelConfig` fields, `arch` and `max_positions` among them), and the shorter seq_len a
    model with fewer positions needs. Unscaled rotary embeddings ask for no scaling parameters
    (the config names any that are set)."""
    wanted = {f"model.{key}": value for key, value in theirs.items() if getattr(m, key) != value}
    if theirs.get("rope_scaling") == "none":
        wanted = {
            key: value
            for key, value in wanted.items()
            if not (value is None and key.removeprefix("model.") in ROPE_SCALING_KEYS)
        }
    if theirs["max_positions"] < m.seq_len:  # a longer context than the model has positions for
        wanted["model.seq_len"] = theirs["max_positions"]
    return wanted


def check_hf_config(raw: dict[str, Any], path: Path, m: ModelConfig) -> None:
    """The Hugging Face model must be the architecture and size the config asks for; the error
    lists the overrides that would make it so."""
    arch, values = hf_model_settings(raw, path)
    wanted = mismatches({"arch": arch, **values}, m)
    if wanted:
        raise CheckpointError(
            f"the Hugging Face model in {path} does not match the config: set {overrides(wanted)}"
        )


def read_hf(
    path: Path, m: ModelConfig, names: Collection[str] | None = None
) -> dict[str, torch.Tensor]:
    """Global megalite tensors from a Hugging Face model directory: all of them, or only those
    in `names` (a rank reads just what it holds). Safetensors only: pickled
    `pytorch_model.bin` weights are refused rather than unpickled."""
    raw = read_hf_config(path)
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
    absent = [file for file in files if not (path / file).is_file()]
    if absent:
        raise CheckpointError(
            f"{path} lacks {', '.join(absent)}, which its model.safetensors.index.json lists: "
            "download the model again"
        )
    stored: dict[str, tuple[str, str]] = {}  # full Hugging Face name -> (file, name in file)
    for file in files:
        with _opened(path / file) as f:
            stored.update({name: (file, name) for name in f.keys()})
    mapping = hf_mapping(m.arch)
    base = mapping.base_prefix
    if not any(name.startswith(base) for name in stored):  # saved from the base model class
        stored = {base + name: where for name, where in stored.items()}
    for name, source in mapping.aliases(raw).items():
        if name not in stored and source in stored:
            stored[name] = stored[source]
    links = [link for link in mapping.links(m) if names is None or link.ours in names]
    needed = {link.theirs for link in links}
    missing = sorted(needed - stored.keys())
    if missing:
        raise CheckpointError(f"the Hugging Face weights have no tensor {missing[0]!r}")
    by_file: dict[str, list[tuple[str, str]]] = {}
    for name in needed:
        file, key = stored[name]
        by_file.setdefault(file, []).append((name, key))
    state = {}
    for file, entries in by_file.items():
        with _opened(path / file) as f:
            state.update({name: f.get_tensor(key) for name, key in entries})
    return mapping.from_hf(state, m, names)


@contextlib.contextmanager
def _opened(file: Path) -> Iterator[Any]:
    """A safetensors file open for reading; a damaged one (truncated, not safetensors) is one
    CheckpointError naming it."""
    try:
        with safe_open(str(file), framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{file} cannot be read ({exc}): download the model again") from None
