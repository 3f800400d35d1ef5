"""Fixed-length training windows over a prepared corpus (see `megalite.data.prepare`).

The token stream is cut into non-overlapping windows of seq_len + 1 tokens starting every
seq_len tokens: inputs are the first seq_len, targets the last seq_len, so every token is
predicted exactly once per epoch. Windows run across document boundaries (the EOS token tells
the model where one ends), as in GPT-2 and Megatron, so no token is wasted on padding.

A rank reads only the tokens it consumes (`BlendedDataset.read`): the first pipeline stage embeds
the inputs, the last takes the loss on the targets, and a middle stage reads nothing.

The last `val_fraction` of the stream (at least one window) is held out as "val"; train windows
end before it starts, so no token is in both splits.

Opening a corpus checks everything that can be checked without reading the tokens, and each
problem is one DataError naming the file and the fix.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megalite.data.blend import Interleave
from megalite.data.errors import DataError
from megalite.data.prepare import FORMAT, FORMAT_VERSION, corpus_paths, token_dtype
from megalite.data.tokenizer import PROBE, HFTokenizer, Tokenizer, open_tokenizer

SPLITS = ("train", "val")


class TokenDataset:
    """The windows of one split of a prepared corpus, read from a read-only memmap."""

    def __init__(
        self,
        prefix: Path,
        seq_len: int,
        split: str = "train",
        val_fraction: float = 0.01,
        vocab_size: int | None = None,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if seq_len < 1 or not 0 <= val_fraction < 1:
            raise ValueError(
                f"need seq_len >= 1 and 0 <= val_fraction < 1, got {seq_len}, {val_fraction}"
            )
        self.prefix = Path(prefix)
        self.seq_len = seq_len
        self.split = split
        self.meta = _read_meta(self.prefix)
        self.tokenizer_path = self.prefix.parent / self.meta["tokenizer"]
        if vocab_size is not None and self.meta["vocab_size"] > vocab_size:
            raise DataError(
                f"{self.prefix} was tokenized with a {self.meta['vocab_size']}-piece vocabulary "
                f"but the model's vocab_size is {vocab_size}; set model.vocab_size >= "
                f"{self.meta['vocab_size']} or prepare the data with a matching tokenizer"
            )
        tokens = _open_tokens(self.prefix, self.meta)
        _check_index(self.prefix, self.meta)

        window = seq_len + 1
        n_val = max(math.ceil(len(tokens) * val_fraction), window)
        n_train = len(tokens) - n_val
        self.tokens = tokens[n_train:] if split == "val" else tokens[: max(n_train, 0)]
        self.file_start = n_train if split == "val" else 0  # where self.tokens begin in the file
        # Windows start every seq_len tokens and need seq_len + 1 of them.
        self._num_windows = max(len(self.tokens) - 1, 0) // seq_len
        if self._num_windows == 0:
            raise DataError(
                f"the {split} split of {self.prefix} has {len(self.tokens)} tokens, fewer than "
                f"one window of seq_len + 1 = {window} ({len(tokens)} tokens in all, "
                f"val_fraction={val_fraction}); prepare more text or use a shorter seq_len"
            )

    def __len__(self) -> int:
        return self._num_windows

    def get_batch(self, indices: Sequence[int], span: slice = slice(None)) -> torch.Tensor:
        """Tokens `span` of windows `indices` (all seq_len + 1 by default) as a LongTensor
        [len(indices), span length]; only those tokens are read from the file."""
        starts = np.asarray(indices, dtype=np.int64)
        if starts.size and not (0 <= starts.min() and starts.max() < self._num_windows):
            raise IndexError(f"window index out of range [0, {self._num_windows}): {indices}")
        offsets = starts[:, None] * self.seq_len + np.arange(self.seq_len + 1)[span]
        ids = self.tokens[offsets]
        if ids.size and ids.max() >= self.meta["vocab_size"]:
            self._refuse_id(ids, offsets)
        return torch.from_numpy(ids.astype(np.int64))  # [n, span length]

    def _refuse_id(self, ids: np.ndarray, offsets: np.ndarray) -> None:
        """A token id past the vocabulary: a corrupt file. On a GPU the embedding and the loss
        would read outside their tables (a device assert, or a silently wrong loss), so it stops
        here, at the token's place in the file."""
        at = int(np.argmax(ids >= self.meta["vocab_size"]))
        place = self.file_start + int(offsets.reshape(-1)[at])
        raise DataError(
            f"{corpus_paths(self.prefix)[0]} holds token id {int(ids.reshape(-1)[at])} at token "
            f"{place}, outside its {self.meta['vocab_size']}-piece vocabulary: the file is "
            f"corrupt; {_fix(self.prefix)}"
        )


