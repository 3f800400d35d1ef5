"""The printed result of a benchmark: a table with a left-aligned first column and notes below
it, and the columns and notes the parallel benchmarks share."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


def print_table(columns: Sequence[str], rows: Sequence[Sequence[str]], notes: list[str]) -> None:
    """A left-aligned first column, right-aligned others, then the notes."""
    widths = [max(len(str(x)) for x in col) for col in zip(columns, *rows)]

    def line(cells: Sequence[str]) -> str:
        first, *rest = cells
        return "  ".join(
            [f"{first:<{widths[0]}}", *(f"{c:>{w}}" for c, w in zip(rest, widths[1:]))]
        )

    print(line(columns))
    print("-" * len(line(columns)))
    for row in rows:
        print(line(row))
    print()
    for note in notes:
        print(note)


def time_ratio(row: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """megalite step time / its torch reference's ('ref' for references themselves)."""
    if row["reference"] is None:
        return "ref"
    ref = next((r for r in rows if r["name"] == row["reference"]), None)
    return "-" if ref is None else f"{row['step_s'] / ref['step_s']:.2f}"


COMMON_COLUMNS = ["implementation", "step ms", "min ms", "tokens/s", "ratio m/t", "loss"]


def common_cells(row: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """implementation, step ms (median), min ms, tokens/s, ratio, last loss."""
    return [
        row["name"],
        f"{row['step_s'] * 1e3:.1f}",
        f"{row['min_s'] * 1e3:.1f}",
        f"{row['tokens_s']:,.0f}",
        time_ratio(row, rows),
        f"{row['loss_last']:.3f}",
    ]


def common_notes(args: argparse.Namespace, world_size: int, tokens: int) -> list[str]:
    """What the parallel benchmarks measured and how to read the common columns."""
    return [
        f"fp32 CPU, {world_size} gloo ranks x 1 thread; {tokens} tokens/step "
        f"(micro-batch {args.micro_batch} x seq {args.seq} x {args.microbatches} micro-batches "
        "per replica); model "
        f"{args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab {args.vocab}.",
        f"step ms: median over {args.steps} steps after {args.warmup} warm-up steps, each the "
        "slowest rank's time (min ms: fastest step); contenders interleaved step by step.",
        "ratio m/t = megalite step time / torch step time (<= 1.00: megalite no slower). "
        "loss: the last timed step's (both sides start from different random weights).",
        f"torch side: torch.optim.AdamW ({args.torch_adamw}), clip 1.0, same batches; megalite "
        "pads the vocabulary to a multiple of 128*tp (padded rows' logits masked out of the loss).",
    ]
