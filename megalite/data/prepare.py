"""Text -> a flat array of token ids on disk, which training reads through a memmap.

A prepared corpus with prefix P is three files:
- `P.bin`: every document's tokens followed by an EOS token, back to back, as uint16 when the
  vocabulary fits in 16 bits (half the disk and page cache) and uint32 otherwise.
- `P.idx.npy`: int64 start offset of each document, then a final entry equal to the number of
  tokens, so document d is `tokens[idx[d]:idx[d + 1]]` (its EOS included).
- `P.json`: metadata; written last, so its presence means the other two are complete. It
  names the tokenizer (a path relative to the corpus) and records the ids that tokenizer gives a
  probe text, so a run can tell the tokenizer it is handed from another one
  (`dataset.check_tokenizer`).

Every file is written under a temporary name and renamed into place, so a crash, a corrupt input
or a concurrent reader never sees half a corpus. An existing corpus is replaced only when asked
(`overwrite`), and an input never.
Tokens are streamed to disk batch by batch; only the document offsets stay in memory (8 bytes
per document). Batches are tokenized by a pool of worker processes, a bounded number in flight,
and written in input order, so the output does not depend on the number of workers.
"""

import json
import multiprocessing as mp
import os
import uuid
from array import array
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import BinaryIO

import numpy as np
from tqdm import tqdm

from megalite.data.errors import DataError
from megalite.data.sources import (
    TEXT_FIELD,
    check_outputs,
    expand_inputs,
    input_bytes,
    read_chunks,
)
from megalite.data.tokenizer import PROBE, HFTokenizer, Tokenizer, open_tokenizer

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
    inputs: Sequence[Path],
    tokenizer: Tokenizer | HFTokenizer,
    out_prefix: Path,
    progress: bool = True,
    text_field: str = TEXT_FIELD,
    glob: str = "*",
    workers: int = 1,
    overwrite: bool = False,
) -> dict:
    """Tokenize `inputs` (files or directories, see `megalite.data.sources`) into the files
    above with `workers` processes. Empty documents are skipped: they would only add a lone EOS.
    Returns the metadata."""
    paths = expand_inputs(inputs, glob)
    out_prefix = Path(out_prefix)
    finals = corpus_paths(out_prefix)
    check_outputs(finals, paths, overwrite)
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    tmps = [p.with_name(f"{p.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}") for p in finals]
    dtype = token_dtype(tokenizer.vocab_size)
    try:
        with open(tmps[0], "wb") as out:
            starts = _write_tokens(paths, text_field, tokenizer, out, dtype, progress, workers)
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
            "tokenizer_probe": tokenizer.encode(PROBE),
        }
        tmps[2].write_text(json.dumps(meta, indent=2) + "\n")
        for tmp, final in zip(tmps, finals):
            os.replace(tmp, final)
    finally:
        for tmp in tmps:
            tmp.unlink(missing_ok=True)
    return meta


def _batches(
    paths: list[Path], text_field: str, whole_text: bool, bar: tqdm
) -> Iterator[list[tuple[str, bool]]]:
    """(text, ends_document) pieces of every input, grouped into batches of BATCH_CHARS."""
    batch: list[tuple[str, bool]] = []
    chars = 0
    for path in paths:
        for text, ends, n_bytes in read_chunks(path, text_field, whole_text):
            batch.append((text, ends))
            chars += len(text)
            if chars >= BATCH_CHARS:
                yield batch
                batch, chars = [], 0
            bar.update(n_bytes)
    if batch:
        yield batch


_worker_tokenizer: Tokenizer | HFTokenizer | None = None


def _start_worker(model_path: Path) -> None:
    global _worker_tokenizer
    # One thread each: the processes, not threads, run in parallel.
    _worker_tokenizer = open_tokenizer(model_path, threads=1)


def _encode_in_worker(texts: list[str]) -> list[list[int]]:
    return _worker_tokenizer.encode_batch(texts)


def _encoded(
    batches: Iterator[list[tuple[str, bool]]], tokenizer: Tokenizer | HFTokenizer, workers: int
) -> Iterator[tuple[list[tuple[str, bool]], list[list[int]]]]:
    """(batch, its token ids) in input order; with workers > 1 tokenized by a process pool
    with at most 2 batches per worker in flight, so memory stays bounded."""
    if workers <= 1:
        for batch in batches:
            yield batch, tokenizer.encode_batch([text for text, _ in batch])
        return
    context = mp.get_context("spawn")  # a clean process: no inherited threads or locks
    with ProcessPoolExecutor(workers, context, _start_worker, (tokenizer.path,)) as pool:
        in_flight: deque[tuple[list, Future]] = deque()
        for batch in batches:
            in_flight.append((batch, pool.submit(_encode_in_worker, [t for t, _ in batch])))
            if len(in_flight) >= 2 * workers:
                done, future = in_flight.popleft()
                yield done, future.result()
        while in_flight:
            done, future = in_flight.popleft()
            yield done, future.result()


def _write_tokens(
    paths: list[Path],
    text_field: str,
    tokenizer: Tokenizer | HFTokenizer,
    out: BinaryIO,
    dtype: np.dtype,
    progress: bool,
    workers: int,
) -> array:
    """Stream every document's tokens + EOS into `out`; return the document start offsets."""
    starts = array("q")
    n_tokens = 0
    doc_open = False  # the current document has tokens and still needs its EOS
    total = sum(input_bytes(p) for p in paths)
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="tokenizing", disable=not progress
    ) as bar:
        batches = _batches(paths, text_field, not tokenizer.encodes_lines_apart, bar)
        for batch, encoded in _encoded(batches, tokenizer, workers):
            buf: list[int] = []
            for (_, ends), ids in zip(batch, encoded):
                if ids and not doc_open:
                    starts.append(n_tokens + len(buf))
                    doc_open = True
                buf.extend(ids)
                if ends and doc_open:
                    buf.append(tokenizer.eos_id)
                    doc_open = False
            out.write(np.asarray(buf, dtype=dtype).tobytes())
            n_tokens += len(buf)
            bar.set_postfix(docs=f"{len(starts):,}", tokens=f"{n_tokens:,}", refresh=False)
    starts.append(n_tokens)
    return starts
