"""The activation layout under sequence parallelism: what (batch, seq, hidden) costs against
(seq, batch, hidden), on the TP benchmark's gloo ranks (issue 24, part 3).

megalite keeps activations (b, s, h), as nanoGPT does. Splitting them along dim 1 (each rank a
piece of every sample's sequence) made every SP collective copy at micro-batch b > 1: the
all-gather joined the received shards along dim 1, the reduce-scatter moved its pieces to
dim 0. Megatron keeps (s, b, h), where splitting s gives each rank a contiguous run of tokens
and both are free. megalite's shards are contiguous runs of the b*s tokens too
(`tensor_parallel.mappings`), with no transposes. Two tables:

- one SP all-gather and one reduce-scatter of a micro-batch's activation: megalite's token
  shards of (b, s, h), dim-1 shards of (b, s, h), and dim-0 shards of (s, b, h);
- whole tp 2 + SP training steps at the shipped configs' widths, micro-batch 1 and 8: the time
  the step spends in layout copies of its collectives (`comm.CommObserver.layout_copy`; none
  is expected), beside the step and the tp communication the rank waited for.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from megalite import comm
from megalite.benchmarks import harness
from megalite.benchmarks.table import print_table
from megalite.profiling.step_timing import CommTimer
from megalite.tensor_parallel import mappings

WIDTHS = {"gpt-tiny": (256, 4), "gpt2-124m": (768, 12)}
"""(hidden, heads) of the shipped configs measured in the step table."""
MICRO_BATCHES = (1, 8)


class LayoutCopies(comm.CommObserver):
    """Seconds and count of the copies that move a dim-wise collective's tensor to or from dim 0
    (the ones (s, b, h) would not need)."""

    def __init__(self) -> None:
        self.seconds, self.count = 0.0, 0

    @contextlib.contextmanager
    def layout_copy(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start
            self.count += 1


def collective_layouts(args: argparse.Namespace, ps: Any, repeats: int = 30) -> list[list]:
    """Median ms of one SP all-gather and one reduce-scatter of a micro-batch's activation in
    each layout: (b, s, h) in token shards (megalite), (b, s, h) split on dim 1 (a transposing
    copy before and after each collective once b > 1), (s, b, h) split on dim 0 (Megatron)."""
    b, s, h, tp = args.micro_batch, args.seq, args.hidden, ps.size("tp")
    group = ps.group("tp")
    layouts = {
        "(b, s, h), token shards": (
            (b, s // tp, h),
            lambda shard: mappings.all_gather_sequence(shard, group),
            lambda full: mappings.reduce_scatter_sequence(full, group),
        ),
        "(b, s, h), dim 1": (
            (b, s // tp, h),
            lambda shard: comm.all_gather(shard, group, 1),
            lambda full: comm.reduce_scatter(full, group, 1),
        ),
        "(s, b, h), dim 0": (
            (s // tp, b, h),
            lambda shard: comm.all_gather(shard, group, 0),
            lambda full: comm.reduce_scatter(full, group, 0),
        ),
    }
    rows = []
    for name, (shard_shape, gather, scatter) in layouts.items():
        shard = torch.randn(shard_shape)
        full = gather(shard)
        cells = [name]
        for op in (functools.partial(gather, shard), functools.partial(scatter, full)):
            times = []
            for _ in range(repeats):
                dist.barrier(group=group)
                start = time.perf_counter()
                op()
                times.append(time.perf_counter() - start)
            cells.append(f"{statistics.median(times) * 1e3:.3f}")
        rows.append(cells)
    return rows


def copy_share(args: argparse.Namespace, ps: Any) -> list[dict[str, Any]]:
    """tp 2 + SP steps (one micro-batch each) at every width of WIDTHS and micro-batch of
    MICRO_BATCHES: per step, the median of the step time (slowest rank), of this rank's layout
    copies and of its exposed tp communication, and the copies' count."""
    rows = []
    for name, (hidden, heads) in WIDTHS.items():
        for micro_batch in MICRO_BATCHES:
            sizes = dict(hidden=hidden, heads=heads, micro_batch=micro_batch, microbatches=1)
            sized = argparse.Namespace(**{**vars(args), **sizes})
            cfg = harness.parallel_config(sized, 1, tp=ps.size("tp"), sp=True, pp=1, zero=0)
            step = harness.megalite_step(harness.megalite_run(cfg, ps), args.lr)
            batches = harness.make_batches(sized, args.warmup + args.steps, micro_batch)
            copies, comm_timer = LayoutCopies(), CommTimer.of(ps)
            measured: dict[str, list[float]] = {"step": [], "copies": [], "tp_comm": []}
            with comm.observe(copies), comm.observe(comm_timer):
                for i, tokens in enumerate(batches):
                    copies.seconds = copies.count = 0
                    elapsed, _ = harness.timed(functools.partial(step, tokens))
                    tp_comm = comm_timer.step_totals()["tp_comm_exposed"]
                    if i >= args.warmup:
                        measured["step"].append(elapsed)
                        measured["copies"].append(copies.seconds)
                        measured["tp_comm"].append(tp_comm)
            row = {key: statistics.median(values) for key, values in measured.items()}
            rows.append({"width": name, "micro_batch": micro_batch, "count": copies.count, **row})
    return rows


def report(args: argparse.Namespace, collectives: list[list], steps: list[dict]) -> None:
    """Print both tables."""
    b, s, h = args.micro_batch, args.seq, args.hidden
    print_table(
        ["SP collective layout", "all-gather ms", "reduce-scatter ms"],
        collectives,
        [f"fp32 activation of one micro-batch, b={b} s={s} h={h}, over 2 gloo ranks; median."],
    )
    cells = [
        [
            f"{r['width']} (h={WIDTHS[r['width']][0]})",
            str(r["micro_batch"]),
            f"{r['step'] * 1e3:.1f}",
            f"{r['tp_comm'] * 1e3:.1f}",
            f"{r['copies'] * 1e3:.2f}",
            f"{r['copies'] / r['step']:.1%}",
            str(r["count"]),
        ]
        for r in steps
    ]
    print_table(
        ["tp 2 + SP step", "micro-batch", "step ms", "tp comm ms", "copies ms", "share", "copies"],
        cells,
        [
            f"One micro-batch per step, {args.layers} layers, seq {args.seq}, vocab {args.vocab}, "
            "fp32, 2 gloo ranks; medians of the timed steps. tp comm: the tp collectives the "
            "rank waited for; copies: the layout copies of the step's collectives (rank 0), "
            "which token shards leave none of in the SP all-gathers and reduce-scatters."
        ],
    )
