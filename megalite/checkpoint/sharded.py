"""Checkpoints: the only module that knows the on-disk layout.

    <out_dir>/checkpoints/
        latest                     text file naming the newest complete checkpoint
        step_000100/
            manifest.json          layout, trainer state, where every tensor lies, checksums
            model_tp01_pp00.safetensors        parameters of one (tp, pp) rank (its dp rank 0)
            optim_tp01_pp00_dp03.safetensors   the Adam state that rank owns (ZeRO: 1/dp)
            rng_rank00003.safetensors          RNG streams of every rank

Tensors are stored under their global names (global layer indices). The manifest lists, for
each, the segments that make it up: (tp piece, flat element range within the piece, file, key).
A parameter is one segment per tp piece; its optimizer state is one segment per owned range, so
each rank writes exactly what it holds, with no gather over dp and host memory bounded by its
own shards. A checkpoint loads into any tp / pp / dp layout: segments are glued and cut as needed.

Safety: everything is written under a temporary directory that is renamed into place only when
complete, then `latest` is replaced atomically; files are safetensors and JSON (no pickle); a
file whose checksum differs from the manifest's is refused with a message naming it. A resuming
rank verifies only the files it reads.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from megalite import comm
from megalite.errors import MegaliteError
from megalite.optimizer.zero1 import STATE_KINDS

FORMAT = "megalite-checkpoint-v2"
READABLE_FORMATS = ("megalite-checkpoint-v1", FORMAT)
OPTIMIZER_KINDS = STATE_KINDS
TOKENIZER = "tokenizer.model"


class CheckpointError(MegaliteError):
    """A checkpoint is missing, incomplete or corrupt."""


def _write_atomic(path: Path, data: bytes) -> str:
    """Write bytes under a temporary name, fsync, rename; returns the sha256."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    return hashlib.sha256(data).hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def _rng_state(run) -> dict[str, torch.Tensor]:
    state = {"torch_cpu": torch.get_rng_state(), "tp_stream": run.tp_random.state.cpu()}
    if run.ps.device.type == "cuda":
        state["torch_cuda"] = torch.cuda.get_rng_state(run.ps.device)
    return state


def _entry(meta, pieces: int) -> dict[str, Any]:
    return {
        "global_shape": list(meta.global_shape),
        "real_rows": meta.init_rows,
        "split_dim": meta.tp_split_dim,
        "pieces": pieces,
        "segments": [],
    }


def _saved_name(param, name: str, ps) -> str | None:
    """The name `param` is saved under by this rank, or None: a tied copy is saved by its
    original, a tp-replicated tensor by tp rank 0."""
    meta = param.meta
    if meta.tied_name is not None or (meta.tp_split_dim is None and ps.tp_rank > 0):
        return None
    return name


def owned_tensors(run) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, dict]]:
    """What this rank writes, by file: its tp piece of every parameter (dp rank 0) and the
    optimizer state of the elements it owns, copied to host memory; and the manifest entries
    saying where each segment lies. No collective: every rank already holds what it writes."""
    ps = run.ps
    model_file = f"model_tp{ps.tp_rank:02d}_pp{ps.pp_rank:02d}.safetensors"
    optim_file = f"optim_tp{ps.tp_rank:02d}_pp{ps.pp_rank:02d}_dp{ps.dp_rank:02d}.safetensors"
    files: dict[str, dict[str, torch.Tensor]] = {}
    entries: dict[str, dict] = {}

    def add(key: str, param, file: str, lo: int, tensor: torch.Tensor) -> None:
        split = param.meta.tp_split_dim is not None
        piece, pieces = (ps.tp_rank, ps.tp_size) if split else (0, 1)
        entry = entries.setdefault(key.split("@")[0], _entry(param.meta, pieces))
        entry["segments"].append([piece, lo, lo + tensor.numel(), file, key])
        files.setdefault(file, {})[key] = tensor.detach().cpu()

    names = run.names
    if ps.dp_rank == 0:
        for name, param in run.named_parameters().items():
            if _saved_name(param, name, ps) is not None:
                add(name, param, model_file, 0, param)
    if run.optimizer.sharded or ps.dp_rank == 0:
        for param, lo, _, views in run.optimizer.owned_pieces():
            name = _saved_name(param, names[param], ps)
            if name is not None:
                for kind, view in views.items():
                    add(f"{name}.{kind}@{lo}", param, optim_file, lo, view)
    return files, entries


