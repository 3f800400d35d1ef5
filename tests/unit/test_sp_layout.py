"""The activation-layout study of the TP benchmark (benchmarks/sp_layout.py): it counts the
copies that (batch, seq, hidden) costs a dim-wise collective, and measures the shipped widths."""

import pytest
import torch

from megalite import comm
from megalite.benchmarks import sp_layout
from megalite.config import load_config


@pytest.mark.parametrize("name", sorted(sp_layout.WIDTHS))
def test_widths_are_the_shipped_configs(name):
    model = load_config(f"configs/{name}.yaml", []).model
    assert sp_layout.WIDTHS[name] == (model.hidden, model.n_heads)


def test_layout_copies_are_observed_only_when_they_copy(monkeypatch):
    """An all-gather along dim 1 of (b, s, h) receives the shards one per row and joins them
    along dim 1: a copy at b > 1 that an observer sees; at b = 1 (or along dim 0) the join is
    free and nothing is reported. The shard itself is sent as it is."""

    def all_gather_flat(output, shard, *args, **kwargs):
        output.copy_(shard.repeat(2))  # a pretend two-rank gather, done at once: no handle

    monkeypatch.setattr(comm, "all_gather_flat", all_gather_flat)
    monkeypatch.setattr(comm, "size", lambda group: 1 if group is None else 2)
    group = object()
    with comm.observe(sp_layout.LayoutCopies()) as copies:
        comm.all_gather(torch.zeros(1, 4, 8), group, dim=1)
        assert copies.count == 0
        comm.all_gather(torch.zeros(2, 4, 8), group, dim=1)
        comm.all_gather(torch.zeros(4, 2, 8), group, dim=0)  # (s, b, h) on dim 0: free
    assert copies.count == 1  # the shards joined along dim 1, once
    assert copies.seconds > 0
