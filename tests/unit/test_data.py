"""Tokenizer, corpus preparation, windows and their error messages, and the data CLI."""

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from megalite.commands.data import register
from megalite.data import (
    DataError,
    TokenDataset,
    Tokenizer,
    builtin_corpus_text,
    corpus_paths,
    prepare_corpus,
    token_dtype,
    train_tokenizer,
)

DOCS = [
    "In the beginning God created the heaven and the earth.\n",
    "  Leading spaces, tabs\tand  double  spaces survive.\n\nA second paragraph, no newline",
    "Unicode: café, naïve, 漢字, emoji 🙂 — byte fallback covers them.\n",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    """A 512-piece tokenizer trained on the first ~300 KB of the builtin corpus (fast)."""
    d = tmp_path_factory.mktemp("tok")
    (d / "train.txt").write_text(builtin_corpus_text()[:300_000])
    return Tokenizer(train_tokenizer([d / "train.txt"], d / "tok", 512))


@pytest.fixture
def corpus(tmp_path, tok) -> Path:
    """Prepared data from a text file (one document) and a JSONL file (three)."""
    text = builtin_corpus_text()[:40_000]
    (tmp_path / "a.txt").write_text(text)
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    prepare_corpus([tmp_path / "a.txt", tmp_path / "b.jsonl"], tok, tmp_path / "c", False)
    return tmp_path / "c"


# --- tokenizer ----------------------------------------------------------------------------


def test_tokenizer_round_trip_and_specials(tok):
    assert tok.vocab_size == 512
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    for text in DOCS + ["", "\n", " ", "\r\n\r\n", "line\n\n\nend\n"]:
        assert tok.decode(tok.encode(text)) == text
    # Encoding line by line (for speed) gives exactly the tokens of encoding the whole text.
    text = "".join(DOCS) * 3
    assert tok.encode(text) == list(tok._sp.encode(text))
    assert tok.encode_batch(DOCS) == [tok.encode(d) for d in DOCS]


def test_tokenizer_training_is_deterministic(tmp_path, tok):
    (tmp_path / "t.txt").write_text(builtin_corpus_text()[:300_000])
    again = train_tokenizer([tmp_path / "t.txt"], tmp_path / "again", 512)
    assert again == tmp_path / "again.model"
    assert again.read_bytes() == tok.path.read_bytes()
    assert not list(tmp_path.glob("*.tmp-*"))


def test_tokenizer_errors(tmp_path):
    with pytest.raises(DataError, match=r"not found: .*nope\.model.*megalite data tokenizer"):
        Tokenizer(tmp_path / "nope.model")
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(DataError, match=r"bad\.model is not a sentencepiece model"):
        Tokenizer(tmp_path / "bad.model")
    (tmp_path / "tiny.txt").write_text("abc abc abc\n")
    with pytest.raises(DataError, match="more text or a smaller --vocab-size"):
        train_tokenizer([tmp_path / "tiny.txt"], tmp_path / "t", 4000)
    with pytest.raises(DataError, match="larger --vocab-size: it must hold 256 bytes"):
        train_tokenizer([tmp_path / "tiny.txt"], tmp_path / "t", 200)
    with pytest.raises(DataError, match=r"not found: .*missing\.txt"):
        train_tokenizer([tmp_path / "missing.txt"], tmp_path / "t", 512)


# --- prepare ------------------------------------------------------------------------------


def test_prepare_round_trip(corpus, tok):
    bin_path, idx_path, meta_path = corpus_paths(corpus)
    meta = json.loads(meta_path.read_text())
    tokens = np.fromfile(bin_path, dtype=meta["dtype"])
    idx = np.load(idx_path)
    inputs = [(corpus.parent / "a.txt").read_text()] + DOCS  # a text file is one document
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 512
    assert meta["n_docs"] == len(inputs) and meta["n_tokens"] == len(tokens) == idx[-1]
    assert idx.dtype == np.int64 and idx[0] == 0
    for d, text in enumerate(inputs):
        doc = tokens[idx[d] : idx[d + 1]].tolist()
        assert doc[-1] == tok.eos_id and tok.eos_id not in doc[:-1]
        assert tok.decode(doc[:-1]) == text
    assert (corpus.parent / meta["tokenizer"]).resolve() == tok.path.resolve()
    assert not list(corpus.parent.glob("*.tmp-*"))


def test_prepare_streams_large_text_files_in_chunks(tmp_path, tok, monkeypatch):
    monkeypatch.setattr("megalite.data.sources.CHUNK_BYTES", 1000)
    monkeypatch.setattr("megalite.data.prepare.BATCH_CHARS", 3000)
    text = builtin_corpus_text()[:20_000]
    (tmp_path / "a.txt").write_text(text)
    meta = prepare_corpus([tmp_path / "a.txt"], tok, tmp_path / "c", progress=False)
    tokens = np.fromfile(corpus_paths(tmp_path / "c")[0], dtype=np.uint16)
    assert meta["n_docs"] == 1
    assert tokens.tolist() == tok.encode(text) + [tok.eos_id]


def test_prepare_skips_empty_documents(tmp_path, tok):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "d.jsonl").write_text('{"text": ""}\n{"text": "one"}\n\n{"text": "two"}')
    meta = prepare_corpus(
        [tmp_path / "empty.txt", tmp_path / "d.jsonl"], tok, tmp_path / "c", False
    )
    one, two = tok.encode("one") + [tok.eos_id], tok.encode("two") + [tok.eos_id]
    assert meta["n_docs"] == 2
    np.testing.assert_array_equal(
        np.load(corpus_paths(tmp_path / "c")[1]), [0, len(one), len(one + two)]
    )
    assert np.fromfile(corpus_paths(tmp_path / "c")[0], dtype=np.uint16).tolist() == one + two


