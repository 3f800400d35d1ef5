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


def _probe(**hooks) -> str:
    env = {**os.environ, **subprocess_hooks.environment(**hooks)}
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_subprocess_installs_each_hook_when_its_module_loads():
    assert _probe(stall_save=(2, 1.0)) == "False NcclLike 1"
    assert _probe(nccl_like=False) == "False NoneType 0"
