"""Pipeline parallelism, pp=2 on two gloo ranks: megalite's interleaved 1F1B against
`torch.distributed.pipelining.ScheduleInterleaved1F1B`.

Both cut the same GPT-2-style model into pp * vpp = 4 chunks (layers split by megalite's
`stage_ranges`, the embedding on the first chunk, final norm + tied LM head + loss on the
last), two chunks per rank (rank r holds chunks r and r + pp), and run m micro-batches per step
(default 8), then clip at 1.0 and take an AdamW step. The torch side wraps `TorchGPT` pieces in
`PipelineStage`s; as megalite does, it sums the gradients of the tied embedding / LM head
copies between the first and last stage, and counts them once in the global gradient norm.

    python tools/bench_pp.py                       # forks its 2 ranks itself
    python tools/bench_pp.py --microbatches 4 --torch-schedule 1f1b
    python tools/bench_pp.py --layers 8 --balance layers  # stages cut by layer count
    torchrun --nproc-per-node 2 tools/bench_pp.py  # same, launched by torchrun
    python -m megalite.benchmarks.pp               # the same, from an installed megalite

Pipeline bubble, two measures, each averaged over the two ranks:
- "p2p wait": time blocked waiting for pipeline messages / compute (the papers' bubble,
  (p - 1) / (v m) for balanced stages). This is megalite's own `StepMetrics.bubble_fraction`
  (receive waits). For torch it is the time spent in
  `torch.distributed.pipelining.schedules._wait_batch_p2p` (a private helper, wrapped for the
  run; every p2p wait of the schedule goes through it, including its final send waits).
- "idle": 1 - compute / schedule wall time, compute being the time inside the chunks' forward
  (including the loss) and backward: megalite's executor times them itself; for torch the
  stages' `forward_one_chunk` / `backward_one_chunk` and the loss function are timed. Wall time
  is the executor's `run` / the schedule's `step`, so it counts p2p bookkeeping as idle too.

If torch's interleaved schedule fails on gloo/CPU, the table says what failed and falls back to
`Schedule1F1B`, then `ScheduleGPipe` (the model cut into pp stages, one per rank), with the row
labelled; `--torch-schedule` picks one directly. On torch 2.13 (CPU build, gloo) all three run.
"""

from __future__ import annotations

import argparse
import time
import traceback
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import pipelining
from torch.distributed.pipelining import schedules as torch_schedules

from megalite.benchmarks import harness
from megalite.benchmarks.table import COMMON_COLUMNS, common_cells, common_notes, print_table
from megalite.benchmarks.torch_gpt import TorchGPT, lm_loss, torch_adamw
from megalite.config import Config
from megalite.launch import run_or_join
from megalite.models.partition import stage_costs, stage_ranges
from megalite.parallel_state import ParallelState, build_parallel_state
from megalite.pipeline.schedule import build_schedule
from megalite.pipeline.simulate import simulate

PP = 2
SCHEDULES = {
    "interleaved": pipelining.ScheduleInterleaved1F1B,
    "1f1b": pipelining.Schedule1F1B,
    "gpipe": pipelining.ScheduleGPipe,
}


class Stopwatch:
    """Seconds spent inside wrapped callables, by kind; reset every step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, kind: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[kind] += time.perf_counter() - start

        return timed


P2P_WAITS = Stopwatch()
"""Every p2p wait of torch's schedules goes through `schedules._wait_batch_p2p`; `worker`
wraps that module-level helper with this stopwatch for the run."""


def bubbles(compute: float, wait: float, wall: float) -> dict[str, float]:
    """p2p wait relative to compute (the papers' (p-1)/(v m), as megalite's metrics report it)
    and the idle share of the schedule's wall time."""
    return {"bubble_wait": wait / compute, "bubble_idle": 1.0 - compute / wall}


# ----------------------------------------------------------------------------- megalite


def pipeline_config(args: argparse.Namespace, vpp: int, schedule: str) -> Config:
    """megalite's config for PP ranks of `vpp` chunks; `--balance layers` cuts the stages by
    layer count (embedding and head weigh nothing), `flops` by their FLOPs (the default)."""
    weights = {"embedding_layer_weight": 0, "head_layer_weight": 0}
    balance = weights if args.balance == "layers" else {}
    return harness.parallel_config(args, 1, tp=1, pp=PP, vpp=vpp, schedule=schedule, **balance)


