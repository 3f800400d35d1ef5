"""A made-up axis added to the grid in-process, to show which modules have to know about an
axis: a second replica axis, `rdp` (as HSDP's replicate axis will be), between cp and dp.

Only the grid is told about it. Everything downstream asks by placement and by the grid's
views: which axes a parameter is a replica over, the group, size and coordinate that span them,
how ZeRO cuts a bucket over them, which rank writes a piece and the files it writes into.
"""

from __future__ import annotations

import torch
from torch import nn

from megalite.checkpoint.sharded import optimizer_file, weights_file
from megalite.data_parallel.grad_buffer import GradBuffer
from megalite.parallel_dims import ParallelDims
from megalite.parallel_state import ParallelState
from megalite.tensor_parallel.layers import ParamMeta, Placement, constant_init

TOY = {"tp": 2, "cp": 1, "rdp": 2, "dp": 2, "pp": 2}
"""16 ranks: tp 2, the toy axis 2, dp 2, pp 2."""


def _dims(ep: int = 1) -> ParallelDims:
    return ParallelDims(TOY, ep=ep)


def _param(numel: int, **meta: object) -> nn.Parameter:
    param = nn.Parameter(torch.zeros(numel))
    param.meta = ParamMeta((numel,), constant_init(0.0), **meta)
    return param


def test_the_grid_makes_the_new_axis_a_replica_axis_with_its_own_group():
    dims = _dims()
    assert dims.replica_axes == ("cp", "rdp", "dp")
    assert dims.group_axes()["dp_cp"] == ("cp", "rdp", "dp")  # the replicas: one purpose
    named = dims.named_groups()
    assert named["rdp"][0] == [0, 2]  # its own group, created after cp's, before dp's
    assert list(named)[:5] == ["tp", "cp", "rdp", "dp", "pp"]
    assert named["dp_cp"][0] == [0, 2, 4, 6]
    assert dims.group_name(("dp", "rdp", "cp")) == "dp_cp"


def test_placements_put_every_parameter_on_the_new_axis_as_a_replica():
    dims = _dims(ep=2)
    dense, expert = _param(8, tp_split_dim=0), _param(8, expert=True)
    assert dense.meta.placement("rdp").kind == "replicate"
    assert dense.meta.replica_axes(dims) == ("cp", "rdp", "dp")
    assert expert.meta.replica_axes(dims) == ("cp", "rdp", "edp")  # the expert view has it too
    assert dims.views["expert"].weight_axes == ("tp", "ep", "pp")


def test_zero_shards_over_the_new_axis_and_its_first_replica_writes():
    """Each of the 4 replicas of a tp x pp piece owns its own quarter of every bucket; only the
    first writes the weights, into a file named by the weight axes alone (optimizer files by
    every axis of size > 1, the new one too)."""
    dims, owned, writers = _dims(), {}, []
    for rank in range(dims.world_size):
        ps = ParallelState(dims, rank, torch.device("cpu"))
        params = [_param(6, tp_split_dim=0), _param(10)]
        buffer = GradBuffer(params, ps, bucket_numel=1 << 20, shard_optimizer=True)
        assert (buffer.replica_axes, buffer.replica_size) == (("cp", "rdp", "dp"), 4)
        coord = ps.coord(*buffer.replica_axes)
        assert coord == ps.coord("dp") * 2 + ps.coord("rdp")
        owned.setdefault(ps.ranks(*buffer.replica_axes), []).append((coord, buffer.owned_ranges))
        if ps.coord(*params[0].meta.replica_axes(dims)) == 0:
            writers.append((weights_file(dims, rank), optimizer_file(dims, rank)))
    assert len(owned) == 4  # the tp x pp pieces, each held by 4 replicas
    for replicas in owned.values():
        assert sorted(replicas) == [(c, [(4 * c, 4 * c + 4)]) for c in range(4)]
    assert writers[:2] == [
        ("model_tp00_pp00.safetensors", "optim_tp00_pp00_rdp00_dp00.safetensors"),
        ("model_tp01_pp00.safetensors", "optim_tp01_pp00_rdp00_dp00.safetensors"),
    ]
    assert len(writers) == 4


def test_the_expert_view_carries_the_new_axis_too():
    dims = _dims(ep=2)
    assert dims.group_name(("cp", "rdp", "edp")) == "expert_dp"
    assert dims.named_groups()["expert_dp"][0] == [0, 2]  # rdp's ranks: edp is 1
    ps = ParallelState(dims, 5, torch.device("cpu"))  # tp 1, rdp 0, dp 1: ep 1, edp 0
    assert (ps.size("ep"), ps.coord("ep"), ps.size("cp", "rdp", "edp")) == (2, 1, 2)


def test_expert_replicas_are_the_dense_ones_at_ep_1_and_a_group_of_their_own_above():
    """At ep 1 the expert view is the dense grid (edp is dp): the experts' replicas are dp x
    cp's group, and ep has one rank. At ep 2 they are cp x edp's, and ep is a group too."""
    dims = ParallelDims.for_world(8, tp=2)
    assert dims.group_name(("cp", "edp")) == "dp_cp"
    ps = ParallelState(dims, 5, torch.device("cpu"))
    assert ps.group("ep") is None and ps.size("ep") == 1
    dims = ParallelDims.for_world(8, tp=2, ep=2)
    assert (dims.group_name(("edp", "cp")), dims.group_name(("ep",))) == ("expert_dp", "ep")
    ps = ParallelState(dims, 5, torch.device("cpu"))  # tp 1, dp 2: ep 0, edp 1
    assert (ps.size("ep"), ps.coord("ep"), ps.coord("cp", "edp")) == (2, 0, 1)
    assert ps.coord("dp", "cp") == 2
    assert ps.ranks("ep") == (5, 7) and ps.ranks("cp", "edp") == (1, 5)


def test_a_parameter_records_its_placement_along_every_axis_of_its_view():
    dims = ParallelDims.for_world(16, tp=2, pp=2, ep=2)
    norm = ParamMeta((8,), constant_init(1.0), tp_grad_reduce=True)
    head = ParamMeta((8, 4), constant_init(0.0), tp_split_dim=0, pp_tied=True, tied_name="e")
    experts = ParamMeta((8, 4), constant_init(0.0), tp_split_dim=1, expert=True)
    shard, replicate, partial = Placement("shard"), Placement("replicate"), Placement("partial")
    assert norm.placements(dims) == {"tp": partial, "cp": replicate, "dp": replicate, "pp": shard}
    assert head.placements(dims)["tp"] == Placement("shard", 0)
    assert head.placements(dims)["pp"] == partial
    assert experts.placements(dims) == {
        "tp": Placement("shard", 1),
        "cp": replicate,
        "ep": shard,
        "edp": replicate,
        "pp": shard,
    }
