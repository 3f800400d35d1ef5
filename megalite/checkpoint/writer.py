"""Writing a run's state as a checkpoint in the layout `sharded.py` describes: every rank writes
the tensors it holds into a temporary directory, rank 0 merges the per-rank indexes into the
manifest and publishes the directory with a rename, then points `latest` at it.

A save is three phases, so that the middle one can run in the background (`saver.py`):
`take_snapshot` (collective, quick: what to write, copied to host memory when staged),
`write_snapshot` (no collective: the files), `publish` (collective: the manifest, the rename,
`latest`). A kill at any point before the rename leaves only a `step_N.tmp` directory, which no
resume reads and the next run removes (`remove_unfinished`)."""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megalite import comm
from megalite.checkpoint.files import safetensors_chunks, write_atomic
from megalite.checkpoint.sharded import (
    FORMAT,
    LATEST,
    MANIFEST,
    MANIFEST_CHECKSUM,
    UNFINISHED_SUFFIX,
    CheckpointError,
    complete_checkpoints,
    is_good,
    latest_name,
    manifest_checksum,
    newest_good_checkpoint,
    optimizer_file,
    rng_file,
    sharded_weights_file,
    state_name,
    step_dir,
    step_of,
    sum_over_world,
    unfinished_checkpoints,
    weights_file,
)
from megalite.checkpoint.staging import HostStaging
from megalite.checkpoint.state import RunState
from megalite.data.tokenizer import tokenizer_files
from megalite.parallel_state import ParallelState
from megalite.tensor_parallel import ParamMeta, global_tensors


def _entry(meta, pieces: int) -> dict[str, Any]:
    return {
        "global_shape": list(meta.global_shape),
        "real_rows": meta.init_rows,
        "split_dim": meta.tp_split_dim,
        "pieces": pieces,
        "segments": [],
    }


def _saved_name(param: torch.Tensor, name: str, ps: ParallelState) -> str | None:
    """The name `param` is saved under by this rank, or None: a tied copy is saved by its
    original, a tp-replicated tensor by tp rank 0."""
    meta = param.meta
    if meta.tied_name is not None or (meta.placement("tp").kind != "shard" and ps.coord("tp") > 0):
        return None
    return name


def owned_tensors(state: RunState) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, dict]]:
    """What this rank writes, by file: its tp piece of every parameter (dp rank 0; under ZeRO-3
    every replica its owned ranges of them) and the optimizer state of the elements it owns
    (views of the live tensors, on their device); and the manifest entries saying where each
    segment lies. No collective: every rank already holds what it writes."""
    ps, optimizer = state.ps, state.optimizer
    model_file, optim_file = weights_file(ps.dims, ps.rank), optimizer_file(ps.dims, ps.rank)
    files: dict[str, dict[str, torch.Tensor]] = {}
    entries: dict[str, dict] = {}

    def add(key: str, param, file: str, lo: int, tensor: torch.Tensor) -> None:
        split = param.meta.tp_split_dim is not None
        piece, pieces = (ps.coord("tp"), ps.size("tp")) if split else (0, 1)
        entry = entries.setdefault(key.split("@")[0], _entry(param.meta, pieces))
        entry["segments"].append([piece, lo, lo + tensor.numel(), file, key])
        files.setdefault(file, {})[key] = tensor.detach()

    def first(meta: ParamMeta) -> bool:
        """Whether this rank is the first replica of its piece: it writes the piece."""
        return ps.coord(*meta.replica_axes(ps.dims)) == 0

    def weights(meta: ParamMeta) -> str:
        """The file of its piece, named by its view's weight axes: the experts' one per (tp, ep,
        pp) piece, written by the first of cp x edp, the dense weights' by the first of dp x cp."""
        return weights_file(ps.dims.view_of(meta.replica_axes(ps.dims)), ps.rank)

    if optimizer.params_sharded:  # ZeRO-3: no rank holds them whole, each writes what it owns
        shards_file = sharded_weights_file(ps.dims, ps.rank)
        for name, tensor, lo, values in optimizer.owned_weights():
            if _saved_name(tensor, name, ps) is not None:
                add(f"{name}@{lo}", tensor, shards_file, lo, values)
    else:
        for name, tensor in global_tensors(state.params).items():  # fused parameters as parts
            if first(tensor.meta) and _saved_name(tensor, name, ps) is not None:
                add(name, tensor, weights(tensor.meta), 0, tensor)
    for name, tensor in state.routing.items():  # the routing biases: one copy per stage
        if first(tensor.meta) and _saved_name(tensor, name, ps) is not None:
            add(name, tensor, model_file, 0, tensor)
    for name, tensor, lo, _, views in optimizer.owned_pieces(first_copies=True):
        if (optimizer.sharded or first(tensor.meta)) and _saved_name(tensor, name, ps):
            for kind, view in views.items():
                add(f"{state_name(name, kind)}@{lo}", tensor, optim_file, lo, view)
    return files, entries


