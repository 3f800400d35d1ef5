"""Shared fixtures: the builtin corpus is tokenized once per session, in this process, before any
multi-process test forks ranks that would otherwise race to build it."""

import pytest

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