def check_shared_directory(directory: Path, ps) -> None:
    """Collective. Every rank writes its own files into a checkpoint, and rank 0 publishes it:
    that needs `directory` on a filesystem every node sees. Each rank leaves a marker named by a
    token that rank 0 draws for this launch and checks that it sees all of them; on a node-local
    disk every rank misses some, so every rank stops with the same clear error."""
    if ps.world_size == 1:
        return
    token = torch.zeros((), dtype=torch.int64, device=ps.device)
    if ps.rank == 0:
        token.fill_(int.from_bytes(os.urandom(6), "little"))
    comm.all_reduce(token, ps.world_group)  # a broadcast: the other ranks add zero
    probe = Path(directory) / f".shared-check-{token.item():x}"
    probe.mkdir(parents=True, exist_ok=True)
    (probe / f"rank{ps.rank}").touch()
    comm.barrier()
    seen = sum((probe / f"rank{r}").is_file() for r in range(ps.world_size))
    comm.barrier()
    if ps.rank == 0 or seen < ps.world_size:
        shutil.rmtree(probe, ignore_errors=True)
    comm.barrier()  # gone for every rank once this returns
    if seen < ps.world_size:
        raise CheckpointError(
            f"{directory} is not shared by all ranks: rank {ps.rank} sees {seen} of "
            f"{ps.world_size} ranks' files there. Put train.out_dir on a filesystem that every "
            "node mounts (NFS, Lustre, ...)"
        )


def save_checkpoint(
    root: Path,
    step: int,
    run,
    trainer_state: dict[str, Any],
    keep: int,
    tokenizer: Path | None = None,
) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint directory. The tokenizer
    model is copied in so a checkpoint alone is enough to generate text."""
    ps = run.ps
    final, tmp_dir = step_dir(root, step), step_dir(root, step).with_suffix(".tmp")
    if ps.rank == 0:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    comm.barrier()
    tmp_dir.mkdir(parents=True, exist_ok=True)
    files, entries = owned_tensors(run)
    index: dict[str, Any] = {"files": {}, "tensors": entries}
    files[f"rng_rank{ps.rank:05d}.safetensors"] = _rng_state(run)
    for file, tensors in files.items():
        index["files"][file] = _write_atomic(tmp_dir / file, safetensors_bytes(tensors))
    if ps.rank == 0 and tokenizer is not None:
        index["files"][TOKENIZER] = _write_atomic(tmp_dir / TOKENIZER, Path(tokenizer).read_bytes())
    _write_atomic(tmp_dir / f"index_rank{ps.rank:05d}.json", json.dumps(index).encode())
    comm.barrier()
    if ps.rank == 0:
        _finish(root, final, tmp_dir, step, run, trainer_state, keep)
    comm.barrier()
    return final


def _finish(root, final, tmp_dir, step, run, trainer_state, keep) -> None:
    """Rank 0: merge the per-rank indexes into the manifest and publish the checkpoint."""
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "step": step,
        "layout": {"tp": run.ps.tp_size, "pp": run.ps.pp_size, "dp": run.ps.dp_size},
        "world_size": run.ps.world_size,
        "optimizer_step": run.optimizer.step_count,
        "trainer": trainer_state,
        "files": {},
        "tensors": {},
    }
    for index_file in sorted(tmp_dir.glob("index_rank*.json")):
        index = json.loads(index_file.read_text())
        manifest["files"].update(index["files"])
        for name, entry in index["tensors"].items():
            merged = manifest["tensors"].setdefault(name, {**entry, "segments": []})
            merged["segments"] += entry["segments"]
        index_file.unlink()
    for entry in manifest["tensors"].values():
        entry["segments"].sort()
    _write_atomic(tmp_dir / "manifest.json", json.dumps(manifest, indent=1).encode())
    if final.exists():
        shutil.rmtree(final)
    tmp_dir.rename(final)
    _write_atomic(root / "latest", final.name.encode())
    for old in sorted(root.glob("step_*[0-9]"))[:-keep]:
        shutil.rmtree(old)


def read_manifest(path: Path, verify_files: bool = True) -> dict[str, Any]:
    """Load a checkpoint's manifest and (verify_files) check every file's checksum; without it,
    each file is checked when first read (`_open`), so a rank verifies only what it reads."""
    manifest_path = path / "manifest.json"
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
    """The checkpoint to resume from: none, the `latest` one (auto), or an explicit directory."""
    if resume == "none":
        return None
    if resume != "auto":
        path = Path(resume)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint.resume={resume}: no such directory")
        return path
    latest = root / "latest"
    return root / latest.read_text().strip() if latest.is_file() else None


def resolve_checkpoint(path: Path) -> Path:
    """The checkpoint a user means by `path`, so that `generate` and `export-hf` take whatever a
    run left behind: a step directory is itself; the `latest` pointer file, a `checkpoints/`
    directory or a run directory (train.out_dir) mean the newest complete checkpoint there."""
    path = Path(path)
    if (path / "manifest.json").is_file():
        return path
    if path.is_file() and path.name == "latest":
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
    latest = root / "latest"
    if latest.is_file():
        named = root / latest.read_text().strip()
        if (named / "manifest.json").is_file():
            return named
    steps = [p for p in root.glob("step_*") if p.name.removeprefix("step_").isdigit()]
    complete = [p for p in steps if (p / "manifest.json").is_file()]
    return max(complete, key=lambda p: int(p.name.removeprefix("step_")), default=None)


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint was saved at, read from its manifest without hashing its files
    (loading does that): enough to decide whether anything is left to train."""
    step = read_manifest(path, verify_files=False).get("step")
    if not isinstance(step, int):
        raise CheckpointError(f"checkpoint {path} has a corrupt manifest.json (no step)")
    return step


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


