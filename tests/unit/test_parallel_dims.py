"""The rank grid as data (`ParallelDims`): coordinates round-trip, tp varies fastest, each axis's
groups partition the world, combined groups are unions along their axes, dp is derived with the
error that names the fix, and an axis inserted by name (cp, as context parallelism will add it)
needs no new formula."""

import pytest
import torch

from megalite.config import ConfigError
from megalite.parallel_dims import ParallelDims
from megalite.parallel_state import ParallelState, layout_change

# (world size, tp, pp): pure dp, pure tp, pure pp, and mixed layouts
LAYOUTS = [(4, 1, 1), (4, 4, 1), (4, 1, 4), (8, 2, 2), (12, 2, 3), (24, 2, 3)]
WITH_CP = ("tp", "cp", "dp", "pp")  # Megatron's "tp-cp-dp-pp"


def _grids() -> list[ParallelDims]:
    return [ParallelDims.for_world(w, tp=tp, pp=pp) for w, tp, pp in LAYOUTS] + [
        ParallelDims.for_world(16, order=WITH_CP, tp=2, cp=2, pp=2)
    ]


def _name(dims: ParallelDims) -> str:
    return "-".join(f"{axis}{size}" for axis, size in dims.sizes.items())


@pytest.mark.parametrize("dims", _grids(), ids=_name)
def test_coordinates_round_trip_and_stay_in_range(dims):
    for rank in range(dims.world_size):
        coords = dims.coords(rank)
        assert all(0 <= coords[axis] < size for axis, size in dims.sizes.items())
        assert dims.rank_of(**coords) == rank


@pytest.mark.parametrize("world_size,tp,pp", LAYOUTS)
def test_tp_varies_fastest_then_dp_then_pp(world_size, tp, pp):
    """Megatron's order: `rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank`."""
    dims = ParallelDims.for_world(world_size, tp=tp, pp=pp)
    dp = world_size // (tp * pp)
    assert list(dims.sizes) == ["tp", "cp", "dp", "pp"] and dims.sizes["dp"] == dp
    assert dims.sizes["cp"] == 1
    for rank in range(world_size):
        c = dims.coords(rank)
        assert rank == c["pp"] * (dp * tp) + c["dp"] * tp + c["tp"]
    assert [dims.span(axis) for axis in ("tp", "dp", "pp")] == [tp, tp * dp, world_size]


@pytest.mark.parametrize("dims", _grids(), ids=_name)
def test_each_axis_partitions_the_world_into_groups_along_it(dims):
    for axis, size in dims.sizes.items():
        groups = dims.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(dims.world_size))
        assert len(groups) == dims.world_size // size
        for group in groups:
            assert len(group) == size and group == sorted(group)
            assert [dims.coords(r)[axis] for r in group] == list(range(size))
            others = {tuple(v for a, v in dims.coords(r).items() if a != axis) for r in group}
            assert len(others) == 1  # the group differs along `axis` alone
            assert all(dims.group_of(r, axis) == group for r in group)


def test_combined_groups_are_the_unions_along_their_axes():
    """dp x cp (gradients, once context parallelism exists) and tp x pp (one model copy)."""
    dims = ParallelDims.for_world(16, order=WITH_CP, tp=2, cp=2, pp=2)
    assert dims.sizes == {"tp": 2, "cp": 2, "dp": 2, "pp": 2}
    dp_cp = dims.groups("dp", "cp")
    assert dp_cp == dims.groups("cp", "dp")  # a set of axes, whatever order they are named in
    assert dp_cp == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    for group in dp_cp:
        assert group == sorted({r for m in group for r in dims.group_of(m, "dp")})
    assert dims.groups("tp", "pp") == dims.named_groups()["model_parallel"]
    assert dims.groups("tp", "cp", "dp", "pp") == [list(range(16))]


def test_named_groups_in_creation_order():
    """Each axis (fastest first), the weight axes together, the replicas (dp x cp), then the
    embedding pairs: the first and last stage of each pipeline."""
    dims = ParallelDims.for_world(8, tp=2, pp=4)
    singles = [[r] for r in range(8)]
    assert dims.named_groups() == {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "cp": singles,
        "dp": singles,
        "pp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "model_parallel": [list(range(8))],
        "dp_cp": singles,
        "embedding": [[0, 6], [1, 7]],
    }
    assert list(ParallelDims.for_world(16, order=WITH_CP, tp=2, cp=2).named_groups()) == [
        "tp",
        "cp",
        "dp",
        "pp",
        "model_parallel",
        "dp_cp",
        "embedding",
    ]