def check_shared_directory(directory: Path, ps: ParallelState) -> None:
    """Collective. Every rank writes its own files into a checkpoint, and rank 0 publishes it:
    that needs `directory` on a filesystem every node sees. Each rank leaves a marker named by a
    token that rank 0 draws for this launch and looks for rank 0's marker alone, while rank 0
    counts the markers with one listing: a few filesystem operations per rank, not one per rank
    (W^2 in all at W ranks). On a node-local disk the ranks of other nodes miss rank 0's marker
    and rank 0 misses theirs; both counts are summed over the world, so every rank stops with
    the same error."""
    if ps.world_size == 1:
        return
    token = torch.zeros((), dtype=torch.int64, device=ps.device)
    if ps.rank == 0:
        token.fill_(int.from_bytes(os.urandom(6), "little"))
    comm.all_reduce(token, ps.world_group)  # a broadcast: the other ranks add zero
    probe = Path(directory) / f".shared-check-{token.item():x}"
    probe.mkdir(parents=True, exist_ok=True)
    marker = probe / f"rank{ps.rank}"
    marker.touch()
    comm.barrier()
    blind = 0 if ps.rank == 0 else int(not (probe / "rank0").is_file())
    unseen = ps.world_size - len(os.listdir(probe)) if ps.rank == 0 else 0
    blind, unseen = sum_over_world([blind, unseen], ps)  # also: every rank has looked
    marker.unlink(missing_ok=True)
    comm.barrier()
    if ps.rank == 0 or blind or unseen:
        shutil.rmtree(probe, ignore_errors=True)
    comm.barrier()  # gone for every rank once this returns
    if blind or unseen:
        raise CheckpointError(
            f"{directory} is not shared by all ranks: {blind} of {ps.world_size} ranks do not "
            f"see rank 0's files there, and rank 0 does not see {unseen} ranks' files. Put "
            "train.out_dir on a filesystem that every node mounts (NFS, Lustre, ...)"
        )


@dataclass
class Snapshot:
    """One rank's share of a checkpoint, taken after a step: the tensors it writes (by file),
    where each segment lies, and the trainer state, all copies that later steps do not change
    when `staging` made them (so that they can be written while training goes on)."""

    root: Path
    step: int
    files: dict[str, dict[str, torch.Tensor]]
    entries: dict[str, dict]
    head: dict[str, Any]
    """The manifest's fields other than files and tensors (rank 0 writes them)."""
    rank: int
    tokenizer: Path | None

    @property
    def final(self) -> Path:
        return step_dir(self.root, self.step)

    @property
    def tmp_dir(self) -> Path:
        return self.final.with_name(self.final.name + UNFINISHED_SUFFIX)

    @property
    def nbytes(self) -> int:
        """About what this rank writes (headers and indexes aside), for a full disk's error."""
        tensors = sum(t.nbytes for ts in self.files.values() for t in ts.values())
        if self.rank != 0 or self.tokenizer is None:
            return tensors
        return tensors + sum(p.stat().st_size for p in tokenizer_files(self.tokenizer).values())


def take_snapshot(
    root: Path,
    state: RunState,
    tokenizer: Path | None,
    staging: HostStaging | None = None,
    good: bool = True,
) -> Snapshot:
    """Collective: rank 0 clears any earlier attempt at this step's directory, then every rank
    gathers what it writes. With `staging`, every tensor is copied into host buffers that
    training does not touch; without it, CPU tensors are the live ones (write them now).
    `good=False` marks the checkpoint bad (`publish`)."""
    ps = state.ps
    files, entries = owned_tensors(state)
    files[rng_file(ps.rank)] = state.rng.state_dict()
    if staging is not None:
        files = staging.stage(files)
    else:
        files = {f: {key: t.cpu() for key, t in tensors.items()} for f, tensors in files.items()}
    head = {
        "format": FORMAT,
        "step": state.step,
        "good": good,
        "layout": ps.dims.layout(),
        "world_size": ps.world_size,
        "optimizer_step": state.optimizer.step_count,
        "trainer": copy.deepcopy(state.trainer_state()),
    }
    snapshot = Snapshot(Path(root), state.step, files, entries, head, ps.rank, tokenizer)
    if ps.rank == 0:
        shutil.rmtree(snapshot.tmp_dir, ignore_errors=True)
    comm.barrier()
    return snapshot


