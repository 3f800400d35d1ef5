"""Every input format of `megalite data` prepares to the tokens of the same text given as plain
text files; directories are searched with a glob; several worker processes give the same output
as one; a corrupt input is one clear error naming it and leaves a prepared corpus untouched."""

import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from megalite.data import (
    DataError,
    Tokenizer,
    builtin_corpus_text,
    corpus_paths,
    prepare_corpus,
    train_tokenizer,
)
from megalite.data.sources import expand_inputs

# Documents with the cases that matter: blank lines inside, no final newline, non-ASCII.
BOOKS = [b.strip("\n") + "\n" for b in builtin_corpus_text()[:60_000].split("\n\n\n") if b.strip()]
DOCS = [*BOOKS[:6], "no newline at the end", "café, naïve, 漢字 🙂\n\nsecond paragraph\n"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    d = tmp_path_factory.mktemp("tok")
    (d / "train.txt").write_text(builtin_corpus_text()[:200_000])
    return Tokenizer(train_tokenizer([d / "train.txt"], d / "tok", 400))


def _jsonl(docs: list[str], field: str = "text") -> bytes:
    return "".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)).encode()


def _arrow_stream(docs: list[str], path: Path, field: str = "text") -> None:
    table = pa.table({"id": list(range(len(docs))), field: docs})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=3):  # several batches
            writer.write_batch(batch)


def _write_formats(root: Path) -> dict[str, list[Path]]:
    """The documents in every supported form; each value is one input list."""
    forms: dict[str, list[Path]] = {}
    txt = root / "txt"
    txt.mkdir()
    for i, doc in enumerate(DOCS):  # a text file is one document
        (txt / f"doc{i:02d}.txt").write_text(doc)
    forms["txt directory"] = [txt]
    (root / "a.jsonl").write_bytes(_jsonl(DOCS))
    forms["jsonl"] = [root / "a.jsonl"]
    (root / "a.json").write_text(json.dumps([{"text": d} for d in DOCS]))
    forms["json"] = [root / "a.json"]
    (root / "a.jsonl.gz").write_bytes(gzip.compress(_jsonl(DOCS)))
    forms["jsonl.gz"] = [root / "a.jsonl.gz"]
    (root / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl(DOCS)))
    forms["jsonl.zst"] = [root / "a.jsonl.zst"]
    pq.write_table(pa.table({"text": DOCS}), root / "a.parquet", row_group_size=3)
    forms["parquet"] = [root / "a.parquet"]
    _arrow_stream(DOCS, root / "a.arrow")
    forms["arrow"] = [root / "a.arrow"]
    saved = root / "saved"  # the layout datasets.Dataset.save_to_disk writes
    saved.mkdir()
    _arrow_stream(DOCS[:4], saved / "data-00000-of-00002.arrow")
    _arrow_stream(DOCS[4:], saved / "data-00001-of-00002.arrow")
    files = [{"filename": f"data-0000{i}-of-00002.arrow"} for i in range(2)]
    (saved / "state.json").write_text(json.dumps({"_data_files": files}))
    (saved / "dataset_info.json").write_text("{}")
    forms["save_to_disk directory"] = [saved]
    return forms


def _tokens(prefix: Path) -> tuple[np.ndarray, np.ndarray]:
    bin_path, idx_path, _ = corpus_paths(prefix)
    meta = json.loads(corpus_paths(prefix)[2].read_text())
    return np.fromfile(bin_path, dtype=meta["dtype"]), np.load(idx_path)


def test_every_format_prepares_to_the_tokens_of_plain_text(tmp_path, tok):
    forms = _write_formats(tmp_path)
    expected = None
    for name, inputs in forms.items():
        prepare_corpus(inputs, tok, tmp_path / "out" / name.replace(" ", "_"), progress=False)
        tokens, index = _tokens(tmp_path / "out" / name.replace(" ", "_"))
        assert len(index) == len(DOCS) + 1, name
        if expected is None:
            expected = (tokens, index)
            # each document is its text's tokens followed by one end-of-document token
            first = tokens[index[0] : index[1]].tolist()
            assert first == tok.encode(DOCS[0]) + [tok.eos_id]
        assert np.array_equal(tokens, expected[0]) and np.array_equal(index, expected[1]), name


