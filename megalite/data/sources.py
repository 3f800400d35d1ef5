"""Reading input files as documents, shared by tokenizer training and corpus preparation.

Inputs are files or directories; a directory is searched recursively (hidden files skipped),
keeping the names that match a glob. Formats, by suffix (after an optional `.gz` or `.zst`):
- `.jsonl`: one JSON object per line; its text field ("text" unless told) is one document.
- `.json`: an array of such objects (or one object): parsed whole, so keep these small.
- `.parquet`: the text column, read one record batch at a time (pyarrow).
- `.arrow` (Arrow IPC stream or file) and `datasets.save_to_disk` directories: likewise.
- anything else: plain UTF-8 text, and the whole file is ONE document. Blank lines in prose
  separate paragraphs, not documents, so splitting on them would put end-of-document tokens in
  the middle of texts; corpora with many documents should be JSONL, Parquet or Arrow.

Everything streams, so memory does not grow with the corpus: the other formats are read a
document or a batch at a time, and text files in chunks of whole lines where the tokenizer
encodes lines apart (megalite's sentencepiece: its newline is a piece of its own, so
line-aligned chunks give the tokens of the file at once). For any other tokenizer a text file
is read whole: byte-level BPEs merge runs of newlines, and a sentencepiece without a newline
piece would prefix every chunk with a space. A file that cannot be read (corrupt compression
or Parquet, bad JSON) is one DataError naming it.
"""

import contextlib
import fnmatch
import gzip
import io
import json
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from zstandard import ZstdDecompressor, ZstdError

from megalite.data.errors import DataError

CHUNK_BYTES = 1 << 20
TEXT_FIELD = "text"
ARROW_BATCH_ROWS = 1024
COMPRESSIONS = (".gz", ".zst")


def expand_inputs(inputs: Sequence[Path], glob: str = "*") -> list[Path]:
    """Files and directories -> the input files (and `save_to_disk` directories) in a stable
    order. Fails early, naming every missing input, before any slow work starts."""
    paths = [Path(p) for p in inputs]
    if not paths:
        raise DataError("no input given; pass files or directories of text, JSONL or Parquet")
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise DataError(f"input not found: {', '.join(missing)}")
    found: list[Path] = []
    for path in paths:
        if path.is_file() or _is_saved_dataset(path):
            found.append(path)
            continue
        matches = _inputs_under(path, glob)
        if not matches:
            raise DataError(f"directory {path} holds no input files matching --glob {glob!r}")
        found += matches
    return found


def check_outputs(outputs: Sequence[Path], inputs: Sequence[Path], overwrite: bool) -> None:
    """Refuse, before any slow work, to write over one of the `inputs` (ever) or over a file
    that exists (unless `overwrite`): a corpus or tokenizer made before may be what a run in
    progress reads, and its replacement would change the data under it."""
    sources = {p.resolve() for p in inputs}
    for out in outputs:
        if out.resolve() in sources:
            raise DataError(f"--out would write {out}, which is an input; choose another --out")
    existing = [str(out) for out in outputs if out.exists()]
    if existing and not overwrite:
        raise DataError(
            f"{', '.join(existing)} already exist{'s' if len(existing) == 1 else ''}: "
            "choose another --out, or pass --overwrite to replace it"
        )


def _inputs_under(root: Path, glob: str) -> list[Path]:
    """Files below `root` whose name matches `glob`, and saved datasets (read whole)."""
    found = []
    for path in sorted(root.rglob("*")):
        parts = path.relative_to(root).parts
        if any(part.startswith(".") for part in parts):
            continue
        if any(_is_saved_dataset(root.joinpath(*parts[:i])) for i in range(1, len(parts))):
            continue  # a file of a saved dataset, which is read as one input
        if _is_saved_dataset(path) or (path.is_file() and fnmatch.fnmatch(path.name, glob)):
            found.append(path)
    return found