def write_snapshot(snapshot: Snapshot) -> None:
    """Write one rank's files and its index into the checkpoint's temporary directory. No
    collective, so it may run on a background thread."""
    tmp_dir = snapshot.tmp_dir
    tmp_dir.mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {"files": {}, "tensors": snapshot.entries}
    for i, (file, tensors) in enumerate(snapshot.files.items()):
        index["files"][file] = write_atomic(tmp_dir / file, *safetensors_chunks(tensors))
        if i == 0:
            for hook in first_file_written:
                hook(snapshot.step)
    if snapshot.rank == 0 and snapshot.tokenizer is not None:
        for name, source in tokenizer_files(snapshot.tokenizer).items():
            index["files"][name] = write_atomic(tmp_dir / name, source.read_bytes())
    write_atomic(tmp_dir / index_file(snapshot.rank), json.dumps(index).encode())


def write_or_error(snapshot: Snapshot) -> Exception | None:
    """`write_snapshot`, returning what it raised: `publish` reports it on every rank."""
    try:
        write_snapshot(snapshot)
    except Exception as exc:  # noqa: BLE001 - any failure must reach publish's agreement
        return exc
    return None


def index_file(rank: int) -> str:
    """The index a rank writes beside its files: what it wrote, where each segment lies."""
    return f"index_rank{rank:05d}.json"


first_file_written: list[Callable[[int], None]] = []
"""Called with the step once a save's first file is written: where the tests' fault injection
(`megalite.testing.faults.stall_save`) holds a writer, so that a test can kill it mid-write or
train on while it writes. Empty in every run."""

INDEX_WAIT_S = 5.0
"""How long rank 0 looks again for an index it does not see (a shared filesystem's metadata
can lag behind another node's write) before refusing to publish."""


def publish(
    snapshot: Snapshot, ps: ParallelState, keep: int, error: Exception | None = None
) -> Path:
    """Collective, on the main thread (collectives from another thread are unsafe): once every
    rank has written its share (`error`: what its write raised), rank 0 merges the manifest
    from every rank's index, renames the directory into place, points `latest` at it when it
    is good, and drops the oldest beyond `keep` (never the newest good one). When any rank
    failed to write, or rank 0 misses an index or cannot publish, every rank raises one line
    saying why: the `.tmp` directory is removed, nothing is pruned, `latest` stays as it was."""
    failed, no_space, needed = sum_over_world(
        [int(error is not None), int(_no_space(error)), snapshot.nbytes], ps
    )  # also the barrier: every rank has written
    if failed:
        if ps.rank == 0:
            shutil.rmtree(snapshot.tmp_dir, ignore_errors=True)
        own = f"rank {ps.rank}: {_one_line(error)}" if error else f"{failed} rank(s) failed"
        raise _not_saved(snapshot, own, no_space > 0, needed)
    outcome, trouble = [0] * (ps.world_size + 1), None
    if ps.rank == 0:
        try:
            missing = _write_manifest(snapshot, ps.world_size)
            for rank in missing:
                outcome[rank] = 1
            if not missing:
                _publish(snapshot, keep)
        except OSError as exc:
            outcome[-1], trouble = 1, exc
        if any(outcome):
            shutil.rmtree(snapshot.tmp_dir, ignore_errors=True)
    outcome = sum_over_world(outcome, ps)
    missing = [rank for rank, flag in enumerate(outcome[:-1]) if flag]
    if missing:
        raise CheckpointError(
            f"the checkpoint of step {snapshot.step} was not published: rank 0 found no index "
            f"from rank(s) {missing} in {snapshot.tmp_dir} (their files never reached the "
            f"filesystem rank 0 sees); nothing was pruned and `latest` still names "
            f"{_latest_name(snapshot.root)}. Check that train.out_dir is on a filesystem "
            "every node mounts"
        )
    if outcome[-1]:
        why = f"rank 0: {_one_line(trouble)}" if trouble else "rank 0 could not publish it"
        raise _not_saved(snapshot, why, _no_space(trouble), needed)
    return snapshot.final


def _no_space(error: BaseException | None) -> bool:
    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)


