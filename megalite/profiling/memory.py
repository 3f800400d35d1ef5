"""Memory: the formulas (Korthikanti et al. 2022 for activations, mixed-precision Adam for the
static part), a counter of what autograd actually keeps for backward, and a per-rank estimate
for a config that uses the pipeline simulator for the number of micro-batches in flight.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from megalite.config import Config, data_parallel_size
from megalite.models import build_chunks
from megalite.parallel_state import ParallelState
from megalite.pipeline.schedule import build_schedule
from megalite.pipeline.simulate import simulate
from megalite.tensor_parallel import TPRandom
from megalite.tensor_parallel.random import checkpoint_input_logs


def activation_bytes_per_layer(
    s: int,
    b: int,
    h: int,
    a: int,
    t: int = 1,
    sp: bool = False,
    recompute: str = "none",
    flash: bool = False,
) -> float:
    """Bytes one transformer layer keeps for backward with 16-bit activations and dropout
    (Korthikanti et al. 2022, table 2). A flash kernel drops the 5as/h attention term."""
    attention = 0.0 if flash or recompute == "selective" else 5 * a * s / h
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)  # only the layer input
    if sp:
        return s * b * h / t * (34 + attention)
    return s * b * h * (10 + 24 / t + attention / t)


@dataclass
class SavedBytes:
    total: int = 0


@contextlib.contextmanager
def count_saved_activations(exclude: Sequence[torch.Tensor] = ()) -> Iterator[SavedBytes]:
    """Bytes of distinct tensors kept for backward inside the block (autograd's saved tensors
    plus the inputs that recompute checkpoints keep outside them), not counting `exclude`
    (the parameters)."""
    seen = {t.untyped_storage().data_ptr() for t in exclude}
    result = SavedBytes()
    checkpointed: list[torch.Tensor] = []

    def add(tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            result.total += storage.nbytes()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        add(tensor)
        return tensor

    checkpoint_input_logs.append(checkpointed)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield result
    finally:
        checkpoint_input_logs.remove(checkpointed)
        for tensor in checkpointed:
            add(tensor)


def in_flight_microbatches(cfg: Config, dp: int) -> float:
    """Micro-batches' worth of its layers the first pipeline stage holds at its peak."""
    p = cfg.parallel
    if p.pp == 1:
        return 1.0
    m = cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp)
    schedules = [
        build_schedule(p.schedule, p.pp, r, m, p.vpp, p.microbatch_group_size) for r in range(p.pp)
    ]
    return simulate(schedules, p.pp, p.vpp).peak_in_flight_microbatches[0]


def recomputed_layers_per_stage(cfg: Config) -> float:
    """Layers of a pipeline stage whose activations full recompute drops: all of them, or the
    first `train.recompute_layers` of each of its vpp chunks."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    layers_per_stage = m.n_layers / p.pp
    if t.recompute != "full":
        return 0.0
    if t.recompute_layers is None:
        return layers_per_stage
    return p.vpp * min(t.recompute_layers, layers_per_stage / p.vpp)


def estimate(cfg: Config, world_size: int, params_per_rank: int) -> dict[str, float]:
    """Bytes per rank of the first pipeline stage: parameters, gradients, optimizer state and
    activations (16-bit training; `params_per_rank` counts this rank's shards)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    dp = data_parallel_size(world_size, p.tp, p.pp)

    def per_layer(recompute: str) -> float:
        return activation_bytes_per_layer(
            m.seq_len,
            t.micro_batch_size,
            m.hidden,
            m.n_heads,
            p.tp,
            p.sp,
            recompute,
            flash=m.dropout == 0.0,
        )

    recomputed = recomputed_layers_per_stage(cfg)
    kept = m.n_layers / p.pp - recomputed
    kept_mode = "none" if t.recompute == "full" else t.recompute
    stage_bytes = recomputed * per_layer("full") + kept * per_layer(kept_mode)
    return {
        "params": 2 * params_per_rank,
        "grads": 4 * params_per_rank,
        "optimizer": 12 * params_per_rank / (dp if p.zero else 1),
        "activations": stage_bytes * in_flight_microbatches(cfg, dp),
    }


def first_stage_params(cfg: Config, world_size: int) -> int:
    """Parameters held by tp rank 0 of the first pipeline stage, counted on the meta device
    (no memory, no process group: the model is only built to be measured)."""
    p = cfg.parallel
    dp = data_parallel_size(world_size, p.tp, p.pp)
    ps = ParallelState(0, world_size, p.tp, p.pp, dp, 0, 0, 0, torch.device("meta"))
    tp_random = TPRandom(0, ParallelState.single())  # the dropout stream: never used, nothing runs
    chunks = build_chunks(cfg, ps, tp_random, random_init=False)
    return sum(param.numel() for chunk in chunks for param in chunk.parameters())
