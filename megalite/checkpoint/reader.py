"""Reading a checkpoint's tensors for a layout: each rank reads only the segments that overlap
what it holds, and of those only the byte ranges it needs, verified block by block as it reads
(`files.TensorFile`). A piece cut the same way as when saved (same tp) is read by range, so a
rank that owns part of a parameter's optimizer state reads that part alone, whatever dp saved
it; another tp cut reads the whole global tensor and cuts it on the host."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from megalite.checkpoint.files import CorruptFile, TensorFile
from megalite.errors import MegaliteError
from megalite.parallel_state import ParallelState


class CheckpointError(MegaliteError):
    """A checkpoint is missing, incomplete or corrupt."""


def corrupt(path: Path, problem: str) -> CheckpointError:
    """The error for a damaged file of checkpoint `path` (`problem` names it), pointing at the
    earlier checkpoints beside it."""
    step = _step(path)
    earlier = {p: s for p in path.parent.glob("step_*") if (s := _step(p)) is not None}
    others = sorted(
        (p for p, s in earlier.items() if p != path and (step is None or s < step)),
        key=earlier.get,
    )
    hint = f" (earlier checkpoints: {', '.join(p.name for p in others)})" if others else ""
    return CheckpointError(
        f"checkpoint {path} is corrupt: {problem}; resume from an earlier checkpoint with "
        f"checkpoint.resume=<dir>{hint}"
    )


def _step(path: Path) -> int | None:
    digits = path.name.removeprefix("step_")
    return int(digits) if path.name.startswith("step_") and digits.isdigit() else None


def segments(entry: dict, name: str) -> list[list]:
    """[piece, lo, hi, file, key] of every stored segment; a v1 entry held whole pieces."""
    if "segments" in entry:
        return entry["segments"]
    return [[i, 0, None, file, name] for i, file in enumerate(entry["files"])]


def piece_shape(entry: dict) -> list[int]:
    shape = list(entry["global_shape"])
    if entry["split_dim"] is not None:
        shape[entry["split_dim"]] //= entry["pieces"]
    return shape


class SavedTensors:
    """The tensors of the checkpoint at `path` (its manifest already read), opened lazily: a
    file is opened once, on its first read, and checked against the manifest as it is read."""

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path, self.manifest = path, manifest
        self._open: dict[str, TensorFile] = {}

    def close(self) -> None:
        for file in self._open.values():
            file.close()
        self._open.clear()

    def file(self, name: str) -> TensorFile:
        """The file `name`, opened (and, for formats before v4, verified whole)."""
        if name not in self._open:
            digest = self.manifest["files"].get(name)
            if digest is None:
                raise corrupt(self.path, f"{name} is missing from its manifest")
            try:
                self._open[name] = TensorFile(self.path / name, digest)
            except CorruptFile as exc:
                raise corrupt(self.path, str(exc)) from None
        return self._open[name]

    def read(self, name: str, key: str, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Elements [lo, hi) of tensor `key` in file `name` (all of it, in its shape, without
        a range)."""
        try:
            return self.file(name).tensor(key, lo, hi)
        except CorruptFile as exc:
            raise corrupt(self.path, str(exc)) from None

    def entry(self, name: str) -> dict:
        entry = self.manifest["tensors"].get(name)
        if entry is None:
            raise CheckpointError(
                f"checkpoint {self.path} has no tensor {name!r}: it was saved from a different "
                "model (check model.arch and model.n_layers)"
            )
        return entry

    def piece_range(self, name: str, piece: int, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of tp piece `piece` of tensor `name`, flattened: glued from the
        parts of the segments that overlap the range, and only those parts are read."""
        entry = self.entry(name)
        numel = torch.Size(piece_shape(entry)).numel()
        parts, filled = [], lo
        for index, s_lo, s_hi, file, key in segments(entry, name):
            s_hi = numel if s_hi is None else s_hi  # v1: a segment is the whole piece
            if index != piece or s_hi <= lo or s_lo >= hi:
                continue
            if s_lo > filled:
                raise CheckpointError(
                    f"checkpoint {self.path}: {name} lacks elements {filled}..{s_lo}"
                )
            start, stop = max(filled, s_lo), min(hi, s_hi)
            if start == s_lo and stop == s_hi:  # the whole segment: the fast path
                parts.append(self.read(file, key).reshape(-1))
            else:
                parts.append(self.read(file, key, start - s_lo, stop - s_lo))
            filled = stop
        if filled != hi:
            raise CheckpointError(f"checkpoint {self.path}: {name} piece {piece} is incomplete")
        return torch.cat(parts) if len(parts) != 1 else parts[0]

    def piece(self, name: str, piece: int) -> torch.Tensor:
        """Tp piece `piece` of tensor `name`, in its shape."""
        shape = piece_shape(self.entry(name))
        return self.piece_range(name, piece, 0, torch.Size(shape).numel()).view(shape)

    def tensor(self, name: str) -> torch.Tensor:
        """The full global tensor `name`, glued from its tp pieces, without the padding rows
        beyond the real vocabulary (whose count depends on the tp it was saved with)."""
        entry = self.entry(name)
        parts = [self.piece(name, i) for i in range(entry["pieces"])]
        full = torch.cat(parts, dim=entry["split_dim"]) if len(parts) > 1 else parts[0]
        return full[: entry["real_rows"]] if entry["real_rows"] else full

    def _same_cut(self, name: str, param: nn.Parameter, ps: ParallelState) -> int | None:
        """The saved tp piece that is this rank's piece of `name`, if saved with this cut."""
        meta = param.meta
        entry = self.entry(name)
        split = meta.tp_split_dim is not None
        if entry["pieces"] == (ps.size("tp") if split else 1) and entry["global_shape"] == list(
            meta.global_shape
        ):
            return ps.coord("tp") if split else 0
        return None

    def local(self, name: str, param: nn.Parameter, ps: ParallelState) -> torch.Tensor:
        """This rank's piece of global tensor `name`, shaped like `param`."""
        piece = self._same_cut(name, param, ps)
        if piece is not None:
            return self.piece(name, piece)
        return local_piece(self.tensor(name), name, param, ps)

    def local_range(
        self, name: str, param: nn.Parameter, ps: ParallelState, lo: int, hi: int
    ) -> torch.Tensor:
        """Elements [lo, hi) of this rank's piece of `name`, flattened: read alone when the
        piece is cut as saved, else cut on the host from the whole tensor."""
        piece = self._same_cut(name, param, ps)
        if piece is not None:
            return self.piece_range(name, piece, lo, hi)
        return local_piece(self.tensor(name), name, param, ps).reshape(-1)[lo:hi]


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
        full = full.chunk(ps.size("tp"), dim=meta.tp_split_dim)[ps.coord("tp")]
    return full