def _one_line(error: BaseException) -> str:
    return " ".join(f"{type(error).__name__}: {error}".split())


def _latest_name(root: Path) -> str:
    return latest_name(root) or "no checkpoint"


def _not_saved(snapshot: Snapshot, why: str, no_space: bool, needed: int) -> CheckpointError:
    """One line for a checkpoint that could not be written: what failed and, for a full disk,
    the space it needs beside the space there is."""
    root, mib = snapshot.root, 2**20
    space = ""
    if no_space:
        free = shutil.disk_usage(root).free if root.is_dir() else 0
        space = f"; it needs {needed / mib:.1f} MiB on {root}, which has {free / mib:.1f} MiB free"
    return CheckpointError(
        f"the checkpoint of step {snapshot.step} was not saved ({why}){space}. Its "
        f"{snapshot.tmp_dir.name} was removed and `latest` still names {_latest_name(root)}: "
        f"free space or fix permissions under {root} and relaunch to continue from it"
    )


def save_checkpoint(
    root: Path, state: RunState, keep: int, tokenizer: Path | None = None, good: bool = True
) -> Path:
    """Collective: every rank calls it after the same step. Saves `state` as the checkpoint of
    step `state.step` under `root`, keeps the newest `keep` (and the newest good one), and
    returns its directory. The tokenizer (sentencepiece model or tokenizer.json) is copied in,
    so a checkpoint alone is enough to generate text. (`saver.CheckpointSaver` also saves in
    the background.)"""
    snapshot = take_snapshot(root, state, tokenizer, good=good)
    return publish(snapshot, state.ps, keep, write_or_error(snapshot))


def _write_manifest(snapshot: Snapshot, world_size: int) -> list[int]:
    """Rank 0: merge every rank's index, each named (a directory listing can miss another
    node's fresh file), into the manifest, checksummed; returns the ranks whose index it does
    not find, after looking again for INDEX_WAIT_S, and then writes nothing."""
    tmp_dir = snapshot.tmp_dir
    indexes: dict[int, dict] = {}
    deadline = time.monotonic() + INDEX_WAIT_S
    while True:
        for rank in range(world_size):
            if rank not in indexes:
                with contextlib.suppress(FileNotFoundError):
                    indexes[rank] = json.loads((tmp_dir / index_file(rank)).read_text())
        if len(indexes) == world_size or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    missing = [rank for rank in range(world_size) if rank not in indexes]
    if missing:
        return missing
    manifest: dict[str, Any] = {**snapshot.head, "files": {}, "tensors": {}}
    for rank in range(world_size):
        index = indexes[rank]
        manifest["files"].update(index["files"])
        for name, entry in index["tensors"].items():
            merged = manifest["tensors"].setdefault(name, {**entry, "segments": []})
            merged["segments"] += entry["segments"]
        (tmp_dir / index_file(rank)).unlink()
    for entry in manifest["tensors"].values():
        entry["segments"].sort()
    _save_manifest(tmp_dir, manifest)
    return []


def _save_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """`manifest` into checkpoint `directory`, with its own checksum, atomically."""
    manifest[MANIFEST_CHECKSUM] = manifest_checksum(manifest)
    write_atomic(directory / MANIFEST, json.dumps(manifest, indent=1).encode())


def _publish(snapshot: Snapshot, keep: int) -> None:
    """Rank 0: rename the complete checkpoint into place, point `latest` at it when it is
    good, drop the oldest complete ones beyond `keep` except the last good states
    (`last_good_states`). Pruning is housekeeping: a failure there is reported, and the new
    checkpoint stays published."""
    root, final = snapshot.root, snapshot.final
    replaced = _set_aside(final) if final.exists() else None
    snapshot.tmp_dir.rename(final)
    if snapshot.head["good"]:
        write_atomic(root / LATEST, final.name.encode())
    try:
        if replaced is not None:
            shutil.rmtree(replaced)
        protected = last_good_states(root)
        for old in complete_checkpoints(root)[:-keep]:
            if old not in protected:
                _discard(old)
    except OSError as exc:
        print(f"warning: checkpoint {final.name} is saved, but pruning failed: {_one_line(exc)}")


def last_good_states(root: Path) -> list[Path]:
    """What pruning keeps whatever `keep` says: the newest good checkpoint, and the newest good
    one before it. The newest holds weights no step has judged yet; should the next steps go
    bad until the run stops, it is demoted (`demote_from`) and the one before it is the last
    good state."""
    newest = newest_good_checkpoint(root)
    if newest is None:
        return []
    before = _newest_good_before(root, step_of(newest))
    return [newest] if before is None else [before, newest]


