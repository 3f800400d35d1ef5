"""Pipeline parallelism, pp=2 on two gloo ranks: megalite's 1F1B, interleaved 1F1B, ZB-H1 and
ZB-V against `torch.distributed.pipelining`'s Schedule1F1B, ScheduleInterleaved1F1B and
ScheduleZBVZeroBubble, in one run.

All cut the same GPT-2-style model into chunks (layers split by megalite's `stage_ranges`, the
embedding on the first chunk, final norm + tied LM head + loss on the last): pp = 2 stages for
1F1B and ZB-H1; pp * vpp = 4 chunks for interleaving (rank r holds chunks r and r + pp) and
for the V schedules (rank r holds chunks r and 2 pp - 1 - r, so rank 0 holds the embedding
and the head). Each runs m micro-batches per step (default 8), then clips at 1.0 and takes an
AdamW step. The torch side wraps `TorchGPT` pieces in `PipelineStage`s; as megalite does, it
sums the gradients of the tied embedding / LM head copies between the first and last stage
(on one rank under ZB-V), and counts them once in the global gradient norm.

    python tools/bench_pp.py                       # forks its 2 ranks itself
    python tools/bench_pp.py --microbatches 4
    python tools/bench_pp.py --layers 8            # 2 layers a chunk: the schedules part ways
    python tools/bench_pp.py --layers 8 --balance layers  # stages cut by layer count
    torchrun --nproc-per-node 2 tools/bench_pp.py  # same, launched by torchrun
    python -m megalite.benchmarks.pp               # the same, from an installed megalite

Pipeline bubble, three measures, the first two averaged over the two ranks:
- "p2p wait": time blocked waiting for pipeline messages / compute (the papers' bubble,
  (p - 1) / (v m) for balanced stages). This is megalite's own `StepMetrics.bubble_fraction`
  (receive waits). For torch it is the time spent in
  `torch.distributed.pipelining.schedules._wait_batch_p2p` (a private helper, wrapped for the
  run; every p2p wait of the schedule goes through it, including its final send waits).
- "idle": 1 - compute / schedule wall time, compute being the time inside the chunks' forward
  (including the loss) and backward (B and W): megalite's executor times them itself; for torch
  the stages' `forward_one_chunk`, `backward_one_chunk` and `backward_weight_one_chunk` and the
  loss function are timed. Wall time is the executor's `run` / the schedule's `step`, so it
  counts p2p bookkeeping as idle too.
- "sim. idle": the idle share the simulator gives megalite's schedule with the chunks' FLOPs
  (forward, B and W: `partition.stage_costs`).

A torch schedule that fails on gloo/CPU gets a row saying so and its last frames below the
table; the megalite rows it was the reference of compare with torch's 1F1B row instead.
"""

from __future__ import annotations

import argparse
import time
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
from megalite.pipeline.schedule import build_schedule, v_shaped, virtual_stage
from megalite.pipeline.simulate import simulate

PP = 2
TORCH = {
    "1f1b": ("torch Schedule1F1B", pipelining.Schedule1F1B, 1),
    "interleaved": ("torch ScheduleInterleaved1F1B", pipelining.ScheduleInterleaved1F1B, None),
    "zb-v": ("torch ScheduleZBVZeroBubble", pipelining.ScheduleZBVZeroBubble, 2),
}
"""torch's schedules by megalite's name of the same order: (row name, class, chunks per rank;
None: --vpp)."""
MEGALITE = {  # kind: (row name, chunks per rank (None: --vpp), torch reference)
    "1f1b": ("megalite 1F1B", 1, "1f1b"),
    "zb-h1": ("megalite ZB-H1", 1, "1f1b"),
    "interleaved": ("megalite interleaved 1F1B", None, "interleaved"),
    "zb-v": ("megalite ZB-V", 2, "zb-v"),
}


def chunks_per_rank(args: argparse.Namespace, chunks: int | None) -> int:
    return args.vpp if chunks is None else chunks


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


