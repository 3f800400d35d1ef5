"""Optimizer offload (optim.offload=cpu): equivalence with the single-process run (ZeRO-1 over dp
2, and composed with tp 2), the same update as on the device, and memory: each rank's optimizer
bytes counted from its live tensors equal the estimate for offload and each state dtype under
zero 0 and 1, on the device the estimate names (master weights, moments and staging on the
host `cpu` device; parameters and gradient buffers on the run's device)."""

import pytest
import torch
from equivalence import TINY, assert_equivalent

from megalite.config import load_config
from megalite.launch import run_ranks
from megalite.parallel_state import ParallelState, build_parallel_state
from megalite.profiling.estimate import estimate_layout
from megalite.profiling.memory import live_bytes, live_devices
from megalite.training.setup import build_run
from megalite.training.step import train_step

GPT = ("model.arch=gpt",)
LLAMA = ("model.arch=llama", "model.n_kv_heads=2")
OFFLOAD = ("optim.offload=cpu",)
LIVE_PARTS = {
    "params": "parameters",
    "buffers": "buffers",
    "grads": "gradients",
    "optimizer": "optimizer",
}
"""`live_bytes`'s names for the estimate's parts."""


@pytest.mark.parametrize(
    "world,model,layout",
    [(2, LLAMA, ("parallel.zero=1",)), (4, GPT, ("parallel.tp=2", "parallel.zero=1"))],
    ids=["dp2-zero1", "dp2-tp2-zero1"],
)
def test_offload_matches_single_process(builtin_corpus, tmp_path, world, model, layout):
    assert_equivalent(world, model, (*layout, *OFFLOAD), tmp_path)


def _with_and_without_offload(precision: str, device: str, model=GPT, steps: int = 3):
    """The same run on `device` with its optimizer state there and on the host: both runs and
    their per-step losses."""
    runs = [
        build_run(
            load_config(None, [*TINY, *model, f"train.precision={precision}", *extra]),
            ParallelState.single(device),
        )
        for extra in ((), OFFLOAD)
    ]
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 500, (8, 33), generator=generator).to(device)
        losses.append([train_step(run, tokens, 3e-3).loss for run in runs])
    return runs, losses


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_offload_is_the_same_update(precision):
    """Host and device run the same kernel on the same numbers: with host == device (this
    machine) the weights after a few steps are bit-identical, 16-bit parameters included
    (they come back through the upload staging)."""
    (on_device, offloaded), losses = _with_and_without_offload(precision, "cpu")
    assert all(a == b for a, b in losses)
    for name, param in on_device.named_parameters().items():
        assert torch.equal(offloaded.named_parameters()[name], param), name
    assert all(s.master is not s.params for s in offloaded.optimizer.states)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_offload_on_cuda(precision):
    """On a GPU: the state lies in host memory (the staging, and the master weights of fp32
    parameters, in one pinned arena), the parameters and gradients stay on the GPU, and the
    CPU's update (with the copies overlapping it on a side stream) gives the GPU's losses and
    master weights to within the two kernels' rounding (Llama: no parameter with a
    zero true gradient, whose rounding noise Adam would turn into lr-sized steps)."""
    runs, losses = _with_and_without_offload(precision, "cuda", model=LLAMA, steps=5)
    on_device, offloaded = runs
    for on_gpu, on_host in losses:
        assert on_host == pytest.approx(on_gpu, rel=1e-5 if precision == "fp32" else 1e-3)
    assert all(t.device.type == "cpu" for t in offloaded.optimizer.state_tensors())
    placement = offloaded.optimizer.placement  # what the copy engine moves: one pinned arena
    assert all(v.is_pinned() for v in placement.arena.views if v.numel())
    assert not any(s.exp_avg.is_pinned() for s in offloaded.optimizer.states)
    assert all(b.params_flat.is_cuda and b.grads_flat.is_cuda for b in offloaded.buffers)
    # With bf16 parameters a last-bit difference between the CPU's and the GPU's fused AdamW
    # can flip a parameter's bf16 rounding, and five steps of Adam magnify that: 6.6e-4 on an
    # H100 (fp32 parameters: below 1e-4).
    tolerance = 1e-4 if precision == "fp32" else 2e-3
    for gpu, host in zip(on_device.optimizer.states, offloaded.optimizer.states, strict=True):
        error = ((host.master.cuda() - gpu.master).norm() / gpu.master.norm()).item()
        assert error < tolerance


MEMORY_CASES = [
    (zero, offload, state_dtype, precision)
    for zero in (0, 1)
    for offload, state_dtype, precision in [
        ("none", "bf16", "fp32"),
        ("none", "fp32", "bf16"),
        ("cpu", "fp32", "bf16"),
        ("cpu", "bf16", "fp32"),
    ]
]


def _memory_config(zero, offload, state_dtype, precision):
    return load_config(
        None,
        [
            *TINY,
            f"parallel.zero={zero}",
            "parallel.bucket_mb=0.05",
            f"optim.offload={offload}",
            f"optim.state_dtype={state_dtype}",
            f"train.precision={precision}",
        ],
    )


def _where(tensors) -> set[str]:
    return {f"{t.device.type}{' pinned' if t.is_pinned() else ''}" for t in tensors}


def _measure(_):
    """For each case: live bytes, where live_bytes says each part lives, and the devices of
    the optimizer's own tensors and of the model's parameter and gradient buffers."""
    results = []
    for case in MEMORY_CASES:
        cfg = _memory_config(*case)
        ps = build_parallel_state(1, 1, torch.device("cpu"))
        run = build_run(cfg, ps)
        model = [t for b in run.buffers for t in (b.params_flat, b.grads_flat, b.owned_grads)]
        placement = run.optimizer.placement
        results.append(
            (
                live_bytes(run),
                live_devices(run),
                _where(run.optimizer.state_tensors()),
                _where(model),
                (placement.state_device.type, ps.device.type),
            )
        )
    return results


def test_optimizer_bytes_and_location_equal_the_estimate():
    per_rank = run_ranks(2, _measure, None)
    for i, case in enumerate(MEMORY_CASES):
        zero, offload, state_dtype, precision = case
        stage = estimate_layout(_memory_config(*case), 2, device="cpu").stages[0]
        parts = {p.name: p for p in stage.parts}
        for results in per_rank:
            live, devices, state_where, model_where, (state_device, run_device) = results[i]
            assert live == {n: stage.part(p) for n, p in LIVE_PARTS.items()}, case
            assert devices == {n: parts[p].device for n, p in LIVE_PARTS.items()}, case
            assert state_device == ("cpu" if offload == "cpu" else run_device), case
            assert state_where == {"cpu"} and model_where == {run_device}, case
        optimizer = stage.part("optimizer")
        if offload == "cpu":  # the host column, not the GPU's
            assert parts["optimizer"].device == "host"
            assert stage.total_bytes == sum(p.bytes for p in stage.parts) - optimizer
        print(f"zero={zero} offload={offload} state={state_dtype} {precision}: {optimizer} B")
