"""The one way to build a model: training, generation, Hugging Face export and import, and the
memory estimator all build their chunks here, so a model is the same object wherever it comes
from (same modules, same global parameter names, same initial weights)."""

from __future__ import annotations

from megalite.models.causal_lm import CausalLM
from megalite.models.layers import BuildContext
from megalite.models.partition import chunk_layers

from megalite.architectures import architecture, load
from megalite.config import Config
from megalite.float8.gemm import float8_training
from megalite.parallel_state import ParallelState
from megalite.tensor_parallel import TPRandom, init_parameters


def model_class(arch: str) -> type[CausalLM]:
    """The model of the registered architecture `arch` (its module imported on first use)."""
    return load(architecture(arch).model)


def build_chunks(
    cfg: Config, ps: ParallelState, tp_random: TPRandom, random_init: bool = True
) -> list[CausalLM]:
    """This rank's model chunks (virtual stages pp_rank, pp_rank + pp, ...), initialised from
    per-parameter seeds so that every layout starts from the same global weights; with
    random_init=False left uninitialised for a checkpoint to fill (or, on the meta device, only
    to be measured)."""
    p, t = cfg.parallel, cfg.train
    float8 = float8_training(t.fp8, t.fp8_min_dim, ps.device, token_groups=[ps.group("cp")])
    ctx = BuildContext(
        cfg.model,
        ps,
        tp_random,
        sequence_parallel=p.sp,
        recompute=t.recompute,
        recompute_layers=t.recompute_layers,
        cp_comm=p.cp_comm,
        float8=float8,
    )
    n_stages = ps.size("pp") * p.vpp
    model = model_class(cfg.model.arch)
    chunks = []
    for stage, layers in chunk_layers(cfg, ps.coord("pp")):
        chunk = model(ctx, layers, has_embedding=stage == 0, has_head=stage == n_stages - 1)
        if random_init:
            init_parameters(chunk, cfg.train.seed, ps)
        chunks.append(chunk)
    return chunks
