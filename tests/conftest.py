"""Shared fixtures: the builtin corpus is tokenized once per session, in this process, before any
multi-process test forks ranks that would otherwise race to build it; NCCL's p2p rules for every
multi-process test."""

import os

import pytest

from megalite.nccl_contract import NCCL_LIKE_P2P_ENV

# Every multi-process test (forked ranks and torchrun alike inherit it) runs p2p as NCCL does:
# one work per batch, blocking sends (megalite.nccl_contract). A test that wants gloo's own
# behaviour sets the variable to 0.
os.environ.setdefault(NCCL_LIKE_P2P_ENV, "1")

TEST_VOCAB = 500


@pytest.fixture(scope="session")
def builtin_corpus():
    from megalite.data import builtin_data

    return builtin_data(TEST_VOCAB)


@pytest.fixture(scope="session")
def builtin_corpus_8000():
    """The builtin corpus at the shipped tiny configs' vocabulary."""
    from megalite.data import builtin_data

    return builtin_data(8000)
