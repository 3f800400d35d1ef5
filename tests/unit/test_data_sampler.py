"""The global batch order: deterministic, seed-dependent only, and exactly resumable."""

import json

import pytest
import torch

from megalite.data import DataError, GlobalBatchSampler


def take(sampler: GlobalBatchSampler, n: int) -> list[list[int]]:
    """The window indices of the next n batches of a one-corpus sampler."""
    batches = [sampler.next_batch() for _ in range(n)]
    assert all(corpus == 0 for batch in batches for corpus, _ in batch)
    return [[window for _, window in batch] for batch in batches]


def test_epochs_are_permutations_and_batches_tile_the_stream():
    n, g = 10, 4
    batches = take(GlobalBatchSampler(n, g, seed=0), 5)  # 20 items: exactly two epochs
    stream = [i for b in batches for i in b]
    assert all(len(b) == g for b in batches)
    assert sorted(stream[:n]) == list(range(n)) and sorted(stream[n:]) == list(range(n))
    assert stream[:n] != stream[n:]  # each epoch is reshuffled
    # Batch 2 straddles the epoch boundary: the end of epoch 0, then the start of epoch 1.
    assert batches[2] == stream[8:12]


def test_batches_larger_than_the_dataset_span_several_epochs():
    (batch,) = take(GlobalBatchSampler(3, 7, seed=5), 1)
    assert len(batch) == 7 and sorted(batch[:6]) == [0, 0, 1, 1, 2, 2]
    assert batch[6] in (0, 1, 2)  # the first window of the third epoch


def test_order_depends_only_on_seed_batch_size_and_num_windows():
    reference = take(GlobalBatchSampler(100, 8, seed=1), 30)
    torch.manual_seed(999)  # the global RNG plays no part
    torch.randn(10)
    assert take(GlobalBatchSampler(100, 8, seed=1), 30) == reference
    assert take(GlobalBatchSampler(100, 8, seed=2), 30) != reference
    # The same stream cut into batches of another size.
    stream = [i for b in reference for i in b]
    assert [i for b in take(GlobalBatchSampler(100, 16, seed=1), 15) for i in b] == stream


def test_plain_state():
    sampler = GlobalBatchSampler(10, 4, seed=0)
    take(sampler, 3)
    state = sampler.state_dict()
    assert state == {
        "consumed_samples": 12,
        "num_windows": [10],
        "weights": [1.0],
        "global_batch_size": 4,
        "seed": 0,
    }
    assert json.loads(json.dumps(state)) == state  # stored in the checkpoint's JSON manifest


def test_state_from_before_blends_resumes():
    """Checkpoints written before blends stored one corpus's size as a plain number."""
    old = {"consumed_batches": 2, "num_windows": 10, "global_batch_size": 4, "seed": 0}
    resumed = GlobalBatchSampler(10, 4, seed=0)
    resumed.load_state_dict(old)
    assert take(resumed, 2) == take(GlobalBatchSampler(10, 4, seed=0), 4)[2:]


@pytest.mark.parametrize("consumed", [3, 5, 8, 12], ids=["mid-epoch", "straddle", "at-end", "e2"])
def test_resume_gives_exactly_the_following_batches(consumed):
    n, g = 20, 8  # 2.5 batches per epoch: boundaries fall inside batches and between them
    full = take(GlobalBatchSampler(n, g, seed=7), consumed + 10)
    first = GlobalBatchSampler(n, g, seed=7)
    take(first, consumed)
    resumed = GlobalBatchSampler(n, g, seed=7)
    resumed.load_state_dict(first.state_dict())
    assert take(resumed, 10) == full[consumed:]


def test_resume_rejects_a_different_order():
    state = GlobalBatchSampler(20, 8, seed=7).state_dict()
    with pytest.raises(DataError, match=r"num_windows=\[20\] but this run has num_windows=\[21\]"):
        GlobalBatchSampler(21, 8, seed=7).load_state_dict(state)
    with pytest.raises(DataError, match="seed=7 but this run has seed=8"):
        GlobalBatchSampler(20, 8, seed=8).load_state_dict(state)


@pytest.mark.parametrize("before, after", [(8, 12), (8, 4), (6, 20)])
def test_a_resume_with_another_batch_size_continues_the_stream_at_the_consumed_window(
    before, after
):
    """A batch-size ramp (or a smaller batch on fewer GPUs): the rest of the same stream, cut
    into batches of the new size, from the first window the old batches did not consume
    (Megatron-LM's consumed samples); nothing skipped, nothing seen twice."""
    n, consumed = 20, 5  # 40 or 30 windows: boundaries of epochs fall inside the batches
    first = GlobalBatchSampler(n, before, seed=7)
    seen = [w for b in take(first, consumed) for w in b]
    resumed = GlobalBatchSampler(n, after, seed=7)
    resumed.load_state_dict(first.state_dict())
    rest = [w for b in take(resumed, 6) for w in b]
    stream = [w for b in take(GlobalBatchSampler(n, 1, seed=7), len(seen) + len(rest)) for w in b]
    assert seen + rest == stream


def test_state_that_counted_batches_resumes_at_their_windows():
    """Checkpoints from before batch-size changes stored the count of batches consumed."""
    old = {"consumed_batches": 3, "num_windows": [10], "global_batch_size": 4, "seed": 0}
    resumed = GlobalBatchSampler(10, 6, seed=0)
    resumed.load_state_dict(old)
    stream = [w for b in take(GlobalBatchSampler(10, 6, seed=0), 4) for w in b]
    assert [w for b in take(resumed, 2) for w in b] == stream[12:24]
