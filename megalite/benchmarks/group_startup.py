"""What creating the process groups costs each rank: at 1,024 ranks on torch's `fake` backend
(one process plays one rank at a time), and on real gloo ranks on this machine.

fake, per sampled rank of a (world, tp, pp) layout, in both of `parallel_state`'s modes:
- unbound (gloo; NCCL without device_id): `new_group` once per group of more than one rank,
  on every rank; a non-member's call returns at once (no store traffic);
- bound (NCCL with device_id): `split_group` once per axis. torch's split needs a GPU, so a
  stand-in counts the calls; each is one world-wide ncclCommSplit that every rank enters.
Columns: creating calls, groups this rank holds, world-wide splits (bound: one per call; the
unbound mode splits nothing, its NCCL communicators start on their first collective through the
store), and the milliseconds `build_parallel_state` took in Python.

gloo: `build_parallel_state` on forked gloo ranks (each member connects to its peers when its
group is made), then one all_reduce over each of the rank's groups; the slowest rank's seconds.

Before this change (HEAD 2a2b696, the same fake measurement): 464 new_group calls per rank at
1,024 ranks (tp 8 x pp 8), none with a time-out, 5.2 ms; bound, each would have been a
world-wide split. At tp 2 x pp 2 on 4 ranks: 11 calls per rank, 4 of them size-1 groups.
With one communicator per purpose (names whose ranks coincide no longer share a group; none is
the world's): 528 new_group calls at 1,024 ranks, 5.6 ms unbound; 6 split_group calls bound
(5 before: dp_cp is split apart from dp), 1.1 ms; gloo 8 ranks tp 2 x pp 2, 27.7 ms to build
(27.5 before) and 21.4 ms for the first all-reduces. tp 2 x pp 2 on 4 ranks: 7 calls (4 before:
the model-parallel group and the embedding pairs now have their own).

    python tools/bench_group_startup.py
    python tools/bench_group_startup.py --fake 1024:8:8 --gloo 8:2:2
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist

from megalite import comm
from megalite.benchmarks.table import print_table
from megalite.launch import run_ranks
from megalite.parallel_state import build_parallel_state

CPU = torch.device("cpu")


def _layout(spec: str) -> tuple[int, int, int]:
    world, tp, pp = (int(x) for x in spec.split(":"))
    return world, tp, pp


def fake_rank(world: int, tp: int, pp: int, rank: int, bound: bool) -> dict[str, float]:
    """One rank's calls and Python time building the layout's groups on the fake backend."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    calls: list[list[list[int]]] = []
    new_group, split_group = dist.new_group, dist.split_group

    def count_new(ranks: list[int], **kwargs: Any) -> Any:
        calls.append([ranks])
        return new_group(ranks, **kwargs)

    def stand_in_split(split_ranks: list[list[int]], **kwargs: Any) -> Any:
        calls.append(split_ranks)
        mine = next((g for g in split_ranks if rank in g), None)
        return None if mine is None else new_group(mine, **kwargs)

    dist.new_group, dist.split_group = count_new, stand_in_split
    try:
        if bound:
            dist.group.WORLD.bound_device_id = torch.device("cuda", 0)
        start = time.perf_counter()
        ps = build_parallel_state(tp, pp, CPU, timeout_s=1800.0)
        seconds = time.perf_counter() - start
    finally:
        dist.new_group, dist.split_group = new_group, split_group
        dist.destroy_process_group()
    held = {id(g) for g in ps.groups.values() if g not in (None, ps.world_group)}
    return {"calls": len(calls), "held": len(held), "ms": seconds * 1e3}


def gloo_ranks(tp: int, pp: int) -> tuple[float, float]:
    """(seconds to build the groups, seconds for the first all_reduce over each) on this rank."""
    dist.barrier()
    start = time.perf_counter()
    ps = build_parallel_state(tp, pp, CPU)
    built = time.perf_counter()
    for group in {id(g): g for g in ps.groups.values() if g is not None}.values():
        comm.all_reduce(torch.ones(1), group)
    return built - start, time.perf_counter() - built


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fake", nargs="*", default=["1024:8:8", "4:2:2"], help="world:tp:pp")
    parser.add_argument("--ranks", type=int, nargs="*", default=[0, 517], help="fake ranks")
    parser.add_argument("--gloo", nargs="*", default=["8:2:2"], help="world:tp:pp")
    parser.add_argument("--repeat", type=int, default=5, help="fake: the fastest of this many")
    args = parser.parse_args(argv)
    rows = []
    for world, tp, pp in map(_layout, args.fake):
        for rank in (r for r in args.ranks if r < world):
            for bound in (False, True):
                tries = [fake_rank(world, tp, pp, rank, bound) for _ in range(args.repeat)]
                got = min(tries, key=lambda t: t["ms"])  # other work only adds time
                splits = got["calls"] if bound else 0
                mode = "bound (nccl)" if bound else "unbound"
                name = f"fake {world} tp{tp} pp{pp} rank {rank} {mode}"
                rows.append([name, got["calls"], got["held"], splits, f"{got['ms']:.1f}", "-"])
    for world, tp, pp in map(_layout, args.gloo):
        per_rank = run_ranks(world, gloo_ranks, tp, pp)
        build, first = (max(r[i] for r in per_rank) for i in (0, 1))
        name = f"gloo {world} tp{tp} pp{pp} (slowest rank)"
        rows.append([name, "-", "-", "-", f"{build * 1e3:.1f}", f"{first * 1e3:.1f}"])
    columns = ["layout", "creating calls", "groups held", "world splits", "build ms", "first ms"]
    notes = ["fake: Python time only; bound: split_group is a stand-in (it needs a GPU)."]
    print_table(columns, [[str(cell) for cell in row] for row in rows], notes)


if __name__ == "__main__":
    main()
