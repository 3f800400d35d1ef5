"""A run's resumable state, typed: everything a rank must get back to continue a run as if it had
never stopped. The training loop builds one `RunState` and hands it to the one save / load pair,
`writer.save_checkpoint` and `sharded.load_checkpoint`; nothing else saves or restores a run, and
only those two modules know how the state lies on disk."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megalite.data.sampler import GlobalBatchSampler
from megalite.optimizer.bad_steps import BadStepPolicy
from megalite.optimizer.distributed import DistributedOptimizer
from megalite.optimizer.loss_scale import LossScaler
from megalite.parallel_state import ParallelState
from megalite.tensor_parallel import TPRandom


def routing_tensors(chunks: list[nn.Module]) -> dict[str, torch.Tensor]:
    """The MoE routers' balancing biases of `chunks`, by global name (`RunState.routing`): what
    a model's routing depends on besides its parameters."""
    return {
        f"{name}.expert_bias": module.expert_bias
        for chunk in chunks
        for name, module in chunk.named_modules()
        if hasattr(module, "take_load")
    }


@dataclass
class RngStreams:
    """The random streams a rank draws from while training: torch's default generator (and the
    GPU's on CUDA) and the tensor-parallel dropout stream. They continue only in the layout they
    were saved in (another layout draws different numbers anyway) and, but for the CPU
    generator, on the device type they were saved on: a GPU's generator state is not a CPU's
    (a run saved on CUDA holds `torch_cuda`)."""

    tp_random: TPRandom

    def state_dict(self) -> dict[str, torch.Tensor]:
        device = self.tp_random.device
        state = {"torch_cpu": torch.get_rng_state(), "tp_stream": self.tp_random.state.cpu()}
        if device.type == "cuda":
            state["torch_cuda"] = torch.cuda.get_rng_state(device)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        device = self.tp_random.device
        torch.set_rng_state(state["torch_cpu"])
        if ("torch_cuda" in state) != (device.type == "cuda"):
            return  # saved on the other device type: this run's fresh streams stand
        self.tp_random.state = state["tp_stream"].to(self.tp_random.state.device)
        if device.type == "cuda":
            torch.cuda.set_rng_state(state["torch_cuda"], device)


@dataclass
class RunState:
    """One rank's share of a run's state. The tensors (parameters, optimizer state, RNG streams)
    are saved per rank and by global name, so they load into any layout; the rest is the
    JSON-able `trainer_state`. A feature with state of its own to resume (a tracker's run id,
    bad-step counters) adds a field here and its key to `trainer_state` / `load_trainer_state`,
    and nothing else changes: not the loop, not the file format."""

    ps: ParallelState
    """The layout the state is held in (tp, pp, dp, world size); saved with it."""
    params: dict[str, nn.Parameter]
    """This rank's parameters by global name."""
    optimizer: DistributedOptimizer
    """Its step count and the master weights and Adam moments of the elements this rank owns."""
    rng: RngStreams
    sampler: GlobalBatchSampler
    """The data position."""
    scaler: LossScaler
    bad_steps: BadStepPolicy
    """The bad-step counters (in total, in a row) and the recent losses spikes are judged by."""
    config: dict[str, Any]
    """The run's resolved config: a resume says what changed since, generation rebuilds the
    model from it."""
    step: int = 0
    """Steps done."""
    tracker_id: str | None = None
    """The run's id in the experiment trackers, so a resume continues the same tracked run."""
    routing: dict[str, torch.Tensor] = field(default_factory=dict)
    """Tensors besides the parameters that the model's behaviour depends on, by global name:
    the MoE routers' balancing biases (`<layer>.mlp.expert_bias`, carrying a replicated
    `ParamMeta`), the same on every replica.
    Saved with the weights by the first replica of their pipeline stage, loaded by name in any
    layout."""

    def trainer_state(self) -> dict[str, Any]:
        """The JSON-able part of the state, as a checkpoint stores it."""
        return {
            "step": self.step,
            "sampler": self.sampler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "bad_steps": self.bad_steps.state_dict(),
            "config": self.config,
            "tracker_id": self.tracker_id,
        }

    def load_trainer_state(self, saved: dict[str, Any]) -> None:
        """Continue from `saved` (what `trainer_state` returned). The sampler refuses a data
        order the saved run did not have (another seed, batch size or dataset)."""
        self.sampler.load_state_dict(saved["sampler"])
        self.scaler.load_state_dict(saved["scaler"])
        if "bad_steps" in saved:  # absent in checkpoints from before the bad-step policy
            self.bad_steps.load_state_dict(saved["bad_steps"])
        self.step = saved["step"]
        self.tracker_id = saved.get("tracker_id")  # absent in checkpoints from before trackers
