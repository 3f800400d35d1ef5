"""The packaged King James Bible, tokenized on first use and cached, so demos and tests need
no download and no preparation step.

The cache entry for a vocabulary size is a directory holding `tokenizer.model` and the
prepared `tokens.*` files. It is built in a private temporary directory and renamed into place
in one step: several processes (distributed ranks, parallel test workers) may build at once,
the first rename wins, and the others delete their copies and use the winner's. A reader can
therefore never see a half-built entry.
"""

import json
import lzma
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

from megalite.data.errors import DataError
from megalite.data.prepare import FORMAT_VERSION, corpus_paths, prepare_corpus
from megalite.data.tokenizer import Tokenizer, train_tokenizer

CORPUS_FILE = "kjv.txt.xz"
CORPUS_VERSION = 1  # bump when the corpus text or its cleaning changes


def builtin_corpus_text() -> str:
    """The cleaned King James Bible: one verse per line, books separated by a blank line."""
    packed = resources.files("megalite.data").joinpath("corpus", CORPUS_FILE).read_bytes()
    return lzma.decompress(packed).decode("ascii")


def cache_root(cache_dir: Path | None = None) -> Path:
    """`cache_dir`, else $MEGALITE_CACHE, else ~/.cache/megalite."""
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(os.environ.get("MEGALITE_CACHE") or Path.home() / ".cache" / "megalite")


def builtin_data(vocab_size: int, cache_dir: Path | None = None) -> tuple[Path, Path]:
    """(prepared prefix, tokenizer .model) of the builtin corpus at exactly `vocab_size` pieces."""
    root = cache_root(cache_dir)
    entry = root / f"kjv-c{CORPUS_VERSION}-f{FORMAT_VERSION}-v{vocab_size}"
    prefix, model = entry / "tokens", entry / "tokenizer.model"
    if corpus_paths(prefix)[2].is_file():
        return prefix, model
    root.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix=f".{entry.name}.tmp-", dir=root))
    try:
        _build(build, vocab_size)
        build.chmod(0o755)  # mkdtemp makes it private; the entry is an ordinary cache dir
        try:
            os.rename(build, entry)
        except OSError as e:
            if not corpus_paths(prefix)[2].is_file():  # not a lost race: a broken entry
                raise DataError(
                    f"cannot place builtin data at {entry} ({e}); if it is a "
                    "leftover from an interrupted run, delete it and retry"
                ) from None
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return prefix, model


def _build(build: Path, vocab_size: int) -> None:
    """Train the tokenizer on the corpus and prepare it with one document per book."""
    text = builtin_corpus_text()
    (build / "kjv.txt").write_text(text)
    books = build / "books.jsonl"
    with open(books, "w") as f:
        f.writelines(
            json.dumps({"text": book.strip("\n") + "\n"}) + "\n" for book in text.split("\n\n")
        )
    try:
        model = train_tokenizer([build / "kjv.txt"], build / "tokenizer", vocab_size)
    except DataError as error:
        raise DataError(
            f"the builtin corpus cannot train a tokenizer of model.vocab_size={vocab_size} "
            "pieces: choose another model.vocab_size (the tiny configs use 8000), or prepare "
            f"data of your own ({error})"
        ) from None
    prepare_corpus([books], Tokenizer(model), build / "tokens", progress=False)
    (build / "kjv.txt").unlink()
    books.unlink()
