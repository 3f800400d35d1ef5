"""The named parallel axes of a run: their order, sizes, a rank's coordinates and the groups of
any axis or combination of axes, as pure functions of the sizes (testable without processes).

Ranks are laid out as Megatron-LM's `RankGenerator` lays them out: the first axis of the order
varies fastest, each later one strides over all before it. The order is tp-cp-dp-pp, so
`rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank` (tp inside a node, then the
context-parallel ring). dp is the axis nobody configures: it takes what the world leaves,
derived here alone (`for_world`).

Expert parallelism (Megatron-LM's) shards the experts of mixture-of-experts layers over ep
ranks carved out of dp: the same ranks seen as a second grid, `expert_dims`, with dp split into
ep (fastest) times edp. The dense weights keep the grid above (replicated over all of dp); an
expert's weights are sharded over tp, ep and pp and replicated over cp x edp. The two grids
are the named views of the ranks (`views`): a group is asked for by the axes it spans in either
(`group_name`), and a parameter's placements name the axes of its view.

Hybrid sharding (HSDP, torchtitan's `data_parallel_replicate_degree`; Megatron-LM's distributed
optimizer instances) is a third view, `hybrid_dims`: dp split into dp_shard (fastest) times
dp_replicate. ZeRO then shards the dense weights' state over cp x dp_shard and keeps
dp_replicate copies of each shard (`shard_and_replicate`), so its gathers stay within a group
of dp / dp_replicate ranks (a node, or a few) and only the gradients cross the replicas.
Nothing here imports torch, so a layout that cannot run fails before torch is loaded.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass

from megalite.errors import ConfigError

ORDER = ("tp", "cp", "dp", "pp")
"""Every axis, fastest-varying first."""
DERIVED = "dp"
"""The axis whose size is the world size over the others'."""
WEIGHT_AXES = ("tp", "pp")
"""The axes along which ranks hold different pieces of the weights; ranks that differ only on
the others hold the same weights."""
ALWAYS_NAMED = ("tp", "dp", "pp")
"""The axes every checkpoint has spelled its layout and file names with. A later axis (cp) is
named only where it is larger than 1, so a run without it writes what earlier runs wrote and
earlier checkpoints read as the same layout."""


