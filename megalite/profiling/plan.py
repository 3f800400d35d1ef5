"""`megalite plan`: which layout to run a config in, on N devices of a given memory.

Every (tp, cp, pp, vpp, schedule, dp, zero, micro-batch size, recompute) layout of the world
size (the schedules: 1f1b or zb-h1 with one chunk per rank, interleaved or zb-v with two,
interleaved with more; cp where the sequence cuts into 2*cp chunks) is built as the config with
those overrides and kept only if config validation accepts it, world size included
(`Config.layout_for_world`): the planner never proposes what `megalite train` would reject.
Layouts whose estimated peak memory (`profiling.estimate`) exceeds the device's are dropped,
and the rest are ranked by the throughput model of `profiling.throughput`. Each proposal comes
with the terms that decide it and the exact command line that runs it.

Expert parallelism (mixture-of-experts models) divides a rank's expert weights, gradients and
optimizer state by ep at the price of four all-to-alls of the routed rows per layer and
micro-batch (two forward, two backward), exposed: it wins where the experts' state is what does
not fit.

Context parallelism divides a rank's activations by cp at the price of the ring's transfers
(hidden behind the attention's compute where the sequence is long) and of smaller per-rank
work: it wins where the sequence makes activations dominate memory, so that without it only
recompute (a third more compute), a deeper pipeline (more bubble) or nothing fits; with a
short sequence its transfers are exposed and it loses to dp.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megalite.config import Config, ConfigError, config_to_dict, with_values
from megalite.errors import MegaliteError
from megalite.parallel_dims import ParallelDims

if TYPE_CHECKING:  # the estimator and the model import torch: loaded once the config is checked
    from megalite.profiling.throughput import Machine, Prediction

RECOMPUTE = ("none", "selective", "full")
MAX_VPP = 8
MAX_MICRO_BATCH = 64
MIN_CP_CHUNK = 256
"""Tokens of the shortest chunk context parallelism is planned with (seq_len / (2 * cp))."""
GIB = 2**30


class PlanError(MegaliteError):
    """The planner's input is wrong, or no layout can run; the message says what to change."""


@dataclass(frozen=True)
class Layout:
    """One way to lay a config out over the world; dp is what tp, cp and pp leave."""

    tp: int
    cp: int
    pp: int
    vpp: int
    schedule: str
    sp: bool
    zero: int
    micro_batch_size: int
    recompute: str
    ep: int = 1
    """Expert-parallel ranks within dp (mixture-of-experts models)."""
    dp_replicate: int = 1
    """HSDP's copies of each ZeRO shard (`hybrid_sizes`)."""
    reshard_after_forward: bool = True
    """ZeRO-3: False keeps a stage's gathered parameters for the step (with pp > 1)."""

    def values(self, base: Config, device: str) -> dict[str, Any]:
        """The config keys (`section.key`) and values that select this layout."""
        values = {
            "parallel.tp": self.tp,
            "parallel.cp": self.cp,
            "parallel.pp": self.pp,
            "parallel.vpp": self.vpp,
            "parallel.schedule": self.schedule,
            "parallel.sp": self.sp,
            "parallel.zero": self.zero,
            "train.micro_batch_size": self.micro_batch_size,
            "train.recompute": self.recompute,
        }
        if base.model.moe_experts is not None:
            values["parallel.ep"] = self.ep
        if self.dp_replicate > 1 or base.parallel.dp_replicate > 1:
            values["parallel.dp_replicate"] = self.dp_replicate
        if not self.reshard_after_forward or not base.parallel.reshard_after_forward:
            values["parallel.reshard_after_forward"] = self.reshard_after_forward
        if base.train.recompute_layers is not None:  # full recompute here means every layer
            values["train.recompute_layers"] = None
        if device == "cpu" and base.train.device != "cpu":
            values["train.device"] = "cpu"
        return values

    def settings(self, base: Config, device: str) -> list[str]:
        """The same as command-line overrides, `section.key=value` (values in YAML)."""
        words = {True: "true", False: "false", None: "null"}
        return [
            f"{key}={words.get(value, value) if isinstance(value, bool | None) else value}"
            for key, value in self.values(base, device).items()
        ]

    def describe(self, dp: int) -> str:
        text = f"tp {self.tp}{'+sp' if self.sp else ''}"
        text += f" cp {self.cp}" if self.cp > 1 else ""
        text += f" pp {self.pp}"
        text += f"x{self.vpp}" if self.vpp > 1 else ""
        text += f" {self.schedule}" if self.schedule.startswith("zb") else ""
        zero = f" zero{self.zero}" if self.zero else ""
        zero += " kept" if not self.reshard_after_forward else ""
        ep = f" (ep {self.ep})" if self.ep > 1 else ""
        copies = self.dp_replicate
        hsdp = f" (hsdp {dp // copies}x{copies})" if copies > 1 else ""
        return text + f" dp {dp}{ep}{hsdp}{zero} mbs {self.micro_batch_size}"