def megalite_contender(args: argparse.Namespace, kind: str, ps: ParallelState) -> harness.Contender:
    name, chunks, _ = MEGALITE[kind]
    vpp = chunks_per_rank(args, chunks)
    training = harness.megalite_run(pipeline_config(args, vpp, kind), ps)
    executor_run, record = training.executor.run, {}

    def timed_run(*a, **kw):  # the executor's own compute time, and its wall time
        start = time.perf_counter()
        loss, timed = executor_run(*a, **kw)
        record.update(wall=time.perf_counter() - start, compute=timed.times().compute_s)
        return loss, timed

    training.executor.run = timed_run
    step = harness.megalite_step(training, args.lr)

    def measured(tokens: torch.Tensor) -> dict[str, float]:
        result = step(tokens)
        idle = bubbles(record["compute"], 0.0, record["wall"])["bubble_idle"]
        return {"loss": result["loss"], "bubble_wait": result["bubble"], "bubble_idle": idle}

    contender = harness.Contender(name + (f" (vpp={vpp})" if chunks is None else ""), measured)
    contender.info["simulated_idle"] = simulated_idle(args, kind, vpp)
    return contender


def simulated_idle(args: argparse.Namespace, kind: str, vpp: int) -> float:
    """The idle share the simulator gives megalite's `kind` with the chunks' FLOPs."""
    costs = stage_costs(pipeline_config(args, vpp, kind))
    schedules = [build_schedule(kind, PP, r, args.microbatches, vpp) for r in range(PP)]
    forward, backward = [c.forward for c in costs], [c.backward for c in costs]
    weight = [c.weight for c in costs]
    result = simulate(schedules, PP, vpp, forward, backward, 0.0, weight, v_shaped(kind))
    return result.bubble_fraction


# ----------------------------------------------------------------------------- torch


def torch_stages(
    args: argparse.Namespace, kind: str, rank: int
) -> tuple[list[pipelining.PipelineStage], list[TorchGPT]]:
    """This rank's `PipelineStage`s and their modules for schedule `kind`, placed as megalite
    places its chunks (a loop, or a V for zb-v) and cut as megalite cuts them."""
    n_local = chunks_per_rank(args, TORCH[kind][2])
    n_stages = PP * n_local
    ranges = stage_ranges(pipeline_config(args, n_local, kind))
    stages, modules = [], []
    for local in range(n_local):
        index = virtual_stage(rank, local, PP, v_shaped(kind))
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
        for method in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(stage, method, watch.wrap("compute", getattr(stage, method)))
    loss_fn = watch.wrap("compute", lm_loss)
    name, schedule_cls, _ = TORCH[kind]
    schedule = schedule_cls(stages if len(stages) > 1 else stages[0], args.microbatches, loss_fn)
    params = [p for m in modules for p in m.parameters()]
    optimizer = torch_adamw(params, args.lr, args.torch_adamw)
    first = next((m for m in modules if m.embed is not None), None)
    last = next((m for m in modules if m.lm_head is not None), None)
    counted = [p for p in params if last is None or p is not last.lm_head.weight]

    def sum_tied_copies() -> None:
        """The tied embedding / LM head copies: on one rank (a V), or over the group."""
        if first is not None and last is not None:
            total = first.embed.wte.weight.grad + last.lm_head.weight.grad
            first.embed.wte.weight.grad.copy_(total)
            last.lm_head.weight.grad.copy_(total)
        elif first is not None or last is not None:
            tied = first.embed.wte.weight if first is not None else last.lm_head.weight
            dist.all_reduce(tied.grad, group=embedding_group)

    def step(tokens: torch.Tensor) -> dict[str, float]:
        optimizer.zero_grad(set_to_none=True)
        watch.seconds.clear()
        P2P_WAITS.seconds.clear()
        losses: list[torch.Tensor] = []
        inputs = (tokens[:, :-1],) if first is not None else ()
        targets = dict(target=tokens[:, 1:], losses=losses) if last is not None else {}
        start = time.perf_counter()
        schedule.step(*inputs, **targets)
        wall = time.perf_counter() - start
        sum_tied_copies()
        sumsq = sum(p.grad.square().sum() for p in counted if p.grad is not None)
        dist.all_reduce(sumsq)
        coefficient = min(1.0, 1.0 / (sumsq.sqrt().item() + 1e-6))
        for p in params:
            p.grad.mul_(coefficient)
        optimizer.step()
        loss = torch.stack(losses).mean().item() if losses else 0.0
        return {"loss": loss, **bubbles(watch.seconds["compute"], P2P_WAITS.seconds["wait"], wall)}

    label = name + (f" (vpp={args.vpp})" if TORCH[kind][2] is None else "")
    return harness.Contender(label, step)