@dataclass(frozen=True)
class ParallelDims:
    """The rank grid: each axis's size, fastest-varying first, and which axes shard the weights.
    Built once per run (`for_world`); everything that needs a rank's place or a group's ranks
    asks it."""

    sizes: Mapping[str, int]
    """Each axis's size, the fastest-varying axis first (a run's: in `ORDER`)."""
    weight_axes: tuple[str, ...] = WEIGHT_AXES
    """The axes that shard the weights (`WEIGHT_AXES` for a run's grid)."""
    ep: int = 1
    """Expert-parallel ranks within each dp group (`expert_dims`)."""
    dp_replicate: int = 1
    """Replicas of each ZeRO shard (HSDP, `hybrid_dims`): dp is dp_shard x dp_replicate."""

    def __post_init__(self) -> None:
        bad = {axis: size for axis, size in self.sizes.items() if size < 1}
        if bad or not set(self.weight_axes) <= set(self.sizes):
            raise ValueError(f"bad grid: sizes {dict(self.sizes)}, weight axes {self.weight_axes}")
        if self.ep > 1 and self.sizes.get(DERIVED, 1) % self.ep:
            raise ConfigError(
                f"parallel.ep={self.ep} does not divide the data-parallel size "
                f"{self.sizes.get(DERIVED, 1)}: expert-parallel ranks are carved out of dp, so "
                f"launch a multiple of {self.ep} data-parallel replicas or lower parallel.ep"
            )
        if self.dp_replicate > 1 and self.sizes.get(DERIVED, 1) % self.dp_replicate:
            raise ConfigError(
                f"parallel.dp_replicate={self.dp_replicate} does not divide the data-parallel "
                f"size {self.sizes.get(DERIVED, 1)}: ZeRO shards within groups of dp / "
                f"dp_replicate ranks, so launch a multiple of {self.dp_replicate} data-parallel "
                "replicas or change parallel.dp_replicate"
            )

    @classmethod
    def for_world(
        cls,
        world_size: int,
        order: tuple[str, ...] = ORDER,
        ep: int = 1,
        dp_replicate: int = 1,
        **sizes: int,
    ) -> ParallelDims:
        """The grid of `world_size` ranks with the given axis sizes (an axis not given: 1), dp
        taking the rest, `ep` expert-parallel ranks within dp and `dp_replicate` replicas of
        each ZeRO shard; the clear error when the other axes do not divide the world, or ep or
        dp_replicate does not divide dp."""
        if DERIVED in sizes or DERIVED not in order or not set(sizes) <= set(order):
            raise ValueError(f"sizes {sizes} must name axes of {order} other than {DERIVED}")
        given = {axis: sizes.get(axis, 1) for axis in order if axis != DERIVED}
        product = math.prod(given.values())
        if world_size % product:
            named = {a: n for a, n in given.items() if a in ALWAYS_NAMED or n > 1}
            raise ConfigError(
                f"world size {world_size} is not divisible by {'*'.join(named)} = "
                f"{'*'.join(map(str, named.values()))}: launch a multiple of {product} processes "
                f"or change {' / '.join(f'parallel.{axis}' for axis in named)}"
            )
        derived = {axis: given.get(axis, world_size // product) for axis in order}
        return cls(derived, ep=ep, dp_replicate=dp_replicate)

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes.values())

    @property
    def naming_order(self) -> tuple[str, ...]:
        """Every axis, the weight axes first: the order in which a layout is spelled
        (`tp 2 pp 1 dp 4`, checkpoint files `optim_tp01_pp00_dp03`)."""
        named = [a for a in self.sizes if a in ALWAYS_NAMED or self.sizes[a] > 1]
        return (*self.weight_axes, *(a for a in named if a not in self.weight_axes))

    def layout(self) -> dict[str, int]:
        """Each axis's size in naming order (and ep, dp_replicate where > 1), as checkpoints
        record the layout that saved them."""
        layout = {axis: self.sizes[axis] for axis in self.naming_order}
        views = {"ep": self.ep, "dp_replicate": self.dp_replicate}
        return layout | {name: size for name, size in views.items() if size > 1}

    def _split_dp(self, fast: str, fast_size: int, slow: str) -> dict[str, int]:
        """The sizes with dp split into `fast` (of `fast_size`) x `slow`, in the grid's order."""
        sizes: dict[str, int] = {}
        for axis, size in self.sizes.items():
            if axis == DERIVED:
                sizes |= {fast: fast_size, slow: size // fast_size}
            else:
                sizes[axis] = size
        return sizes

    @functools.cached_property
    def expert_dims(self) -> ParallelDims:
        """The same ranks as the grid of the experts: dp split into ep (fastest) x edp, the
        weights sharded over tp, ep and pp. A rank's dp coordinate is edp * ep + ep."""
        sizes = self._split_dp("ep", self.ep, "edp")
        return ParallelDims(sizes, weight_axes=(*self.weight_axes[:1], "ep", *self.weight_axes[1:]))

    @functools.cached_property
    def hybrid_dims(self) -> ParallelDims:
        """The same ranks as HSDP's grid: dp split into dp_shard (fastest) x dp_replicate, the
        weights sharded as the dense grid's. A rank's dp coordinate is dp_replicate *
        dp_shard size + dp_shard, as torchtitan's mesh orders them."""
        shard = self.sizes[DERIVED] // self.dp_replicate
        return ParallelDims(self._split_dp("dp_shard", shard, "dp_replicate"), self.weight_axes)

    def shard_and_replicate(
        self, replica_axes: tuple[str, ...]
    ) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The axes ZeRO shards a weight's state over, and those it keeps copies of each shard
        over, for a weight replicated over `replica_axes`: all of them and none, except the
        dense weights under HSDP (cp x dp_shard, and dp_replicate). The experts, replicated over
        cp x edp, shard over all their replicas."""
        if self.dp_replicate == 1 or DERIVED not in replica_axes:
            return replica_axes, ()
        shard = tuple("dp_shard" if axis == DERIVED else axis for axis in replica_axes)
        return shard, ("dp_replicate",)

    @functools.cached_property
    def strides(self) -> dict[str, int]:
        """Per axis, how far apart two ranks are that differ by one along it alone."""
        sizes = list(self.sizes.values())
        return {axis: math.prod(sizes[:i]) for i, axis in enumerate(self.sizes)}

    def span(self, axis: str) -> int:
        """How many consecutive ranks a group of `axis` lies within (stride times size): a
        group whose span fits a node talks over the node's links."""
        return self.strides[axis] * self.sizes[axis]

    def coords(self, rank: int) -> dict[str, int]:
        """`rank`'s coordinate on every axis."""
        return {axis: rank // self.strides[axis] % size for axis, size in self.sizes.items()}

    def rank_of(self, **coords: int) -> int:
        """The rank at these coordinates (an axis not named: coordinate 0)."""
        if not set(coords) <= set(self.sizes):
            raise ValueError(f"coordinates {coords} name axes outside {tuple(self.sizes)}")
        return sum(value * self.strides[axis] for axis, value in coords.items())

    def group_of(self, rank: int, *axes: str) -> list[int]:
        """The ranks that share `rank`'s coordinates except on `axes`, in rank order (the
        pipeline's ranks, indexed by pp rank, for `group_of(rank, "pp")`)."""
        coords = self.coords(rank)
        first = rank - sum(coords[axis] * self.strides[axis] for axis in axes)
        return [first + offset for offset in self._offsets(axes)]

    def groups(self, *axes: str) -> list[list[int]]:
        """The partition of the world into the groups of `axes` (one axis, or several together,
        such as tp x pp for the ranks holding one copy of the model), by first rank."""
        if not axes or not set(axes) <= set(self.sizes):
            raise ValueError(f"axes {axes} must be some of {tuple(self.sizes)}")
        members = self._offsets(axes)
        firsts = self._offsets(tuple(axis for axis in self.sizes if axis not in axes))
        return [[first + offset for offset in members] for first in firsts]

    def _offsets(self, axes: tuple[str, ...]) -> list[int]:
        """How far each rank reached by moving along `axes` alone lies from the start, sorted."""
        steps = [[i * self.strides[axis] for i in range(self.sizes[axis])] for axis in axes]
        return sorted(map(sum, itertools.product(*steps)))

    def embedding_groups(self) -> list[list[int]]:
        """The first and last stage of each pipeline: they hold the tied embedding's copies."""
        return [sorted({g[0], g[-1]}) for g in self.groups("pp")]

    @property
    def replica_axes(self) -> tuple[str, ...]:
        """The axes along which ranks hold the same weights (dp, cp): their gradients are summed
        over these together, and ZeRO shards the optimizer over them."""
        return tuple(axis for axis in self.sizes if axis not in self.weight_axes)

    @functools.cached_property
    def views(self) -> dict[str, ParallelDims]:
        """The named views of the same ranks that parameters are placed in: `dense` (this
        grid) and `expert` (dp split into ep x edp, `expert_dims`)."""
        return {"dense": self, "expert": self.expert_dims}

    def view_of(self, axes: tuple[str, ...]) -> ParallelDims:
        """The first view holding every one of `axes` (the views, then HSDP's grid,
        `hybrid_dims`): the grid they are coordinates of."""
        for view in (*self.views.values(), self.hybrid_dims):
            if set(axes) <= set(view.sizes):
                return view
        raise ValueError(f"no view of the grid has all of the axes {axes}")

    def group_axes(self) -> dict[str, tuple[str, ...]]:
        """The axes each named group spans (the embedding pairs: none, they are two stages of
        pp), in the order every rank creates them: each axis's (fastest first), the
        model-parallel groups (the weight axes together: one copy of the model), the replicas
        of one piece of the weights (`dp_cp`, Megatron's data-parallel group with context
        parallelism: the dp group's ranks when cp is 1, a communicator of its own all the
        same), the embedding pairs; with expert parallelism the ep groups and the replicas of
        one piece of the experts (`expert_dp`: cp x edp); under HSDP the ZeRO shard groups
        (`dp_shard_cp`: cp x dp_shard) and the replicas of each shard (`dp_replicate`) last."""
        named = {
            **{axis: (axis,) for axis in self.sizes},
            "model_parallel": self.weight_axes,
            "dp_cp": self.replica_axes,
            "embedding": (),
        }
        if self.ep > 1:  # the experts' all-to-all, and the replicas of one expert's weights
            named |= {"ep": ("ep",), "expert_dp": self.expert_dims.replica_axes}
        if self.dp_replicate > 1:  # HSDP: ZeRO's shards, and the copies of each
            shard, replicate = self.shard_and_replicate(self.replica_axes)
            named |= {"dp_shard_cp": shard, "dp_replicate": replicate}
        return named

    def named_groups(self) -> dict[str, list[list[int]]]:
        """Every group a run creates, by the name `ParallelState` gives it, in creation order
        (`group_axes`): the partition of the world into that name's groups."""
        return {
            name: self.view_of(axes).groups(*axes) if axes else self.embedding_groups()
            for name, axes in self.group_axes().items()
        }

    def group_name(self, axes: tuple[str, ...]) -> str:
        """The named group spanning exactly `axes` (in any order). At ep 1 the expert view is
        the dense grid: edp is dp and ep has one rank, so the experts' replicas are `dp_cp`."""
        if self.ep == 1:
            axes = tuple(DERIVED if axis == "edp" else axis for axis in axes if axis != "ep")
        name = self._names_by_axes.get(frozenset(axes))
        if name is None:
            raise ValueError(f"no group spans the axes {axes}: name one in ParallelDims.group_axes")
        return name

    @functools.cached_property
    def _names_by_axes(self) -> dict[frozenset[str], str]:
        """`group_name`'s table, made once: layers ask for their groups at every call."""
        return {frozenset(axes): name for name, axes in self.group_axes().items() if axes}

    def label(self, rank: int, axes: tuple[str, ...]) -> str:
        """`rank`'s coordinates on `axes` as a name, `tp01_pp00`: how checkpoint files name
        the piece a rank holds."""
        coords = self.coords(rank)
        return "_".join(f"{axis}{coords[axis]:02d}" for axis in axes)
