"""A run's checkpoint saves, synchronous or asynchronous (`checkpoint.async_save`).

An asynchronous save copies this rank's share of the state into host buffers (`staging.py`),
then writes the files on a background thread while training goes on: a step waits only for the
copy. What finishes a checkpoint is collective (every rank done, rank 0 merges the manifest,
renames the directory into place, points `latest`), and NCCL and gloo collectives are not safe
from a second thread, so that part runs on the main thread, in `finish()`: after the first step
at which every rank has written its files (`finish_if_written`, the check Megatron-LM makes each
step), else at the next save, at the end of training, and before an exit (a preemption handler
calls it too). Until then the checkpoint is a `step_N.tmp` directory, so a crash mid-write
leaves the previous one `latest`.

`torch.distributed.checkpoint.async_save` works the same way (stage to host memory, write on
a thread, its future awaited before the next save), but runs its whole `save` on the thread,
collectives included (the plan gather and the metadata write), which is why torch advises a
process group of its own for it; here the thread does file I/O only. It also writes its own
format. `megalite.benchmarks.checkpoint_save` compares the two."""

from __future__ import annotations

import threading
from pathlib import Path

from megalite import comm
from megalite.checkpoint.staging import HostStaging
from megalite.checkpoint.state import RunState
from megalite.checkpoint.writer import Snapshot, publish, take_snapshot, write_or_error
from megalite.parallel_state import ParallelState


class CheckpointSaver:
    """Saves a run's checkpoints under `root`, keeping the newest `keep`; collective (every
    rank calls `save` after the same steps, and `finish` at the same points)."""

    def __init__(
        self, root: Path, keep: int, tokenizer: Path | None = None, async_save: bool = False
    ) -> None:
        self.root, self.keep, self.tokenizer = Path(root), keep, tokenizer
        self.staging = HostStaging() if async_save else None
        self._pending: tuple[Snapshot, ParallelState, threading.Thread] | None = None
        self._error: Exception | None = None

    @property
    def pending(self) -> bool:
        """Whether a checkpoint is being written in the background, not yet published."""
        return self._pending is not None

    def save(self, state: RunState, good: bool = True) -> Path:
        """Save `state` as the checkpoint of step `state.step`; returns its directory, which
        exists once `finish` has published it (at once for a synchronous save). `good=False`
        marks it bad (saved during a bad-step streak or after a spike): kept, but `latest`,
        auto-resume and pruning go by the newest good one (`sharded.newest_good_checkpoint`)."""
        self.finish()  # the previous save, before its buffers are reused
        snapshot = take_snapshot(self.root, state, self.tokenizer, self.staging, good)
        if self.staging is None:
            return publish(snapshot, state.ps, self.keep, write_or_error(snapshot))
        writer = threading.Thread(
            target=self._write, args=(snapshot,), name=f"checkpoint-{state.step}", daemon=True
        )
        # daemon: a run that dies leaves the write unfinished (a step_N.tmp), never waits on it
        writer.start()
        self._pending = (snapshot, state.ps, writer)
        return snapshot.final

    def finish(self) -> Path | None:
        """Collective, main thread: wait for the background write, then publish it; returns
        the checkpoint published, or None when none was pending. Raises on every rank when any
        rank failed to write (the previous checkpoint stays `latest`)."""
        if self._pending is None:
            return None
        snapshot, ps, writer = self._pending
        self._pending = None
        writer.join()
        error, self._error = self._error, None
        return publish(snapshot, ps, self.keep, error)

    def finish_if_written(self) -> Path | None:
        """Collective, main thread, after each step: publish the background save once every
        rank has written its files, so that a restart loses the steps since it, not since the
        one before; returns the checkpoint published, or None."""
        if self._pending is None:  # alike on every rank: saves are collective
            return None
        if comm.any_rank(self._pending[2].is_alive()):
            return None
        return self.finish()

    def _write(self, snapshot: Snapshot) -> None:
        self._error = write_or_error(snapshot)  # finish() reports it, on every rank