@dataclass
class TokenBatch:
    """A rank's share of a global batch: `size` windows, with their inputs (size, seq) where the
    rank embeds tokens (the first pipeline stage) and their next-token targets (size, seq) where
    it takes the loss (the last); None where it needs them not (a middle stage has neither)."""

    size: int
    inputs: torch.Tensor | None = None
    targets: torch.Tensor | None = None

    @classmethod
    def of_windows(cls, windows: torch.Tensor) -> TokenBatch:
        """Both halves of whole (n, seq + 1) windows."""
        return cls(windows.shape[0], windows[:, :-1], windows[:, 1:])

    def to(self, device: torch.device) -> TokenBatch:
        """The batch on `device`; onto a GPU from pinned memory, so the host does not wait."""

        def moved(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or device.type != "cuda":
                return None if t is None else t.to(device)
            return t.pin_memory().to(device, non_blocking=True)

        return TokenBatch(self.size, moved(self.inputs), moved(self.targets))


class BlendedDataset:
    """The windows of one split of one or more corpora, addressed as (corpus, window) pairs:
    what `GlobalBatchSampler` yields. One corpus is the blend of weight 1."""

    def __init__(self, datasets: Sequence[TokenDataset], weights: Sequence[float]) -> None:
        self.datasets, self.weights = list(datasets), list(weights)
        self.interleave = Interleave(self.weights)
        self.tokenizer_path = self.datasets[0].tokenizer_path
        """The tokenizer the first corpus names; `check_tokenizer` holds every corpus to one."""

    def check_tokenizer(self, tokenizer: Tokenizer | HFTokenizer) -> None:
        """Fail unless every corpus was prepared with `tokenizer`: its vocabulary size, end of
        document and the ids it gives the probe text. Corpora prepared before the metadata
        recorded those ids are compared with the tokenizer they name, where it is."""
        ids = tokenizer.encode(PROBE)
        for dataset in self.datasets:
            recorded = dataset.meta.get("tokenizer_probe")
            named = dataset.tokenizer_path
            if recorded is None and named.is_file() and named.resolve() != tokenizer.path.resolve():
                recorded = open_tokenizer(named).encode(PROBE)
            meta = (dataset.meta["vocab_size"], dataset.meta["eos_id"])
            if meta != (tokenizer.vocab_size, tokenizer.eos_id) or recorded not in (None, ids):
                raise DataError(
                    f"{dataset.prefix} was prepared with another tokenizer than {tokenizer.path} "
                    "(it encodes differently); one run reads its data with one tokenizer: prepare "
                    f"it with `megalite data prepare --tokenizer {tokenizer.path} ...`, or set "
                    "data.tokenizer to the tokenizer it was prepared with"
                )

    @property
    def sizes(self) -> list[int]:
        return [len(d) for d in self.datasets]

    @property
    def eos_id(self) -> int:
        """The end-of-document token the corpora were prepared with (one tokenizer)."""
        return int(self.datasets[0].meta["eos_id"])

    def describe(self) -> str:
        """'data blend: 0.7000 a (N windows), ...' with the proportions actually drawn."""
        parts = [
            f"{weight:.4f} {dataset.prefix} ({len(dataset):,} windows)"
            for weight, dataset in zip(self.interleave.weights, self.datasets)
        ]
        return "data blend: " + ", ".join(parts)

    def get_batch(
        self, pairs: Sequence[tuple[int, int]], span: slice = slice(None)
    ) -> torch.Tensor:
        """Tokens `span` (default: all seq_len + 1) of the windows of (corpus, window index)
        pairs as a LongTensor [len(pairs), span length]."""
        corpus = np.array([c for c, _ in pairs], dtype=np.int64)
        windows = np.array([w for _, w in pairs], dtype=np.int64)
        width = len(range(self.datasets[0].seq_len + 1)[span])
        out = torch.empty((len(pairs), width), dtype=torch.int64)
        for c, dataset in enumerate(self.datasets):
            here = np.flatnonzero(corpus == c)
            if here.size:
                out[torch.from_numpy(here)] = dataset.get_batch(windows[here], span)
        return out

    def read(
        self, pairs: Sequence[tuple[int, int]], inputs: bool = True, targets: bool = True
    ) -> TokenBatch:
        """The windows `pairs` as a TokenBatch holding only the halves asked for, and reading
        only those: inputs are tokens [0, seq) of a window, targets [1, seq + 1); both together
        are read as one window."""
        if inputs and targets:
            return TokenBatch.of_windows(self.get_batch(pairs))
        seq = self.datasets[0].seq_len
        return TokenBatch(
            len(pairs),
            self.get_batch(pairs, slice(0, seq)) if inputs else None,
            self.get_batch(pairs, slice(1, seq + 1)) if targets else None,
        )

    def evaluation_pairs(self, k: int, size: int) -> list[tuple[int, int]]:
        """Evaluation batch k: the blend's positions [k * size, (k + 1) * size) in order, each
        corpus read from its first window on, so every evaluation sees the same windows."""
        corpus, draws = self.interleave(np.arange(k * size, (k + 1) * size))
        sizes = np.array(self.sizes, dtype=np.int64)
        return list(zip(corpus.tolist(), (draws % sizes[corpus]).tolist()))


def _fix(prefix: Path) -> str:
    command = f"megalite data prepare --input FILE... --tokenizer MODEL --out {prefix}"
    return f"re-create it with `{command}`"


def _read_meta(prefix: Path) -> dict:
    bin_path, idx_path, meta_path = corpus_paths(prefix)
    missing = [str(p) for p in (bin_path, idx_path, meta_path) if not p.is_file()]
    if len(missing) == 3:
        raise DataError(
            f"no prepared data at {prefix} (looked for {prefix}.bin, .idx.npy and .json; give "
            f"the prefix without an extension); create it with `megalite data prepare --input "
            f"FILE... --tokenizer MODEL --out {prefix}`"
        )
    if missing:
        raise DataError(f"prepared data incomplete, missing {', '.join(missing)}; {_fix(prefix)}")
    try:
        meta = json.loads(meta_path.read_text())
        ok = meta.get("format") == FORMAT and meta.get("format_version") == FORMAT_VERSION
        fields = {k: meta[k] for k in ("dtype", "n_tokens", "n_docs", "vocab_size", "tokenizer")}
    except (ValueError, KeyError, AttributeError) as e:
        raise DataError(f"metadata {meta_path} is unreadable ({e}); {_fix(prefix)}") from None
    if not ok:
        raise DataError(
            f"metadata {meta_path} is not megalite token data version {FORMAT_VERSION} "
            f"(format={meta.get('format')!r}, version={meta.get('format_version')!r}); "
            f"{_fix(prefix)}"
        )
    if fields["dtype"] not in ("uint16", "uint32"):
        raise DataError(
            f"metadata {meta_path} has dtype {fields['dtype']!r}, expected uint16 or "
            f"uint32; {_fix(prefix)}"
        )
    if np.dtype(fields["dtype"]).itemsize < token_dtype(fields["vocab_size"]).itemsize:
        raise DataError(
            f"metadata {meta_path} says dtype {fields['dtype']} but vocab_size "
            f"{fields['vocab_size']} needs {token_dtype(fields['vocab_size']).name}; "
            f"{_fix(prefix)}"
        )
    return meta


def _open_tokens(prefix: Path, meta: dict) -> np.ndarray:
    bin_path = corpus_paths(prefix)[0]
    dtype = np.dtype(meta["dtype"])
    size = bin_path.stat().st_size
    if size == 0:
        raise DataError(f"token file {bin_path} is empty; {_fix(prefix)}")
    if size % dtype.itemsize:
        raise DataError(
            f"token file {bin_path} has {size} bytes, not a multiple of {dtype.itemsize} "
            f"({dtype.name}): wrong dtype or a truncated write; {_fix(prefix)}"
        )
    if size // dtype.itemsize != meta["n_tokens"]:
        raise DataError(
            f"token file {bin_path} holds {size // dtype.itemsize} {dtype.name} tokens but its "
            f"metadata says {meta['n_tokens']}: truncated or from another run; {_fix(prefix)}"
        )
    return np.memmap(bin_path, dtype=dtype, mode="r")


def _check_index(prefix: Path, meta: dict) -> None:
    idx_path = corpus_paths(prefix)[1]
    try:
        idx = np.load(idx_path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError):
        raise DataError(
            f"document index {idx_path} is not a readable .npy array; {_fix(prefix)}"
        ) from None
    problem = None
    if idx.dtype != np.int64 or idx.ndim != 1:
        problem = f"has dtype {idx.dtype} and shape {idx.shape}, expected 1-D int64"
    elif len(idx) < 2 or len(idx) != meta["n_docs"] + 1:
        problem = f"has {len(idx)} entries, expected n_docs + 1 = {meta['n_docs'] + 1}"
    elif idx[0] != 0 or idx[-1] != meta["n_tokens"]:
        problem = f"runs from {idx[0]} to {idx[-1]}, expected 0 to n_tokens = {meta['n_tokens']}"
    elif not _increasing(idx):
        problem = "has document offsets that are not increasing"
    if problem:
        raise DataError(
            f"document index {idx_path} {problem}: truncated or inconsistent; {_fix(prefix)}"
        )


def _increasing(idx: np.ndarray, chunk: int = 1 << 20) -> bool:
    """Whether a memmapped index strictly increases, read a chunk at a time: an index of a
    billion documents is 8 GB, which every rank of a node would otherwise hold at once."""
    for start in range(0, len(idx) - 1, chunk):
        piece = np.asarray(idx[start : start + chunk + 1])  # one entry of overlap
        if np.any(np.diff(piece) <= 0):
            return False
    return True
