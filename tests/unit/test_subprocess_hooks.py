"""A test's subprocess gets the test hooks (`megalite.testing.subprocess_hooks`) as the modules
they hook into load: the NCCL emulation with `megalite.comm`, a stalled writer with the
checkpoint writer, and nothing, torch included, before the program imports it."""

import os
import subprocess
import sys

from megalite.testing import subprocess_hooks

PROBE = (
    "import sys\n"
    "before = 'torch' in sys.modules\n"
    "import megalite.training.loop\n"
    "from megalite import comm\n"
    "from megalite.checkpoint import writer\n"
    "print(before, type(comm._emulation).__name__, len(writer.first_file_written))\n"
)


WORKER = (  # what an xdist worker does first: conftest.py installs the emulation itself
    "from megalite.testing import nccl_like\n"
    "nccl_like.install()\n"
    "from megalite import comm\n"
    "print(type(comm._emulation).__name__)\n"
)


def _probe(probe: str = PROBE, **hooks) -> str:
    env = {**os.environ, **subprocess_hooks.environment(**hooks)}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_subprocess_installs_each_hook_when_its_module_loads():
    assert _probe(stall_save=(2, 1.0)) == "False NcclLike 1"
    assert _probe(nccl_like=False) == "False NoneType 0"


def test_a_hooked_subprocess_may_import_the_emulation_first():
    """The hook on `megalite.comm` fires while the emulation's own module is what imports it."""
    assert _probe(WORKER) == "NcclLike"
