"""The Megatron-style linears (tensor_parallel/linear.py): the input gradient's collective is in
flight while the weight-gradient GEMM runs, and weight gradients added straight into the fp32
main grads equal what `.grad` then copy/add gave (fp32), with and without SP, biases, a shared
kv head (n_kv_heads < tp) and ZeRO-2's staging; fused q/k/v and gate/up run one GEMM each; a
split backward (B, then its deferred weight gradients in W) gives the same gradients, and no
bucket is reduced before W."""

import contextlib
import time

import pytest
import torch
from equivalence import relative_error
from megalite.models.gpt.model import GPT
from megalite.models.layers import BuildContext
from megalite.models.llama.model import Llama
from torch.utils._python_dispatch import TorchDispatchMode

from megalite import comm
from megalite.config import load_config
from megalite.data_parallel.grad_buffer import build_grad_buffers
from megalite.launch import run_ranks
from megalite.parallel_state import build_parallel_state
from megalite.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPRandom,
    all_gather_sequence,
    gemms,
    init_parameters,
    sequence_shard,
)
from megalite.tensor_parallel import normal_init as normal
from megalite.tensor_parallel.deferred import WeightGradQueue

pytestmark = pytest.mark.serial  # asserts on wall-clock time (Makefile)

B, S, H, OUT = 2, 8, 16, 24
DELAY_S = 0.5


def _track_async_collectives(events: list, handles: list) -> None:
    """From now on, each asynchronous collective appends ("issue", op) to `events` and its
    handle to `handles`, and its wait appends ("wait", op)."""
    issue = comm._issue

    def tracked_issue(call, fn, async_op):
        handle = issue(call, fn, async_op)
        if async_op:
            events.append(("issue", call.op))
            handles.append((call.op, handle))
            wait = handle.wait
            handle.wait = lambda: events.append(("wait", call.op)) or wait()
        return handle

    comm._issue = tracked_issue


