"""`megalite plan`: which layout to run a config in, on N devices of a given memory.

Every (tp, pp, vpp, dp, zero, micro-batch size, recompute) layout of the world size is built as
the config with those overrides and kept only if config validation accepts it, world size
included (`Config.layout_for_world`): the planner never proposes what `megalite train` would
reject. Layouts whose estimated peak memory (`profiling.estimate`) exceeds the device's are
dropped, and the rest are ranked by the throughput model of `profiling.throughput`. Each
proposal comes with the terms that decide it and the exact command line that runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megalite.config import (
    Config,
    ConfigError,
    build_config,
    config_to_dict,
    load_config,
)
from megalite.errors import MegaliteError
from megalite.parallel_dims import ParallelDims
from megalite.profiling.flops import cpu_cores, cpu_peak_flops, gpu_peak_flops

if TYPE_CHECKING:  # the estimator and the model import torch: loaded once the config is checked
    from megalite.profiling.throughput import Machine, Prediction

RECOMPUTE = ("none", "selective", "full")
MAX_VPP = 8
MAX_MICRO_BATCH = 64
UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}
UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
GIB = 2**30


class PlanError(MegaliteError):
    """The planner's input is wrong, or no layout can run; the message says what to change."""


def parse_memory(text: str) -> float:
    """'80GB' (10^9 bytes), '80GiB' (2^30), '512 MB', '1.5TB' or plain bytes -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b|b)?\s*", text, re.IGNORECASE)
    if not match or float(match[1]) <= 0:
        raise PlanError(
            f"--gpu-memory {text!r} is not a memory size: write it like 80GB, 80GiB or 512MB"
        )
    return float(match[1]) * UNITS[(match[2] or "").lower()]


@dataclass(frozen=True)
class Layout:
    """One way to lay a config out over the world; dp is what tp and pp leave."""

    tp: int
    pp: int
    vpp: int
    sp: bool
    zero: int
    micro_batch_size: int
    recompute: str

    def values(self, base: Config, device: str) -> dict[str, Any]:
        """The config keys (`section.key`) and values that select this layout."""
        values = {
            "parallel.tp": self.tp,
            "parallel.pp": self.pp,
            "parallel.vpp": self.vpp,
            "parallel.schedule": "interleaved" if self.vpp > 1 else "1f1b",
            "parallel.sp": self.sp,
            "parallel.zero": self.zero,
            "train.micro_batch_size": self.micro_batch_size,
            "train.recompute": self.recompute,
        }
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
        text = f"tp {self.tp}{'+sp' if self.sp else ''} pp {self.pp}"
        text += f"x{self.vpp}" if self.vpp > 1 else ""
        zero = f" zero{self.zero}" if self.zero else ""
        return text + f" dp {dp}{zero} mbs {self.micro_batch_size}"


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


def layouts(base: Config, world_size: int) -> Iterator[Layout]:
    """Every layout worth building: tp and pp dividing the world, vpp splitting the layers
    evenly, ZeRO only with dp > 1, micro-batches dividing a replica's batch, each recompute
    mode; sp whenever tp > 1 (the same traffic as without, less memory)."""
    n_layers, batch = base.model.n_layers, base.train.global_batch_size
    for tp in _divisors(world_size):
        for pp in _divisors(world_size // tp):
            dp = ParallelDims.for_world(world_size, tp=tp, pp=pp).sizes["dp"]
            vpps = [v for v in range(2, MAX_VPP + 1) if pp > 1 and n_layers % (pp * v) == 0]
            micro = [b for b in _divisors(max(batch // dp, 1)) if b <= MAX_MICRO_BATCH]
            for vpp in (1, *vpps):
                for zero in (0, 1, 2) if dp > 1 else (0,):
                    for mbs in micro:
                        for recompute in RECOMPUTE:
                            yield Layout(tp, pp, vpp, tp > 1, zero, mbs, recompute)


def with_values(base: dict[str, dict[str, Any]], values: dict[str, Any]) -> Config:
    """The config `base` (as `config_to_dict` gives it) with `section.key` values set, through
    the same validation as `load_config`."""
    raw = {section: dict(fields) for section, fields in base.items()}
    for key, value in values.items():
        section, name = key.split(".")
        raw[section][name] = value
    return build_config(raw)


def validated(
    base: Config, layout: Layout, world_size: int, device: str, raw: dict | None = None
) -> tuple[Layout, Config, int, int] | None:
    """(layout, config, dp, micro-batches), or None when validation rejects the layout (with sp
    tried off when it is on: sp needs the sequence to divide by tp). `raw`: `base` as a dict,
    when the caller has it already."""
    raw = raw or config_to_dict(base)
    tries = (layout, dataclasses.replace(layout, sp=False)) if layout.sp else (layout,)
    for candidate in tries:
        try:
            cfg = with_values(raw, candidate.values(base, device))
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
) -> list[Proposal]:
    """The `top` fastest layouts that validate and fit in `machine.memory_bytes`, fastest
    first; a layout with recompute only where less recompute would not fit."""
    from megalite.profiling.throughput import predict

    ranked, raw = [], config_to_dict(base)
    for layout in dict.fromkeys(layouts(base, machine.world_size)):
        found = validated(base, layout, machine.world_size, machine.device, raw)
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
    for prediction, (layout, cfg, dp, m) in ranked:
        need = memory(cfg)
        if smallest is None or need < smallest[0]:
            smallest = (need, layout, dp)
        if need > machine.memory_bytes or _lighter_fits(raw, base, layout, machine, memory):
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
    raw: dict, base: Config, layout: Layout, machine: Machine, memory: Callable[[Config], float]
) -> bool:
    """Whether the layout with less recompute (none; selective instead of full) also fits:
    then it is at least as fast, and this one is not worth proposing."""
    for lighter in RECOMPUTE[: RECOMPUTE.index(layout.recompute)]:
        found = validated(
            base,
            dataclasses.replace(layout, recompute=lighter),
            machine.world_size,
            machine.device,
            raw,
        )
        if found is not None and memory(found[1]) <= machine.memory_bytes:
            return True
    return False


def _reasons(layout: Layout, prediction: Prediction, need: float, machine: Machine) -> list[str]:
    """The terms that decide a layout, in words."""
    p = prediction
    reasons = [f"bubble {p.bubble:.0%}" if layout.pp > 1 else "no pipeline bubble"]
    if layout.tp == 1:
        reasons.append("no tp traffic")
    else:
        link = "intra-node" if layout.tp <= machine.ranks_per_node else "inter-node"
        reasons.append(f"tp traffic {p.tp_comm_s / p.step_s:.0%} of the step ({link})")
    if p.dp_comm_s > 0.01 * p.step_s:
        reasons.append(f"dp traffic exposed {p.dp_comm_s / p.step_s:.0%}")
    if layout.recompute != "none":
        reasons.append(f"needs {layout.recompute} recompute to fit")
    if p.cpu_bound:
        reasons.append("cores saturated: idle ranks lend theirs")
    reasons.append(f"{need / GIB:.2f} of {machine.memory_bytes / GIB:.1f} GiB")
    return reasons


# ----------------------------------------------------------------------------- command line

DEFAULT_GPU = "H100 SXM"
# device: (mfu fraction, intra-node Gbit/s, inter-node Gbit/s, optimizer GB/s, ms per layer and
# micro-batch, ms per message, reduce-scatter / all-gather cost relative to a ring's). CPU, from
# 8 gloo ranks of gpt-tiny on 2 cores: about 80 % of the measured peak; larger micro-batches were
# not faster (no per-layer overhead to save); every tp collective or p2p message cost about 5 ms
# (ranks wait for their peer's turn on a core); an all-reduce of 21 MB took 0.2 s, i.e. each
# rank's share of the 2 cores moved its ring bytes at about 6 Gbit/s. On a machine of its own a
# rank waiting in a bubble lends all its core time (pp 4 x dp 2 was the fastest layout measured,
# 24 % ahead of dp 8); only where other work shares the cores is part of it lost (measured while
# other jobs ran: 40 %; pass a lower `Machine.bubble_lent` to model that).
DEFAULTS = {
    "cuda": (0.5, 2400.0, 400.0, 2000.0, 0.05, 0.02, 1.0, 1.0),
    "cpu": (0.8, 6.0, 6.0, 4.0, 0.0, 5.0, 2.0, 1.0),
}


def machine_from_args(args: argparse.Namespace, base: Config) -> Machine:
    """The hardware described on the command line, defaults filled in per device."""
    from megalite.profiling.estimate import resolve_precision
    from megalite.profiling.throughput import Machine

    _check(args.gpus >= 1, f"--gpus must be >= 1, got {args.gpus}")
    _check(
        args.nodes >= 1 and args.gpus % args.nodes == 0,
        f"--nodes {args.nodes} must divide --gpus {args.gpus} (ranks per node are equal)",
    )
    mfu, intra, inter, optimizer, overhead_ms, latency_ms, split, lent = DEFAULTS[args.device]
    mfu = args.mfu_fraction if args.mfu_fraction is not None else mfu
    _check(0 < mfu <= 1, f"--mfu-fraction must be in (0, 1], got {mfu}")
    intra = args.intra_node_gbps if args.intra_node_gbps is not None else intra
    inter = args.inter_node_gbps if args.inter_node_gbps is not None else inter
    _check(intra > 0 and inter > 0, "link bandwidths (--intra/--inter-node-gbps) must be > 0")
    precision = resolve_precision(base.train.precision, args.device)
    if args.peak_tflops is not None:
        _check(args.peak_tflops > 0, f"--peak-tflops must be > 0, got {args.peak_tflops}")
        peak = args.peak_tflops * 1e12
    elif args.device == "cpu":
        peak = cpu_peak_flops(precision)  # this machine's, measured once and cached
    else:
        peak = gpu_peak_flops(DEFAULT_GPU, precision)
    if args.gpu_memory is not None:
        memory = parse_memory(args.gpu_memory)
    elif args.device == "cpu":  # the ranks share this machine's RAM
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / args.gpus
    else:
        raise PlanError("--gpu-memory is needed for GPUs: the memory of one, e.g. 80GB")
    return Machine(
        device=args.device,
        world_size=args.gpus,
        nodes=args.nodes,
        memory_bytes=memory,
        peak_flops=peak,
        mfu_fraction=mfu,
        intra_node_bandwidth=intra * 1e9 / 8,
        inter_node_bandwidth=inter * 1e9 / 8,
        memory_bandwidth=optimizer * 1e9,
        layer_overhead_s=overhead_ms / 1e3,
        latency_s=latency_ms / 1e3,
        split_collective_cost=split,
        bubble_lent=lent,
        cores=cpu_cores() if args.device == "cpu" else 1,
    )


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise PlanError(message)


def print_plan(proposals: list[Proposal], machine: Machine) -> None:
    """The ranked table, then the command line of each proposal."""
    where = f"{machine.world_size} {'CPU ranks' if machine.device == 'cpu' else 'GPUs'}"
    print(
        f"{where} on {machine.nodes} node(s), {machine.memory_bytes / GIB:.1f} GiB each, "
        f"{machine.peak_flops / 1e12:.2f} TFLOP/s peak at {machine.mfu_fraction:.0%}"
    )
    header = f"{'#':>2}  {'layout':<34} {'recompute':<9} {'step s':>8} {'tokens/s':>10}  why"
    print(header + "\n" + "-" * len(header))
    for i, p in enumerate(proposals, 1):
        layout = p.layout.describe(p.dp) + f" m {p.microbatches}"
        print(
            f"{i:>2}  {layout:<34} {p.layout.recompute:<9} {p.prediction.step_s:>8.3f} "
            f"{p.prediction.tokens_per_s:>10,.0f}  {'; '.join(p.reasons)}"
        )
    for i, p in enumerate(proposals, 1):
        print(f"\n{i}: {p.command}")


def _run_plan(args: argparse.Namespace) -> int:
    base = load_config(args.config, args.overrides)
    machine = machine_from_args(args, base)
    _check(args.top >= 1, f"--top must be >= 1, got {args.top}")
    print_plan(plan(args.config, args.overrides, base, machine, args.top), machine)
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    """Add `megalite plan`."""
    parser = commands.add_parser(
        "plan",
        help="rank the layouts of a config on N devices",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--config", help="YAML config (see configs/); defaults when omitted")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    parser.add_argument(
        "--gpus", type=int, required=True, help="devices (with --device cpu: gloo ranks here)"
    )
    parser.add_argument("--gpu-memory", help="memory of one device, e.g. 80GB or 80GiB")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--nodes", type=int, default=1, help="nodes the devices are spread over")
    parser.add_argument("--intra-node-gbps", type=float, help="Gbit/s between ranks in a node")
    parser.add_argument("--inter-node-gbps", type=float, help="Gbit/s between nodes, per rank")
    parser.add_argument(
        "--peak-tflops", type=float, help=f"dense peak of one device (default {DEFAULT_GPU})"
    )
    parser.add_argument("--mfu-fraction", type=float, help="share of the peak matmuls reach")
    parser.add_argument("--top", type=int, default=5, help="how many layouts to show")
    parser.set_defaults(func=_run_plan)