def input_bytes(path: Path) -> int:
    """On-disk size of one input, for progress in MB/s."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.glob("*.arrow"))
    return path.stat().st_size


def read_chunks(
    path: Path, text_field: str = TEXT_FIELD, whole_text: bool = False
) -> Iterator[tuple[str, bool, int]]:
    """Yield (text, ends_document, on-disk bytes consumed) for `path`, in file order;
    `whole_text`: a plain text file in one piece, not in chunks of lines."""
    try:
        if _is_saved_dataset(path):
            for arrow in _saved_dataset_files(path):
                yield from _arrow_chunks(arrow, text_field)
            return
        kind = _format(path)
        if kind == ".parquet":
            yield from _parquet_chunks(path, text_field)
        elif kind == ".arrow":
            yield from _arrow_chunks(path, text_field)
        else:
            with _open_stream(path) as (stream, raw):
                if kind in (".jsonl", ".json"):
                    reader = _jsonl_chunks if kind == ".jsonl" else _json_chunks
                    yield from reader(stream, raw, path, text_field)
                else:
                    yield from _text_chunks(stream, raw, path, whole_text)
    except DataError:
        raise
    except (OSError, EOFError, zlib.error, ValueError, ZstdError) as exc:
        raise DataError(
            f"cannot read {path}: {exc}; is the file complete and not corrupt?"
        ) from None


def read_lines(paths: Sequence[Path], text_field: str = TEXT_FIELD) -> Iterator[str]:
    """Every line of every document (without newlines): what the tokenizer trains on."""
    for path in paths:
        for text, _, _ in read_chunks(path, text_field):
            yield from text.split("\n")  # exactly where `Tokenizer.encode` splits


def _format(path: Path) -> str:
    suffixes = path.suffixes
    if suffixes and suffixes[-1] in COMPRESSIONS:
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes else ""


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and (path / "state.json").is_file()


@contextlib.contextmanager
def _open_stream(path: Path) -> Iterator[tuple[BinaryIO, BinaryIO]]:
    """The decompressed byte stream of a file and the raw file under it (for progress)."""
    with open(path, "rb") as raw:
        if path.suffix == ".gz":
            yield gzip.GzipFile(fileobj=raw), raw
        elif path.suffix == ".zst":
            yield io.BufferedReader(_ZstdStream(raw), CHUNK_BYTES), raw
        else:
            yield raw, raw


class _ZstdStream(io.RawIOBase):
    """The decompressed bytes of a .zst file (one or more frames). zstandard's own stream reader
    ends quietly where a truncated file ends; this one raises, so a cut-short download is an
    error rather than a shorter corpus."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw, self.frame, self.pending = raw, ZstdDecompressor().decompressobj(), b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self.pending:
            data = self.raw.read(CHUNK_BYTES)
            if not data:
                if not self.frame.eof:
                    raise ZstdError("the file ends in the middle of a zstd frame")
                return 0
            while data:
                if self.frame.eof:  # the next frame starts
                    self.frame = ZstdDecompressor().decompressobj()
                self.pending += self.frame.decompress(data)
                data = self.frame.unused_data if self.frame.eof else b""
        n = min(len(buffer), len(self.pending))
        buffer[:n], self.pending = self.pending[:n], self.pending[n:]
        return n


def _text_chunks(stream, raw, path: Path, whole: bool) -> Iterator[tuple[str, bool, int]]:
    done = 0
    size = -1 if whole else CHUNK_BYTES
    lines = stream.readlines(size)
    if not lines:
        yield "", True, 0
    while lines:
        raw_text = b"".join(lines)
        lines = stream.readlines(size)
        position = raw.tell()
        yield _decode(raw_text, path), not lines, position - done
        done = position


def _jsonl_chunks(stream, raw, path: Path, field: str) -> Iterator[tuple[str, bool, int]]:
    done = 0
    for lineno, line in enumerate(stream, start=1):
        position = raw.tell()
        consumed, done = position - done, position
        if not line.strip():
            yield "", False, consumed
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{path}:{lineno}: not valid JSON ({e.msg}); expected one object per line like "
                f'{{"{field}": "..."}}'
            ) from None
        yield _text_of(record, field, f"{path}:{lineno}"), True, consumed


def _json_chunks(stream, raw, path: Path, field: str) -> Iterator[tuple[str, bool, int]]:
    try:
        records = json.loads(stream.read())
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    records = records if isinstance(records, list) else [records]
    for index, record in enumerate(records):
        last = index == len(records) - 1
        yield _text_of(record, field, f"{path}[{index}]"), True, raw.tell() if last else 0


def _text_of(record, field: str, where: str) -> str:
    if not isinstance(record, dict) or not isinstance(record.get(field), str):
        raise DataError(
            f'{where}: expected an object with a string "{field}" field (one document each); '
            "name another field with --text-field"
        )
    return record[field]


def _require_column(names: list[str], path: Path, field: str) -> None:
    if field not in names:
        raise DataError(
            f"{path} has no column {field!r} (columns: {', '.join(names)}); name the text "
            "column with --text-field"
        )


def _batch_documents(batches, path: Path, field: str) -> Iterator[tuple[str, bool, int]]:
    """Documents of Arrow record batches; the file's bytes are counted at its first batch."""
    size = path.stat().st_size
    for batch in batches:
        texts = batch.column(field).to_pylist()
        for i, text in enumerate(texts):
            yield ("" if text is None else str(text)), True, size if i == len(texts) - 1 else 0
        size = 0


def _parquet_chunks(path: Path, field: str) -> Iterator[tuple[str, bool, int]]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    _require_column(parquet.schema_arrow.names, path, field)
    yield from _batch_documents(
        parquet.iter_batches(batch_size=ARROW_BATCH_ROWS, columns=[field]), path, field
    )


def _arrow_chunks(path: Path, field: str) -> Iterator[tuple[str, bool, int]]:
    import pyarrow as pa

    source = pa.memory_map(str(path))
    try:
        reader = pa.ipc.open_stream(source)
        batches = iter(reader)
    except pa.ArrowInvalid:  # the random-access file format rather than a stream
        reader = pa.ipc.open_file(source)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    _require_column(reader.schema.names, path, field)
    yield from _batch_documents(batches, path, field)


def _saved_dataset_files(path: Path) -> list[Path]:
    """The Arrow files of a `datasets.save_to_disk` directory, in its own order."""
    state = json.loads((path / "state.json").read_text())
    return [path / entry["filename"] for entry in state.get("_data_files", [])]


def _decode(raw: bytes, path: Path) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path} is not UTF-8 text ({e.reason} at byte {e.start} of a chunk); "
            "convert it to UTF-8 first"
        ) from None
