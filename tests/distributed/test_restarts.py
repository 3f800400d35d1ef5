"""Restarts: a rank killed under `torchrun --max-restarts 1` is restarted with the others, and
the job resumes from its newest complete checkpoint to the very result of an uninterrupted run.
The cause of the restart failures this guards against: torchrun's agent keeps one TCPStore for
the whole job, so restarted ranks met the keys of the ranks they replaced; each start of the
workers now agrees on a generation of its own (`parallel_state.agree_on_generation`)."""

import datetime
import json
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megalite.benchmarks.restarts import TRIAL_CONFIG, kill_one_rank_trial
from megalite.checkpoint.sharded import Checkpoint, resolve_checkpoint
from megalite.config import load_config
from megalite.launch import free_port, run_ranks
from megalite.parallel_state import DistributedStartError, agree_on_generation
from megalite.training.loop import train


def _start(port: int, world_size: int, ranks: range, timeout_s: float = 20.0) -> dict:
    """`ranks` of one start of a job agree on a generation, each rank a thread with its own
    client of the store at `port`, rank 0 last; returns rank -> generation (None: gave up)."""
    agreed: dict[int, int] = {}

    def rank_thread(rank: int) -> None:
        store = dist.TCPStore("127.0.0.1", port, is_master=False)
        if rank == 0:
            time.sleep(0.3)  # the others read the counter first: it is an earlier start's
        try:
            agreed[rank] = agree_on_generation(store, rank, world_size, timeout_s, 0.2)
        except DistributedStartError:
            agreed[rank] = None

    threads = [threading.Thread(target=rank_thread, args=(rank,)) for rank in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 10)  # longer than a rank takes to give up: its verdict counts
    return agreed


@pytest.mark.serial
def test_each_start_agrees_on_a_new_generation_despite_the_keys_of_earlier_ones():
    port = free_port()
    server = dist.TCPStore(  # noqa: F841  (the agent's store: it outlives every start)
        "127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=20)
    )
    assert _start(port, 3, range(3)) == {0: 1, 1: 1, 2: 1}
    # A start whose rank 0 died before drawing a generation: ranks 1 and 2 greet the stale
    # generation 1, whose rank 0 never answers them.
    assert _start(port, 3, range(1, 3), timeout_s=1.0) == {1: None, 2: None}
    # The next start must not take generation 1 (the first start's welcomes name other
    # nonces) and agrees on 2.
    assert _start(port, 3, range(3)) == {0: 2, 1: 2, 2: 2}


def _train(overrides: tuple[str, ...]) -> None:
    train(load_config(None, list(overrides)))


def _final(out_dir: Path) -> tuple[float, dict[str, torch.Tensor]]:
    """The last step's loss in metrics.jsonl and the final checkpoint's weights."""
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    checkpoint = Checkpoint(resolve_checkpoint(out_dir))
    return rows[-1]["loss"], {n: checkpoint.tensor(n) for n in checkpoint.weight_names()}


def test_a_rank_killed_under_torchrun_restarts_and_ends_as_an_uninterrupted_run(
    builtin_corpus, tmp_path
):
    steps, interval = 16, 4
    result = kill_one_rank_trial(tmp_path / "killed", steps=steps, interval=interval, rank=1)
    log = result.log.read_text()
    assert result.recovered, f"exit {result.exit_code}:\n{log[-3000:]}"
    assert result.killed_at_step is not None and result.killed_at_step < steps
    restarted = log.split("(restart 1)")[-1]
    assert "(restart 1)" in log and "left: finished" in restarted, log[-3000:]
    assert f"at step {result.killed_at_step}" in log  # resumed from the checkpoint it had

    plain = tmp_path / "plain"
    run_ranks(4, _train, (*TRIAL_CONFIG, f"train.steps={steps}", f"train.out_dir={plain}"))
    loss, weights = _final(tmp_path / "killed")
    plain_loss, plain_weights = _final(plain)
    assert loss == plain_loss
    assert weights.keys() == plain_weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(tensor, plain_weights[name]), name
