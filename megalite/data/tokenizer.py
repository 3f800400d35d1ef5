"""Tokenizers: training them, and small wrappers that encode and decode.

Two kinds, one interface (`open_tokenizer` picks by file):
- sentencepiece BPE (`PREFIX.model`), megalite's own default, trained as below;
- Hugging Face `tokenizers` (`tokenizer.json`, or a model directory holding one): GPT-2's
  byte-level BPE, Llama 3's tiktoken-style BPE, or one trained here with `--kind byte-bpe`, so
  a model can be continued with the tokenizer it was trained with.

Choices for the sentencepiece kind, and why:
- Byte fallback: any UTF-8 text encodes without <unk>, so decode(encode(text)) == text.
- Identity normalisation, no whitespace collapsing: the text the model sees is the file's text.
- "\\n" is a piece of its own and no dummy "▁" is prepended: sentencepiece trains on single
  lines, so a learned piece never contains a newline, and a word at the start of a line is
  tokenized the same in training and in multi-line documents. It also means lines can be
  encoded independently and joined with the newline id, which is how `encode` parallelises.
- Fixed thread count, shuffling seed and sample size, so the same inputs give a byte-identical
  .model file on any machine.
"""

import io
import json
import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path

import sentencepiece as spm

from megalite.data.errors import DataError
from megalite.data.sources import TEXT_FIELD, check_outputs, expand_inputs, read_lines

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
NUM_THREADS = 4
TRAINER_OPTIONS = {
    "model_type": "bpe",
    "byte_fallback": True,
    "character_coverage": 1.0,
    "normalization_rule_name": "identity",
    "remove_extra_whitespaces": False,
    "add_dummy_prefix": False,
    "allow_whitespace_only_pieces": True,
    "split_digits": True,
    "user_defined_symbols": ["\n"],
    "unk_id": UNK_ID,
    "bos_id": BOS_ID,
    "eos_id": EOS_ID,
    "pad_id": -1,
    "hard_vocab_limit": True,
    "num_threads": NUM_THREADS,
    "input_sentence_size": 2_000_000,  # lines sampled from very large corpora (seeded)
    "max_sentence_length": 1 << 16,  # bytes; longer lines are left out of training
    "shuffle_input_sentence": True,
    "minloglevel": 2,
}
SHUFFLE_SEED = 0


KINDS = ("sentencepiece", "byte-bpe")
BYTE_BPE_EOS = "<|endoftext|>"  # GPT-2's end-of-text token, also its BOS


def train_tokenizer(
    inputs: Sequence[Path],
    out_prefix: Path,
    vocab_size: int,
    text_field: str = TEXT_FIELD,
    glob: str = "*",
    kind: str = "sentencepiece",
    overwrite: bool = False,
) -> Path:
    """Train a tokenizer of exactly `vocab_size` pieces on `inputs` (files or directories, read
    as in `megalite.data.sources`): sentencepiece BPE to `<out_prefix>.model`, or GPT-2-style
    byte-level BPE to `<out_prefix>.json`, written atomically; an existing one is replaced only
    if `overwrite`. Returns the file."""
    trainers = {
        "byte-bpe": (".json", _train_byte_bpe),
        "sentencepiece": (".model", _train_sentencepiece),
    }
    if kind not in trainers:
        raise DataError(f"unknown tokenizer kind {kind!r}: choose one of {', '.join(KINDS)}")
    paths = expand_inputs(inputs, glob)
    suffix, train = trainers[kind]
    out = Path(f"{out_prefix}{suffix}")
    check_outputs([out], paths, overwrite)
    data = train(paths, vocab_size, text_field)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.write_bytes(data)
    os.replace(tmp, out)
    return out


