"""Compile megalite's Triton kernels for a GPU, on a machine without one.

The interpreter (``TRITON_INTERPRET=1``) checks every kernel's numbers on CPU, but it never
compiles one, and runs one fixed tile instead of the autotune sweeps. What only the GPU compiler
sees goes unchecked there: a candidate tile that does not compile, one whose pipeline stages
need more shared memory than the GPU has (Triton then refuses to load it), one that runs out of
registers and spills to local memory. Triton compiles ahead of time for any GPU
(``GPUTarget``), with the ptxas it ships, so all of that can be read on any machine:

1. `record_launches` runs megalite's kernel calls (`kernel_calls`, at the sizes of a model:
   `Shapes`) on empty CPU tensors, forward and backward, each launch recorded instead of run:
   the kernel, its arguments, and the candidates Triton's autotuner would time for that call
   (after the kernel's own pruning); torch's matrix products are not computed there either;
2. `jobs` binds each candidate to its launch's arguments as ``JITFunction.run`` would, for each
   `Target` (Hopper, Ampere, Ada, Blackwell), once per distinct compile; `build` compiles one
   and reads what it needs: shared memory (Triton's own figure, the one it checks at load
   time), registers and spilled bytes (``cuobjdump --dump-resource-usage`` on the cubin),
   compile seconds;
3. `problems` names what would fail on that GPU.

This needs a process started with ``MEGALITE_TRITON_BUILD_ONLY=1`` (`_triton.BUILD_ONLY`): the
kernels are then built with their GPU sweeps, and the dispatch takes the Triton path for CPU
tensors. `megalite.benchmarks.kernel_build` is the command line (``tools/build_kernels.py``).
"""

from __future__ import annotations

import contextlib
import itertools
import re
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from ._triton import BUILD_ONLY, BUILD_ONLY_ENV

aten = torch.ops.aten


@dataclass(frozen=True)
class Target:
    """A GPU to compile for: its compute capability and the shared memory one block may use
    (the opt-in maximum, CUDA programming guide, "Technical Specifications")."""

    name: str
    gpus: str
    capability: int
    shared_memory: int


TARGETS = {
    t.name: t
    for t in (
        Target("sm90", "H100, H200", 90, 227 * 1024),
        Target("sm80", "A100", 80, 163 * 1024),
        Target("sm89", "L40S, RTX 4090", 89, 99 * 1024),
        Target("sm100", "B200", 100, 227 * 1024),
    )
}


@dataclass(frozen=True)
class Shapes:
    """The sizes one rank's kernels see: its heads, K/V heads, FFN width, vocabulary slice and
    experts. The kernels take them as run-time arguments, so the compiled code is mostly the
    same for every split, except where one changes what Triton specialises an integer on: a
    size of 1 (one K/V head or one expert a rank), or one that stops being a multiple of 16
    (gpt2-1.3b's 8 heads a rank at tp 2) compiles variants of its own.
    `vocab`: the rank's slice of the padded vocabulary; `real_vocab`: the columns of the last
    rank's slice that are not padding (every other rank's are all real).
    `tokens`: rows per call, a run-time size too, kept small (the tensors are allocated); the
    grouped GEMM, whose row tile depends on the rows per expert, is called at both tiles'."""

    hidden: int
    head_dim: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    real_vocab: int
    experts: int | None = None
    tokens: int = 256


@dataclass(eq=False)
class Launch:
    """One recorded kernel launch: what `kernel[grid](*args, **kwargs)` was called with, and the
    candidates the autotuner would compile for it (one None for a kernel without a sweep).
    Compared and hashed by identity: each is one event."""

    call: str
    kernel: Any  # triton.runtime.jit.JITFunction
    args: tuple
    kwargs: dict
    candidates: list

    @property
    def name(self) -> str:
        return self.kernel.__name__


@dataclass
class Job:
    """One candidate of a launch, bound to the launch's arguments, to compile for a target."""

    launch: Launch
    candidate: str
    target: Target
    source: Any  # triton.compiler.ASTSource
    options: dict


@dataclass
class Built:
    """A job compiled, with what it needs on its target (or why it failed)."""

    job: Job
    seconds: float
    shared: int = 0
    registers: int = 0
    spilled: int = 0
    error: str | None = None

    @property
    def fits(self) -> bool:
        return self.error is None and self.shared <= self.job.target.shared_memory


