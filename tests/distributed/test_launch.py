"""The test launcher (`run_ranks`): ranks that finish at different times all report."""

import gc
import threading
import time

import torch.distributed as dist
from tqdm import TMonitor, tqdm

from megalite.launch import run_ranks


def _late_group() -> int:
    """Rank 1 still creates a process group (through the store) after rank 0 has returned."""
    if dist.get_rank() == 1:
        time.sleep(1.0)
        dist.new_group([1])
    return dist.get_rank()


def test_a_rank_finishing_first_leaves_the_store_to_the_others():
    assert run_ranks(2, _late_group, timeout=30) == [0, 1]


def _draw_a_bar() -> int:
    with tqdm(total=2, mininterval=0) as bar:
        bar.update(2)
    return bar.n


def test_no_tqdm_monitor_runs_when_the_ranks_are_forked(monkeypatch):
    """A monitor holding tqdm's lock at the fork would leave a rank's first bar waiting."""
    monkeypatch.setattr(tqdm, "monitor_interval", 10)
    with tqdm(total=1, disable=False) as bar:  # starts a monitor in this process
        bar.update(1)
    assert any(isinstance(t, TMonitor) and t.is_alive() for t in threading.enumerate())
    assert run_ranks(2, _draw_a_bar, timeout=30) == [2, 2]
    assert not any(isinstance(t, TMonitor) and t.is_alive() for t in threading.enumerate())


def _collect_garbage() -> int:
    return gc.collect()


def test_a_store_left_in_a_reference_cycle_is_never_destroyed_in_a_rank():
    """A store server an earlier test left in a cycle (garbage not yet collected) is inherited
    by the forked ranks: collected there, its destructor would join a server thread the rank
    does not have (torch aborts with std::system_error, or the rank hangs)."""
    cycle = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)]
    cycle.append(cycle)
    del cycle
    try:
        run_ranks(2, _collect_garbage, timeout=30)
    finally:
        gc.collect()  # here, where its thread runs
