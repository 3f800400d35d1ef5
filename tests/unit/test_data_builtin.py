"""The builtin corpus and its cache, including several processes building it at once."""

import multiprocessing
from pathlib import Path

import pytest

from megalite.data import DataError, TokenDataset, Tokenizer, builtin_corpus_text, builtin_data
from megalite.data import builtin as builtin_module
from megalite.data.prepare import corpus_paths


def test_builtin_corpus_text():
    text = builtin_corpus_text()
    assert len(text) > 4_000_000 and text.isascii()
    books = text.split("\n\n")
    assert len(books) == 66
    assert books[0].startswith("Genesis\nIn the beginning God created the heaven and the earth.")
    assert books[-1].endswith("The grace of our Lord Jesus Christ be with you all. Amen.\n")


def _fake_build(build: Path, vocab_size: int) -> None:
    corpus_paths(build / "tokens")[2].write_text(f"{vocab_size} built in {build.name}")


def test_cache_location_and_reuse(tmp_path, monkeypatch):
    monkeypatch.setattr(builtin_module, "_build", _fake_build)
    monkeypatch.setenv("MEGALITE_CACHE", str(tmp_path / "env"))
    prefix, model = builtin_data(64)
    assert prefix.parent.parent == tmp_path / "env" and model.parent == prefix.parent
    meta = corpus_paths(prefix)[2]
    assert builtin_data(64) == (prefix, model) and meta.read_text().startswith("64 built")
    assert builtin_data(64, tmp_path / "explicit")[0].parent.parent == tmp_path / "explicit"
    assert builtin_data(65)[0] != prefix  # keyed by vocabulary size


def test_losing_the_race_uses_the_winners_copy(tmp_path, monkeypatch):
    def build_then_get_overtaken(build: Path, vocab_size: int) -> None:
        _fake_build(build, vocab_size)
        monkeypatch.setattr(builtin_module, "_build", _fake_build)
        builtin_data(vocab_size, tmp_path)  # another process finishes first

    monkeypatch.setattr(builtin_module, "_build", build_then_get_overtaken)
    prefix, _ = builtin_data(64, tmp_path)
    winner = corpus_paths(prefix)[2].read_text()
    assert prefix.parent.exists() and len(list(tmp_path.iterdir())) == 1  # loser cleaned up
    assert builtin_data(64, tmp_path) == (prefix, prefix.parent / "tokenizer.model")
    assert corpus_paths(prefix)[2].read_text() == winner


def test_a_broken_cache_entry_is_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(builtin_module, "_build", _fake_build)
    prefix, _ = builtin_data(64, tmp_path)
    corpus_paths(prefix)[2].unlink()  # as if interrupted while deleting it by hand
    corpus_paths(prefix)[0].write_bytes(b"")
    with pytest.raises(DataError, match=r"cannot place builtin data at .*delete it and retry"):
        builtin_data(64, tmp_path)


def test_concurrent_processes_build_once_and_agree(tmp_path):
    """Two processes race into an empty cache: both succeed and return the same files."""
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        results = pool.starmap_async(builtin_data, [(512, tmp_path), (512, tmp_path)]).get(120)
    assert results[0] == results[1]
    prefix, model = results[0]
    assert [p.name for p in tmp_path.iterdir()] == [prefix.parent.name]  # no temp dirs left
    tok = Tokenizer(model)
    assert tok.vocab_size == 512
    train = TokenDataset(prefix, seq_len=128, vocab_size=512)
    assert train.meta["n_docs"] == 66
    text = tok.decode(train.get_batch([0])[0].tolist())
    assert text.startswith("Genesis\nIn the beginning God created the heaven and the earth.")
