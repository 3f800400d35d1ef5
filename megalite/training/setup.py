"""Build everything one rank trains with from the config: its model chunks (from the model
factory, `megalite.models.build_chunks`), gradient buffers, optimizer, loss scaler and pipeline
executor. The same function serves every layout."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from megalite.checkpoint.initial import load_initial_weights
from megalite.checkpoint.state import routing_tensors
from megalite.config import Config
from megalite.context_parallel.layout import SequenceCut
from megalite.data_parallel.grad_buffer import GradBuffer, build_grad_buffers
from megalite.models.causal_lm import CausalLM
from megalite.models.factory import build_chunks
from megalite.optimizer.bad_steps import BadStepPolicy
from megalite.optimizer.distributed import DistributedOptimizer
from megalite.optimizer.loss_scale import LossScaler
from megalite.parallel_state import ParallelState
from megalite.pipeline.executor import PipelineExecutor
from megalite.pipeline.schedule import Action, build_schedule, v_shaped
from megalite.tensor_parallel import TPRandom
from megalite.training.compile import CompileWatch, can_trace_linears, compile_blocks

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_precision(precision: str, device: torch.device) -> str:
    """auto: bf16 on CUDA, fp32 on CPU."""
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


@dataclass
class Run:
    """One rank's training state."""

    cfg: Config
    ps: ParallelState
    chunks: list[CausalLM]
    buffers: list[GradBuffer]
    optimizer: DistributedOptimizer
    scaler: LossScaler
    executor: PipelineExecutor
    tp_random: TPRandom
    bad_steps: BadStepPolicy
    """Judges each step (NaN / inf, loss spikes); its counters are part of the run state."""
    names: dict[nn.Parameter, str] = field(default_factory=dict)
    compile_watch: CompileWatch | None = None
    """With `train.compile`: compile time and recompiles of the blocks (training/compile.py)."""
    eos_id: int | None = None
    """The data's end-of-document token, where documents are masked (`data.document_mask`)."""
    _schedules: dict[tuple[int, bool], list[Action]] = field(default_factory=dict)

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """Global name -> local parameter over all chunks (names never repeat across chunks)."""
        return {name: param for param, name in self.names.items()}

    @property
    def sequence_cut(self) -> SequenceCut:
        """How this rank cuts its windows: its cp chunks, and the documents if masked."""
        masked = self.cfg.data.document_mask
        if masked and self.eos_id is None:
            raise ValueError("data.document_mask needs the data's eos_id (Run.eos_id)")
        return SequenceCut(
            self.cfg.model.seq_len,
            self.ps.size("cp"),
            self.ps.coord("cp"),
            self.eos_id if masked else None,
            self.cfg.data.reset_positions,
            self.ps.device,
        )

    @functools.cached_property
    def moe_layers(self) -> dict[str, nn.Module]:
        """The mixture-of-experts layers of this rank's chunks, by global name (their routing
        statistics and biases are kept per step: `step.route_balance`, `RunState.routing`)."""
        return {
            name: module
            for chunk in self.chunks
            for name, module in chunk.named_modules()
            if hasattr(module, "take_load")
        }

    def train(self, mode: bool = True) -> None:
        for chunk in self.chunks:
            chunk.train(mode)

    def schedule(self, num_microbatches: int, forward_only: bool = False) -> list[Action]:
        """This rank's action list (cached); evaluation runs GPipe's forwards."""
        key = (num_microbatches, forward_only)
        if key not in self._schedules:
            p = self.cfg.parallel
            self._schedules[key] = build_schedule(
                p.schedule,
                self.ps.size("pp"),
                self.ps.coord("pp"),
                num_microbatches,
                p.vpp,
                p.microbatch_group_size,
                forward_only,
            )
        return self._schedules[key]


def build_run(
    cfg: Config,
    ps: ParallelState,
    init_from: Path | None = None,
    random_init: bool = True,
    eos_id: int | None = None,
) -> Run:
    """`init_from`: weights to start from instead of the seeded initialisation (loaded before
    the optimizer takes its master copy). `random_init=False`: the caller loads every weight
    afterwards (resume), so drawing them would be wasted start-up time; nothing is drawn either
    with `init_from`, which fills every parameter."""
    precision = resolve_precision(cfg.train.precision, ps.device)
    tp_random = TPRandom(cfg.train.seed, ps)
    chunks = build_chunks(cfg, ps, tp_random, random_init and init_from is None)
    if init_from is not None:
        named = {name: p for chunk in chunks for name, p in chunk.named_parameters()}
        load_initial_weights(init_from, named, routing_tensors(chunks), ps, cfg.model)
    for chunk in chunks:
        chunk.to(DTYPES[precision])
    names = {param: name for chunk in chunks for name, param in chunk.named_parameters()}
    tied = {param for param in names if param.meta.pp_tied}
    buffers_of_chunk = [
        build_grad_buffers(
            [chunk],
            ps,
            cfg.parallel.bucket_mb,
            cfg.parallel.zero,
            tied,
            offload_params=cfg.optim.offload == "cpu",
            keep_gathered=not cfg.parallel.reshard_after_forward,
        )
        for chunk in chunks
    ]
    buffers = [b for chunk_buffers in buffers_of_chunk for b in chunk_buffers]
    seq = cfg.model.seq_len // ps.size("cp") // (ps.size("tp") if cfg.parallel.sp else 1)
    executor = PipelineExecutor(
        chunks,
        ps,
        cfg.parallel.vpp,
        activation_shape=(cfg.train.micro_batch_size, seq, cfg.model.hidden),
        dtype=DTYPES[precision],
        buffers_of_chunk=buffers_of_chunk,
        v_shape=v_shaped(cfg.parallel.schedule),
    )
    compile_watch = None
    if cfg.train.compile:
        compile_blocks(chunks, can_trace_linears(ps.size("tp"), cfg.parallel.schedule))
        compile_watch = CompileWatch()
    return Run(
        cfg=cfg,
        ps=ps,
        chunks=chunks,
        buffers=buffers,
        optimizer=DistributedOptimizer(buffers, names, cfg.optim, ps),
        scaler=LossScaler.for_precision(precision),
        executor=executor,
        tp_random=tp_random,
        bad_steps=BadStepPolicy.from_config(cfg.fault),
        names=names,
        compile_watch=compile_watch,
        eos_id=eos_id,
    )