TRITON_RELEASE = "3.9"
"""The Triton release whose internals this module records and binds launches with
(``JITFunction.run``, ``Autotuner.prune_configs``, ``JITFunction._pack_args``): the one the
Makefile's setup installs. They are not Triton's public API, and they change between releases."""


class UnsupportedTriton(RuntimeError):
    """This process's Triton is not `TRITON_RELEASE`."""


def _require_build_only() -> None:
    if not BUILD_ONLY:
        raise RuntimeError(
            f"kernels.gpu_build needs a process started with {BUILD_ONLY_ENV}=1 (and without "
            "TRITON_INTERPRET=1): run python tools/build_kernels.py"
        )
    import triton

    if not triton.__version__.startswith(f"{TRITON_RELEASE}."):
        raise UnsupportedTriton(
            f"kernels.gpu_build records and binds launches with Triton {TRITON_RELEASE}'s "
            f"internals, and this is Triton {triton.__version__}: run it where Triton "
            f"{TRITON_RELEASE} is installed (pip install 'triton=={TRITON_RELEASE}.*')"
        )


class _UncomputedProducts(TorchDispatchMode):
    """torch's matrix products, not computed: each gives an empty tensor of the shape, strides
    and dtype the product would have (out= and in-place ones leave theirs unwritten). A recording
    reads no value (the kernels' outputs are empty already), and on a CPU without bf16
    instructions a 16-bit product costs ~90x an fp32 one: a recorded bf16 training step then
    costs only its elementwise ops. The tensors stay a 16-bit step's, so every launch binds the
    dtypes, sizes, strides and fresh (aligned) allocations a GPU's step gives it."""

    PRODUCTS = frozenset(
        (aten.mm, aten.bmm, aten.addmm, aten.addmm_, aten.baddbmm, aten.baddbmm_, aten.addbmm,
         aten.addbmm_)
    )  # fmt: skip

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket not in self.PRODUCTS:
            return func(*args, **kwargs)
        if "out" in kwargs:
            return kwargs["out"]
        if func.overloadpacket.__name__.endswith("_"):
            return args[0]
        meta = func(*tree_map_only(torch.Tensor, lambda t: t.to("meta"), args), **kwargs)
        return torch.empty_strided(
            meta.shape, meta.stride(), dtype=meta.dtype, device=args[0].device
        )


