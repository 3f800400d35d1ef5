"""`megalite estimate`: the memory of every pipeline rank of a layout, as a table (or JSON).

    megalite estimate --config configs/llama-7b.yaml --world-size 64
    megalite estimate --config configs/gpt2-1.3b.yaml --world-size 8 train.recompute=none --json
    megalite estimate --config configs/llama-7b.yaml --world-size 64 model.seq_len=131072 \
        parallel.cp=8 parallel.pp=1 parallel.vpp=1 parallel.schedule=1f1b

The world is tp x cp x dp x pp ranks: dp is what the world leaves.

The numbers come from `megalite.profiling.estimate` (its docstring says what each part counts);
this module only lays them out.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from megalite.commands import non_negative_float, positive_int

if TYPE_CHECKING:  # the CLI imports this module for its parser: keep torch out of that
    from megalite.profiling.estimate import LayoutEstimate, StageEstimate

MAX_COLUMNS = 5


def format_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1 (B, KiB, MiB, GiB)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _shown(stages: list[StageEstimate]) -> list[StageEstimate]:
    """Every rank when they fit the page, else the first two, a middle one, the last two."""
    if len(stages) <= MAX_COLUMNS:
        return stages
    picks = sorted({0, 1, len(stages) // 2, len(stages) - 2, len(stages) - 1})
    return [stages[i] for i in picks]


def _chunk_label(stage: int, layers: range, n_stages: int) -> str:
    extra = (" +embedding" if stage == 0 else "") + (" +head" if stage == n_stages - 1 else "")
    return f"layers {layers.start}-{layers.stop - 1}{extra}"


def layout_lines(est: LayoutEstimate) -> list[str]:
    p, t = est.cfg.parallel, est.cfg.train
    recompute = t.recompute
    if recompute == "full" and t.recompute_layers is not None:
        recompute += f" ({t.recompute_layers} layers per chunk)"
    cp = f"cp={p.cp}" + (
        f" ({p.cp_comm}, {est.cfg.model.seq_len // p.cp} tokens per rank)" if p.cp > 1 else ""
    )
    lines = [
        f"layout: tp={p.tp} {cp} pp={p.pp} vpp={p.vpp} dp={est.dp}"
        + (
            f" (ep={p.ep}: {est.cfg.model.moe_experts // p.ep} experts per rank)"
            if p.ep > 1
            else ""
        )
        + f" sp={p.sp} zero={p.zero} "
        f"schedule={p.schedule} recompute={recompute} precision={est.precision}"
        + (f" fp8={t.fp8}" if t.fp8 != "none" else "")
        + " "
        f"({est.device} kernels); micro-batches: {est.microbatches} of {t.micro_batch_size}"
    ]
    n_stages = p.pp * p.vpp
    for stage in est.stages:
        chunks = ", ".join(_chunk_label(v, layers, n_stages) for v, layers in stage.chunks)
        lines.append(f"  pp rank {stage.pp_rank}: {chunks}")
    return lines


def table(est: LayoutEstimate) -> str:
    """The layout, the layer split, then one column per pipeline rank: parts, total, in-flight
    micro-batches and the GPU view."""
    shown = _shown(est.stages)
    names = list(dict.fromkeys(part.name for stage in est.stages for part in stage.parts))
    on_host = {part.name for stage in est.stages for part in stage.parts if part.device == "host"}
    labels = {n: f"{n} (host)" if n in on_host else n for n in names}
    width = (
        max(len(n) for n in [*labels.values(), "micro-batches in flight", "nvidia-smi (est.)"]) + 2
    )

    def row(label: str, cells: list[str]) -> str:
        return f"{label:<{width}}" + "".join(f"{c:>16}" for c in cells)

    lines = layout_lines(est)
    lines.append(row("", [f"pp rank {s.pp_rank}" for s in shown]))
    lines.append(row("parameters (M)", [f"{s.parameters / 1e6:,.2f}" for s in shown]))
    lines += [row(labels[n], [format_bytes(s.part(n)) for s in shown]) for n in names]
    lines.append(
        row("total (gpu)" if on_host else "total", [format_bytes(s.total_bytes) for s in shown])
    )
    lines.append(row("micro-batches in flight", [str(s.in_flight) for s in shown]))
    if est.device == "cuda":
        lines.append(row("nvidia-smi (est.)", [format_bytes(est.gpu_bytes(s)) for s in shown]))
    fullest = max(est.stages, key=lambda s: s.total_bytes)
    lines.append(f"peak: {format_bytes(est.peak_bytes)} on pp rank {fullest.pp_rank}")
    lines += notes(est)
    return "\n".join(lines)


def notes(est: LayoutEstimate) -> list[str]:
    """How megalite's accounting differs from the papers' and what the GPU view adds."""
    out = []
    if est.device == "cuda":
        out.append(
            f"note: nvidia-smi adds the caching allocator's segments and a "
            f"{format_bytes(est.cuda_context)} CUDA context (--cuda-context to change)"
        )
    if est.precision != "fp32":
        from megalite.profiling.estimate import zero_paper_bytes

        fullest = max(est.stages, key=lambda s: s.total_bytes)
        paper = zero_paper_bytes(fullest.parameters, est.replicas, est.cfg.parallel.zero)
        ours = sum(fullest.part(n) for n in ("parameters", "gradients", "optimizer"))
        dp = "dp" if est.cfg.parallel.cp == 1 else "(dp x cp)"
        out.append(
            "note: per parameter megalite keeps 2 B (16-bit param) + 4 B (fp32 main grad) + "
            f"12 B (fp32 master, Adam m, v; / {dp} under ZeRO-1, which adds a 4 B / {dp} reduced-"
            "gradient shard; ZeRO-2 keeps only that shard, plus bucket staging; ZeRO-3 also only "
            f"2 B / {dp} of the params between uses); the ZeRO paper counts 2 + 2 + 12 (P_os: "
            f"12 / dp; P_os+g: 14 / dp; P_os+g+p: 16 / dp): {format_bytes(paper)} of "
            f"model state on pp rank {fullest.pp_rank}, against {format_bytes(ours)} here"
        )
    p = est.cfg.parallel
    if p.cp > 1:
        out.append(
            f"note: cp={p.cp} keeps seq_len / cp = {est.cfg.model.seq_len // p.cp} tokens of each "
            "window per rank (activations / cp); parameters and gradients are replicated over "
            f"cp as over dp, ZeRO shards over dp x cp = {est.replicas}; the ring's K/V blocks "
            "and fp32 accumulators are a transient of each layer's attention"
        )
    out += float8_notes(est)
    o = est.cfg.optim
    if o.offload == "cpu" or o.state_dtype != "fp32":
        moment = 2 if o.state_dtype == "bf16" else 4
        where = (
            "; optim.offload=cpu keeps them, the fp32 master weights and the offload's gradient "
            "and upload staging in host memory, outside the GPU total"
        )
        out.append(
            f"note: Adam's m and v take {moment} + {moment} B per owned element "
            f"(optim.state_dtype={o.state_dtype}; master weights stay fp32)"
            + (where if o.offload == "cpu" else "")
        )
    return out


def float8_notes(est: LayoutEstimate) -> list[str]:
    """What `train.fp8` changes in the table, and the peak its MFU is stated against."""
    t = est.cfg.train
    if t.fp8 == "none":
        return []
    kept = {
        "tensorwise": "the tensor-parallel linears keep their inputs as float8 copies (1 B per "
        "element, plus an input and a weight scale of 4 B each; attention's projection keeps "
        "its copy beside the output attention keeps) and the expert GEMMs their scales",
        "rowwise": "the linears keep their inputs in the compute dtype, as torchao does (each "
        "GEMM casts its operands along the dim it contracts)",
    }[t.fp8]
    return [
        f"note: train.fp8={t.fp8} (linears with both dims >= train.fp8_min_dim = "
        f"{t.fp8_min_dim}): {kept}; MFU is stated against the {est.precision} dense peak, "
        "not float8's (twice it on H100)"
    ]


def as_dict(est: LayoutEstimate) -> dict[str, Any]:
    p = est.cfg.parallel
    return {
        "world_size": est.world_size,
        "tp": p.tp,
        "cp": p.cp,
        "cp_comm": p.cp_comm,
        "pp": p.pp,
        "vpp": p.vpp,
        "dp": est.dp,
        "microbatches": est.microbatches,
        "precision": est.precision,
        "fp8": est.cfg.train.fp8,
        "device": est.device,
        "cuda_context_bytes": est.cuda_context,
        "peak_bytes": est.peak_bytes,
        "stages": [
            {
                "pp_rank": s.pp_rank,
                "chunks": [[v, layers.start, layers.stop] for v, layers in s.chunks],
                "parameters": s.parameters,
                "in_flight": s.in_flight,
                "parts": {part.name: part.bytes for part in s.parts},
                "devices": {part.name: part.device for part in s.parts},
                "total_bytes": s.total_bytes,
                "gpu_bytes": est.gpu_bytes(s),
            }
            for s in est.stages
        ],
    }


def _run(args: argparse.Namespace) -> int:
    from megalite.config import load_config

    cfg = load_config(args.config, args.overrides)  # a bad config fails before torch loads
    from megalite.profiling.estimate import CUDA_CONTEXT_BYTES, estimate_layout

    context = CUDA_CONTEXT_BYTES if args.cuda_context is None else round(args.cuda_context * 2**30)
    est = estimate_layout(cfg, args.world_size, args.device, context)
    print(json.dumps(as_dict(est), indent=2) if args.json else table(est))
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    """Add `megalite estimate`."""
    cmd = commands.add_parser(
        "estimate",
        help="per-rank memory of a layout, without building the model",
        description=__doc__.split("\n\n")[0],
    )
    cmd.add_argument("--config", help="YAML config (see configs/); defaults when omitted")
    cmd.add_argument(
        "--world-size", type=positive_int, required=True, metavar="N", help="ranks in all"
    )
    cmd.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cuda: Triton kernels, bf16 for precision=auto; cpu: what a CPU run keeps",
    )
    cmd.add_argument(
        "--cuda-context",
        type=non_negative_float,
        metavar="GIB",
        help="CUDA context per process added to the nvidia-smi view (default 0.75)",
    )
    cmd.add_argument("--json", action="store_true", help="print JSON instead of the table")
    cmd.add_argument("overrides", nargs="*", metavar="section.key=value")
    cmd.set_defaults(func=_run)