def worker(args: argparse.Namespace) -> dict:
    """One rank's part: build every contender, time them interleaved, return rank-local rows."""
    torch.manual_seed(args.seed)
    batches = harness.make_batches(args, args.warmup + args.steps, harness.global_batch(args))
    torch_schedules._wait_batch_p2p = P2P_WAITS.wrap("wait", torch_schedules._wait_batch_p2p)
    ps = build_parallel_state(1, PP, torch.device("cpu"))
    embedding_group = ps.embedding_group
    contenders, references, failures = [], {}, {}
    for kind in TORCH:
        found = harness.trial(lambda k=kind: torch_contender(args, k, embedding_group), batches[0])
        if isinstance(found, str):
            failures[TORCH[kind][0]] = found
        else:
            contenders.append(found)
            references[kind] = found.name
    for kind in MEGALITE:
        megalite = megalite_contender(args, kind, ps)
        megalite.step(batches[0])  # the same trial step as torch's, so the losses compare
        megalite.reference = references.get(MEGALITE[kind][2], references.get("1f1b"))
        contenders.append(megalite)
    harness.measure(contenders, batches, args.warmup)
    return {
        "rows": harness.summary(contenders, harness.global_batch(args) * args.seq),
        "failures": failures,
    }


def options() -> argparse.ArgumentParser:
    """This benchmark's command line."""
    parser = harness.options(__doc__.split("\n\n")[0], microbatches=8)
    parser.add_argument("--vpp", type=int, default=2, help="chunks per rank when interleaved")
    parser.add_argument(
        "--balance",
        choices=("flops", "layers"),
        default="flops",
        help="cut the stages (both contenders alike) by FLOPs, embedding and head counted, or "
        "by layer count",
    )
    return parser


def run(args: argparse.Namespace) -> dict | None:
    """Measure on PP gloo ranks: {"rows": [...], "failures": {row name: traceback}} (None on
    the ranks other than 0 under torchrun)."""
    return run_or_join(PP, worker, args, timeout=args.timeout)


def split(args: argparse.Namespace, vpp: int) -> str:
    """The layers of each of the pp * vpp chunks, as megalite cuts them."""
    ranges = stage_ranges(pipeline_config(args, vpp, "interleaved" if vpp > 1 else "1f1b"))
    return ", ".join(f"{r.start}-{r.stop - 1}" for r in ranges)


def report(args: argparse.Namespace, result: dict) -> None:
    """Print the table of `run`'s result."""
    rows = result["rows"]
    table = [
        common_cells(r, rows)
        + [f"{r['bubble_wait']:.3f}", f"{r['bubble_idle']:.3f}"]
        + [f"{r['simulated_idle']:.3f}" if "simulated_idle" in r else "-"]
        for r in rows
    ]
    for name in result["failures"]:
        table.append([f"{name} (failed, see below)"] + ["-"] * (len(COMMON_COLUMNS) + 2))
    m, vpp = args.microbatches, args.vpp
    notes = common_notes(args, PP, harness.global_batch(args) * args.seq)
    notes += [
        "bubble p2p wait = time blocked on pipeline p2p / compute; bubble idle = "
        "1 - compute / schedule wall time; both averaged over the ranks; sim. idle = the "
        "simulator's idle share for megalite's schedule with the chunks' FLOPs (see the "
        "docstring).",
        f"textbook bubbles for pp={PP}, m={m}, equal F = B = W, as compute shares: 1F1B "
        f"(pp-1)/m = {(PP - 1) / m:.3f}, interleaved (pp-1)/(v m) = {(PP - 1) / (vpp * m):.3f}, "
        f"ZB-H1 (pp-1)/(3m) = {(PP - 1) / (3 * m):.3f}, ZB-V (pp-1)/(6m) = "
        f"{(PP - 1) / (6 * m):.3f} (m >= 2pp-1; `tests/unit/test_schedule.py`).",
        "ratio m/t compares megalite ZB-H1 with torch's 1F1B (torch has no ZB-H1).",
        f"stages cut by {args.balance}, layers per chunk: {split(args, 1)} (pp chunks), "
        f"{split(args, vpp)} (pp x {vpp}), {split(args, 2)} (pp x 2, the V's).",
    ]
    for name, error in result["failures"].items():
        notes.append(f"{name} failed on gloo/CPU; its last frames:\n{error}")
    columns = COMMON_COLUMNS + ["bubble p2p wait", "bubble idle", "sim. idle"]
    print_table(columns, table, notes)


def main(argv: list[str] | None = None) -> None:
    harness.command_line(options(), run, report, argv)


if __name__ == "__main__":
    main()