def test_text_field_names_another_column(tmp_path, tok):
    (tmp_path / "a.jsonl").write_bytes(_jsonl(DOCS, field="content"))
    pq.write_table(pa.table({"content": DOCS}), tmp_path / "a.parquet")
    with pytest.raises(DataError, match=r'a.jsonl:1: expected an object with a string "text"'):
        prepare_corpus([tmp_path / "a.jsonl"], tok, tmp_path / "x", progress=False)
    with pytest.raises(DataError, match=r"has no column 'text' \(columns: content\).*--text-field"):
        prepare_corpus([tmp_path / "a.parquet"], tok, tmp_path / "x", progress=False)
    for name in ("a.jsonl", "a.parquet"):
        prepare_corpus([tmp_path / name], tok, tmp_path / name, False, text_field="content")
    assert np.array_equal(_tokens(tmp_path / "a.jsonl")[0], _tokens(tmp_path / "a.parquet")[0])


def test_directories_are_searched_recursively_with_a_glob(tmp_path):
    (tmp_path / "data" / "part" / "deep").mkdir(parents=True)
    for name in ("b.jsonl", "part/a.jsonl.gz", "part/deep/c.parquet", "notes.md", ".hidden.jsonl"):
        (tmp_path / "data" / name).write_bytes(b"")
    found = expand_inputs([tmp_path / "data"])
    assert [p.relative_to(tmp_path / "data").as_posix() for p in found] == [
        "b.jsonl",
        "notes.md",
        "part/a.jsonl.gz",
        "part/deep/c.parquet",
    ]
    only = expand_inputs([tmp_path / "data"], glob="*.jsonl*")
    assert [p.name for p in only] == ["b.jsonl", "a.jsonl.gz"]
    with pytest.raises(DataError, match=r"holds no input files matching --glob '\*.txt'"):
        expand_inputs([tmp_path / "data"], glob="*.txt")
    with pytest.raises(DataError, match=r"input not found: .*missing"):
        expand_inputs([tmp_path / "missing"])


def test_worker_processes_give_the_same_corpus(tmp_path, tok, monkeypatch):
    import megalite.data.prepare as prepare

    monkeypatch.setattr(prepare, "BATCH_CHARS", 5_000)  # many batches in flight
    (tmp_path / "a.jsonl").write_bytes(_jsonl(DOCS * 3))
    prepare_corpus([tmp_path / "a.jsonl"], tok, tmp_path / "one", progress=False)
    prepare_corpus([tmp_path / "a.jsonl"], tok, tmp_path / "two", progress=False, workers=2)
    for one, two in zip(_tokens(tmp_path / "one"), _tokens(tmp_path / "two")):
        assert np.array_equal(one, two)


@pytest.mark.parametrize("kind", ["gz", "parquet", "zst"])
def test_a_corrupt_input_is_named_and_a_prepared_corpus_survives(tmp_path, tok, kind):
    (tmp_path / "good.jsonl").write_bytes(_jsonl(DOCS))
    prepare_corpus([tmp_path / "good.jsonl"], tok, tmp_path / "corpus", progress=False)
    before = {p: p.read_bytes() for p in corpus_paths(tmp_path / "corpus")}
    if kind == "gz":
        data = gzip.compress(_jsonl(DOCS * 20))
        bad = tmp_path / "bad.jsonl.gz"
    elif kind == "zst":
        data = zstandard.ZstdCompressor().compress(_jsonl(DOCS * 20))
        bad = tmp_path / "bad.jsonl.zst"
    else:
        pq.write_table(pa.table({"text": DOCS * 20}), tmp_path / "whole.parquet")
        data = (tmp_path / "whole.parquet").read_bytes()
        bad = tmp_path / "bad.parquet"
    bad.write_bytes(data[: len(data) // 2])  # cut short, as by an interrupted download
    with pytest.raises(DataError, match=rf"cannot read {bad}.*corrupt"):
        prepare_corpus(
            [tmp_path / "good.jsonl", bad], tok, tmp_path / "corpus", False, overwrite=True
        )
    assert {p: p.read_bytes() for p in corpus_paths(tmp_path / "corpus")} == before
    assert sorted(p.name for p in tmp_path.iterdir() if ".tmp-" in p.name) == []
