"""Checkpoints: the one module that knows the on-disk layout, and how a checkpoint is read.

    <out_dir>/checkpoints/
        latest                     text file naming the newest complete checkpoint
        step_000100/
            manifest.json          layout, trainer state, where every tensor lies, checksums
            model_tp01_pp00.safetensors        parameters of one (tp, pp) rank (its dp rank 0)
            optim_tp01_pp00_dp03.safetensors   the Adam state that rank owns (ZeRO: 1/dp)
            rng_rank00003.safetensors          RNG streams of every rank
            tokenizer.model, or tokenizer.json (+ tokenizer_config.json)   the run's tokenizer

Tensors are stored under their global names (global layer indices). The manifest lists, for
each, the segments that make it up: (tp piece, flat element range within the piece, file, key).
A parameter is one segment per tp piece; its optimizer state is one segment per owned range, so
each rank writes exactly what it holds, with no gather over dp and host memory bounded by its
own shards. A checkpoint loads into any tp / pp / dp layout: segments are glued and cut as needed.

Safety: everything is written under a temporary directory that is renamed into place only when
complete, then `latest` is replaced atomically (`writer.py`); files are safetensors and JSON (no
pickle); a file whose checksum differs from the manifest's is refused with a message naming it.
A resuming rank verifies only the files it reads.

Reading: `Checkpoint` is the read API every other module uses (its step, saved config,
tokenizer, weights, the one-process `model()`); `load_checkpoint` restores a whole `RunState`
for a resume.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from megalite.checkpoint.state import RunState
from megalite.config import build_config
from megalite.data.tokenizer import HFTokenizer, Tokenizer, open_tokenizer
from megalite.errors import MegaliteError
from megalite.models import CausalLM, build_chunks
from megalite.optimizer.zero1 import STATE_KINDS
from megalite.parallel_state import ParallelState
from megalite.tensor_parallel import TPRandom

FORMAT = "megalite-checkpoint-v3"
READABLE_FORMATS = ("megalite-checkpoint-v1", "megalite-checkpoint-v2", FORMAT)
"""v3 adds the manifest's own checksum; older ones are read without it."""
MANIFEST = "manifest.json"
LATEST = "latest"
UNFINISHED_SUFFIX = ".tmp"
"""A checkpoint is written under `step_N.tmp` and renamed to `step_N` once complete."""
MANIFEST_CHECKSUM = "manifest_sha256"
"""The manifest's key holding the sha256 of the rest of the manifest (`manifest_checksum`)."""

SHAPE_KEYS = (
    "arch",
    "n_layers",
    "hidden",
    "n_heads",
    "n_kv_heads",
    "ffn_hidden",
    "vocab_size",
    "max_positions",
)
"""The model settings that decide which tensors a checkpoint holds and their shapes."""

MODEL_IDENTITY = (*SHAPE_KEYS, "norm_eps", "rope_theta")
"""The model settings that change the function a checkpoint's weights compute: resuming with any
of them changed would reinterpret the weights (another head split) or silently drop some (fewer
layers) whenever the tensor shapes happen to fit, so a resume refuses it."""


class CheckpointError(MegaliteError):
    """A checkpoint is missing, incomplete or corrupt."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def rng_file(rank: int) -> str:
    """The file holding the RNG streams of global rank `rank`."""
    return f"rng_rank{rank:05d}.safetensors"


def state_name(param_name: str, kind: str) -> str:
    """The global name one optimizer state of a parameter is stored under (`kind` in
    STATE_KINDS), e.g. `wte.weight.exp_avg`."""
    return f"{param_name}.{kind}"


def layout_of(ps: ParallelState) -> dict[str, int]:
    return {"tp": ps.tp_size, "pp": ps.pp_size, "dp": ps.dp_size}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def manifest_checksum(manifest: dict[str, Any]) -> str:
    """The sha256 of a manifest's canonical JSON without its own checksum key: an edited step
    number or file list no longer matches it."""
    body = {key: value for key, value in manifest.items() if key != MANIFEST_CHECKSUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_manifest(path: Path, verify_files: bool = True) -> dict[str, Any]:
    """Load a checkpoint's manifest and (verify_files) check every file's checksum; without it,
    each file is checked when first read (`_verify`), so a rank verifies only what it reads."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(
            f"{path} is not a complete megalite checkpoint (no manifest.json): "
            "point checkpoint.resume at a step_* directory written by megalite"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint {path} has a corrupt manifest.json: {exc}") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"checkpoint {path} has a corrupt manifest.json (not an object)")
    if manifest.get("format") not in READABLE_FORMATS:
        raise CheckpointError(f"{path}: unknown checkpoint format {manifest.get('format')!r}")
    if not {"files", "tensors", "trainer"} <= manifest.keys():
        raise CheckpointError(f"checkpoint {path} has a corrupt manifest.json (missing fields)")
    if manifest["format"] == FORMAT and manifest.get(MANIFEST_CHECKSUM) != manifest_checksum(
        manifest
    ):
        raise CheckpointError(
            f"{manifest_path} fails its checksum (edited or damaged): resume from an earlier "
            "checkpoint with checkpoint.resume=<dir>, or restore the file"
        )
    if verify_files:
        for name in manifest["files"]:
            _verify(path, manifest, name)
    return manifest