@dataclass
class Proposal:
    """A layout that validates and fits, with its predicted speed and why."""

    layout: Layout
    config: Config
    dp: int
    microbatches: int
    prediction: Prediction
    peak_bytes: float
    reasons: list[str]
    command: str


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def schedules(pp: int, vpp: int) -> tuple[str, ...]:
    """The pipeline schedules that run `vpp` chunks per rank: with one, 1F1B and its
    zero-bubble form ZB-H1 (GPipe holds more for the same bubble); with two, interleaving and
    ZB-V; with more, interleaving."""
    if pp == 1:
        return ("1f1b",)
    return {1: ("1f1b", "zb-h1"), 2: ("interleaved", "zb-v")}.get(vpp, ("interleaved",))


def context_parallel_sizes(base: Config, world_size: int) -> list[int]:
    """The cp sizes that divide the world and cut the sequence into 2*cp chunks of at least
    MIN_CP_CHUNK tokens (shorter ones leave the attention kernel's tiles mostly empty and each
    ring step too little compute to hide its transfer); 1 alone where dropout is on (cp never
    materialises the attention probabilities it would drop)."""
    seq = base.model.seq_len
    if base.model.dropout > 0:
        return [1]
    return [
        cp
        for cp in _divisors(world_size)
        if cp == 1 or (seq % (2 * cp) == 0 and seq // (2 * cp) >= MIN_CP_CHUNK)
    ]


def expert_parallel_sizes(base: Config, dp: int) -> list[int]:
    """The ep sizes of a mixture-of-experts model: dividing dp and the experts (1 alone for a
    dense model)."""
    experts = base.model.moe_experts
    if experts is None:
        return [1]
    return [ep for ep in _divisors(dp) if experts % ep == 0]


def hybrid_sizes(zero: int, tp: int, cp: int, dp: int, ranks_per_node: int | None) -> list[int]:
    """dp_replicate's sizes worth planning: 1, and under ZeRO the HSDP whose shard groups
    (cp x dp_shard, with tp inside) fill a node, where that leaves more than one copy: its
    gathers then stay on the node's links and only one all-reduce of the shards a step crosses
    nodes."""
    if not zero or ranks_per_node is None or ranks_per_node % (tp * cp):
        return [1]
    shard = ranks_per_node // (tp * cp)
    return [1, dp // shard] if shard > 1 and dp % shard == 0 and dp > shard else [1]


def layouts(base: Config, world_size: int, ranks_per_node: int | None = None) -> Iterator[Layout]:
    """Every layout worth building: tp, cp and pp dividing the world (cp: see
    `context_parallel_sizes`), vpp splitting the layers evenly, each schedule for it, ZeRO only
    with more than one replica (dp x cp), HSDP by a node (`hybrid_sizes`, given the node's
    ranks), ZeRO-3 with pp also keeping each stage's gathered parameters for the step,
    micro-batches dividing a replica's batch, each recompute mode; sp whenever tp > 1
    (the same traffic as without, less memory)."""
    n_layers, batch = base.model.n_layers, base.train.global_batch_size
    cps = context_parallel_sizes(base, world_size)
    for tp in _divisors(world_size):
        for cp in [c for c in cps if (world_size // tp) % c == 0]:
            for pp in _divisors(world_size // (tp * cp)):
                dp = ParallelDims.for_world(world_size, tp=tp, cp=cp, pp=pp).sizes["dp"]
                vpps = [v for v in range(2, MAX_VPP + 1) if pp > 1 and n_layers % (pp * v) == 0]
                micro = [b for b in _divisors(max(batch // dp, 1)) if b <= MAX_MICRO_BATCH]
                eps = expert_parallel_sizes(base, dp)
                for vpp, schedule in [(v, s) for v in (1, *vpps) for s in schedules(pp, v)]:
                    for zero in (0, 1, 2, 3) if dp * cp > 1 else (0,):
                        hybrid = hybrid_sizes(zero, tp, cp, dp, ranks_per_node)
                        reshards = (True, False) if zero == 3 and pp > 1 else (True,)
                        for mbs, recompute, ep, copies, reshard in itertools.product(
                            micro, RECOMPUTE, eps, hybrid, reshards
                        ):
                            yield Layout(
                                *(tp, cp, pp, vpp, schedule, tp > 1, zero, mbs, recompute),
                                *(ep, copies, reshard),
                            )


def validated(
    base: Config, layout: Layout, world_size: int, device: str
) -> tuple[Layout, Config, int, int] | None:
    """(layout, config, dp, micro-batches), or None when validation rejects the layout (with sp
    tried off when it is on: sp needs the sequence to divide by tp)."""
    tries = (layout, dataclasses.replace(layout, sp=False)) if layout.sp else (layout,)
    for candidate in tries:
        try:
            cfg = with_values(base, candidate.values(base, device))
            return candidate, cfg, *cfg.layout_for_world(world_size)
        except ConfigError:
            continue
    return None


def estimated_peak_bytes(cfg: Config, machine: Machine) -> float:
    """The most memory any rank of the layout needs, from the closed-form estimator: on a GPU
    what the caching allocator reserves, CUDA context included."""
    from megalite.profiling.estimate import estimate_layout

    estimate = estimate_layout(cfg, machine.world_size, machine.device)
    if machine.device == "cpu":
        return estimate.peak_bytes
    return max(estimate.gpu_bytes(stage) for stage in estimate.stages)


def command_line(
    config_path: str | None, overrides: list[str], settings: list[str], machine: Machine
) -> str:
    """The torchrun command that trains in this layout on `machine`."""
    launch = ["torchrun"]
    if machine.nodes > 1:
        launch += [f"--nnodes={machine.nodes}", "--rdzv-backend=c10d", "--rdzv-endpoint=HOST:29500"]
    launch += [f"--nproc-per-node={machine.ranks_per_node}", "-m", "megalite", "train"]
    launch += ["--config", config_path] if config_path else []
    return shlex.join([*launch, *overrides, *settings])


def plan(
    config_path: str | None,
    overrides: list[str],
    base: Config,
    machine: Machine,
    top: int = 5,
    peak_bytes: Callable[[Config, Machine], float] = estimated_peak_bytes,
    progress: bool = False,
) -> list[Proposal]:
    """The `top` fastest layouts that validate and fit in `machine.memory_bytes`, fastest
    first; a layout with recompute only where less recompute would not fit. `progress`: bars
    on stderr for the two passes (every layout predicted; the fastest checked for memory until
    `top` fit), which take seconds for long sequences on many devices."""
    from tqdm import tqdm

    from megalite.profiling.throughput import predict

    ranked = []
    candidates = list(dict.fromkeys(layouts(base, machine.world_size, machine.ranks_per_node)))
    for layout in tqdm(candidates, desc="predicting layouts", unit="layout", disable=not progress):
        found = validated(base, layout, machine.world_size, machine.device)
        if found is not None:
            ranked.append((predict(found[1], machine), found))
    if not ranked:
        raise PlanError(
            f"no layout of this config validates on {machine.world_size} ranks (global batch "
            f"{base.train.global_batch_size}, {base.model.n_layers} layers, {base.model.n_heads} "
            "heads): choose a device count that divides the batch and the model"
        )
    ranked.sort(key=lambda entry: entry[0].step_s)
    memory = _memoised(peak_bytes, machine)
    proposals, smallest = [], None
    fastest_first = iter(ranked)  # no length: the pass ends once `top` fit, not at the end
    bar = tqdm(fastest_first, "checking memory, fastest first", unit="layout", disable=not progress)
    with bar as checks:
        for prediction, (layout, cfg, dp, m) in checks:
            need = memory(cfg)
            if smallest is None or need < smallest[0]:
                smallest = (need, layout, dp)
            if need > machine.memory_bytes or _lighter_fits(base, layout, machine, memory):
                continue
            reasons = _reasons(layout, prediction, need, machine)
            settings = layout.settings(base, machine.device)
            command = command_line(config_path, overrides, settings, machine)
            proposals.append(Proposal(layout, cfg, dp, m, prediction, need, reasons, command))
            if len(proposals) == top:
                break
    if not proposals:
        need, layout, dp = smallest
        raise PlanError(
            f"no layout fits in {machine.memory_bytes / GIB:.1f} GiB per device on "
            f"{machine.world_size} devices: the smallest ({layout.describe(dp)}, recompute "
            f"{layout.recompute}) needs {need / GIB:.1f} GiB; add devices or raise --gpu-memory"
        )
    return proposals


def _memoised(
    peak_bytes: Callable[[Config, Machine], float], machine: Machine
) -> Callable[[Config], float]:
    """`peak_bytes` on `machine`, once per distinct config (reasons ask again)."""
    cache: dict[str, float] = {}

    def memory(cfg: Config) -> float:
        key = repr(config_to_dict(cfg))
        if key not in cache:
            cache[key] = peak_bytes(cfg, machine)
        return cache[key]

    return memory


def _lighter_fits(
    base: Config, layout: Layout, machine: Machine, memory: Callable[[Config], float]
) -> bool:
    """Whether the layout with less recompute (none; selective instead of full) also fits:
    then it is at least as fast, and this one is not worth proposing."""
    for lighter in RECOMPUTE[: RECOMPUTE.index(layout.recompute)]:
        found = validated(
            base,
            dataclasses.replace(layout, recompute=lighter),
            machine.world_size,
            machine.device,
        )
        if found is not None and memory(found[1]) <= machine.memory_bytes:
            return True
    return False


def _reasons(layout: Layout, prediction: Prediction, need: float, machine: Machine) -> list[str]:
    """The terms that decide a layout, in words."""
    p = prediction
    # the papers' bubble, idle time relative to compute ((pp - 1) / (vpp m)), as the metrics'
    # bubble_fraction and `megalite profile` report it; the prediction's is a share of the span
    idle_over_compute = p.bubble / (1 - p.bubble) if p.bubble < 1 else math.inf
    bubble = f"bubble {idle_over_compute:.2f} of compute"
    reasons = [bubble if layout.pp > 1 else "no pipeline bubble"]
    if layout.tp == 1:
        reasons.append("no tp traffic")
    else:
        link = "intra-node" if machine.within_node(layout.tp) else "inter-node"
        reasons.append(f"tp traffic {p.tp_comm_s / p.step_s:.0%} of the step ({link})")
    if layout.cp > 1:
        span = layout.tp * layout.cp  # the cp ring's ranks lie within tp x cp consecutive ones
        link = "intra-node" if machine.within_node(span) else "inter-node"
        exposed = p.cp_comm_s / p.step_s
        reasons.append(
            f"cp {layout.cp}: activations / {layout.cp}, ring {exposed:.0%} exposed ({link})"
        )
    if layout.ep > 1:
        reasons.append(
            f"ep {layout.ep}: expert weights / {layout.ep}, all-to-all {p.ep_comm_s / p.step_s:.0%}"
        )
    if p.dp_comm_s > 0.01 * p.step_s:
        reasons.append(f"dp traffic exposed {p.dp_comm_s / p.step_s:.0%}")
    if layout.recompute != "none":
        reasons.append(f"needs {layout.recompute} recompute to fit")
    if p.cpu_bound:
        reasons.append("cores saturated: idle ranks lend theirs")
    reasons.append(f"{need / GIB:.2f} of {machine.memory_bytes / GIB:.1f} GiB")
    return reasons
