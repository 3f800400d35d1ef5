"""Kernel tests run the Triton code itself on CPU, under the Triton interpreter.

Triton reads ``TRITON_INTERPRET`` when it, and each kernel, is first imported, so it has to be
set before anything imports ``triton``. On a CPU machine megalite does not import Triton unless
the interpreter is on, so if an earlier test module imported ``megalite.kernels`` we simply
re-import those modules in place (every reference to them then sees interpreted kernels). If
Triton itself is already imported in compiled mode (a CUDA machine), nothing can be done here:
the root ``tests/conftest.py`` must set ``TRITON_INTERPRET=1`` first, and we say so.

``MEGALITE_KERNEL_TEST_DEVICE=cuda`` runs the same tests on a GPU with compiled kernels
(``test_gpu.py`` does that in a subprocess when CUDA is present).
"""

import importlib
import os
import sys
import zlib

import pytest
import torch  # does not import triton
from kernel_checks import rel

DEVICE = os.environ.get("MEGALITE_KERNEL_TEST_DEVICE", "cpu")
# Dependencies first.
_KERNEL_MODULES = [
    *("_triton", "autotune", "dispatch", "flash_attention", "gelu", "norms", "rotary", "swiglu"),
    "wgrad",
    "grouped_gemm",
    "cross_entropy",
]


def _use_interpreter() -> None:
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "triton was imported before TRITON_INTERPRET=1 was set, so the kernel tests cannot "
            "run it on CPU: set os.environ['TRITON_INTERPRET'] = '1' at the top of "
            "tests/conftest.py"
        )
    os.environ["TRITON_INTERPRET"] = "1"
    shim = sys.modules.get("megalite.kernels._triton")
    if shim is not None and not shim.INTERPRETED_AT_IMPORT:
        for name in _KERNEL_MODULES:
            importlib.reload(sys.modules[f"megalite.kernels.{name}"])
        importlib.reload(sys.modules["megalite.kernels"])


if DEVICE == "cpu":
    _use_interpreter()
else:
    os.environ.pop("TRITON_INTERPRET", None)

TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def force_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every kernel test runs the Triton path unless it switches MEGALITE_KERNELS itself."""
    monkeypatch.setenv("MEGALITE_KERNELS", "triton")


@pytest.fixture
def rel_err():
    return rel


@pytest.fixture
def tolerance() -> dict:
    """Max relative error vs float64 per input dtype."""
    return TOLERANCE


@pytest.fixture
def device() -> torch.device:
    return torch.device(DEVICE)


@pytest.fixture
def randn(request: pytest.FixtureRequest, device: torch.device):
    """``randn(*shape, dtype=...)``: leaf tensors requiring grad on the test device, from a
    generator seeded by the test id (fresh inputs per test, reproducible per test). Drawn in
    fp32 on the CPU, then cast and moved, so both devices see the same values."""
    gen = torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))

    def make(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0):
        values = torch.randn(*shape, generator=gen) * scale
        return values.to(device=device, dtype=dtype).requires_grad_()

    return make
