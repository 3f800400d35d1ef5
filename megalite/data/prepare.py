"""Text -> a flat array of token ids on disk, which training reads through a memmap.

A prepared corpus with prefix P is three files:
- `P.bin`: every document's tokens followed by an EOS token, back to back, as uint16 when the
  vocabulary fits in 16 bits (half the disk and page cache) and uint32 otherwise.
- `P.idx.npy`: int64 start offset of each document, then a final entry equal to the number of
  tokens, so document d is `tokens[idx[d]:idx[d + 1]]` (its EOS included).
- `P.json`: metadata; written last, so its presence means the other two are complete.

Every file is written under a temporary name and renamed into place, so a crash or a concurrent
reader never sees half a corpus. Tokens are streamed to disk batch by batch; only the document
offsets stay in memory (8 bytes per document).
"""

import json
import os
import uuid
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np
from tqdm import tqdm

from megalite.data.errors import DataError
from megalite.data.sources import check_inputs, read_chunks
from megalite.data.tokenizer import Tokenizer

FORMAT = "megalite-tokens"
FORMAT_VERSION = 1
BATCH_CHARS = 1 << 22  # text handed to the tokenizer at once: big enough to keep threads busy


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id of this vocabulary."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def corpus_paths(prefix: Path) -> tuple[Path, Path, Path]:
    """(tokens .bin, document index .idx.npy, metadata .json) of a prepared corpus."""
    return Path(f"{prefix}.bin"), Path(f"{prefix}.idx.npy"), Path(f"{prefix}.json")


def prepare_corpus(
    inputs: Sequence[Path], tokenizer: Tokenizer, out_prefix: Path, progress: bool = True
) -> dict:
    """Tokenize text/.jsonl `inputs` (see `megalite.data.sources`) into the files above.

    Empty documents are skipped: they would only add a lone EOS. Returns the metadata.
    """
    paths = check_inputs(inputs)
    out_prefix = Path(out_prefix)
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    finals = corpus_paths(out_prefix)
    tmps = [p.with_name(f"{p.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}") for p in finals]
    dtype = token_dtype(tokenizer.vocab_size)
    try:
        with open(tmps[0], "wb") as out:
            starts = _write_tokens(paths, tokenizer, out, dtype, progress)
        n_tokens = starts[-1]
        if n_tokens == 0:
            raise DataError(f"no text in {', '.join(map(str, paths))}; nothing to prepare")
        with open(tmps[1], "wb") as f:
            np.save(f, np.frombuffer(starts, dtype=np.int64))
        meta = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "dtype": dtype.name,
            "n_tokens": n_tokens,
            "n_docs": len(starts) - 1,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            # Relative, so the corpus and its tokenizer can move together.
            "tokenizer": os.path.relpath(tokenizer.path.resolve(), out_prefix.parent.resolve()),
        }
        tmps[2].write_text(json.dumps(meta, indent=2) + "\n")
        for tmp, final in zip(tmps, finals):
            os.replace(tmp, final)
    finally:
        for tmp in tmps:
            tmp.unlink(missing_ok=True)
    return meta


def _write_tokens(
    paths: list[Path], tokenizer: Tokenizer, out: BinaryIO, dtype: np.dtype, progress: bool
) -> array:
    """Stream every document's tokens + EOS into `out`; return the document start offsets."""
    starts = array("q")
    n_tokens = 0
    doc_open = False  # the current document has tokens and still needs its EOS
    pending: list[tuple[str, bool]] = []
    pending_chars = 0

    def flush() -> None:
        nonlocal n_tokens, doc_open, pending_chars
        buf: list[int] = []
        for (_, ends), ids in zip(pending, tokenizer.encode_batch([t for t, _ in pending])):
            if ids and not doc_open:
                starts.append(n_tokens + len(buf))
                doc_open = True
            buf.extend(ids)
            if ends and doc_open:
                buf.append(tokenizer.eos_id)
                doc_open = False
        out.write(np.asarray(buf, dtype=dtype).tobytes())
        n_tokens += len(buf)
        pending.clear()
        pending_chars = 0

    total = sum(p.stat().st_size for p in paths)
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="tokenizing", disable=not progress
    ) as bar:
        for path in paths:
            for text, ends, n_bytes in read_chunks(path):
                pending.append((text, ends))
                pending_chars += len(text)
                if pending_chars >= BATCH_CHARS:
                    flush()
                bar.update(n_bytes)
        flush()
    starts.append(n_tokens)
    return starts
