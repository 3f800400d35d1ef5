"""The ZeRO parameter all-gather overlaps the next step's forward, early layers first: after the
optimizer step one asynchronous all-gather per bucket is issued in the order the forward uses
them (embedding first, head last), the step returns with them in flight, and the next forward
waits for each bucket only when the first module using it runs, so layer 0 computes before the
head's parameters were waited for. Evaluation, checkpoints and the end of training see every
gather finished (the equivalence tests of zero 1 and 2 check the values)."""

import pytest
import torch
from equivalence import TINY

from megalite import comm
from megalite.config import load_config
from megalite.launch import run_ranks
from megalite.parallel_state import build_parallel_state
from megalite.training.setup import build_run
from megalite.training.step import train_step


def _record_step_boundary(zero: int) -> tuple[list[tuple], int]:
    """Two training steps with the gathers, the waits and the start of the forwards logged."""
    overrides = [*TINY, "model.arch=gpt", "parallel.bucket_mb=0.05", f"parallel.zero={zero}"]
    cfg = load_config(None, overrides)
    ps = build_parallel_state(1, 1, torch.device("cpu"))
    run = build_run(cfg, ps)
    (buffer,) = run.buffers
    chunk = run.chunks[0]
    index_of = {id(b): i for i, b in enumerate(buffer.buckets)}
    by_address = {
        buffer.params_flat[b.start : b.end].data_ptr(): i for i, b in enumerate(buffer.buckets)
    }
    log: list[tuple] = []

    real_gather, real_wait = comm.all_gather_flat, buffer.wait_param_gather

    def gather(output, shard, group, async_op=False):
        log.append(("issue", by_address[output.data_ptr()]))
        return real_gather(output, shard, group, async_op)

    def wait(bucket):
        if bucket.gather is not None:
            log.append(("wait", index_of[id(bucket)]))
        real_wait(bucket)

    comm.all_gather_flat, buffer.wait_param_gather = gather, wait
    chunk.register_forward_pre_hook(lambda *_: log.append(("forward",)), prepend=True)
    chunk.layers["0"].register_forward_pre_hook(lambda *_: log.append(("layer 0",)))
    torch.manual_seed(ps.coord("dp"))
    for step in (1, 2):
        train_step(run, torch.randint(0, 500, (4, 33)), 1e-3)
        log.append(("step done", step))
    run.optimizer.finish_param_gather()
    assert all(bucket.gather is None for bucket in buffer.buckets)
    comm.all_gather_flat = real_gather
    return log, len(buffer.buckets)


@pytest.mark.parametrize("zero", [1, 2])
def test_gathers_overlap_the_next_forward_early_layers_first(zero):
    log, buckets = run_ranks(2, _record_step_boundary, zero)[0]
    assert buckets > 3
    step_one = log[: log.index(("step done", 1))]
    step_two = log[log.index(("step done", 1)) : log.index(("step done", 2))]
    forward_order = list(reversed(range(buckets)))  # buckets are laid out in backward order
    assert [e[1] for e in step_one if e[0] == "issue"] == forward_order, "issued early first"
    assert [e for e in step_one if e[0] == "wait"] == [], "step 1 returns with them in flight"
    waits = [e[1] for e in step_two if e[0] == "wait"]
    assert waits == forward_order, "each waited for by the first forward that uses it"
    first_forward = step_two.index(("forward",))
    assert step_two.index(("wait", forward_order[0])) > first_forward
    assert step_two.index(("layer 0",)) < step_two.index(("wait", forward_order[-1])), (
        "layer 0 must compute before the last bucket (the head's) was waited for"
    )


class _LandsOnWait:
    """An all-gather as NCCL runs it for the host: its output holds the gathered parameters
    only once the work is waited on (here: NaN until then, so a read too early shows)."""

    def __init__(self, output: torch.Tensor, gathered: torch.Tensor) -> None:
        self.output, self.gathered = output, gathered

    def wait(self) -> bool:
        self.output.copy_(self.gathered)
        return True


def _losses(arch: tuple[str, ...], zero: int, lazy: bool) -> list[float]:
    overrides = [*TINY, *arch, "parallel.bucket_mb=0.05", f"parallel.zero={zero}"]
    run = build_run(load_config(None, overrides), build_parallel_state(1, 1, torch.device("cpu")))
    real_gather = comm.all_gather_flat

    def gather(output, shard, group, async_op=False):
        gathered = torch.empty_like(output)
        real_gather(gathered, shard, group)
        if not async_op:
            return output.copy_(gathered)
        output.fill_(float("nan"))
        return _LandsOnWait(output, gathered)

    if lazy:
        comm.all_gather_flat = gather
    try:
        generator = torch.Generator().manual_seed(run.ps.coord("dp"))
        return [
            train_step(run, torch.randint(0, 500, (4, 33), generator=generator), 1e-3).loss
            for _ in range(3)
        ]
    finally:
        comm.all_gather_flat = real_gather


GPT = ("model.arch=gpt",)
LLAMA = ("model.arch=llama", "model.n_kv_heads=2")
MIXTRAL = ("model.arch=mixtral", "model.n_kv_heads=2", "model.moe_experts=4")


@pytest.mark.parametrize(
    "arch,zero",
    [
        *((arch, zero) for zero in (1, 2, 3) for arch in (GPT, LLAMA)),
        *(((*MIXTRAL, "model.moe_shared_experts=1"), zero) for zero in (1, 2)),
    ],
    ids=[
        *(f"{a}-zero{z}" for z in (1, 2, 3) for a in ("gpt", "llama")),
        "mixtral-zero1",
        "mixtral-zero2",
    ],
)
def test_every_parameter_is_waited_for_before_it_is_read(arch, zero):
    """Modules that hold parameters other modules read (MoE's expert weights) included: with
    gathers that land only when waited on, the losses are those of gathers that land at once.
    Under ZeRO-3 these are every unit's gathers, for its forward and again for its backward
    (zero 3 refuses MoE models)."""
    now = run_ranks(2, _losses, arch, zero, False)
    on_wait = run_ranks(2, _losses, arch, zero, True)
    assert on_wait == now and all(loss == loss for rank in now for loss in rank)