def adopt_as_latest(root: Path, resumed: Path, ps: ParallelState) -> None:
    """Rank 0: a run resumed by name from a good checkpoint of its own directory (a rewind past
    a corrupt or diverged one) points `latest` at it, so that pruning keeps it as the last good
    state rather than what `latest` named in the run it rewound. The good checkpoints after it
    belong to the run it rewound: they are marked bad (and said so), so that neither pruning
    (the good one before the newest), a fatal streak's demotion nor an auto-resume takes one
    of them for this run's last good state; a resume by name still reads them."""
    root, resumed = Path(root), Path(resumed)
    if ps.rank == 0 and resumed.parent.resolve() == root.resolve() and is_good(resumed):
        complete = complete_checkpoints(root)
        step = step_of(resumed) if resumed.name in {p.name for p in complete} else None
        for path in complete if step is not None else []:  # a step_N directory: later ones
            if step_of(path) > step and is_good(path):
                with contextlib.suppress(OSError, ValueError):  # unreadable: loading refuses it
                    _mark_bad(path)
                    print(
                        f"marked {path} bad: it is newer than {resumed}, which this run rewinds to"
                    )
        write_atomic(root / LATEST, resumed.name.encode())


def demote_from(root: Path, step: int, ps: ParallelState) -> Path | None:
    """Collective in effect (every rank answers alike, rank 0 writes): the checkpoints of `step`
    and later hold the weights a fatal bad-step streak ran with (a bad step skips its update,
    so the streak's first step ran with the weights saved at `step`): mark each bad and point
    `latest` at the newest good checkpoint before them, which is returned (None: there is
    none)."""
    root = Path(root)
    if not root.is_dir():
        return None
    last_good = _newest_good_before(root, step)
    if ps.rank == 0:
        for path in complete_checkpoints(root):
            if step_of(path) >= step and is_good(path):
                with contextlib.suppress(OSError, ValueError):  # unreadable: loading refuses it
                    _mark_bad(path)
        if last_good is not None:
            write_atomic(root / LATEST, last_good.name.encode())
    return last_good


def _mark_bad(path: Path) -> None:
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["good"] = False
    _save_manifest(path, manifest)


def _newest_good_before(root: Path, step: int) -> Path | None:
    """The newest complete checkpoint under `root` saved as good before `step`."""
    good = [p for p in complete_checkpoints(root) if step_of(p) < step and is_good(p)]
    return good[-1] if good else None


def _set_aside(path: Path) -> Path:
    """Rename a step directory to an unfinished name, which no resume reads and the next start
    removes: the first half of discarding it, so a crash midway never leaves a step directory
    without its manifest."""
    doomed = path.with_name(f"{path.name}.discarded{UNFINISHED_SUFFIX}")
    path.rename(doomed)
    return doomed


def _discard(path: Path) -> None:
    """Remove a step directory, set aside first (`_set_aside`)."""
    shutil.rmtree(_set_aside(path))


def remove_unfinished(root: Path, ps: ParallelState) -> list[Path]:
    """Rank 0 deletes the checkpoint directories an earlier run left unfinished (killed or
    preempted mid-save: never renamed into place, so never resumed from) and says so; returns
    them. One that holds its manifest was complete (rank 0 writes it once every rank's files
    are there) and only missed its rename: it is published instead (renamed into place, and
    named by `latest` when good and newer than what `latest` names), unless its step is there
    already. Call it while holding the run lock and before any rank writes a checkpoint."""
    if ps.rank != 0:
        return []
    leftovers = []
    for path in unfinished_checkpoints(Path(root)):
        final = path.with_name(path.name.removesuffix(UNFINISHED_SUFFIX))
        step = final.name.removeprefix("step_")
        if step.isdigit() and (path / MANIFEST).is_file() and not final.exists():
            current = newest_good_checkpoint(root)
            path.rename(final)
            if is_good(final) and (current is None or step_of(final) > step_of(current)):
                write_atomic(Path(root) / LATEST, final.name.encode())
            print(f"published {final}: complete, but an earlier run stopped before its rename")
            continue
        shutil.rmtree(path, ignore_errors=True)
        print(f"removed {path}: an unfinished checkpoint of an earlier run (stopped mid-save)")
        leftovers.append(path)
    return leftovers
