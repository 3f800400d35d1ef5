"""One run per out_dir at a time. Two runs writing one out_dir would overwrite each other's
checkpoints and interleave metrics.jsonl, so global rank 0 holds an exclusive `flock` on
`<out_dir>/run.lock` for as long as the run lives, with its pid and host written in the file for
the message a second run prints. The kernel drops the lock when the process ends, however it
ends: a run that crashed or was killed never leaves it stuck (its file stays, unlocked), and no
stale-lock clean-up exists to get wrong. (On NFS, Linux emulates flock with POSIX locks, which
the server also releases when the client process dies.)"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from pathlib import Path

from megalite import comm
from megalite.errors import MegaliteError
from megalite.parallel_state import ParallelState

LOCK_FILE = "run.lock"


class RunLockError(MegaliteError):
    """Another run is using the out_dir."""


class RunLock:
    """An exclusive lock on `<out_dir>/run.lock`, held by this process until `release` or its
    end. Taking it again in the process that holds it succeeds (a test or notebook may call
    `train` again after a failed run), since flock would otherwise refuse the process itself.
    The file exists while a run holds it (and after a crash, unlocked: harmless). A run that
    stops early leaves no empty directory behind: on release, the directories the run created
    in the out_dir (checkpoints/ before the first save) go if empty, and so does the out_dir
    if the run created it."""

    _held: dict[Path, RunLock] = {}

    def __init__(self, path: Path, fd: int, created_dir: bool) -> None:
        self.path, self._fd, self._created_dir = path, fd, created_dir
        self._dirs_before = _subdirectories(path.parent)

    @classmethod
    def acquire(cls, out_dir: Path) -> RunLock:
        """Take the lock of `out_dir` now, or raise RunLockError naming the run that holds it."""
        path = (Path(out_dir) / LOCK_FILE).resolve()
        if path in cls._held:
            return cls._held[path]
        created_dir = not path.parent.exists()
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                holder = path.read_text().strip() or "a run that has not written its name yet"
                raise RunLockError(
                    f"another run is using {Path(out_dir)} ({holder}): wait for it to end, "
                    "stop it, or use another train.out_dir"
                ) from None
            if _same_file(fd, path):
                break
            os.close(fd)  # locked a file its holder removed on release: lock the current one
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {started}\n".encode())
        lock = cls._held[path] = cls(path, fd, created_dir)
        return lock

    def release(self) -> None:
        """Let other runs use the out_dir: remove the file (still locked, so that no one takes
        the lock of a removed file, see `acquire`), then unlock."""
        if self._held.pop(self.path, None) is None:
            return
        self.path.unlink(missing_ok=True)
        made = _subdirectories(self.path.parent) - self._dirs_before
        for directory in [*made, *([self.path.parent] if self._created_dir else [])]:
            with contextlib.suppress(OSError):  # not empty: the run wrote something
                directory.rmdir()
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)


def _subdirectories(directory: Path) -> set[Path]:
    return {p for p in directory.iterdir() if p.is_dir()} if directory.is_dir() else set()


def _same_file(fd: int, path: Path) -> bool:
    """Whether `fd` is still the file at `path` (not one removed and re-created since)."""
    try:
        return os.fstat(fd).st_ino == path.stat().st_ino
    except FileNotFoundError:
        return False


def lock_out_dir(out_dir: Path, ps: ParallelState) -> RunLock | None:
    """Collective: global rank 0 takes the lock of `out_dir` (and returns it; the other ranks
    get None); if another run holds it, or the directory cannot be made or locked, every rank
    raises RunLockError, rank 0's saying why."""
    lock, error = None, None
    if ps.rank == 0:
        try:
            lock = RunLock.acquire(out_dir)
        except RunLockError as exc:
            error = exc
        except OSError as exc:  # not a directory, no permission, no flock on this filesystem
            error = RunLockError(
                f"cannot use train.out_dir={out_dir}: {exc.strerror or exc} "
                f"({exc.filename or out_dir}); choose another train.out_dir"
            )
    if comm.any_rank(error is not None):
        echo = RunLockError(
            f"rank 0 cannot take {Path(out_dir)} for this run (it says why): wait for the run "
            "using it to end, or use another train.out_dir"
        )
        echo.same_on_every_rank = True  # rank 0 prints its own message, naming the holder
        raise error or echo
    return lock