_verified: set[tuple[Path, str]] = set()
"""(file, checksum) pairs this process has already verified."""


def _verify(path: Path, manifest: dict, name: str) -> None:
    file, digest = (path / name).resolve(), manifest["files"].get(name)
    if (file, digest) in _verified:
        return
    if digest is None or not file.is_file() or _sha256(file) != digest:
        others = sorted(p.name for p in path.parent.glob("step_*[0-9]") if p != path)
        hint = f" (earlier checkpoints: {', '.join(others)})" if others else ""
        raise CheckpointError(
            f"checkpoint {path} is corrupt: {name} is missing or fails its checksum; "
            f"resume from an earlier checkpoint with checkpoint.resume=<dir>{hint}"
        )
    _verified.add((file, digest))


def _segments(entry: dict, name: str) -> list[list]:
    """[piece, lo, hi, file, key] of every stored segment; a v1 entry held whole pieces."""
    if "segments" in entry:
        return entry["segments"]
    return [[i, 0, None, file, name] for i, file in enumerate(entry["files"])]


def find_checkpoint(root: Path, resume: str) -> Path | None:
    """The checkpoint to resume from: none, the newest complete one (auto: the one `latest`
    names, see `_newest_complete`), or an explicit directory. Unfinished writes (`step_N.tmp`)
    are never resumed from."""
    if resume == "none":
        return None
    if resume != "auto":
        path = Path(resume)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint.resume={resume}: no such directory")
        return path
    return _newest_complete(root) if root.is_dir() else None


def complete_checkpoints(root: Path) -> list[Path]:
    """The step directories under `root` that hold a manifest, by step."""
    steps = [p for p in root.glob("step_*") if p.name.removeprefix("step_").isdigit()]
    return sorted((p for p in steps if (p / MANIFEST).is_file()), key=_step_of)


def unfinished_checkpoints(root: Path) -> list[Path]:
    """Checkpoint directories whose writing never finished (a kill or preemption mid-save)."""
    return sorted(p for p in root.glob(f"step_*{UNFINISHED_SUFFIX}") if p.is_dir())