def megalite_contender(args: argparse.Namespace, ps: ParallelState) -> harness.Contender:
    cfg = pipeline_config(args, args.vpp, "interleaved")
    training = harness.megalite_run(cfg, ps)
    executor_run, record = training.executor.run, {}

    def timed_run(*a, **kw):  # the executor's own compute time, and its wall time
        start = time.perf_counter()
        loss, times = executor_run(*a, **kw)
        record.update(wall=time.perf_counter() - start, compute=times.compute_s)
        return loss, times

    training.executor.run = timed_run
    step = harness.megalite_step(training, args.lr)

    def measured(tokens: torch.Tensor) -> dict[str, float]:
        result = step(tokens)
        idle = bubbles(record["compute"], 0.0, record["wall"])["bubble_idle"]
        return {"loss": result["loss"], "bubble_wait": result["bubble"], "bubble_idle": idle}

    name = f"megalite interleaved 1F1B (vpp={args.vpp})"
    return harness.Contender(name, measured)


# ----------------------------------------------------------------------------- torch


def torch_stages(
    args: argparse.Namespace, kind: str, rank: int
) -> tuple[list[pipelining.PipelineStage], list[TorchGPT]]:
    """This rank's `PipelineStage`s and their modules for schedule `kind`."""
    n_local = args.vpp if kind == "interleaved" else 1
    n_stages = PP * n_local
    # megalite's split; with one stage per rank, megalite's split of PP chunks
    ranges = stage_ranges(pipeline_config(args, n_local, "interleaved" if n_local > 1 else "1f1b"))
    stages, modules = [], []
    for local in range(n_local):
        index = local * PP + rank
        module = TorchGPT(args, ranges[index], embed=index == 0, head=index == n_stages - 1)
        stages.append(pipelining.PipelineStage(module, index, n_stages, torch.device("cpu")))
        modules.append(module)
    return stages, modules


def torch_contender(
    args: argparse.Namespace, kind: str, embedding_group: dist.ProcessGroup
) -> harness.Contender:
    rank = dist.get_rank()
    stages, modules = torch_stages(args, kind, rank)
    watch = Stopwatch()
    for stage in stages:
        stage.forward_one_chunk = watch.wrap("compute", stage.forward_one_chunk)
        stage.backward_one_chunk = watch.wrap("compute", stage.backward_one_chunk)
    loss_fn = watch.wrap("compute", lm_loss)
    schedule_cls = SCHEDULES[kind]
    schedule = schedule_cls(
        stages if kind == "interleaved" else stages[0], args.microbatches, loss_fn=loss_fn
    )
    params = [p for m in modules for p in m.parameters()]
    optimizer = torch_adamw(params, args.lr, args.torch_adamw)
    first = next((m for m in modules if m.embed is not None), None)
    last = next((m for m in modules if m.lm_head is not None), None)
    tied = first.embed.wte.weight if first is not None else last.lm_head.weight
    counted = [p for p in params if last is None or p is not last.lm_head.weight]

    def step(tokens: torch.Tensor) -> dict[str, float]:
        optimizer.zero_grad(set_to_none=True)
        watch.seconds.clear()
        P2P_WAITS.seconds.clear()
        losses: list[torch.Tensor] = []
        start = time.perf_counter()
        if first is not None:
            schedule.step(tokens[:, :-1])
        else:
            schedule.step(target=tokens[:, 1:], losses=losses)
        wall = time.perf_counter() - start
        dist.all_reduce(tied.grad, group=embedding_group)  # tied embedding / LM head copies
        sumsq = sum(p.grad.square().sum() for p in counted if p.grad is not None)
        dist.all_reduce(sumsq)
        coefficient = min(1.0, 1.0 / (sumsq.sqrt().item() + 1e-6))
        for p in params:
            p.grad.mul_(coefficient)
        optimizer.step()
        loss = torch.stack(losses).mean().item() if losses else 0.0
        return {"loss": loss, **bubbles(watch.seconds["compute"], P2P_WAITS.seconds["wait"], wall)}

    label = {
        "interleaved": f"torch ScheduleInterleaved1F1B (vpp={args.vpp})",
        "1f1b": "torch Schedule1F1B (1 stage/rank)",
        "gpipe": "torch ScheduleGPipe (1 stage/rank)",
    }[kind]
    return harness.Contender(label, step)


