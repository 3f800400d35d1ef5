"""Reading input files as documents, shared by tokenizer training and corpus preparation.

Two formats:
- `.jsonl`: one JSON object per line; its "text" field is one document.
- anything else: plain UTF-8 text, and the whole file is ONE document. Blank lines in prose
  separate paragraphs, not documents, so splitting on them would put end-of-document tokens in
  the middle of texts; corpora with many documents should be written as JSONL.

Text files are streamed in chunks of whole lines, so a multi-gigabyte file never has to fit in
memory: the tokenizer never merges across a newline, so encoding line-aligned chunks gives the
same tokens as encoding the file at once.
"""

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from megalite.data.errors import DataError

CHUNK_BYTES = 1 << 20


def check_inputs(paths: Sequence[Path]) -> list[Path]:
    """Fail early, naming every missing input, before any slow work starts."""
    paths = [Path(p) for p in paths]
    if not paths:
        raise DataError("no input files given; pass one or more text or .jsonl files")
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise DataError(f"input file(s) not found: {', '.join(missing)}")
    return paths


def read_chunks(path: Path) -> Iterator[tuple[str, bool, int]]:
    """Yield (text, ends_document, bytes_read) for `path`, in file order."""
    if path.suffix == ".jsonl":
        yield from _jsonl_chunks(path)
    else:
        yield from _text_chunks(path)


def read_lines(paths: Sequence[Path]) -> Iterator[str]:
    """Every line of every document (without newlines): what the tokenizer trains on."""
    for path in paths:
        for text, _, _ in read_chunks(path):
            yield from text.split("\n")  # exactly where `Tokenizer.encode` splits


def _text_chunks(path: Path) -> Iterator[tuple[str, bool, int]]:
    with open(path, "rb") as f:
        lines = f.readlines(CHUNK_BYTES)
        if not lines:
            yield "", True, 0
        while lines:
            raw = b"".join(lines)
            lines = f.readlines(CHUNK_BYTES)
            yield _decode(raw, path), not lines, len(raw)


def _jsonl_chunks(path: Path) -> Iterator[tuple[str, bool, int]]:
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                yield "", False, len(line)
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}:{lineno}: not valid JSON ({e.msg}); expected one "
                    'object per line like {"text": "..."}'
                ) from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise DataError(
                    f'{path}:{lineno}: expected an object with a string "text" '
                    "field, one document per line"
                )
            yield record["text"], True, len(line)


def _decode(raw: bytes, path: Path) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path} is not UTF-8 text ({e.reason} at byte {e.start} of a chunk); "
            "convert it to UTF-8 first"
        ) from None