def test_prepare_uses_uint32_for_large_vocabularies(tmp_path, tok):
    class BigVocab:
        """The real tokenizer's ids, claiming a vocabulary too big for uint16."""

        path, vocab_size, eos_id = tok.path, 70_000, 69_999
        encodes_lines_apart = True
        encode_batch = staticmethod(
            lambda texts: [[i + 65_536 for i in tok.encode(t)] for t in texts]
        )
        encode = staticmethod(lambda text: [i + 65_536 for i in tok.encode(text)])

    assert token_dtype(65_536) == np.uint16 and token_dtype(65_537) == np.uint32
    (tmp_path / "a.txt").write_text(builtin_corpus_text()[:5_000])
    meta = prepare_corpus([tmp_path / "a.txt"], BigVocab(), tmp_path / "c", progress=False)
    assert meta["dtype"] == "uint32"
    ds = TokenDataset(tmp_path / "c", seq_len=16, val_fraction=0.1)
    assert ds.get_batch([0]).min() >= 65_536  # ids above 2**16 survive the round trip


def test_prepare_input_errors(tmp_path, tok):
    with pytest.raises(DataError, match=r"not found: .*nope\.txt"):
        prepare_corpus([tmp_path / "nope.txt"], tok, tmp_path / "c", False)
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: not valid JSON"):
        prepare_corpus([tmp_path / "bad.jsonl"], tok, tmp_path / "c", False)
    (tmp_path / "notext.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(DataError, match=r"notext\.jsonl:1: .*string \"text\" field"):
        prepare_corpus([tmp_path / "notext.jsonl"], tok, tmp_path / "c", False)
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.txt is not UTF-8"):
        prepare_corpus([tmp_path / "latin1.txt"], tok, tmp_path / "c", False)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="no text in"):
        prepare_corpus([tmp_path / "empty.txt"], tok, tmp_path / "c", False)
    assert not list(tmp_path.glob("c.*"))  # failures leave neither outputs nor temp files


# --- dataset ------------------------------------------------------------------------------