def first_working_torch(
    args: argparse.Namespace, batch: torch.Tensor, embedding_group: dist.ProcessGroup
) -> tuple[harness.Contender, dict[str, str]]:
    """The first torch schedule that runs a trial step on every rank, and the failures before."""
    kinds = [args.torch_schedule] + [k for k in ("1f1b", "gpipe") if k != args.torch_schedule]
    failures = {}
    for kind in kinds:
        contender, error = None, None
        try:
            contender = torch_contender(args, kind, embedding_group)
            contender.step(batch)
        except Exception:
            error = traceback.format_exc(limit=-4)
        ok = torch.tensor(0.0 if error else 1.0)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item() == 1.0:
            return contender, failures
        failures[kind] = error or "failed on the other rank"
    raise RuntimeError(f"no torch pipeline schedule ran: {failures}")


def worker(args: argparse.Namespace) -> dict:
    """One rank's part: build both contenders, time them interleaved, return rank-local rows."""
    torch.manual_seed(args.seed)
    batches = harness.make_batches(args, args.warmup + args.steps, harness.global_batch(args))
    ps = build_parallel_state(1, PP, torch.device("cpu"))
    megalite = megalite_contender(args, ps)
    torch_schedules._wait_batch_p2p = P2P_WAITS.wrap("wait", torch_schedules._wait_batch_p2p)
    torch_row, failures = first_working_torch(args, batches[0], ps.embedding_group)
    megalite.step(batches[0])  # the same trial step as torch's, so the losses compare
    megalite.reference = torch_row.name
    contenders = [torch_row, megalite]
    harness.measure(contenders, batches, args.warmup)
    return {
        "rows": harness.summary(contenders, harness.global_batch(args) * args.seq),
        "failures": failures,
    }


def options() -> argparse.ArgumentParser:
    """This benchmark's command line."""
    parser = harness.options(__doc__.split("\n\n")[0], microbatches=8)
    parser.add_argument("--vpp", type=int, default=2, help="model chunks per pipeline rank")
    parser.add_argument("--torch-schedule", choices=tuple(SCHEDULES), default="interleaved")
    parser.add_argument(
        "--balance",
        choices=("flops", "layers"),
        default="flops",
        help="cut the stages (both contenders alike) by FLOPs, embedding and head counted, or "
        "by layer count",
    )
    return parser


def run(args: argparse.Namespace) -> dict | None:
    """Measure on PP gloo ranks: {"rows": [...], "failures": {schedule: traceback}} (None on
    the ranks other than 0 under torchrun)."""
    return run_or_join(PP, worker, args, timeout=args.timeout)


def simulated_note(args: argparse.Namespace) -> str:
    """The stages megalite cut (`--balance`) and the idle share the simulator gives them from
    their FLOPs (the last chunk also runs the LM head + loss over the vocabulary)."""
    cfg = pipeline_config(args, args.vpp, "interleaved")
    costs = stage_costs(cfg)
    schedules = [
        build_schedule("interleaved", PP, r, args.microbatches, args.vpp) for r in range(PP)
    ]
    forward, backward = [c.forward for c in costs], [c.backward for c in costs]
    idle = simulate(schedules, PP, args.vpp, forward, backward).bubble_fraction
    layers = ", ".join(f"{r.start}-{r.stop - 1}" for r in stage_ranges(cfg))
    return (
        f"stages cut by {args.balance} (layers per chunk: {layers}); simulated idle share with "
        f"the chunks' FLOPs: {idle:.3f}"
    )


def report(args: argparse.Namespace, result: dict) -> None:
    """Print the table of `run`'s result."""
    rows = result["rows"]
    ideal = (PP - 1) / (args.vpp * args.microbatches + PP - 1)
    table = [
        common_cells(r, rows) + [f"{r['bubble_wait']:.3f}", f"{r['bubble_idle']:.3f}"] for r in rows
    ]
    notes = common_notes(args, PP, harness.global_batch(args) * args.seq)
    notes += [
        "bubble p2p wait = time blocked on pipeline p2p / compute; bubble idle = "
        "1 - compute / schedule wall time; both averaged over the ranks (see the docstring).",
        f"textbook interleaved bubble for pp={PP}, vpp={args.vpp}, m={args.microbatches}, "
        f"equal chunks: (pp-1)/(v*m) = {(PP - 1) / (args.vpp * args.microbatches):.3f} of the "
        f"compute, (pp-1)/(v*m+pp-1) = {ideal:.3f} of the schedule (idle).",
        simulated_note(args),
    ]
    for kind, error in result["failures"].items():
        notes.append(f"torch schedule {kind!r} failed on gloo/CPU; its last frames:\n{error}")
    print_table(COMMON_COLUMNS + ["bubble p2p wait", "bubble idle"], table, notes)


def main(argv: list[str] | None = None) -> None:
    harness.command_line(options(), run, report, argv)


if __name__ == "__main__":
    main()
