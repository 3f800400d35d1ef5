"""Writing a run's state as a checkpoint in the layout `sharded.py` describes: every rank writes
the tensors it holds into a temporary directory, rank 0 merges the per-rank indexes into the
manifest and publishes the directory with a rename, then points `latest` at it.

A save is three phases, so that the middle one can run in the background (`saver.py`):
`take_snapshot` (collective, quick: what to write, copied to host memory when staged),
`write_snapshot` (no collective: the files), `publish` (collective: the manifest, the rename,
`latest`). A kill at any point before the rename leaves only a `step_N.tmp` directory, which no
resume reads and the next run removes (`remove_unfinished`)."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from megalite import comm
from megalite.checkpoint.sharded import (
    FORMAT,
    LATEST,
    MANIFEST,
    MANIFEST_CHECKSUM,
    UNFINISHED_SUFFIX,
    CheckpointError,
    layout_of,
    manifest_checksum,
    rng_file,
    state_name,
    step_dir,
    unfinished_checkpoints,
)
from megalite.checkpoint.staging import HostStaging
from megalite.checkpoint.state import RunState
from megalite.data.tokenizer import tokenizer_files
from megalite.parallel_state import ParallelState

Chunk = bytes | np.ndarray
"""Something a file write and a hash take as it is (the buffer protocol)."""


def _write_atomic(path: Path, *chunks: Chunk) -> str:
    """Write the chunks one after another under a temporary name, fsync, rename; returns the
    sha256 of the file, hashed as it is written."""
    digest = hashlib.sha256()
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
            digest.update(chunk)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    return digest.hexdigest()


SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def safetensors_chunks(tensors: dict[str, torch.Tensor]) -> list[Chunk]:
    """A safetensors file as chunks to write: its header, then each (CPU) tensor's own memory,
    so that a save copies nothing in user space (serializing to one bytes object first cost as
    much as the write itself). The layout is the format's: an 8-byte little-endian header size,
    the JSON header padded to 8 bytes, the tensors back to back in the header's order."""
    header, chunks, offset = {}, [], 0
    for key, tensor in tensors.items():
        flat = tensor.detach().reshape(-1).contiguous()
        size = flat.numel() * flat.element_size()
        header[key] = {
            "dtype": SAFETENSORS_DTYPES[flat.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        chunks.append(flat.view(torch.uint8).numpy())
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return [len(text).to_bytes(8, "little"), text, *chunks]


def _entry(meta, pieces: int) -> dict[str, Any]:
    return {
        "global_shape": list(meta.global_shape),
        "real_rows": meta.init_rows,
        "split_dim": meta.tp_split_dim,
        "pieces": pieces,
        "segments": [],
    }


def _saved_name(param: nn.Parameter, name: str, ps: ParallelState) -> str | None:
    """The name `param` is saved under by this rank, or None: a tied copy is saved by its
    original, a tp-replicated tensor by tp rank 0."""
    meta = param.meta
    if meta.tied_name is not None or (meta.tp_split_dim is None and ps.tp_rank > 0):
        return None
    return name


def owned_tensors(state: RunState) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, dict]]:
    """What this rank writes, by file: its tp piece of every parameter (dp rank 0) and the
    optimizer state of the elements it owns (views of the live tensors, on their device); and the
    manifest entries saying where each segment lies. No collective: every rank already holds
    what it writes."""
    ps, optimizer = state.ps, state.optimizer
    model_file = f"model_tp{ps.tp_rank:02d}_pp{ps.pp_rank:02d}.safetensors"
    optim_file = f"optim_tp{ps.tp_rank:02d}_pp{ps.pp_rank:02d}_dp{ps.dp_rank:02d}.safetensors"
    files: dict[str, dict[str, torch.Tensor]] = {}
    entries: dict[str, dict] = {}

    def add(key: str, param, file: str, lo: int, tensor: torch.Tensor) -> None:
        split = param.meta.tp_split_dim is not None
        piece, pieces = (ps.tp_rank, ps.tp_size) if split else (0, 1)
        entry = entries.setdefault(key.split("@")[0], _entry(param.meta, pieces))
        entry["segments"].append([piece, lo, lo + tensor.numel(), file, key])
        files.setdefault(file, {})[key] = tensor.detach()

    if ps.dp_rank == 0:
        for name, param in state.params.items():
            if _saved_name(param, name, ps) is not None:
                add(name, param, model_file, 0, param)
    if optimizer.sharded or ps.dp_rank == 0:
        names = {param: name for name, param in state.params.items()}
        for param, lo, _, views in optimizer.owned_pieces():
            name = _saved_name(param, names[param], ps)
            if name is not None:
                for kind, view in views.items():
                    add(f"{state_name(name, kind)}@{lo}", param, optim_file, lo, view)
    return files, entries


def check_shared_directory(directory: Path, ps: ParallelState) -> None:
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


@dataclass
class Snapshot:
    """One rank's share of a checkpoint, taken after a step: the tensors it writes (by file),
    where each segment lies, and the trainer state, all copies that later steps do not change
    when `staging` made them (so that they can be written while training goes on)."""

    root: Path
    step: int
    files: dict[str, dict[str, torch.Tensor]]
    entries: dict[str, dict]
    head: dict[str, Any]
    """The manifest's fields other than files and tensors (rank 0 writes them)."""
    rank: int
    tokenizer: Path | None

    @property
    def final(self) -> Path:
        return step_dir(self.root, self.step)

    @property
    def tmp_dir(self) -> Path:
        return self.final.with_name(self.final.name + UNFINISHED_SUFFIX)