def test_windows_are_shifted_targets_and_splits_are_disjoint(corpus):
    meta = json.loads(corpus_paths(corpus)[2].read_text())
    tokens = np.fromfile(corpus_paths(corpus)[0], dtype=np.uint16).astype(np.int64)
    seq_len = 32
    train = TokenDataset(corpus, seq_len, "train", val_fraction=0.1, vocab_size=512)
    val = TokenDataset(corpus, seq_len, "val", val_fraction=0.1)
    n_val = int(np.ceil(meta["n_tokens"] * 0.1))
    assert len(train) == (meta["n_tokens"] - n_val - 1) // seq_len
    assert len(val) == (n_val - 1) // seq_len
    batch = train.get_batch([0, 3, len(train) - 1])
    assert batch.shape == (3, seq_len + 1) and batch.dtype == torch.int64
    for row, i in zip(batch, [0, 3, len(train) - 1]):
        np.testing.assert_array_equal(row.numpy(), tokens[i * seq_len : (i + 1) * seq_len + 1])
    inputs, targets = batch[:, :-1], batch[:, 1:]
    assert (inputs[:, 1:] == targets[:, :-1]).all()
    # The last train window (its final target included) ends before the first val token.
    last_train_token = (len(train) - 1) * seq_len + seq_len
    assert last_train_token < meta["n_tokens"] - n_val
    np.testing.assert_array_equal(val.get_batch([0])[0].numpy(), tokens[-n_val:][: seq_len + 1])
    with pytest.raises(IndexError):
        train.get_batch([len(train)])


def test_val_split_holds_at_least_one_window(corpus):
    val = TokenDataset(corpus, 64, "val", val_fraction=0.0)
    assert len(val) == 1


def _break(corpus: Path, what: str) -> None:
    bin_path, idx_path, meta_path = corpus_paths(corpus)
    meta = json.loads(meta_path.read_text())
    idx = np.load(idx_path)
    if what in ("bin", "idx", "json"):
        {"bin": bin_path, "idx": idx_path, "json": meta_path}[what].unlink()
    elif what == "empty":
        bin_path.write_bytes(b"")
    elif what == "odd_size":
        bin_path.write_bytes(bin_path.read_bytes()[:-1])
    elif what == "short_bin":
        bin_path.write_bytes(bin_path.read_bytes()[:-2])
    elif what == "dtype_vocab":
        meta_path.write_text(json.dumps({**meta, "vocab_size": 70_000}))
    elif what == "dtype_name":
        meta_path.write_text(json.dumps({**meta, "dtype": "int8"}))
    elif what == "bad_json":
        meta_path.write_text("{not json")
    elif what == "short_idx":
        np.save(idx_path, idx[:-1])
    elif what == "idx_order":
        idx[1], idx[2] = idx[2], idx[1]
        np.save(idx_path, idx)
    elif what == "idx_garbage":
        idx_path.write_bytes(b"garbage")


@pytest.mark.parametrize(
    "what, message",
    [
        ("bin", r"missing .*c\.bin.*megalite data prepare"),
        ("idx", r"missing .*c\.idx\.npy"),
        ("json", r"missing .*c\.json"),
        ("empty", r"c\.bin is empty"),
        ("odd_size", r"not a multiple of 2 \(uint16\): wrong dtype"),
        ("short_bin", r"metadata says \d+: truncated"),
        ("dtype_vocab", r"dtype uint16 but vocab_size 70000 needs uint32"),
        ("dtype_name", r"dtype 'int8', expected uint16 or uint32"),
        ("bad_json", r"c\.json is unreadable"),
        ("short_idx", r"c\.idx\.npy has \d+ entries, expected n_docs \+ 1.*inconsistent"),
        ("idx_order", r"not increasing"),
        ("idx_garbage", r"c\.idx\.npy is not a readable \.npy array"),
    ],
)
def test_dataset_rejects_bad_files(corpus, what, message):
    _break(corpus, what)
    with pytest.raises(DataError, match=message) as e:
        TokenDataset(corpus, seq_len=16)
    assert "megalite data prepare" in str(e.value)


