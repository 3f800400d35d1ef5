"""Hugging Face tokenizers beside sentencepiece: a GPT-2-style byte-level BPE trained with
`tokenizers` encodes, prepares data and loads in `AutoTokenizer` with the same ids; a model
directory's tokenizer_config.json names its end-of-document token."""

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from megalite.commands.data import register
from megalite.data import (
    DataError,
    HFTokenizer,
    builtin_corpus_text,
    corpus_paths,
    open_tokenizer,
    prepare_corpus,
    train_tokenizer,
)

TEXTS = ["In the beginning God created\n\nthe heaven.", "  spaces,\ttabs, café 漢字 🙂\n", ""]
SPECIALS = ["<s> literal", "a </s> b <unk>"]  # text: megalite's sentencepiece reads it as text


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    (root / "train.txt").write_text(builtin_corpus_text()[:200_000])
    return root


@pytest.mark.parametrize("kind", ["byte-bpe", "sentencepiece"])
def test_each_kind_round_trips_and_loads_in_transformers(corpus, tmp_path, kind):
    path = train_tokenizer([corpus / "train.txt"], tmp_path / "tok", 600, kind=kind)
    assert path.suffix == (".json" if kind == "byte-bpe" else ".model")
    tok = open_tokenizer(path)
    assert tok.vocab_size == 600 and tok.piece(tok.eos_id) in ("<|endoftext|>", "</s>")
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    (tmp_path / "hf").mkdir()
    tok.save_for_transformers(tmp_path / "hf")
    auto = AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in TEXTS + (SPECIALS if kind == "sentencepiece" else []):
        assert auto(text)["input_ids"] == tok.encode(text), text
    assert auto.eos_token_id == tok.eos_id
    assert open_tokenizer(tmp_path / "hf").encode(TEXTS[0]) == tok.encode(TEXTS[0])


def test_a_byte_bpe_prepares_documents_with_its_end_of_text_token(corpus, tmp_path):
    tok = open_tokenizer(
        train_tokenizer([corpus / "train.txt"], tmp_path / "tok", 600, kind="byte-bpe")
    )
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    prepare_corpus([tmp_path / "docs.jsonl"], tok, tmp_path / "c", progress=False, workers=2)
    tokens = np.fromfile(corpus_paths(tmp_path / "c")[0], dtype=np.uint16).tolist()
    assert tokens == tok.encode(TEXTS[0]) + [tok.eos_id] + tok.encode(TEXTS[1]) + [tok.eos_id]


def test_config_names_the_end_of_document_token(corpus, tmp_path):
    path = train_tokenizer(
        [corpus / "train.txt"], tmp_path / "model" / "tokenizer", 600, kind="byte-bpe"
    )
    assert open_tokenizer(tmp_path / "model").eos_id == open_tokenizer(path).eos_id
    data = json.loads(path.read_text())
    data["added_tokens"][0]["content"] = "<|im_end|>"  # a vocabulary without a known EOS
    data["model"]["vocab"]["<|im_end|>"] = data["model"]["vocab"].pop("<|endoftext|>")
    path.write_text(json.dumps(data))
    with pytest.raises(DataError, match="has no end-of-document token"):
        open_tokenizer(path)
    (tmp_path / "model" / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
    tok = open_tokenizer(tmp_path / "model")
    assert tok.piece(tok.eos_id) == "<|im_end|>"
    with pytest.raises(DataError, match="no tokenizer.json or tokenizer.model in"):
        open_tokenizer(tmp_path)


def test_cli_trains_a_byte_bpe(corpus, tmp_path, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    argv = ["data", "tokenizer", "--kind", "byte-bpe", "--input", str(corpus), "--vocab-size"]
    args = parser.parse_args([*argv, "500", "--out", str(tmp_path / "t")])
    assert args.func(args) == 0
    assert "t.json (500 pieces)" in capsys.readouterr().out


def _gpt2_like(path) -> HFTokenizer:
    """A byte-level BPE with GPT-2's pre-tokenizer and its one merge of two newlines (GPT-2's
    token 628), which megalite's own byte-bpe, trained on lines, never learns."""
    from tokenizers import Tokenizer as Model
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab |= {"ĊĊ": len(vocab), "<|endoftext|>": len(vocab) + 1}
    model = Model(models.BPE(vocab=vocab, merges=[("Ċ", "Ċ")]))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    model.save(str(path))
    return HFTokenizer(path)


def test_a_byte_bpe_prepares_a_large_text_file_as_it_encodes_it_whole(tmp_path, monkeypatch):
    """GPT-2's pre-tokenizer merges a run of newlines but the last, which goes with what
    follows: a text file cut into chunks of lines (as for megalite's sentencepiece) would
    tokenize differently wherever a cut falls in such a run. It is read whole."""
    tok = _gpt2_like(tmp_path / "tokenizer.json")
    assert tok.encode("\n\n\nA") == tok.encode("\n\n") + tok.encode("\nA")
    assert tok.encode("\n\n\nA") != tok.encode("\n") + tok.encode("\n\nA")  # a cut's tokens
    lines = builtin_corpus_text()[:30_000].split("\n")
    text = "".join(line + ("\n\n\n" if i % 3 == 2 else "\n") for i, line in enumerate(lines))
    (tmp_path / "book.txt").write_text(text)
    monkeypatch.setattr("megalite.data.sources.CHUNK_BYTES", 1000)
    prepare_corpus([tmp_path / "book.txt"], tok, tmp_path / "c", progress=False)
    tokens = np.fromfile(corpus_paths(tmp_path / "c")[0], dtype=np.uint16).tolist()
    assert tokens == tok.encode(text) + [tok.eos_id]
    assert tok.decode(tokens[:-1]) == text