def read_tensor(path: Path, manifest: dict, name: str) -> torch.Tensor:
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
    path: Path, manifest: dict, name: str, param: torch.nn.Parameter, ps
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
    return local_piece(read_tensor(path, manifest, name), name, param, ps)


def local_piece(full: torch.Tensor, name: str, param: torch.nn.Parameter, ps) -> torch.Tensor:
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
def load_checkpoint(path: Path, run) -> dict[str, Any]:
    """Load weights, optimizer state and (same layout only) RNG streams into `run`; returns the
    trainer state saved with them (step, data position, loss scaler)."""
    manifest = read_manifest(path, verify_files=False)
    load_parameters(path, manifest, run.named_parameters(), run.ps)

    def read_state(param: torch.nn.Parameter, kind: str) -> torch.Tensor:
        source = param.meta.tied_name or run.names[param]
        piece = _local_piece(path, manifest, f"{source}.{kind}", param, run.ps)
        return piece.reshape(-1).to(run.ps.device)

    run.optimizer.load_pieces(read_state, manifest["optimizer_step"])
    rng_file = path / f"rng_rank{run.ps.rank:05d}.safetensors"
    same_layout = manifest["layout"] == {
        "tp": run.ps.tp_size,
        "pp": run.ps.pp_size,
        "dp": run.ps.dp_size,
    }
    if same_layout and rng_file.is_file():
        with safe_open(str(rng_file), framework="pt") as f:
            torch.set_rng_state(f.get_tensor("torch_cpu"))
            run.tp_random.state = f.get_tensor("tp_stream").to(run.tp_random.state.device)
            if run.ps.device.type == "cuda" and "torch_cuda" in f.keys():
                torch.cuda.set_rng_state(f.get_tensor("torch_cuda"), run.ps.device)
    return manifest["trainer"]


@torch.no_grad()
def load_parameters(path: Path, manifest: dict, params: dict[str, torch.nn.Parameter], ps) -> None:
    """Fill every local parameter with its piece of the saved global tensor."""
    for name, param in params.items():
        source = param.meta.tied_name or name
        param.copy_(_local_piece(path, manifest, source, param, ps))
