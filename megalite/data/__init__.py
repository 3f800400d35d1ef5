"""Data: tokenizer, text -> token memmap preparation, windows, the global batch order, and the
builtin corpus (the King James Bible), which needs no preparation step.

Names are imported on first use, so that `megalite data ...` and the CLI's config checks answer
without waiting for torch to load.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "BlendedDataset": "dataset",
    "DataError": "errors",
    "GlobalBatchSampler": "sampler",
    "HFTokenizer": "tokenizer",
    "TokenBatch": "dataset",
    "TokenDataset": "dataset",
    "Tokenizer": "tokenizer",
    "builtin_corpus_text": "builtin",
    "builtin_data": "builtin",
    "corpus_paths": "prepare",
    "open_tokenizer": "tokenizer",
    "parse_source": "blend",
    "prepare_corpus": "prepare",
    "token_dtype": "prepare",
    "train_tokenizer": "tokenizer",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
