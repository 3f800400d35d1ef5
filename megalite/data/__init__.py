"""Data: tokenizer, text -> token memmap preparation, windows, the global batch order, and the
builtin corpus (the King James Bible), which needs no preparation step."""

from megalite.data.builtin import builtin_corpus_text, builtin_data
from megalite.data.dataset import TokenDataset
from megalite.data.errors import DataError
from megalite.data.prepare import corpus_paths, prepare_corpus, token_dtype
from megalite.data.sampler import GlobalBatchSampler
from megalite.data.tokenizer import Tokenizer, train_tokenizer

__all__ = [
    "DataError",
    "GlobalBatchSampler",
    "TokenDataset",
    "Tokenizer",
    "builtin_corpus_text",
    "builtin_data",
    "corpus_paths",
    "prepare_corpus",
    "token_dtype",
    "train_tokenizer",
]
