"""Shared fixtures: the builtin corpus is tokenized once per session, in this process, before any
multi-process test forks ranks that would otherwise race to build it; NCCL's p2p rules for every
multi-process test; one temp dir per session, checked for leaks."""

import getpass
import os
import tempfile
from pathlib import Path

import pytest

from megalite.nccl_contract import NCCL_LIKE_P2P_ENV

# Every multi-process test (forked ranks and torchrun alike inherit it) runs p2p as NCCL does:
# one work per batch, blocking sends (megalite.nccl_contract). A test that wants gloo's own
# behaviour sets the variable to 0.
os.environ.setdefault(NCCL_LIKE_P2P_ENV, "1")

TEST_VOCAB = 500


@pytest.fixture(scope="session", autouse=True)
def session_temp_dir(tmp_path_factory):
    """Every temporary file of the session (the code under test's, its ranks', its subprocesses')
    goes to one directory inside pytest's, which goes when the session passes. Whatever megalite
    left there is a leak and fails the session: forgotten scratch runs once filled CI's disk."""
    root = tmp_path_factory.mktemp("tmp")
    # inductor's compiled kernels stay in its default cache, shared by sessions (a warm cache
    # halves the compile tests' time)
    default_cache = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(default_cache))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", str(root))
        patch.setattr(tempfile, "tempdir", str(root))
        yield root
    leaks = sorted(path.name for path in root.iterdir() if path.name.startswith("megalite-"))
    assert not leaks, f"temporary directories left behind in {root}: {leaks}"


@pytest.fixture(scope="session")
def builtin_corpus():
    from megalite.data import builtin_data

    return builtin_data(TEST_VOCAB)


@pytest.fixture(scope="session")
def builtin_corpus_8000():
    """The builtin corpus at the shipped tiny configs' vocabulary."""
    from megalite.data import builtin_data

    return builtin_data(8000)
