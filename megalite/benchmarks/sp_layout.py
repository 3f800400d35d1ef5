"""The activation layout under sequence parallelism: what (batch, seq, hidden) costs against
(seq, batch, hidden), on the TP benchmark's gloo ranks (issue 24, part 3).

megalite keeps activations (b, s, h), as nanoGPT does, and SP shards dim 1. A dim-wise
collective works on dim 0 of a contiguous tensor, so at micro-batch b > 1 every SP all-gather
joins the shards it received along dim 1 (one copy), and every reduce-scatter moves its input's
pieces to dim 0 (one copy). Megatron keeps (s, b, h), where these are free. Two tables bound
what (s, b, h) could save:

- one SP all-gather and one reduce-scatter of a micro-batch's activation in each layout;
- whole tp 2 + SP training steps at the shipped configs' widths, micro-batch 1 and 8: the time
  the step spends in those layout copies (`comm.CommObserver.layout_copy`), beside the step
  and the tp communication the rank waited for.

The copies are an upper bound of the saving: (s, b, h) needs its own transposes elsewhere
(attention takes (b, heads, s, head_dim)).
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
    """Median ms of one SP all-gather and one reduce-scatter of a micro-batch's activation,
    (batch, seq, hidden) split on dim 1 against (seq, batch, hidden) split on dim 0: the first
    needs a transposing copy before and after each collective once batch > 1, the second none."""
    b, s, h, tp = args.micro_batch, args.seq, args.hidden, ps.tp_size
    rows = []
    for name, shard_shape, dim in (("(b, s, h), dim 1", (b, s // tp, h), 1),
                                   ("(s, b, h), dim 0", (s // tp, b, h), 0)):  # fmt: skip
        shard = torch.randn(shard_shape)
        full = comm.all_gather(shard, ps.tp_group, dim)
        gather = functools.partial(comm.all_gather, shard, ps.tp_group, dim)
        scatter = functools.partial(comm.reduce_scatter, full, ps.tp_group, dim)
        cells = [name]
        for op in (gather, scatter):
            times = []
            for _ in range(repeats):
                dist.barrier(group=ps.tp_group)
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
            cfg = harness.parallel_config(sized, 1, tp=ps.tp_size, sp=True, pp=1, zero=0)
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
            "rank waited for; copies: the (b, s, h) layout copies of the SP all-gathers and "
            "reduce-scatters (rank 0), what (s, b, h) could save at most."
        ],
    )
