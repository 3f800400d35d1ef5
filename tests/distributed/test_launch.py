"""The test launcher (`run_ranks`): ranks that finish at different times all report."""

import time

import torch.distributed as dist

from megalite.launch import run_ranks


def _late_group() -> int:
    """Rank 1 still creates a process group (through the store) after rank 0 has returned."""
    if dist.get_rank() == 1:
        time.sleep(1.0)
        dist.new_group([1])
    return dist.get_rank()


def test_a_rank_finishing_first_leaves_the_store_to_the_others():
    assert run_ranks(2, _late_group, timeout=30) == [0, 1]
