"""A checkpoint's files, byte by byte: safetensors written as a stream with a checksum per block,
and read back by element range, each block verified as it is read.

Why blocks: with one checksum per file, a rank that needs part of a file (its share of another
dp rank's optimizer state, after a change of dp) must read all of it to verify it. A file of n
bytes is checksummed in at most MAX_BLOCKS blocks of a power of two of at least MIN_BLOCK bytes
(`block_size`), so the manifest stays small and a range read reads at most one block more at
each end. Formats v1-v3 carry one sha256 per file: such a file is verified whole when opened."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megalite.comm_trace import progress

Chunk = bytes | np.ndarray
"""Something a file write and a hash take as it is (the buffer protocol)."""

FileDigest = str | dict[str, Any]
"""A file's checksum in the manifest: the sha256 of the whole file (formats v1-v3), or
`{"block": bytes per block, "sha256": [one per block]}` (v4)."""

MIN_BLOCK = 4096
MAX_BLOCKS = 1024
WRITE_PIECE = 64 << 20
"""Bytes written at a time. Each piece written is progress for the watchdog (from the
background writer too), so a long save, at a preemption say, is not taken for a hang, while a
write that stalls still is."""

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
TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


class CorruptFile(Exception):
    """A file is missing, truncated or fails its checksum (`sharded` says which checkpoint)."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"{name} {problem}")
        self.name, self.problem = name, problem


