"""`megalite data tokenizer` and `megalite data prepare`: the two steps that turn your own text
into training data (the builtin corpus does both by itself).

Each handler takes the parsed arguments and returns an exit code; a DataError propagates to the
top-level CLI, which prints it and exits non-zero.
"""

import argparse
import os
import time
from pathlib import Path

from megalite.data.prepare import corpus_paths, prepare_corpus
from megalite.data.tokenizer import KINDS, open_tokenizer, train_tokenizer


def _add_input(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--input",
        nargs="+",
        type=Path,
        required=True,
        metavar="PATH",
        help="files or directories (searched recursively): text (each file one document), "
        ".jsonl / .json, .parquet, .arrow or datasets.save_to_disk directories; .gz and .zst "
        "are decompressed",
    )
    parser.add_argument(
        "--glob", default="*", help="in directories, read only names matching this (e.g. '*.jsonl')"
    )
    parser.add_argument(
        "--text-field", default="text", help="the JSON field or Parquet/Arrow column of the text"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace what --out names if it exists (runs that read it will see other data)",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `data` command group; each leaf sets `func(args) -> int`."""
    data = subparsers.add_parser("data", help="train a tokenizer and prepare token data")
    commands = data.add_subparsers(dest="data_command", required=True, metavar="COMMAND")

    tok = commands.add_parser(
        "tokenizer",
        help="train a tokenizer",
        description="Train a byte-fallback sentencepiece BPE tokenizer (writes PREFIX.model) or "
        "a GPT-2-style byte-level BPE with Hugging Face tokenizers (writes PREFIX.json).",
    )
    _add_input(tok)
    tok.add_argument(
        "--vocab-size",
        type=int,
        required=True,
        metavar="N",
        help="exact number of pieces (>= 256 bytes + characters + specials)",
    )
    tok.add_argument("--kind", choices=KINDS, default="sentencepiece")
    tok.add_argument("--out", type=Path, required=True, metavar="PREFIX")
    tok.set_defaults(func=run_tokenizer)

    prep = commands.add_parser(
        "prepare",
        help="tokenize text into PREFIX.bin/.idx.npy/.json",
        description="Tokenize text into a memmap of token ids plus a document index.",
    )
    _add_input(prep)
    prep.add_argument(
        "--tokenizer",
        type=Path,
        required=True,
        metavar="TOKENIZER",
        help="a .model or .json file from `megalite data tokenizer`, or a Hugging Face "
        "tokenizer.json or model directory (GPT-2, Llama 3, ...)",
    )
    prep.add_argument("--out", type=Path, required=True, metavar="PREFIX")
    prep.add_argument(
        "--workers",
        type=int,
        default=min(4, os.cpu_count() or 1),
        help="tokenizer processes (default: up to 4, one per core)",
    )
    prep.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    prep.set_defaults(func=run_prepare)


def run_tokenizer(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    model = train_tokenizer(
        args.input, args.out, args.vocab_size, args.text_field, args.glob, args.kind, args.overwrite
    )
    print(f"wrote {model} ({args.vocab_size} pieces) in {time.perf_counter() - start:.1f}s")
    return 0


def run_prepare(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    meta = prepare_corpus(
        args.input,
        open_tokenizer(args.tokenizer),
        args.out,
        progress=not args.no_progress,
        text_field=args.text_field,
        glob=args.glob,
        workers=args.workers,
        overwrite=args.overwrite,
    )
    print(
        f"wrote {corpus_paths(args.out)[0]}: {meta['n_tokens']:,} {meta['dtype']} tokens in "
        f"{meta['n_docs']:,} documents in {time.perf_counter() - start:.1f}s"
    )
    return 0