def take_snapshot(
    root: Path, state: RunState, tokenizer: Path | None, staging: HostStaging | None = None
) -> Snapshot:
    """Collective: rank 0 clears any earlier attempt at this step's directory, then every rank
    gathers what it writes. With `staging`, every tensor is copied into host buffers that
    training does not touch; without it, CPU tensors are the live ones (write them now)."""
    ps = state.ps
    files, entries = owned_tensors(state)
    files[rng_file(ps.rank)] = state.rng.state_dict()
    if staging is not None:
        files = staging.stage(files)
    else:
        files = {f: {key: t.cpu() for key, t in tensors.items()} for f, tensors in files.items()}
    head = {
        "format": FORMAT,
        "step": state.step,
        "layout": layout_of(ps),
        "world_size": ps.world_size,
        "optimizer_step": state.optimizer.step_count,
        "trainer": copy.deepcopy(state.trainer_state()),
    }
    snapshot = Snapshot(Path(root), state.step, files, entries, head, ps.rank, tokenizer)
    if ps.rank == 0:
        shutil.rmtree(snapshot.tmp_dir, ignore_errors=True)
    comm.barrier()
    return snapshot


def write_snapshot(snapshot: Snapshot) -> None:
    """Write one rank's files and its index into the checkpoint's temporary directory. No
    collective, so it may run on a background thread."""
    tmp_dir = snapshot.tmp_dir
    tmp_dir.mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {"files": {}, "tensors": snapshot.entries}
    for i, (file, tensors) in enumerate(snapshot.files.items()):
        index["files"][file] = _write_atomic(tmp_dir / file, *safetensors_chunks(tensors))
        if i == 0:
            _test_stall(snapshot.step)
    if snapshot.rank == 0 and snapshot.tokenizer is not None:
        for name, source in tokenizer_files(snapshot.tokenizer).items():
            index["files"][name] = _write_atomic(tmp_dir / name, source.read_bytes())
    _write_atomic(tmp_dir / f"index_rank{snapshot.rank:05d}.json", json.dumps(index).encode())


STALL_ENV = "MEGALITE_TEST_STALL_SAVE"
"""Test hook, `<step>:<seconds>`: the writer of that step's checkpoint sleeps after its first
file, so that a test can kill it mid-write or train on while it writes."""


def _test_stall(step: int) -> None:
    stall = os.environ.get(STALL_ENV)
    if stall is not None and int(stall.split(":")[0]) == step:
        time.sleep(float(stall.split(":")[1]))


def publish(snapshot: Snapshot, ps: ParallelState, keep: int, error: str | None = None) -> Path:
    """Collective, on the main thread (collectives from another thread are unsafe): once every
    rank has written its share, rank 0 merges the manifest, renames the directory into place,
    points `latest` at it and drops the oldest beyond `keep`. If any rank failed to write
    (`error`), nothing is published and every rank raises: `latest` stays the previous one."""
    failed = torch.tensor(float(error is not None), device=ps.device)
    comm.all_reduce_max(failed, ps.world_group)  # also the barrier: every rank has written
    if failed.item():
        why = error or "another rank failed to write its files"
        raise CheckpointError(
            f"the checkpoint of step {snapshot.step} was not saved ({why}); the previous one "
            f"stays `latest`. Check free space and permissions under {snapshot.root}"
        )
    if ps.rank == 0:
        _write_manifest(snapshot)
        _publish(snapshot.root, snapshot.final, snapshot.tmp_dir, keep)
    comm.barrier()
    return snapshot.final


def save_checkpoint(root: Path, state: RunState, keep: int, tokenizer: Path | None = None) -> Path:
    """Collective: every rank calls it after the same step. Saves `state` as the checkpoint of
    step `state.step` under `root`, keeps the newest `keep`, and returns its directory. The
    tokenizer (sentencepiece model or tokenizer.json) is copied in, so a checkpoint alone is
    enough to generate text. (`saver.CheckpointSaver` also saves in the background.)"""
    snapshot = take_snapshot(root, state, tokenizer)
    write_snapshot(snapshot)
    return publish(snapshot, state.ps, keep)


def _write_manifest(snapshot: Snapshot) -> None:
    """Rank 0: merge the per-rank indexes into the manifest, checksummed."""
    tmp_dir = snapshot.tmp_dir
    manifest: dict[str, Any] = {**snapshot.head, "files": {}, "tensors": {}}
    for index_file in sorted(tmp_dir.glob("index_rank*.json")):
        index = json.loads(index_file.read_text())
        manifest["files"].update(index["files"])
        for name, entry in index["tensors"].items():
            merged = manifest["tensors"].setdefault(name, {**entry, "segments": []})
            merged["segments"] += entry["segments"]
        index_file.unlink()
    for entry in manifest["tensors"].values():
        entry["segments"].sort()
    manifest[MANIFEST_CHECKSUM] = manifest_checksum(manifest)
    _write_atomic(tmp_dir / MANIFEST, json.dumps(manifest, indent=1).encode())


def _publish(root: Path, final: Path, tmp_dir: Path, keep: int) -> None:
    """Rank 0: rename the complete checkpoint into place, point `latest` at it, drop the oldest
    beyond `keep`."""
    if final.exists():
        shutil.rmtree(final)
    tmp_dir.rename(final)
    _write_atomic(root / LATEST, final.name.encode())
    for old in sorted(root.glob("step_*[0-9]"))[:-keep]:
        shutil.rmtree(old)


def remove_unfinished(root: Path, ps: ParallelState) -> list[Path]:
    """Rank 0 deletes the checkpoint directories an earlier run left unfinished (killed or
    preempted mid-save: never renamed into place, so never resumed from) and says so; returns
    them. Call it while holding the run lock and before any rank writes a checkpoint."""
    if ps.rank != 0:
        return []
    leftovers = unfinished_checkpoints(Path(root))
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
        print(f"removed {path}: an unfinished checkpoint of an earlier run (stopped mid-save)")
    return leftovers