def test_dataset_rejects_vocab_and_size_mismatches(corpus):
    with pytest.raises(DataError, match=r"no prepared data at .*nothing.*megalite data prepare"):
        TokenDataset(corpus.parent / "nothing", seq_len=16)
    with pytest.raises(DataError, match=r"512-piece vocabulary but the model's vocab_size is 256"):
        TokenDataset(corpus, seq_len=16, vocab_size=256)
    n_tokens = json.loads(corpus_paths(corpus)[2].read_text())["n_tokens"]
    with pytest.raises(DataError, match=r"train split of .* fewer than one window"):
        TokenDataset(corpus, seq_len=n_tokens // 2)
    with pytest.raises(DataError, match=r"val split .* fewer than one window"):
        TokenDataset(corpus, seq_len=n_tokens, split="val")


def test_a_token_id_past_the_vocabulary_is_refused_where_it_is_read(corpus):
    """A corrupt id (a flipped bit in the .bin) passes every size check, and on a GPU would
    read outside the embedding and the loss's tables: reading its window fails and names the
    id and its place in the file, in either split; the windows around it still read."""
    bin_path = corpus_paths(corpus)[0]
    tokens = np.fromfile(bin_path, dtype=np.uint16)
    train, val = (TokenDataset(corpus, seq_len=16, split=split) for split in ("train", "val"))
    for dataset, place in ((train, 16 * 3 + 5), (val, val.file_start + 16 + 2)):
        broken = tokens.copy()
        broken[place] = 512  # the corpus's vocabulary is 512 pieces: ids 0..511
        broken.tofile(bin_path)
        dataset = TokenDataset(corpus, seq_len=16, split=dataset.split)
        window = (place - dataset.file_start) // 16
        with pytest.raises(DataError, match=rf"token id 512 at token {place}, outside its 512-"):
            dataset.get_batch([window - 1, window])
        with pytest.raises(DataError, match="corrupt; re-create it with `megalite data prepare"):
            dataset.get_batch([window], slice(0, 16))  # the inputs of the window
        assert dataset.get_batch([window + 1]).max() < 512
    tokens.tofile(bin_path)


# --- CLI ----------------------------------------------------------------------------------


def test_cli_tokenizer_then_prepare(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    (tmp_path / "a.txt").write_text(builtin_corpus_text()[:100_000])

    def run(*argv: str) -> int:
        args = parser.parse_args(argv)
        return args.func(args)

    assert (
        run(
            "data",
            "tokenizer",
            "--input",
            str(tmp_path / "a.txt"),
            "--vocab-size",
            "400",
            "--out",
            str(tmp_path / "tok"),
        )
        == 0
    )
    assert "tok.model (400 pieces)" in capsys.readouterr().out
    assert (
        run(
            "data",
            "prepare",
            "--input",
            str(tmp_path / "a.txt"),
            "--tokenizer",
            str(tmp_path / "tok.model"),
            "--out",
            str(tmp_path / "c"),
            "--no-progress",
        )
        == 0
    )
    assert "uint16 tokens in 1 documents" in capsys.readouterr().out
    assert len(TokenDataset(tmp_path / "c", seq_len=64)) > 0
    with pytest.raises(DataError, match="tokenizer model not found"):
        run(
            "data",
            "prepare",
            "--input",
            str(tmp_path / "a.txt"),
            "--tokenizer",
            str(tmp_path / "none.model"),
            "--out",
            str(tmp_path / "c"),
        )


def test_the_index_check_reads_the_index_a_chunk_at_a_time_and_sees_across_chunks():
    from megalite.data.dataset import _increasing

    idx = np.arange(0, 40, 2, dtype=np.int64)
    assert _increasing(idx, chunk=4) and _increasing(idx[:1], chunk=4)
    for at in range(1, len(idx)):  # a repeat at every position, chunk boundaries included
        bad = idx.copy()
        bad[at] = bad[at - 1]
        assert not _increasing(bad, chunk=4), at
