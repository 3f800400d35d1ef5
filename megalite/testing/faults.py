"""Faults a test injects into the trainer: a checkpoint writer that stalls mid-save."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from megalite.checkpoint import writer


def stalling(step: int, seconds: float) -> Callable[[int], None]:
    """A hook for `writer.first_file_written`: the writer of step `step`'s checkpoint sleeps
    `seconds` once its first file is written, long enough to kill it mid-save or to train on
    while it writes."""

    def stall(saved_step: int) -> None:
        if saved_step == step:
            time.sleep(seconds)

    return stall


@contextlib.contextmanager
def stall_save(step: int, seconds: float) -> Iterator[None]:
    """`stalling(step, seconds)` inside the block."""
    hook = stalling(step, seconds)
    writer.first_file_written.append(hook)
    try:
        yield
    finally:
        writer.first_file_written.remove(hook)