def _overlap(sp: bool) -> list[tuple[str, ...]]:
    """One column-parallel linear's backward on 2 ranks, rank 1 arriving DELAY_S late. Returns
    rank 0's events: collectives issued and waited for, and for each weight-gradient GEMM
    which asynchronous collectives were still in flight when it started."""
    ps = build_parallel_state(2, 1, torch.device("cpu"))
    layer = ColumnParallelLinear(H, OUT, ps, bias=True, init=normal(1.0), sequence_parallel=sp)
    init_parameters(layer, 0, ps)
    x = torch.randn(B, S // 2 if sp else S, H, requires_grad=True)
    y = layer(x)
    events, handles = [], []
    weight_grad = gemms.weight_grad

    def tracked_weight_grad(*args):
        pending = [op for op, h in handles if not h.is_completed()]
        events.append(("weight grad", *pending))
        return weight_grad(*args)

    _track_async_collectives(events, handles)
    gemms.weight_grad = tracked_weight_grad
    if ps.coord("tp") == 1:
        time.sleep(DELAY_S)
    y.sum().backward()
    return events


@pytest.mark.parametrize("sp", [False, True], ids=["allreduce", "sp"])
def test_input_grad_collective_in_flight_during_weight_grad(sp):
    events = run_ranks(2, _overlap, sp)[0]
    reduce = "reduce_scatter" if sp else "all_reduce"
    ops = [e for e in events if e[0] != "weight grad"]
    expected = [("issue", reduce), ("wait", reduce)]
    if sp:  # the shard is gathered again first, under the input-gradient GEMM
        expected = [("issue", "all_gather"), ("wait", "all_gather"), *expected]
    assert ops == expected, events
    # the weight and bias gradients run between the reduction's issue and its wait
    first, wait = events.index(("issue", reduce)), events.index(("wait", reduce))
    grads = [i for i, e in enumerate(events) if e[0] == "weight grad"]
    assert len(grads) == 2 and all(first < i < wait for i in grads), events
    if not sp:  # rank 1 is still asleep: the all-reduce cannot have finished
        assert all(events[i][1:] == (reduce,) for i in grads), events


class _GemmsInFlight(TorchDispatchMode):
    """Appends ("gemm", ops still in flight) to `events` at each GEMM."""

    def __init__(self, events: list, handles: list) -> None:
        super().__init__()
        self.events, self.handles = events, handles

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in GEMMS:
            self.events.append(("gemm", *[op for op, h in self.handles if not h.is_completed()]))
        return func(*args, **(kwargs or {}))


def _sp_products(kind: str, tp: int) -> list[tuple[str, ...]]:
    """Under SP on `tp` ranks, the last rank arriving DELAY_S late: rank 0's events (async
    collectives issued and waited for, GEMMs with the collectives still in flight) in a
    column-parallel linear's forward ("column forward"), a row-parallel one's backward ("row
    backward") or its forward ("row forward")."""
    ps = build_parallel_state(tp, 1, torch.device("cpu"))
    events, handles = [], []
    _track_async_collectives(events, handles)
    late = ps.coord("tp") == tp - 1
    if kind == "column forward":
        layer = ColumnParallelLinear(
            H, OUT, ps, bias=True, init=normal(1.0), sequence_parallel=True
        )
        init_parameters(layer, 0, ps)
        x = torch.randn(B, S // tp, H)
        if late:
            time.sleep(DELAY_S)
        with _GemmsInFlight(events, handles):
            y = layer(x)
        measured = list(events)
        full = all_gather_sequence(x, ps.group("tp"))
        reference = torch.nn.functional.linear(full, layer.weight, layer.bias)
    elif kind == "row forward":
        layer = RowParallelLinear(H, OUT, ps, bias=False, init=normal(1.0), sequence_parallel=True)
        init_parameters(layer, 0, ps)
        x = torch.randn(B, S, H // tp)
        if late:
            time.sleep(DELAY_S)
        with _GemmsInFlight(events, handles):
            y = layer(x)
        measured = list(events)
        summed = torch.nn.functional.linear(x, layer.weight)  # partial sums, then the sums
        comm.all_reduce(summed, ps.group("tp"))
        reference = sequence_shard(summed, ps.group("tp"))
    else:
        layer = RowParallelLinear(H, OUT, ps, bias=False, init=normal(1.0), sequence_parallel=True)
        init_parameters(layer, 0, ps)
        x = torch.randn(B, S, H // tp, requires_grad=True)
        dy = torch.randn(B, S // tp, OUT)
        y = layer(x)
        if late:
            time.sleep(DELAY_S)
        events.clear()  # the forward's
        with _GemmsInFlight(events, handles):
            y.backward(dy)
        measured = list(events)
        y, reference = x.grad, all_gather_sequence(dy, ps.group("tp")) @ layer.weight
    assert relative_error(y, reference) < 1e-6
    return measured


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("kind", ["column forward", "row backward"])
def test_gathered_products_start_under_the_gather(kind, tp):
    """A GEMM that needs all-gathered sequence shards multiplies this rank's own tokens while
    the gather is in flight (the last rank is still asleep), then the others' after the wait:
    rank 0's tokens come first, so one GEMM after it at any tp. The products equal the GEMM of
    the gathered input."""
    events = run_ranks(tp, _sp_products, kind, tp)[0]
    gather = [("issue", "all_gather"), ("gemm", "all_gather"), ("wait", "all_gather"), ("gemm",)]
    if kind == "row backward":  # then the weight gradient, from the gathered output gradient
        gather.append(("gemm",))
    assert events == gather, events


@pytest.mark.parametrize("tp", [2, 4])
def test_scattered_products_send_the_other_ranks_tokens_first(tp):
    """The row-parallel forward under SP multiplies the other ranks' tokens, starts sending
    those partial sums, and multiplies this rank's own while they travel (the last rank is still
    asleep); the result equals the reduce-scatter of the whole product. Rank 0's tokens come
    first, so the others' are one GEMM before the issue at any tp."""
    events = run_ranks(tp, _sp_products, "row forward", tp)[0]
    scatter = [("gemm",), ("issue", "reduce_scatter"), ("gemm", "reduce_scatter")]
    assert events == [*scatter, ("wait", "reduce_scatter")], events


ARCHS = {
    "gpt": ["model.arch=gpt"],  # biases (q/k/v in the fused function, fc through bias-GELU)
    "llama-gqa": ["model.arch=llama", "model.n_kv_heads=1"],  # a shared kv head at tp 2
}


def _with_and_without(option: str, arch: str, sp: bool, zero: int) -> float:
    """The relative difference of this rank's fp32 gradients after 2 micro-batches with and
    without `option`: "fuse" (weight gradients through accumulate_main_grad) or "split" (the
    backward split into B, then W running what B deferred; the last micro-batch's buckets
    counting from its W, as the executor starts them: after B none is staged or reduced)."""
    ps = build_parallel_state(2, 1, torch.device("cpu"))  # dp: the rest of the world
    overrides = [*ARCHS[arch], "model.hidden=32", "model.n_heads=4", "model.seq_len=16"]
    cfg = load_config(None, [*overrides, "model.n_layers=2"])
    results = []
    for on in (True, False):
        ctx = BuildContext(cfg.model, ps, TPRandom(0, ps), sequence_parallel=sp)
        chunk = (GPT if arch == "gpt" else Llama)(ctx, range(2))
        init_parameters(chunk, 0, ps)
        fuse = on or option != "fuse"
        (buffer,) = build_grad_buffers([chunk], ps, 0.01, zero, fuse_wgrad=fuse)
        split = on and option == "split"
        torch.manual_seed(0)
        for micro_batch in range(2):
            if micro_batch == 1:
                buffer.start_sync()
            ids = torch.randint(0, cfg.model.vocab_size, (B, 17))
            queue = WeightGradQueue()
            with ctx.deferral.deferring(queue) if split else contextlib.nullcontext():
                chunk(ids[:, :-1], ids[:, 1:]).backward()
            if split:
                assert all(b.handle is None and b.staging is None for b in buffer.buckets)
                queue.run()
            buffer.end_backward()
        buffer.finish_sync()
        results.append(buffer.owned_grads.clone())
    assert results[0].abs().sum() > 0
    return relative_error(*results)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
def test_fused_accumulation_equals_grad_then_add_in_fp32(arch, sp):
    assert max(run_ranks(2, _with_and_without, "fuse", arch, sp, 0)) < 1e-6


def test_fused_accumulation_under_zero2():
    """tp 2 x dp 2, ZeRO-2: the weight gradients go into the buckets' staging."""
    assert max(run_ranks(4, _with_and_without, "fuse", "gpt", True, 2)) < 1e-6


@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
def test_split_backward_equals_plain_backward(sp):
    """tp 2 x dp 2, ZeRO-1 (under SP the linears gather their shards again in W)."""
    assert max(run_ranks(4, _with_and_without, "split", "llama-gqa", sp, 1)) < 1e-6


def test_split_backward_under_zero2():
    assert max(run_ranks(4, _with_and_without, "split", "gpt", True, 2)) < 1e-6


GEMMS = {
    getattr(op, overload)
    for op in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm)
    for overload in ("default", "out")
}


class _CountGemms(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in GEMMS
        return func(*args, **(kwargs or {}))


def _gemms(overrides: list[str]) -> dict[str, tuple[int, int]]:
    """(forward, backward) GEMMs of each column-parallel group of a block at tp 2 with SP."""
    ps = build_parallel_state(2, 1, torch.device("cpu"))
    cfg = load_config(None, [*overrides, "model.hidden=32", "model.n_heads=4", "model.n_layers=1"])
    ctx = BuildContext(cfg.model, ps, TPRandom(0, ps), sequence_parallel=True)
    block = (GPT if cfg.model.arch == "gpt" else Llama)(ctx, range(1)).layers["0"]
    init_parameters(block, 0, ps)
    groups = {"qkv": block.attn.wqkv}
    if cfg.model.arch == "llama":
        groups["gate_up"] = block.mlp.gate_up
    counts = {}
    for name, group in groups.items():
        x = torch.randn(B, S // 2, 32, requires_grad=True)
        with _CountGemms() as forward:
            outputs = group(x)
        loss = sum(y.square().sum() for y in outputs)
        with _CountGemms() as backward:
            loss.backward()
        counts[name] = (forward.count, backward.count)
    return counts


@pytest.mark.parametrize(
    "overrides",
    [["model.arch=gpt"], ["model.arch=llama", "model.n_kv_heads=2"], ARCHS["llama-gqa"]],
    ids=["gpt", "llama-kv-split", "llama-kv-shared"],
)
def test_fused_column_parallel_runs_one_gemm(overrides):
    """One GEMM forward per piece of the sequence (under SP at tp 2: this rank's own tokens
    while the other rank's are gathered, then those), and the input and weight gradients one
    each backward, for q/k/v (k/v split over tp, or one kv head shared by both ranks) and
    gate/up."""
    for counts in run_ranks(2, _gemms, overrides):
        assert set(counts.values()) == {(2, 2)}, counts