def test_dp_takes_the_rest_of_the_world():
    assert ParallelDims.for_world(8, tp=2).sizes == {"tp": 2, "cp": 1, "dp": 4, "pp": 1}
    assert ParallelDims.for_world(1).world_size == 1


def test_a_world_the_other_axes_do_not_divide_is_one_clear_error():
    with pytest.raises(ConfigError) as info:
        ParallelDims.for_world(6, tp=2, pp=2)
    assert str(info.value) == (
        "world size 6 is not divisible by tp*pp = 2*2: launch a multiple of 4 processes or "
        "change parallel.tp / parallel.pp"
    )
    with pytest.raises(ConfigError, match=r"tp\*cp\*pp = 2\*3\*1: .* parallel.cp / parallel.pp"):
        ParallelDims.for_world(8, order=WITH_CP, tp=2, cp=3)


def test_dp_is_never_given_and_axes_must_exist():
    with pytest.raises(ValueError):
        ParallelDims.for_world(8, dp=2)
    with pytest.raises(ValueError):
        ParallelDims.for_world(8, xp=2)  # not in the order
    with pytest.raises(ValueError):
        ParallelDims.for_world(8).groups("ep")  # ep is the experts' grid's, not this one's


def test_expert_parallel_ranks_are_carved_out_of_dp():
    """ep 2 in dp 4 (tp 2, 16 ranks with pp 2): the experts' grid is the same ranks with dp
    split into ep (fastest) x edp; its groups are new names, the dense grid is unchanged."""
    dims = ParallelDims.for_world(16, ep=2, tp=2, pp=2)
    plain = ParallelDims.for_world(16, tp=2, pp=2)
    assert dims.sizes == plain.sizes and dims.layout() == {**plain.layout(), "ep": 2}
    experts = dims.expert_dims
    assert experts.sizes == {"tp": 2, "cp": 1, "ep": 2, "edp": 2, "pp": 2}
    assert experts.weight_axes == ("tp", "ep", "pp")
    for rank in range(16):
        dense, expert = dims.coords(rank), experts.coords(rank)
        assert dense["dp"] == expert["edp"] * 2 + expert["ep"]
        assert (dense["tp"], dense["pp"]) == (expert["tp"], expert["pp"])
    named = dims.named_groups()
    assert named["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert named["expert_dp"][0] == [0, 4]  # the same experts: same tp, ep and pp
    assert named["dp"] == plain.named_groups()["dp"]
    assert "ep" not in plain.named_groups()
    with pytest.raises(ConfigError, match="parallel.ep=3 does not divide"):
        ParallelDims.for_world(16, ep=3, tp=2, pp=2)


def test_layout_and_labels_spell_the_weight_axes_first():
    dims = ParallelDims.for_world(16, tp=2, pp=2)
    assert list(dims.layout().items()) == [("tp", 2), ("pp", 2), ("dp", 4)]
    assert dims.label(dims.rank_of(tp=1, dp=3), dims.naming_order) == "tp01_pp00_dp03"


def test_a_layout_change_names_the_batch_it_was_saved_with():
    """Resumed on 2 ranks from 4 with another global or micro batch: the line counts the saved
    run's micro-batches with the saved run's batch sizes."""
    dims = ParallelDims.for_world(2)
    ps = ParallelState(dims, 0, torch.device("cpu"))
    saved = ParallelDims.for_world(4).layout()
    assert layout_change(saved, ps, (8, 2), (8, 2)) == (
        "world size 4 -> 2: layout tp 1 pp 1 dp 4 -> tp 1 pp 1 dp 2, the same global batch of 8 "
        "as 1 -> 2 micro-batches of 2 per data-parallel rank"
    )
    assert layout_change(saved, ps, (8, 2), (16, 4)) == (
        "world size 4 -> 2: layout tp 1 pp 1 dp 4 -> tp 1 pp 1 dp 2, a global batch of 8 -> 16 "
        "as 1 micro-batches of 2 -> 2 micro-batches of 4 per data-parallel rank"
    )
    assert layout_change(dims.layout(), ps, (8, 2), (16, 2)) is None
