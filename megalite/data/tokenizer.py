"""A sentencepiece BPE tokenizer: training it, and a small wrapper that encodes and decodes.

Choices, and why:
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
import os
import uuid
from collections.abc import Sequence
from pathlib import Path

import sentencepiece as spm

from megalite.data.errors import DataError
from megalite.data.sources import TEXT_FIELD, expand_inputs, read_lines

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


def train_tokenizer(
    inputs: Sequence[Path],
    out_prefix: Path,
    vocab_size: int,
    text_field: str = TEXT_FIELD,
    glob: str = "*",
) -> Path:
    """Train a BPE model with exactly `vocab_size` pieces; write `<out_prefix>.model` atomically.

    Inputs are files or directories, read as in `megalite.data.sources`. Returns the model path.
    """
    paths = expand_inputs(inputs, glob)
    out = Path(f"{out_prefix}.model")
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
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.write_bytes(model.getvalue())
    os.replace(tmp, out)
    return out


class Tokenizer:
    """A trained sentencepiece model: text <-> token ids."""

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
