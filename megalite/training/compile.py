"""`train.compile`: torch.compile in the regional style (torchtitan's): every transformer block
is compiled on its own, so one compiled graph serves all the blocks of a model, on every
pipeline stage and virtual chunk, whatever the schedule runs next.

What is compiled and what is not (docs/architecture.md, "A compiled step"):
- compiled: the compute between the tensor-parallel linears: norms, residual adds, dropout,
  rotary, bias-GELU / SwiGLU and the attention core. The elementwise kernels take their
  PyTorch references inside the compiled region (`kernels.dispatch.use_triton`'s `fusable`):
  inductor fuses them with their neighbours, where a Triton launch would cut the graph. The
  Triton attention is an operator (`megalite::flash_attention` and its backward), one node of
  the graph that inductor calls as it is;
- eager, as opaque ops between the compiled pieces (graph breaks): the column- and
  row-parallel linears with their collectives and main-grad accumulation
  (`tensor_parallel/linear.py`), the sequence-parallel mappings, and the other Triton
  kernels when forced (`MEGALITE_KERNELS=triton`) or without a reference compile could fuse
  (the grouped GEMM; `kernels.dispatch.opaque`). The linears' communication overlap is
  hand-scheduled (the input gradient's collective in flight under the weight-gradient GEMM),
  their observers count and time every collective, and the gloo / NCCL work objects they
  wait on are not traceable;
- except at tp 1 with an unsplit backward (`can_trace_linears`), where a linear has no collective
  and no deferred weight gradient: there it is a plain `F.linear` that compile traces
  (`tensor_parallel.linear.traced_linear`), its weight gradient a `.grad` the gradient buffer
  adds into the fp32 main grad (in 16 bits under bf16: rounded once per micro-batch, as torch's
  DDP and FSDP gradients are, where the eager path accumulates in fp32). A block is then one
  graph, on a GPU too, instead of a piece between every pair of linears: a small model's step
  is bound by launches and per-graph overhead, not by its GEMMs;
- eager: embedding, LM head and loss, the pipeline's sends and receives, the optimizer.

Shapes are static: every micro-batch of a run has the same shape, so there is nothing to
recompile after the first step; `CompileWatch` counts what is compiled after it (the training
loop logs it, tests require 0). Evaluation and generation run eager (`eager()`): no-grad and
eval-mode graphs would only add compile time for a few batches.

Dropout: inductor's fused random numbers differ from eager's, so `fallback_random` keeps the
eager generator: compiled equals eager, mask for mask, as every layout does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from megalite.eager_boundary import mark_for_compile
from megalite.pipeline.schedule import splits_backward
from megalite.tensor_parallel import FusedColumnParallelLinear, RowParallelLinear

# torch._dynamo and torch._inductor are imported inside the functions: importing them imports
# Triton, which must not happen before a test sets TRITON_INTERPRET (and costs start-up time
# for every run that does not compile).


def compile_blocks(chunks: list[nn.Module], trace_linears: bool) -> None:
    """Compile every block (`chunk.layers`) of this rank's chunks in place. `trace_linears`
    (tp 1, a backward that is not split into B and W): trace the linears too."""
    import torch._inductor.config

    mark_for_compile()  # the tensor-parallel linears and mappings stay eager (graph breaks)
    torch._inductor.config.fallback_random = True
    for chunk in chunks:
        for block in chunk.layers.values():
            for module in block.modules():
                if isinstance(module, FusedColumnParallelLinear | RowParallelLinear):
                    module.traceable = trace_linears
            block.compile(dynamic=False)


def can_trace_linears(tp_size: int, schedule: str) -> bool:
    """Whether compiled blocks may trace their linears: no tensor-parallel peer to talk to and
    no weight gradient to defer to a W step."""
    return tp_size == 1 and not splits_backward(schedule)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (each forward graph; AOTAutograd
    compiles its backward with it)."""
    import torch._dynamo.utils

    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


RECOMPILE_LIMIT = "Dynamo recompile limit exceeded"
"""The graph-break type dynamo records (in its `unimplemented` counter) for a frame it stops
compiling at `torch._dynamo.config.recompile_limit`."""


def recompile_limit_hits() -> int:
    """Frames dynamo stopped compiling at its recompile limit in this process so far: each then
    runs eager for good, which no count of graphs shows."""
    import torch._dynamo.utils

    stopped = torch._dynamo.utils.counters["unimplemented"]
    return sum(n for reason, n in stopped.items() if reason.startswith(RECOMPILE_LIMIT))


def compile_seconds() -> float:
    """Wall time this process has spent compiling so far (dynamo, AOTAutograd, inductor;
    backward graphs included)."""
    import torch._dynamo.utils

    return torch._dynamo.utils.calculate_time_spent().get("total_wall_time", 0.0)


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Run compiled modules eagerly inside (evaluation, generation): no new graphs."""
    with torch.compiler.set_stance("force_eager"):
        yield


class CompileWatch:
    """Compile time and recompiles of a run: the first step compiles every graph; any graph
    compiled after it is a recompile (a guard failed: a shape, dtype or mode changed), and so
    is a frame that reaches dynamo's recompile limit at any step (a first step of many
    micro-batches can: from then on the frame runs eager, compiling nothing)."""

    def __init__(self) -> None:
        self._seconds = compile_seconds()
        self._stopped = recompile_limit_hits()
        self._graphs_after_first: int | None = None

    def step_done(self) -> None:
        if self._graphs_after_first is None:
            self._graphs_after_first = compiled_graphs()

    @property
    def seconds(self) -> float:
        """Seconds spent compiling since the watch began."""
        return compile_seconds() - self._seconds

    @property
    def recompiles(self) -> int:
        """Graphs compiled after the first step, and frames stopped at the recompile limit since
        the watch began (0 unless a guard failed)."""
        stopped = recompile_limit_hits() - self._stopped
        if self._graphs_after_first is None:
            return stopped
        return compiled_graphs() - self._graphs_after_first + stopped
