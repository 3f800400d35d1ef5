"""On a GPU, run this whole folder again with compiled (not interpreted) Triton kernels.

Triton fixes interpreter-or-compiler at import time, so the compiled run needs a fresh
process; the conftest switches to CUDA tensors when MEGALITE_KERNEL_TEST_DEVICE=cuda.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_tests_pass_compiled_on_gpu():
    env = {**os.environ, "MEGALITE_KERNEL_TEST_DEVICE": "cuda"}
    env.pop("TRITON_INTERPRET", None)
    command = [sys.executable, "-m", "pytest", "-q", "-m", "not gpu", str(Path(__file__).parent)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
