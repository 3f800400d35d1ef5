"""The one exception type users see: every bad input becomes a MegaliteError with a message that
names the problem and the fix, and the CLI turns it into `error: ...` with exit code 2.

Under torchrun every rank runs the CLI, so an error every rank hits would be printed W times,
and unbuffered writes from W processes interleave mid-line. `report_error` prints each line with
one write, and an error that is the same on every rank once, by global rank 0; a rank-specific
one names its rank. Nothing here imports torch: config errors come before it is loaded."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from datetime import timedelta

RANK0_ERROR_KEY = "megalite/error/rank0"
"""Where global rank 0 leaves its error line in the job's store, for the others to compare."""
GRACE_S = 2.0
"""How long a rank other than 0 waits for rank 0's error before deciding its own is its own;
also how long it stays up so that rank 0 prints before torchrun's agent stops the job."""


class MegaliteError(Exception):
    """A user-facing error: bad config, bad data, bad checkpoint, impossible layout."""

    same_on_every_rank: bool = False
    """True where every rank raises it with the message global rank 0 prints (it follows from
    the command line, the config and the world size alone, or echoes rank 0's failure): the
    other ranks print nothing."""


class ConfigError(MegaliteError):
    """A config value or key is wrong, or the layout does not fit the world; the message says
    which and how to fix it."""

    same_on_every_rank = True  # from the command line, the config file and the world size


def print_line(text: str) -> None:
    """`text` on stderr as one line, in one write: lines of several ranks never run together."""
    sys.stderr.write(" ".join(text.splitlines()) + "\n")
    sys.stderr.flush()


def report_error(error: MegaliteError) -> None:
    """Print `error: ...` once for the job: by global rank 0 when every rank hits it, else by
    each rank that hits it, naming the rank."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    line = f"error: {error}"
    if world_size == 1:
        print_line(line)
        return
    store = _job_store()
    if rank == 0:
        print_line(line)
        if store is not None:
            with contextlib.suppress(RuntimeError):  # the store is gone: the others say theirs
                store.set(RANK0_ERROR_KEY, line)
        return
    if error.same_on_every_rank:
        time.sleep(GRACE_S)  # rank 0 prints it; an early exit here would get rank 0 stopped
    elif store is None or _rank0_error(store) != line:
        print_line(f"error: rank {rank}: {error}")


def _job_store() -> object | None:
    """The joined world's store, or None before the world is joined (torch maybe not loaded)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    store = dist.distributed_c10d._get_default_store().clone()
    store.set_timeout(timedelta(seconds=GRACE_S))
    return store


def _rank0_error(store: object) -> str | None:
    """Rank 0's error line, if it reports one within GRACE_S."""
    try:
        return store.get(RANK0_ERROR_KEY).decode()
    except RuntimeError:  # rank 0 did not fail (or the store is gone): this error is our own
        return None