def _train_byte_bpe(paths: list[Path], vocab_size: int, text_field: str) -> bytes:
    """GPT-2's scheme: bytes mapped to printable characters, split on words, merged by BPE."""
    from tokenizers import Tokenizer as HFTokenizerModel
    from tokenizers import decoders, models, pre_tokenizers, trainers

    model = HFTokenizerModel(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BYTE_BPE_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    model.train_from_iterator(read_lines(paths, text_field), trainer=trainer)
    return model.to_str().encode()


def _train_sentencepiece(paths: list[Path], vocab_size: int, text_field: str) -> bytes:
    model = io.BytesIO()
    spm.set_random_generator_seed(SHUFFLE_SEED)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=read_lines(paths, text_field),
            model_writer=model,
            vocab_size=vocab_size,
            **TRAINER_OPTIONS,
        )
    except RuntimeError as e:
        fix = (
            "use a larger --vocab-size: it must hold 256 bytes, 4 special pieces and every "
            "distinct character"
            if "smaller than required_chars" in str(e)
            else "use more text or a smaller --vocab-size"
        )
        raise DataError(
            f"cannot train a {vocab_size}-piece tokenizer on {', '.join(map(str, paths))}; "
            f"{fix} (sentencepiece said: {e})"
        ) from None
    return model.getvalue()


