"""Import Triton only where one of its kernels could run.

Triton kernels run on CUDA tensors, or on CPU under the Triton interpreter
(``TRITON_INTERPRET=1``). Anywhere else (CPU training, macOS, where Triton has no wheels)
megalite uses the PyTorch references, so the kernel modules get a stand-in whose decorators
return the function unchanged: importing megalite then never imports Triton. That also keeps
``TRITON_INTERPRET`` settable after megalite is imported, because Triton reads it only when it
(and each kernel) is first imported.
"""

import os
from types import SimpleNamespace

import torch


def interpreter_enabled() -> bool:
    """Whether ``TRITON_INTERPRET=1`` is set now (Triton kernels then run on CPU, slowly)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Whether the kernels in this process were built for the interpreter (decided once, here).
INTERPRETED_AT_IMPORT = interpreter_enabled()

BUILD_ONLY_ENV = "MEGALITE_TRITON_BUILD_ONLY"
BUILD_ONLY = os.environ.get(BUILD_ONLY_ENV, "0") == "1" and not INTERPRETED_AT_IMPORT
"""A process that compiles the GPU kernels for a GPU it does not have (`gpu_build`): Triton is
imported and the kernels get their GPU autotune sweeps, whose launches are recorded, never run."""

HAVE_TRITON = False
if INTERPRETED_AT_IMPORT or BUILD_ONLY or torch.cuda.is_available():
    try:
        import triton
        import triton.language as tl

        HAVE_TRITON = True
    except ImportError:
        pass

if not HAVE_TRITON:

    def _jit(fn=None, **_kwargs):
        return fn if fn is not None else (lambda f: f)

    def _autotune(*_args, **_kwargs):
        return lambda fn: fn

    def _next_power_of_2(n: int) -> int:
        return 1 << (n - 1).bit_length()

    # the host-side helper the dispatchers use to size blocks before choosing a path
    triton = SimpleNamespace(
        jit=_jit,
        autotune=_autotune,
        Config=lambda *args, **kwargs: None,
        next_power_of_2=_next_power_of_2,
    )
    tl = SimpleNamespace(constexpr=lambda value=None: value)