def _step_of(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def resolve_checkpoint(path: Path) -> Path:
    """The checkpoint a user means by `path`, so that `generate` and `export-hf` take whatever a
    run left behind: a step directory is itself; the `latest` pointer file, a `checkpoints/`
    directory or a run directory (train.out_dir) mean the newest complete checkpoint there."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    if path.is_file() and path.name == LATEST:
        root = path.parent
    elif (path / "checkpoints").is_dir():
        root = path / "checkpoints"
    else:
        root = path
    newest = _newest_complete(root) if root.is_dir() else None
    if newest is None:
        found = "no complete megalite checkpoint" if path.exists() else "no such file or directory"
        raise CheckpointError(
            f"{path}: {found}; expected a run directory (train.out_dir), its checkpoints/ "
            "directory, the checkpoints/latest file, or a step_* directory with a manifest.json"
        )
    return newest


def _newest_complete(root: Path) -> Path | None:
    """The checkpoint `latest` names when it is complete, else the highest complete step_*."""
    latest = root / LATEST
    if latest.is_file():
        named = root / latest.read_text().strip()
        if (named / MANIFEST).is_file():
            return named
    complete = complete_checkpoints(root)
    return complete[-1] if complete else None


def _piece_shape(entry: dict) -> list[int]:
    shape = list(entry["global_shape"])
    if entry["split_dim"] is not None:
        shape[entry["split_dim"]] //= entry["pieces"]
    return shape


def _read_piece(path: Path, manifest: dict, name: str, entry: dict, piece: int) -> torch.Tensor:
    """Tp piece `piece` of tensor `name`, glued from its segments (verified on first read)."""
    parts, filled = [], 0
    for index, lo, _, file, key in _segments(entry, name):
        if index != piece:
            continue
        if lo != filled:
            raise CheckpointError(f"checkpoint {path}: {name} lacks elements {filled}..{lo}")
        _verify(path, manifest, file)
        with safe_open(str(path / file), framework="pt") as f:
            parts.append(f.get_tensor(key).reshape(-1))
        filled += parts[-1].numel()
    shape = _piece_shape(entry)
    if filled != torch.Size(shape).numel():
        raise CheckpointError(f"checkpoint {path}: {name} piece {piece} is incomplete")
    return torch.cat(parts).view(shape) if len(parts) > 1 else parts[0].view(shape)


def _read_tensor(path: Path, manifest: dict, name: str) -> torch.Tensor:
    """The full global tensor `name`, glued from its tp pieces, without the padding rows beyond
    the real vocabulary (whose count depends on the tp it was saved with)."""
    entry = manifest["tensors"].get(name)
    if entry is None:
        raise CheckpointError(
            f"checkpoint {path} has no tensor {name!r}: it was saved from a different model "
            "(check model.arch and model.n_layers)"
        )
    parts = [_read_piece(path, manifest, name, entry, i) for i in range(entry["pieces"])]
    full = torch.cat(parts, dim=entry["split_dim"]) if len(parts) > 1 else parts[0]
    return full[: entry["real_rows"]] if entry["real_rows"] else full


def _local_piece(
    path: Path, manifest: dict, name: str, param: nn.Parameter, ps: ParallelState
) -> torch.Tensor:
    """This rank's piece of global tensor `name`, shaped like `param`."""
    meta = param.meta
    entry = manifest["tensors"].get(name)
    same_cut = (
        entry is not None
        and entry["pieces"] == (ps.tp_size if meta.tp_split_dim is not None else 1)
        and entry["global_shape"] == list(meta.global_shape)
    )
    if same_cut:  # saved with this tp: read only our own piece
        piece = ps.tp_rank if meta.tp_split_dim is not None else 0
        return _read_piece(path, manifest, name, entry, piece)
    return local_piece(_read_tensor(path, manifest, name), name, param, ps)


def local_piece(
    full: torch.Tensor, name: str, param: nn.Parameter, ps: ParallelState
) -> torch.Tensor:
    """This rank's piece of the global tensor `full` (the real vocabulary rows only, for
    vocabulary weights), shaped like `param`: padding rows for this tp added, then cut."""
    meta = param.meta
    if meta.init_rows is not None and full.shape[0] <= meta.global_shape[0]:
        padded = full.new_zeros(meta.global_shape)
        padded[: full.shape[0]] = full
        full = padded
    if tuple(full.shape) != tuple(meta.global_shape):
        raise CheckpointError(
            f"checkpoint tensor {name} has shape {tuple(full.shape)}, the model expects "
            f"{tuple(meta.global_shape)}: the config does not match the checkpoint's model"
        )
    if meta.tp_split_dim is not None:
        full = full.chunk(ps.tp_size, dim=meta.tp_split_dim)[ps.tp_rank]
    return full


@torch.no_grad()
def load_parameters(
    path: Path, manifest: dict, params: dict[str, nn.Parameter], ps: ParallelState
) -> None:
    """Fill every local parameter with its piece of the saved global tensor."""
    for name, param in params.items():
        source = param.meta.tied_name or name
        param.copy_(_local_piece(path, manifest, source, param, ps))


class Checkpoint:
    """A saved checkpoint opened for reading: the read API for every module that needs one
    (generation, export, `checkpoint.init_from`, resume, tests), so that none of them indexes the
    manifest. `path` is a step directory (`resolve_checkpoint` finds one from what a user
    typed). With `verify_files` every file's checksum is checked now; otherwise each file is
    checked when first read."""

    def __init__(self, path: Path, verify_files: bool = True) -> None:
        self.path = Path(path)
        self._manifest = read_manifest(self.path, verify_files)
        self._files: dict[str, str] = self._manifest["files"]

    @property
    def step(self) -> int:
        """The step it was saved at."""
        step = self._manifest.get("step")
        if not isinstance(step, int):
            raise CheckpointError(f"checkpoint {self.path} has a corrupt manifest.json (no step)")
        return step

    @property
    def layout(self) -> dict[str, int]:
        """The layout that saved it (`{"tp": .., "pp": .., "dp": ..}`, as `layout_of` gives)."""
        return dict(self._manifest["layout"])

    @property
    def config(self) -> dict[str, Any]:
        """The saved run's config as `config_to_dict` wrote it (a copy, free to change); empty
        when the checkpoint stored none."""
        return copy.deepcopy(self._manifest["trainer"].get("config", {}))

    @property
    def tokenizer(self) -> Tokenizer | HFTokenizer:
        """The tokenizer saved with it (sentencepiece model or tokenizer.json), verified."""
        saved = [n for n in (HFTokenizer.file_name, Tokenizer.file_name) if n in self._files]
        if not saved:
            raise CheckpointError(f"checkpoint {self.path} carries no tokenizer")
        for name in self._files:
            if name.startswith("tokenizer"):
                _verify(self.path, self._manifest, name)
        return open_tokenizer(self.path / saved[0])

    def model(self, device: str = "cpu") -> CausalLM:
        """The whole model as one chunk (tp = pp = 1) with these weights, in eval mode: what
        generation and Hugging Face export run, whatever layout trained it."""
        raw = self.config
        raw["parallel"] = {}  # one process: no tp/pp/sp
        raw["train"]["recompute"] = "none"
        cfg = build_config(raw)
        ps = ParallelState.single(device)
        # The checkpoint fills every weight: no random init to throw away.
        (model,) = build_chunks(cfg, ps, TPRandom(cfg.train.seed, ps), random_init=False)
        self.load_parameters(dict(model.named_parameters()), ps)
        return model.eval()

    def load_parameters(self, params: dict[str, nn.Parameter], ps: ParallelState) -> None:
        """Fill local parameters (global name -> this rank's piece in layout `ps`) with their
        saved values, whatever layout saved them."""
        load_parameters(self.path, self._manifest, params, ps)

    def weight_names(self) -> list[str]:
        """Global names of the saved model weights (a tied copy is saved once, as its original)."""
        return [name for name in self._manifest["tensors"] if not name.endswith(STATE_KINDS)]

    def tensor(self, name: str) -> torch.Tensor:
        """The full global tensor `name`, without vocabulary padding rows."""
        return _read_tensor(self.path, self._manifest, name)


def check_same_model(ckpt: Checkpoint, config: dict[str, Any]) -> None:
    """Refuse to resume `config` (a run's config as `config_to_dict` writes it) from a checkpoint
    of another model, naming every MODEL_IDENTITY field that differs (a field the checkpoint's
    config lacks is not compared)."""
    saved, now = ckpt.config.get("model", {}), config["model"]
    changed = [
        f"model.{key} {json.dumps(saved[key])} -> {json.dumps(now[key])}"
        for key in MODEL_IDENTITY
        if key in saved and saved[key] != now[key]
    ]
    if changed:
        raise CheckpointError(
            f"checkpoint {ckpt.path} holds another model than this run's config: "
            f"{', '.join(changed)}. Resume with the checkpoint's model settings, or train the "
            "new model in another train.out_dir"
        )


@torch.no_grad()
def load_checkpoint(
    path: Path, state: RunState, announce: Callable[[Checkpoint], None] | None = None
) -> Checkpoint:
    """Restore `state` from the checkpoint at `path`: weights and optimizer state (from any
    layout), the RNG streams (saved in this layout only), then step, data position and loss
    scaler. `announce` runs in between, so that a resume whose data order is refused has already
    said what changed. No collective; each rank verifies only the files it reads."""
    ckpt = Checkpoint(path, verify_files=False)
    check_same_model(ckpt, state.config)
    path, manifest, ps = ckpt.path, ckpt._manifest, state.ps
    ckpt.load_parameters(state.params, ps)
    names = {param: name for name, param in state.params.items()}

    def read_state(param: nn.Parameter, kind: str) -> torch.Tensor:
        source = state_name(param.meta.tied_name or names[param], kind)
        return _local_piece(path, manifest, source, param, ps).reshape(-1).to(ps.device)

    state.optimizer.load_pieces(read_state, manifest["optimizer_step"])
    rng = rng_file(ps.rank)
    if manifest["layout"] == layout_of(ps) and (path / rng).is_file():
        _verify(path, manifest, rng)
        with safe_open(str(path / rng), framework="pt") as f:
            state.rng.load_state_dict({key: f.get_tensor(key) for key in f.keys()})
    if announce is not None:
        announce(ckpt)
    state.load_trainer_state(manifest["trainer"])
    return ckpt