class Tokenizer:
    """A trained sentencepiece model: text <-> token ids."""

    kind = "sentencepiece"
    file_name = "tokenizer.model"
    """What the file is called in a checkpoint and in a Hugging Face model directory."""

    def __init__(self, model_path: Path, threads: int = NUM_THREADS) -> None:
        self.path = Path(model_path)
        self.threads = threads
        hint = "make one with `megalite data tokenizer --input FILE... --vocab-size N --out PREFIX`"
        if not self.path.is_file():
            raise DataError(f"tokenizer model not found: {self.path}; {hint}")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(self.path))
        except (RuntimeError, OSError) as e:
            raise DataError(
                f"tokenizer model {self.path} is not a sentencepiece model ({e}); {hint}"
            ) from None
        if self.eos_id < 0:
            raise DataError(f"tokenizer model {self.path} has no end-of-document piece; {hint}")
        # Models from elsewhere may lack the newline piece: they encode whole texts, slowly.
        newline_id = self._sp.piece_to_id("\n")
        self._newline_id = newline_id if self._sp.id_to_piece(newline_id) == "\n" else None

    @property
    def encodes_lines_apart(self) -> bool:
        """Whether a text's ids are its lines' ids joined by the newline's, so a text may be
        encoded in chunks of whole lines (`megalite.data.prepare`)."""
        return self._newline_id is not None

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def unk_id(self) -> int:
        return self._sp.unk_id()

    def piece(self, token_id: int) -> str:
        """The text of one vocabulary entry (e.g. "<s>" for the BOS id)."""
        return self._sp.id_to_piece(token_id)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no BOS/EOS added); lines are encoded in parallel."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` of each text; one threaded call for all their lines."""
        if self._newline_id is None:
            return self._sp.encode(list(texts), num_threads=self.threads)
        line_lists = [text.split("\n") for text in texts]
        encoded = iter(
            self._sp.encode(
                [line for lines in line_lists for line in lines], num_threads=self.threads
            )
        )
        out = []
        for lines in line_lists:
            ids = list(next(encoded))
            for _ in range(len(lines) - 1):
                ids.append(self._newline_id)
                ids.extend(next(encoded))
            out.append(ids)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def save_for_transformers(self, directory: Path) -> None:
        """The model as `tokenizer.model`, with a config that lets `AutoTokenizer` encode exactly
        as megalite does: no BOS/EOS added, no space prefixed, pieces taken as they are, and the
        text "</s>" read as text (sentencepiece never makes a special token of it)."""
        shutil.copyfile(self.path, Path(directory) / self.file_name)
        special = {"unk_token": self.unk_id, "bos_token": self.bos_id, "eos_token": self.eos_id}
        config = {
            "tokenizer_class": "LlamaTokenizer",
            "add_bos_token": False,
            "add_eos_token": False,
            "add_prefix_space": False,
            "legacy": True,
            "split_special_tokens": True,
            **{name: self.piece(i) for name, i in special.items() if i >= 0},
        }
        (Path(directory) / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


# Special tokens of well-known Hugging Face tokenizers, most specific first.
_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>")


class HFTokenizer:
    """A Hugging Face `tokenizers` model (`tokenizer.json`): text <-> token ids.

    Its end-of-document token is the `eos_token` of a `tokenizer_config.json` beside it, else the
    first of GPT-2's, Llama 3's or Llama 2's that the vocabulary has. GPT-2 has no BOS of its
    own and uses the same token, as it does.
    """

    kind = "huggingface"
    file_name = "tokenizer.json"
    encodes_lines_apart = False
    """Byte-level BPEs merge runs of newlines: a text is encoded whole."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizerModel

        self.path = Path(path)
        try:
            self._tok = HFTokenizerModel.from_file(str(self.path))
        except Exception as e:  # the library raises plain Exceptions for malformed files
            raise DataError(f"{self.path} is not a Hugging Face tokenizer.json ({e})") from None
        config_file = self.path.with_name("tokenizer_config.json")
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.eos_id = self._special(config.get("eos_token"), _EOS_NAMES)
        if self.eos_id < 0:
            raise DataError(
                f"{self.path} has no end-of-document token ({', '.join(_EOS_NAMES)}) and no "
                "tokenizer_config.json naming its eos_token"
            )
        bos = self._special(config.get("bos_token"), _BOS_NAMES)
        self.bos_id = bos if bos >= 0 else self.eos_id
        self.unk_id = self._special(config.get("unk_token"), ("<unk>",))

    def _special(self, configured, names: Sequence[str]) -> int:
        if isinstance(configured, dict):  # {"content": "<s>", ...} in older configs
            configured = configured.get("content")
        for name in ([configured] if configured else []) + list(names):
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return token_id
        return -1

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def piece(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without the specials a post-processor might add."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` of each text, in one parallel call."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def save_for_transformers(self, directory: Path) -> None:
        """`tokenizer.json` with the config `AutoTokenizer` needs to load it as a fast tokenizer
        that adds no special tokens of its own, as megalite encodes."""
        shutil.copyfile(self.path, Path(directory) / self.file_name)
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": False,
            "add_eos_token": False,
            "eos_token": self.piece(self.eos_id),
            "bos_token": self.piece(self.bos_id),
            **({"unk_token": self.piece(self.unk_id)} if self.unk_id >= 0 else {}),
        }
        (Path(directory) / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def find_tokenizer_file(directory: Path) -> Path | None:
    """The tokenizer.json or tokenizer.model in `directory` (a Hugging Face model directory, a
    megalite checkpoint), if it holds one."""
    for name in (HFTokenizer.file_name, Tokenizer.file_name):
        if (Path(directory) / name).is_file():
            return Path(directory) / name
    return None


def _tokenizer_file(path: Path) -> Path:
    """`path` itself, or the tokenizer file inside a directory."""
    path = Path(path)
    if not path.is_dir():
        return path
    found = find_tokenizer_file(path)
    if found is None:
        raise DataError(f"no tokenizer.json or tokenizer.model in {path}")
    return found


def tokenizer_files(path: Path) -> dict[str, Path]:
    """The files that make up the tokenizer at `path`, by the name a checkpoint or a Hugging
    Face model directory gives them."""
    path = _tokenizer_file(path)
    if path.suffix != ".json":
        return {Tokenizer.file_name: path}
    config = path.with_name("tokenizer_config.json")
    return {HFTokenizer.file_name: path, **({config.name: config} if config.is_file() else {})}


def open_tokenizer(path: Path, threads: int = NUM_THREADS) -> Tokenizer | HFTokenizer:
    """The tokenizer at `path`: a sentencepiece `.model`, a `tokenizer.json`, or a directory
    holding either (a Hugging Face model directory, a megalite checkpoint)."""
    path = _tokenizer_file(path)
    if path.suffix == ".json":
        if not path.is_file():
            raise DataError(f"tokenizer not found: {path}")
        return HFTokenizer(path)
    return Tokenizer(path, threads)


PROBE = "In the beginning God created\n\nthe heaven  and the earth: 1611, é ü 漢字 🙂"


def same_tokenizer(a: Tokenizer | HFTokenizer, b: Tokenizer | HFTokenizer) -> bool:
    """Whether two tokenizers give the same ids (vocabulary, end of document, a probe text)."""
    return (a.vocab_size, a.eos_id, a.encode(PROBE)) == (b.vocab_size, b.eos_id, b.encode(PROBE))
