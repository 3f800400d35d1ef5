"""Checkpoints that scale: each rank writes only what it holds (its tp piece of the weights on dp
rank 0, the Adam state it owns under ZeRO-1) with no gather over dp, and a checkpoint directory
that not every rank can see stops the run with one clear error."""

import os
from pathlib import Path

import pytest
import torch
from equivalence import TINY

from megalite import comm
from megalite.checkpoint.sharded import CheckpointError
from megalite.checkpoint.writer import check_shared_directory, owned_tensors, save_checkpoint
from megalite.config import load_config
from megalite.data import GlobalBatchSampler
from megalite.launch import run_ranks
from megalite.parallel_state import build_parallel_state
from megalite.tensor_parallel import global_tensors
from megalite.training.loop import run_state
from megalite.training.setup import build_run

LAYOUT = ("parallel.tp=2", "parallel.zero=1", "model.arch=llama", "model.n_kv_heads=2")


def _save(root: str):
    cfg = load_config(None, [*TINY, *LAYOUT])
    ps = build_parallel_state(2, 1, torch.device("cpu"))
    run = build_run(cfg, ps)
    state = run_state(run, GlobalBatchSampler(100, cfg.train.global_batch_size, cfg.train.seed))
    state.step = 1
    files, _ = owned_tensors(state)
    written = {
        kind: sum(
            t.numel() * t.element_size()
            for file, tensors in files.items()
            if file.startswith(kind)
            for t in tensors.values()
        )
        for kind in ("model_", "optim_")
    }
    # What this tp rank saves: its piece of split tensors, replicated ones on tp rank 0 only,
    # tied copies never (their original is saved); fused parameters by part.
    saved = [
        p
        for p in global_tensors(run.named_parameters()).values()
        if p.meta.tied_name is None and (p.meta.tp_split_dim is not None or ps.coord("tp") == 0)
    ]
    elements = sum(p.numel() for p in saved)
    with comm.record_collectives() as log:
        save_checkpoint(Path(root), state, keep=1)
    return ps.coord("tp"), ps.coord("dp"), written, elements, [(r.op, r.bytes) for r in log]


def test_each_rank_saves_only_its_own_shards(tmp_path):
    ranks = run_ranks(4, _save, str(tmp_path))
    for tp_rank in (0, 1):
        mine = [(dp, w, n, ops) for t, dp, w, n, ops in ranks if t == tp_rank]
        elements = mine[0][2]
        for dp_rank, written, _, ops in mine:
            # Only the publish's agreement (a few int64 flags per rank), never a gather over dp.
            assert all(op == "all_reduce" and size <= 8 * 5 for op, size in ops), ops
            # Weights (fp32 here): this rank's tp piece, written once per tp rank by dp rank 0.
            assert written["model_"] == (4 * elements if dp_rank == 0 else 0)
            # Adam state (fp32 master, exp_avg, exp_avg_sq): about half of it on each dp rank.
            assert 0 < written["optim_"] < 0.6 * 12 * elements
        # Between them the dp ranks wrote every element's state exactly once.
        assert sum(written["optim_"] for _, written, _, _ in mine) == 12 * elements


def _check(shared: str, per_rank: str) -> tuple[str, list[str], int]:
    ps = build_parallel_state(1, 1, torch.device("cpu"))
    looked = []  # every stat and listing of the probe: a rank's filesystem work
    stat, listdir = os.stat, os.listdir

    def counted(real):
        def call(path, *args, **kwargs):
            if ".shared-check-" in str(path):
                looked.append(str(path))
            return real(path, *args, **kwargs)

        return call

    os.stat, os.listdir = counted(stat), counted(listdir)
    try:
        check_shared_directory(Path(shared), ps)  # one directory every rank sees: no error
    finally:
        os.stat, os.listdir = stat, listdir
    left = [p.name for p in Path(shared).iterdir()]
    try:
        check_shared_directory(Path(per_rank) / f"node{ps.rank}", ps)
    except CheckpointError as exc:
        return str(exc), left, len(looked)
    return "passed", left, len(looked)


@pytest.mark.parametrize("world_size", [2, 8])
def test_a_directory_not_every_rank_sees_is_refused(tmp_path, world_size):
    """Each rank looks at a few paths, however many ranks there are (looking for every rank's
    marker was W^2 in all); a per-node directory stops every rank with the same error."""
    results = run_ranks(
        world_size, _check, str(tmp_path / "shared"), str(tmp_path / "local"), timeout=60
    )
    for message, left, looked in results:
        assert left == [], "the shared check must leave nothing behind"
        assert looked <= 3, f"{looked} filesystem look-ups on one rank"
        assert "not shared by all ranks" in message and "train.out_dir" in message
        assert f"{world_size - 1} of {world_size} ranks do not see rank 0's files" in message
        assert f"rank 0 does not see {world_size - 1} ranks' files" in message
