"""A run reads its data with the tokenizer it was prepared with, and `data` commands never write
over what is already on disk unless asked.

Two sentencepiece models of the same size and end of document but trained on different text
encode differently: a corpus prepared with one must not be read (or blended, or exported with a
checkpoint) as if tokenized by the other.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from megalite.config import load_config
from megalite.data import (
    BlendedDataset,
    DataError,
    TokenDataset,
    Tokenizer,
    builtin_corpus_text,
    corpus_paths,
    prepare_corpus,
    train_tokenizer,
)
from megalite.data.tokenizer import PROBE
from megalite.training.loop import open_data

VOCAB = 400
SEQ = 32


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> tuple[Tokenizer, Tokenizer]:
    """Two tokenizers alike in size and specials, trained on different thirds of the corpus."""
    root = tmp_path_factory.mktemp("toks")
    text = builtin_corpus_text()
    (root / "a.txt").write_text(text[:150_000])
    (root / "b.txt").write_text(text[-150_000:])
    a = Tokenizer(train_tokenizer([root / "a.txt"], root / "a", VOCAB))
    b = Tokenizer(train_tokenizer([root / "b.txt"], root / "b", VOCAB))
    assert (a.vocab_size, a.eos_id) == (b.vocab_size, b.eos_id)
    assert a.encode(PROBE) != b.encode(PROBE)
    return a, b


def _prepare(root: Path, name: str, tok: Tokenizer) -> Path:
    (root / f"{name}.txt").write_text(builtin_corpus_text()[200_000:240_000])
    prepare_corpus([root / f"{name}.txt"], tok, root / name, progress=False)
    return root / name


def _blend(*prefixes: Path) -> BlendedDataset:
    return BlendedDataset([TokenDataset(p, SEQ) for p in prefixes], [1.0] * len(prefixes))


def _config(tmp_path: Path, *overrides: str):
    return load_config(
        None,
        [
            f"model.vocab_size={VOCAB}",
            f"model.seq_len={SEQ}",
            "model.n_layers=1",
            "model.hidden=32",
            "model.n_heads=2",
            f"train.out_dir={tmp_path / 'run'}",
            *overrides,
        ],
    )


def test_the_metadata_records_the_tokenizer_and_the_check_holds_a_blend_to_it(tmp_path, tokenizers):
    a, b = tokenizers
    first, second = _prepare(tmp_path, "first", a), _prepare(tmp_path, "second", b)
    assert json.loads(corpus_paths(first)[2].read_text())["tokenizer_probe"] == a.encode(PROBE)
    _blend(first).check_tokenizer(a)
    copy = Tokenizer(shutil.copy(a.path, tmp_path / "copy.model"))
    _blend(first).check_tokenizer(copy)  # the same tokenizer elsewhere
    with pytest.raises(
        DataError, match=r"first was prepared with another tokenizer than .*b\.model"
    ):
        _blend(first).check_tokenizer(b)
    with pytest.raises(DataError, match=r"second was prepared with another tokenizer"):
        _blend(first, second).check_tokenizer(a)


def test_corpora_from_before_the_probe_are_compared_with_the_tokenizer_they_name(
    tmp_path, tokenizers
):
    a, b = tokenizers
    prefix = _prepare(tmp_path, "old", a)
    meta_path = corpus_paths(prefix)[2]
    meta = json.loads(meta_path.read_text())
    del meta["tokenizer_probe"]
    meta_path.write_text(json.dumps(meta))
    _blend(prefix).check_tokenizer(a)
    with pytest.raises(DataError, match="another tokenizer"):
        _blend(prefix).check_tokenizer(b)


def test_a_run_refuses_a_tokenizer_the_data_was_not_prepared_with(tmp_path, tokenizers):
    a, b = tokenizers
    prefix = _prepare(tmp_path, "corpus", a)
    data = open_data(_config(tmp_path, f"data.source={prefix}"))
    assert data.tokenizer_path.resolve() == a.path.resolve()
    data = open_data(_config(tmp_path, f"data.source={prefix}", f"data.tokenizer={a.path}"))
    assert data.tokenizer_path == a.path
    with pytest.raises(DataError, match=r"corpus was prepared with another tokenizer than"):
        open_data(_config(tmp_path, f"data.source={prefix}", f"data.tokenizer={b.path}"))


def test_a_corpus_moved_without_its_tokenizer_is_refused_before_training(tmp_path, tokenizers):
    a, _ = tokenizers
    prefix = _prepare(tmp_path, "corpus", a)
    moved = tmp_path / "cluster"
    moved.mkdir()
    for path in corpus_paths(prefix):
        shutil.copy(path, moved / path.name)
    source = f"data.source={moved / 'corpus'}"
    with pytest.raises(DataError, match=r"names its tokenizer .* not there: .*data\.tokenizer"):
        open_data(_config(tmp_path, source))
    assert open_data(_config(tmp_path, source, f"data.tokenizer={a.path}")).train.sizes[0] > 0


def test_a_model_started_from_must_have_the_datas_tokenizer(tmp_path, tokenizers):
    a, b = tokenizers
    prefix = _prepare(tmp_path, "corpus", a)
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(b.path, model / "tokenizer.model")
    for tokenizer in ([], [f"data.tokenizer={a.path}"]):  # named or found beside the data
        cfg = _config(
            tmp_path, f"data.source={prefix}", f"checkpoint.init_from={model}", *tokenizer
        )
        with pytest.raises(DataError, match="brings its own tokenizer"):
            open_data(cfg)
    shutil.copy(a.path, model / "tokenizer.model")
    cfg = _config(tmp_path, f"data.source={prefix}", f"checkpoint.init_from={model}")
    assert open_data(cfg).tokenizer_path == model / "tokenizer.model"


def test_prepare_writes_over_no_input_and_over_a_corpus_only_when_asked(tmp_path, tokenizers):
    a, b = tokenizers
    source = tmp_path / "corpus.json"  # the metadata's own name
    source.write_text(json.dumps([{"text": "In the beginning"}, {"text": "God created"}]))
    before = source.read_bytes()
    with pytest.raises(DataError, match=r"would write .*corpus\.json, which is an input"):
        prepare_corpus([source], a, tmp_path / "corpus", progress=False, overwrite=True)
    assert source.read_bytes() == before

    prefix = _prepare(tmp_path, "c", a)
    kept = {p: p.read_bytes() for p in corpus_paths(prefix)}
    with pytest.raises(DataError, match=r"c\.bin, .*c\.json already exist: .*--overwrite"):
        prepare_corpus([source], b, prefix, progress=False)
    assert {p: p.read_bytes() for p in corpus_paths(prefix)} == kept
    prepare_corpus([source], b, prefix, progress=False, overwrite=True)
    assert (
        np.load(corpus_paths(prefix)[1]).tolist()[-1]
        == json.loads(corpus_paths(prefix)[2].read_text())["n_tokens"]
    )
    assert corpus_paths(prefix)[0].read_bytes() != kept[corpus_paths(prefix)[0]]


def test_a_tokenizer_is_replaced_only_when_asked(tmp_path, tokenizers):
    a, _ = tokenizers
    (tmp_path / "t.txt").write_text(builtin_corpus_text()[:60_000])
    model = train_tokenizer([tmp_path / "t.txt"], tmp_path / "tok", 400)
    kept = model.read_bytes()
    with pytest.raises(DataError, match=r"tok\.model already exists: .*--overwrite"):
        train_tokenizer([tmp_path / "t.txt"], tmp_path / "tok", 420)
    assert model.read_bytes() == kept
    train_tokenizer([tmp_path / "t.txt"], tmp_path / "tok", 420, overwrite=True)
    assert Tokenizer(model).vocab_size == 420
    with pytest.raises(DataError, match=r"would write .*a\.model, which is an input"):
        train_tokenizer([a.path], a.path.with_suffix(""), 400, overwrite=True)