def block_size(nbytes: int) -> int:
    """The checksum block of a file of `nbytes` bytes."""
    per_block = -(-nbytes // MAX_BLOCKS)
    return max(MIN_BLOCK, 1 << max(0, per_block - 1).bit_length())


def nbytes_of(chunks: tuple[Chunk, ...] | list[Chunk]) -> int:
    return sum(memoryview(chunk).nbytes for chunk in chunks)


def write_atomic(path: Path, *chunks: Chunk) -> dict[str, Any]:
    """Write the chunks one after another under a temporary name, fsync, rename; returns the
    file's block checksums, hashed as it is written."""
    block = block_size(nbytes_of(chunks))
    digests: list[str] = []
    digest, room = hashlib.sha256(), block
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        for chunk in chunks:
            whole = memoryview(chunk).cast("B")
            for start in range(0, len(whole), WRITE_PIECE):
                view = whole[start : start + WRITE_PIECE]
                f.write(view)
                progress.moved_on()
                while len(view):
                    digest.update(view[:room])
                    taken = min(room, len(view))
                    view, room = view[taken:], room - taken
                    if room == 0:
                        digests.append(digest.hexdigest())
                        digest, room = hashlib.sha256(), block
        f.flush()
        os.fsync(f.fileno())
    if room < block:  # the last, partial block
        digests.append(digest.hexdigest())
    tmp.replace(path)
    return {"block": block, "sha256": digests}


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


def verify_file(path: Path, digest: FileDigest) -> None:
    """Check the whole file at `path` against its manifest checksum; raises CorruptFile."""
    if not path.is_file():
        raise CorruptFile(path.name, "is missing")
    if isinstance(digest, str):
        whole = hashlib.sha256()
        with open(path, "rb") as f:
            for data in iter(lambda: f.read(1 << 20), b""):
                whole.update(data)
        if whole.hexdigest() != digest:
            raise CorruptFile(path.name, "fails its checksum")
        return
    with TensorFile(path, digest, header=False) as file:
        for start in range(0, file.size, file.block):  # one block in memory at a time
            file.read_bytes(start, min(start + file.block, file.size))


class TensorFile:
    """One safetensors file opened for reads by element range. With block checksums, every
    block a read touches is read whole and verified; the last block read is kept, so reading a
    file's tensors in order reads each byte once. With a whole-file checksum (formats v1-v3),
    the file is verified whole when opened."""

    def __init__(self, path: Path, digest: FileDigest, header: bool = True) -> None:
        self.name = path.name
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CorruptFile(self.name, "is missing") from None
        self.size = os.fstat(self._fd).st_size
        self._last: tuple[int, torch.Tensor] | None = None  # (block index, its bytes), verified
        if isinstance(digest, str):
            verify_file(path, digest)
            self.block, self._digests = 0, []
        else:
            self.block, self._digests = digest["block"], digest["sha256"]
            if -(-self.size // self.block) != len(self._digests):
                self.close()
                raise CorruptFile(self.name, "fails its checksum (wrong size)")
        self.header: dict[str, Any] = self._read_header() if header else {}

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _read_header(self) -> dict[str, Any]:
        length = int.from_bytes(self.read_bytes(0, 8).numpy().tobytes(), "little")
        if length > self.size - 8:
            raise CorruptFile(self.name, "fails its checksum (bad header)")
        try:
            header = json.loads(self.read_bytes(8, 8 + length).numpy().tobytes())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CorruptFile(self.name, "fails its checksum (bad header)") from None
        self._data_start = 8 + length
        header.pop("__metadata__", None)
        return header

    def tensor(self, key: str, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Elements [lo, hi) of tensor `key`, flattened; the whole tensor in its own shape
        when no range is given."""
        info = self.header.get(key)
        if info is None:
            raise CorruptFile(self.name, f"lacks tensor {key!r}")
        dtype, shape = TORCH_DTYPES[info["dtype"]], info["shape"]
        size = torch.empty((), dtype=dtype).element_size()
        start = self._data_start + info["data_offsets"][0]
        whole = hi is None
        hi = int(np.prod(shape)) if hi is None else hi
        flat = self.read_bytes(start + lo * size, start + hi * size).view(dtype)
        return flat.view(shape) if whole else flat

    def read_bytes(self, start: int, end: int) -> torch.Tensor:
        """Bytes [start, end) of the file, verified, as a uint8 tensor of their own."""
        if end > self.size:
            raise CorruptFile(self.name, "fails its checksum (truncated)")
        out = torch.empty(max(0, end - start), dtype=torch.uint8)
        if end <= start or not self.block:  # (the latter verified whole when opened)
            self._pread(out, start)
            return out
        block = self.block
        first, last = start // block, (end - 1) // block
        lo, hi = first * block, min((last + 1) * block, self.size)
        # The blocks the range touches, as three spans: before it, it, after it.
        spans = [(lo, torch.empty(start - lo, dtype=torch.uint8)), (start, out)]
        spans.append((end, torch.empty(hi - end, dtype=torch.uint8)))
        done = lo
        if self._last is not None and self._last[0] == first:  # where the last read ended
            cached = self._last[1]
            for offset, part in _parts(spans, lo, lo + cached.numel()):
                part.copy_(cached[offset - lo : offset - lo + part.numel()])
            done = lo + cached.numel()
        for offset, part in _parts(spans, done, hi):
            self._pread(part, offset)
        for index in range((done - lo) // block + first, last + 1):
            digest = hashlib.sha256()
            for _, part in _parts(spans, index * block, (index + 1) * block):
                digest.update(part.numpy())
            if digest.hexdigest() != self._digests[index]:
                raise CorruptFile(self.name, "fails its checksum")
        self._last = (last, torch.cat([part for _, part in _parts(spans, last * block, hi)]))
        return out

    def _pread(self, out: torch.Tensor, offset: int) -> None:
        view, done = memoryview(out.numpy()), 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got == 0:
                raise CorruptFile(self.name, "fails its checksum (truncated)")
            done += got


def _parts(
    spans: list[tuple[int, torch.Tensor]], start: int, end: int
) -> list[tuple[int, torch.Tensor]]:
    """The pieces of `spans` ((file offset, bytes) back to back) within [start, end)."""
    parts = []
    for begin, data in spans:
        lo, hi = max(start, begin), min(end, begin + data.numel())
        if lo < hi:
            parts.append((lo, data[lo - begin : hi - begin]))
    return parts
