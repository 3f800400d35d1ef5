"""Throughput of `megalite data prepare` against a plain single-process `tokenizers` loop.

A corpus of `--mb` megabytes of JSONL (the builtin corpus's books, repeated) is tokenized with a
GPT-2-style byte-level BPE (`tokenizer.json`, trained here on the builtin corpus):
- baseline: one process reads the file line by line and calls the tokenizer's `encode_batch` on
  batches of documents, the loop people write first (the Rust tokenizer uses its own threads);
- megalite: `prepare_corpus` with 1 and with `--workers` processes, which also writes the token
  file and the document index, as training reads them.
Each row reports MB of input text per second and tokens per second (the fastest of `--repeat`).

    python -m megalite.benchmarks.prepare --mb 64 --workers 4
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile
import time
from pathlib import Path

from megalite.benchmarks.table import print_table
from megalite.data import builtin_corpus_text, open_tokenizer, prepare_corpus, train_tokenizer

BATCH_DOCS = 256


def write_corpus(path: Path, megabytes: float) -> int:
    """JSONL of the builtin corpus's books, repeated to `megabytes`; returns its size."""
    books = [b for b in builtin_corpus_text().split("\n\n") if b.strip()]
    lines = itertools.cycle(json.dumps({"text": book}) + "\n" for book in books)
    written = 0
    with open(path, "w") as f:
        while written < megabytes * 1e6:  # whole books: at most one book past the size
            line = next(lines)
            f.write(line)
            written += len(line)
    return path.stat().st_size


def plain_tokenizers(corpus: Path, tokenizer_json: Path) -> int:
    """The baseline: read documents, encode_batch them, count the tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    tokens, batch = 0, []
    with open(corpus) as f:
        for line in f:
            batch.append(json.loads(line)["text"])
            if len(batch) == BATCH_DOCS:
                tokens += sum(len(e.ids) for e in tok.encode_batch(batch))
                batch = []
    if batch:
        tokens += sum(len(e.ids) for e in tok.encode_batch(batch))
    return tokens


def run(args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="megalite-bench-prepare-") as scratch:
        return _run_in(Path(scratch), args)


def _run_in(root: Path, args: argparse.Namespace) -> list[dict]:
    (root / "train.txt").write_text(builtin_corpus_text()[:2_000_000])
    tokenizer = train_tokenizer([root / "train.txt"], root / "bpe", 8000, kind="byte-bpe")
    size = write_corpus(root / "corpus.jsonl", args.mb)
    contenders = {
        "tokenizers, 1 process (baseline)": lambda: plain_tokenizers(
            root / "corpus.jsonl", tokenizer
        ),
        "megalite prepare, --workers 1": lambda: _prepare(root, tokenizer, 1),
        f"megalite prepare, --workers {args.workers}": lambda: _prepare(
            root, tokenizer, args.workers
        ),
    }
    rows = []
    for name, contender in contenders.items():
        best, tokens = float("inf"), 0
        for _ in range(args.repeat):
            start = time.perf_counter()
            tokens = contender()
            best = min(best, time.perf_counter() - start)
        rows.append({"name": name, "seconds": best, "tokens": tokens, "bytes": size})
    return rows


def _prepare(root: Path, tokenizer: Path, workers: int) -> int:
    meta = prepare_corpus(  # the scratch corpus of the last contender's run is replaced
        [root / "corpus.jsonl"],
        open_tokenizer(tokenizer),
        root / "out",
        False,
        workers=workers,
        overwrite=True,
    )
    return meta["n_tokens"] - meta["n_docs"]  # without the end-of-document tokens


def report(args: argparse.Namespace, rows: list[dict]) -> None:
    table = [
        [
            r["name"],
            f"{r['seconds']:.2f}",
            f"{r['bytes'] / r['seconds'] / 1e6:.1f}",
            f"{r['tokens'] / r['seconds']:,.0f}",
            f"{r['tokens']:,}",
        ]
        for r in rows
    ]
    columns = ["implementation", "seconds", "MB/s", "tokens/s", "tokens"]
    notes = [
        f"{rows[0]['bytes'] / 1e6:.1f} MB of JSONL, byte-level BPE of 8000 pieces, "
        f"{os.cpu_count()} CPU cores, fastest of {args.repeat}.",
        "megalite also writes the token file and document index; the baseline only counts.",
    ]
    print_table(columns, table, notes)


def options() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=32.0, help="corpus size in MB")
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1))
    parser.add_argument("--repeat", type=int, default=2)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = options().parse_args(argv)
    report(args, run(args))


if __name__ == "__main__":
    main()
