"""Pick the Triton kernel or its PyTorch reference, per call.

``MEGALITE_KERNELS``, a user's switch, read once per process (a host that launches a thousand
kernels a step should not look the variable up for each; `use` switches it for benchmarks, and
the test suite reads it afresh for every test):

* ``auto`` (default): Triton when every tensor is on CUDA and Triton is installed, else the
  PyTorch reference: the "same code path on every device" rule of docs/architecture.md.
* ``torch``: always the reference.
* ``triton``: always the Triton kernel. On CPU that only works under the Triton interpreter
  (``TRITON_INTERPRET=1`` set before megalite is imported); otherwise we raise one clear error
  instead of letting Triton fail somewhere deep in its compiler.
"""

import os
from collections.abc import Callable
from typing import TypeVar

import torch

from ._triton import BUILD_ONLY, HAVE_TRITON, INTERPRETED_AT_IMPORT, interpreter_enabled

T = TypeVar("T")
ENV_VAR = "MEGALITE_KERNELS"
CHOICES = ("auto", "triton", "torch")


_switch: dict[str, str] = {}
"""``MEGALITE_KERNELS`` as first read: `requested_backend`'s cache (`forget_switch` empties it)."""


def requested_backend() -> str:
    """The value of ``MEGALITE_KERNELS`` (``auto`` when unset), validated; read on first use.
    While torch.compile traces, read afresh: the trace takes it as a constant of the graph, and
    a cache filled inside the trace would be a guard that fails, a recompile, once it is."""
    if torch.compiler.is_compiling():
        return _read_switch()
    if "value" not in _switch:
        _switch["value"] = _read_switch()
    return _switch["value"]


def _read_switch() -> str:
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV_VAR}={value!r}: expected one of {', '.join(CHOICES)}")
    return value


def forget_switch() -> None:
    """Read ``MEGALITE_KERNELS`` again at the next call (the test suite, after it switches it)."""
    _switch.clear()


def use(value: str) -> None:
    """Run the kernels `value` asks for from now on, in this process and those it starts."""
    os.environ[ENV_VAR] = value
    forget_switch()


def kernel_backend(*tensors: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"``: what the kernels would run right now.

    With tensors, the answer is for those tensors (``auto`` picks Triton only if all are on
    CUDA); without, it is for the default device (CUDA if available). Raises ``RuntimeError``
    when Triton is forced but cannot run here.
    """
    requested = requested_backend()
    on_cuda = all(t.is_cuda for t in tensors) if tensors else torch.cuda.is_available()
    on_cuda = on_cuda or BUILD_ONLY  # its CPU tensors stand for CUDA ones (`gpu_build`)
    if requested == "torch":
        return "torch"
    if requested == "auto":
        return "triton" if HAVE_TRITON and on_cuda else "torch"
    _check_triton_can_run(on_cuda)
    return "triton"


def _check_triton_can_run(on_cuda: bool) -> None:
    if not on_cuda and not interpreter_enabled():
        raise RuntimeError(
            f"{ENV_VAR}=triton with CPU tensors: Triton kernels run on CPU only under the "
            "Triton interpreter (set TRITON_INTERPRET=1 before importing megalite; slow, meant "
            f"for tests). Otherwise use {ENV_VAR}=torch or auto."
        )
    if not on_cuda and not INTERPRETED_AT_IMPORT:
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after megalite.kernels was imported, so its kernels "
            "were not built for the interpreter; set it before the first import of megalite"
        )
    if not HAVE_TRITON:
        raise RuntimeError(
            f"{ENV_VAR}=triton but Triton is not installed; use {ENV_VAR}=torch or auto"
        )


def opaque(launch: Callable[..., T]) -> Callable[..., T]:
    """`launch` (a Triton kernel's autograd Function `.apply`) run outside torch.compile's
    tracing: a compiled region calls it as one opaque op (a graph break), so dynamo never
    traces Triton launches, our autotune pruning or their host-side checks. The PyTorch
    references stay traceable, which is where compile fuses on CPU."""
    return torch.compiler.disable(launch, recursive=True)


def use_triton(
    *tensors: torch.Tensor, unsupported: str | None = None, fusable: bool = False
) -> bool:
    """Whether a kernel call on ``tensors`` should take the Triton path.

    ``unsupported`` is the reason the Triton kernel cannot handle these inputs (None when it
    can): under ``auto`` we then quietly use the reference, under ``triton`` we raise.
    ``fusable``: an elementwise kernel (a norm with its residual add, an activation, rotary)
    that inductor generates and fuses with its neighbours itself. Inside a compiled region,
    under ``auto``, it takes the traceable reference: an opaque Triton launch there would cut
    the graph in two, and the launches and guards of the pieces cost a small model more than
    a hand-written kernel saves (``train.compile``, training/compile.py).
    """
    if fusable and torch.compiler.is_compiling() and requested_backend() == "auto":
        return False
    if kernel_backend(*tensors) != "triton":
        return False
    if unsupported is None:
        return True
    if requested_backend() == "triton":
        raise ValueError(f"{ENV_VAR}=triton but the Triton kernel does not support {unsupported}")
    return False