@contextlib.contextmanager
def record_launches(into: list[Launch], call: str) -> Iterator[None]:
    """Inside: every Triton launch is appended to `into` instead of run (the kernels' outputs
    stay empty), as made by `call` (a name, for the rows of the table); torch's matrix products
    are not computed either (`_UncomputedProducts`)."""
    _require_build_only()
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    def jit_run(kernel, *args, grid, warmup, **kwargs):
        into.append(Launch(call, kernel, args, kwargs, [None]))

    def autotuned_run(tuner, *args, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
        tuner.nargs = dict(zip(tuner.arg_names, args))
        candidates = tuner.prune_configs(kwargs)  # what Triton would time for this call
        tuner.nargs = None
        into.append(Launch(call, tuner.fn, args, kwargs, candidates))

    runs = JITFunction.run, Autotuner.run
    JITFunction.run, Autotuner.run = jit_run, autotuned_run
    try:
        with _UncomputedProducts():
            yield
    finally:
        JITFunction.run, Autotuner.run = runs


def kernel_calls(shapes: Shapes, dtype: torch.dtype) -> dict[str, Callable[[], None]]:
    """megalite's kernel calls at these sizes, by name: each runs forward and backward where
    the kernel has one, through the public functions (their checks and dispatch as in
    training). Attention is called as the model calls it: whole causal windows
    (`flash_attention`), and the causal blocks at offsets, with and without documents, of
    context parallelism and `data.document_mask` (`context_parallel.attention`: a query chunk
    against its own keys and against an earlier chunk's, with the backward's delta given);
    and through the varlen API (`cu_seqlens`) a user may call."""
    import megalite.kernels as K
    from megalite.kernels.cross_entropy import Columns

    rows, d = shapes.tokens, shapes.head_dim  # attention: one window of `rows` tokens

    def empty(*size, grad: bool = False, type_: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(size, dtype=type_, requires_grad=grad)

    def qkv():
        return (
            empty(1, rows, shapes.heads, d, grad=True),
            empty(1, rows, shapes.kv_heads, d, grad=True),
            empty(1, rows, shapes.kv_heads, d, grad=True),
        )

    def backward(*outputs: torch.Tensor) -> None:
        torch.autograd.backward(outputs, [torch.empty_like(o) for o in outputs])

    halves = torch.tensor([0, rows // 2, rows])

    def attention(documents: bool) -> None:
        q, k, v = qkv()
        backward(K.flash_attention(q, k, v, causal=True, cu_seqlens=halves if documents else None))

    def blocks(documents: bool) -> None:
        q, k, v = (t.detach() for t in qkv())
        docs = K.doc_start_from_cu_seqlens(halves, 1, rows) if documents else None
        delta = empty(1, shapes.heads, rows, type_=torch.float32)
        for q_offset in (0, rows):  # the diagonal block, and one of earlier keys
            block = dict(q_offset=q_offset, k_offset=0, causal=True, doc_start=docs)
            out, lse = K.attention_block_forward(q, k, v, **block)
            dout = torch.empty_like(out)
            K.attention_block_backward(dout, q, k, v, out, lse, **block, delta=delta)

    def norms() -> None:
        x = empty(rows, shapes.hidden, grad=True)
        weight, bias = empty(shapes.hidden, grad=True), empty(shapes.hidden, grad=True)
        for residual in (None, empty(rows, shapes.hidden, grad=True)):
            backward(*K.layer_norm(x, weight, bias, 1e-5, residual))
            backward(*K.rms_norm(x, weight, 1e-5, residual))

    def grouped_mlp() -> None:
        # Both row tiles the kernels choose from (`grouped_gemm._block_m`): experts averaging
        # fewer than 128 rows, and at least 128 (a real micro-batch's tokens).
        experts = shapes.experts or 1
        up_weight = empty(experts, shapes.ffn, shapes.hidden, grad=True)
        down_weight = empty(experts, shapes.hidden, shapes.ffn, grad=True)
        for rows_each in (64, 128):
            counts = torch.full((experts,), rows_each, dtype=torch.int64)
            x = empty(rows_each * experts, shapes.hidden, grad=True)
            backward(K.grouped_mm(K.grouped_mm(x, up_weight, counts), down_weight, counts))

    def cross_entropy() -> None:
        # The loss runs over chunks of the tokens (`tensor_parallel.cross_entropy`), so Triton
        # sees the pointers at every 16-byte alignment a chunk gives them: the row statistics
        # are rows of one (3, chunk) buffer (aligned when the chunk is a multiple of 4 rows; the
        # sum and target logit misaligned apart at 2 mod 4), and a chunk's targets start at an
        # odd token when the chunk is odd. Columns: a full slice, and the last rank's real ones.
        for real in dict.fromkeys((shapes.vocab, shapes.real_vocab)):
            for chunk, first in itertools.product((rows, rows - 2, rows - 1), (0, 1)):
                targets = torch.zeros(first + chunk, dtype=torch.int64)[first:]
                K.softmax_cross_entropy(empty(chunk, shapes.vocab), targets, Columns(real), True)

    def wgrad() -> None:
        main_grad = empty(shapes.ffn, shapes.hidden, type_=torch.float32)
        for first in (True, False):  # a step's first product overwrites the main grad
            K.wgrad_accumulate(
                main_grad, empty(rows, shapes.ffn), empty(rows, shapes.hidden), first
            )

    calls = {
        "attention": lambda: attention(documents=False),
        "attention, varlen": lambda: attention(documents=True),
        "blocks": lambda: blocks(documents=False),
        "blocks, documents": lambda: blocks(documents=True),
        "norms": norms,
        "bias_gelu": lambda: backward(
            K.bias_gelu(empty(rows, shapes.ffn, grad=True), empty(shapes.ffn, grad=True))
        ),
        "swiglu": lambda: backward(
            K.swiglu(empty(rows, shapes.ffn, grad=True), empty(rows, shapes.ffn, grad=True))
        ),
        "rotary": lambda: backward(*K.rotary_embedding(*qkv()[:2], empty(rows, d), empty(rows, d))),
        "cross_entropy": cross_entropy,
    }
    if shapes.experts:
        calls["grouped_mm"] = grouped_mlp
    if dtype != torch.float32:  # the fused weight-gradient GEMM takes 16-bit inputs only
        calls["wgrad_accumulate"] = wgrad
    return calls


def launches(shapes: Shapes, dtype: torch.dtype) -> list[Launch]:
    """Every launch of `kernel_calls(shapes, dtype)`, in order."""
    recorded: list[Launch] = []
    for call, run in kernel_calls(shapes, dtype).items():
        with record_launches(recorded, call):
            run()
    return recorded


def jobs(recorded: list[Launch], targets: list[Target]) -> list[Job]:
    """Every candidate of every launch, for every target; a compile that an earlier launch
    already asked for (the same kernel, arguments and options) is left out."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    seen: set[tuple] = set()
    found = []
    for target in targets:
        backend = make_backend(GPUTarget("cuda", target.capability, 32))
        for launch in recorded:
            for job, key in _bound(launch, target, backend):
                if key not in seen:
                    seen.add(key)
                    found.append(job)
    return found


def _bound(launch: Launch, target: Target, backend) -> Iterator[tuple[Job, tuple]]:
    """Each candidate of `launch` bound to its arguments as `JITFunction.run` binds them, with
    the key of what would be compiled."""
    from triton.compiler import ASTSource
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    bind = create_function_from_signature(kernel.signature, kernel.params, backend)
    for candidate in launch.candidates:
        kwargs = {**launch.kwargs, **(candidate.all_kwargs() if candidate else {})}
        bound, specialization, options = bind(*launch.args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(
            backend, kwargs, bound, specialization, options
        )
        compiled = (signature, constexprs, attrs, options)
        source = ASTSource(kernel, signature, constexprs, attrs)
        job = Job(launch, _describe(candidate), target, source, options.__dict__)
        yield job, (launch.name, target.name, *map(repr, compiled))


def build(job: Job) -> Built:
    """Compile a job for its target and read what it needs there. Safe to call from several
    threads at once (Triton's compiler and ptxas release the GIL)."""
    import triton
    from triton.backends.compiler import GPUTarget

    start = time.perf_counter()
    try:
        gpu = GPUTarget("cuda", job.target.capability, 32)
        compiled = triton.compile(job.source, target=gpu, options=job.options)
    except Exception as error:  # any compiler failure is what this looks for
        return Built(job, time.perf_counter() - start, error=_reason(error))
    seconds = time.perf_counter() - start
    registers, spilled = _resources(compiled.asm["cubin"], job.launch.name)
    return Built(job, seconds, compiled.metadata.shared, registers, spilled)


def _reason(error: Exception) -> str:
    """A compiler error in one line: its type and last line (Triton puts the kernel's source,
    with a caret, above the reason; ptxas puts its verdict last)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"[:300]


def _describe(candidate) -> str:
    """A candidate as the table shows it: its blocks, then warps and stages."""
    if candidate is None:
        return "-"
    blocks = "x".join(str(v) for v in candidate.kwargs.values())
    return f"{blocks} w{candidate.num_warps} s{candidate.num_stages}"


def _resources(cubin: bytes, kernel: str) -> tuple[int, int]:
    """(registers per thread, bytes spilled to the stack) of `kernel` in a cubin, as ptxas
    allocated them (``cuobjdump --dump-resource-usage``)."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "--dump-resource-usage", file.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    found = re.search(rf"Function {re.escape(kernel)}:\s*REG:(\d+) STACK:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no resource usage for {kernel}:\n{usage}")
    return int(found.group(1)), int(found.group(2))


def problems(built: list[Built]) -> list[str]:
    """What would fail on the GPU: a candidate that does not compile; a launch none of whose
    candidates fits the target's shared memory (the autotuner skips a candidate that does not
    fit, so one is enough; a kernel without a sweep has only the one)."""
    found = []
    by_launch: dict[tuple[int, str], list[Built]] = {}
    for b in built:
        job = b.job
        if b.error:
            found.append(f"{job.launch.name} {job.candidate} on {job.target.name}: {b.error}")
        by_launch.setdefault((id(job.launch), job.target.name), []).append(b)
    for rows in by_launch.values():
        if not any(b.error for b in rows) and not any(b.fits for b in rows):
            job = rows[0].job
            found.append(
                f"{job.launch.name} ({job.launch.call}) on {job.target.name}: no candidate fits "
                f"its {job.target.shared_memory} bytes of shared memory (the smallest needs "
                f"{min(b.shared for b in rows)})"
            )
    return found
