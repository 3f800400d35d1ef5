"""Shared fixtures: the builtin corpus is tokenized once per session, in this process, before any
multi-process test forks ranks that would otherwise race to build it; NCCL's p2p rules for every
multi-process test; one temp dir per session, checked for leaks; under pytest-xdist, each worker's
share of the cores, and a few modules kept whole in one worker."""

import getpass
import os
import sys
import tempfile
from pathlib import Path

import pytest

from megalite.testing import nccl_like, subprocess_hooks

# Every multi-process test runs communication as NCCL does (megalite.nccl_contract): one work
# per p2p batch, sends that complete when matched, each group's operations in issue order.
# Forked ranks inherit the emulation installed here; subprocesses (the CLI, torchrun's workers)
# install it at start-up from the variables set here. A test that wants gloo's own behaviour
# uses the `gloo_as_it_is` fixture.
nccl_like.install()
os.environ.update(subprocess_hooks.environment(nccl_like=True))

TEST_VOCAB = 500


def pytest_configure(config):
    """A pytest-xdist worker computes on its share of the cores, as torchrun gives each rank
    one thread: at torch's defaults (every core per worker, for OpenMP and for inductor's
    pool of compile processes) the workers oversubscribe the cores and wait on each other,
    which made the in-process runs up to a third slower and a cold compile a sixth slower.
    Its subprocesses inherit the share."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None:
        return
    import torch

    from megalite.hardware import cpu_cores

    share = max(1, cpu_cores() // int(workers))
    torch.set_num_threads(share)
    os.environ["OMP_NUM_THREADS"] = str(share)
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = str(share)  # read when inductor is imported


WHOLE_MODULES = {
    "tests/e2e/test_readme.py": "the README's commands use what earlier ones wrote, in order",
    "tests/e2e/test_cli.py": "its module fixture trains three runs",
    "tests/distributed/test_checkpoint_crash.py": "its module fixtures kill runs mid-save",
    "tests/distributed/test_zero3.py": "its module fixture trains every layout in one launch",
}
"""Modules whose tests one xdist worker runs, in order, and why: dealt apart, their tests would
miss what earlier ones wrote, or each worker would build the same costly module fixture."""


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist deals each test to the next free worker, but each of WHOLE_MODULES as one
    unit (first: the largest units start first, so the longest chain does not finish last).
    (xdist's own `--dist loadgroup` no longer groups since pytest 9 moved the test ids.) Only
    in place of the default `--dist load`: another --dist asked for is xdist's to make."""
    if config.getvalue("dist") != "load":
        return None
    missing = [module for module in WHOLE_MODULES if not (config.rootpath / module).is_file()]
    if missing:  # renamed: its tests would be dealt apart again, unseen
        raise pytest.UsageError(f"WHOLE_MODULES in tests/conftest.py names no file: {missing}")
    from xdist.scheduler import LoadScopeScheduling

    class WholeModules(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            return module if module in WHOLE_MODULES else nodeid

    return WholeModules(config, log)


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


@pytest.fixture
def gloo_as_it_is(monkeypatch):
    """gloo's own communication, without the NCCL emulation, in this test and the ranks and
    subprocesses it starts."""
    nccl_like.uninstall()
    monkeypatch.setenv(subprocess_hooks.HOOKS_ENV, "")
    yield
    nccl_like.install()


KERNELS_SWITCH = "MEGALITE_KERNELS"


@pytest.fixture(autouse=True)
def kernels_switch_read_afresh(monkeypatch):
    """The trainer reads MEGALITE_KERNELS once per process (`kernels.dispatch`); tests switch it
    with monkeypatch, before and between their calls, so each test and each switch reads it
    afresh."""

    def forget() -> None:
        dispatch = sys.modules.get("megalite.kernels.dispatch")  # not imported: nothing to forget
        if dispatch is not None:
            dispatch.forget_switch()

    def switching(change):
        def changed(name, *args, **kwargs):
            change(name, *args, **kwargs)
            if name == KERNELS_SWITCH:
                forget()

        return changed

    monkeypatch.setenv = switching(monkeypatch.setenv)
    monkeypatch.delenv = switching(monkeypatch.delenv)
    forget()
    yield
    forget()
