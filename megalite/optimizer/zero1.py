"""AdamW on the fp32 master copy of the parameter elements this rank owns.

With ZeRO-1 (Rajbhandari et al. 2020; Megatron-LM's distributed optimizer) each data-parallel
rank owns 1/dp of every gradient bucket: it keeps fp32 master weights and Adam moments for that
piece only (12 bytes per owned element), steps on it, and the updated values are all-gathered
back into the model. With ZeRO-0 a rank owns every element, and this is plain mixed-precision
AdamW. The update matches torch.optim.AdamW (decoupled weight decay, bias-corrected moments).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megalite import comm
from megalite.config import OptimConfig
from megalite.optimizer.clip import sum_of_squares
from megalite.optimizer.grad_buffer import GradBuffer
from megalite.parallel_state import ParallelState


@dataclass
class ShardState:
    """Optimizer state of one buffer's owned elements (all fp32, owned coordinates)."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    decay: torch.Tensor
    """1.0 where weight decay applies (matrices), 0.0 for norms and biases."""
    counted: list[tuple[int, int]]
    """Ranges this rank counts in the global grad norm: each element of the model exactly once
    (tp-replicated parameters on tp rank 0, tied copies on their owner)."""


def _owned_ranges(buffer: GradBuffer, include) -> list[tuple[int, int]]:
    """Owned-coordinate ranges of the parameters `include` selects, adjacent ones merged."""
    ranges: list[tuple[int, int]] = []
    for start, end in sorted(
        (s, e) for p in buffer.params if include(p) for s, e, _ in buffer.owned_segments(p)
    ):
        if ranges and ranges[-1][1] == start:
            ranges[-1] = (ranges[-1][0], end)
        else:
            ranges.append((start, end))
    return ranges


def _owned_mask(buffer: GradBuffer, include) -> torch.Tensor:
    owned = sum(e - s for s, e in buffer.owned_ranges)
    mask = torch.zeros(owned, dtype=torch.float32, device=buffer.params_flat.device)
    for start, end in _owned_ranges(buffer, include):
        mask[start:end] = 1.0
    return mask


class DistributedOptimizer:
    def __init__(
        self,
        buffers: list[GradBuffer],
        names: dict[nn.Parameter, str],
        cfg: OptimConfig,
        ps: ParallelState,
    ) -> None:
        self.buffers, self.names, self.cfg, self.ps = buffers, names, cfg, ps
        self.step_count = 0
        self.states = []
        for buffer in buffers:
            # fp32 parameters that this rank owns entirely are their own master copy
            alias = not buffer.sharded and buffer.params_flat.dtype == torch.float32
            master = buffer.params_flat if alias else buffer.owned_params().float()
            self.states.append(
                ShardState(
                    master=master,
                    exp_avg=torch.zeros_like(master),
                    exp_avg_sq=torch.zeros_like(master),
                    decay=_owned_mask(buffer, lambda p: p.meta.weight_decay),
                    counted=_owned_ranges(buffer, self._counts_in_norm),
                )
            )

    def _counts_in_norm(self, param: nn.Parameter) -> bool:
        replicated_over_tp = param.meta.tp_split_dim is None
        return param.meta.tied_name is None and (self.ps.tp_rank == 0 or not replicated_over_tp)

    @property
    def sharded(self) -> bool:
        return any(b.sharded for b in self.buffers)

    def norm_group(self):
        """Ranks whose owned gradients together cover the model exactly once."""
        return self.ps.world_group if self.sharded else self.ps.model_parallel_group

    def grad_norm(self) -> float:
        """Global L2 norm of the (unscaled) gradient over every rank."""
        sumsq = torch.zeros((), dtype=torch.float64, device=self.ps.device)
        for buffer, state in zip(self.buffers, self.states):
            for start, end in state.counted:
                sumsq += sum_of_squares(buffer.owned_grads[start:end])
        comm.all_reduce(sumsq, self.norm_group())
        return sumsq.sqrt().item()

    def found_non_finite(self) -> bool:
        """Whether any rank's gradient has inf/nan (fp16 overflow), agreed over all ranks."""
        flag = torch.zeros((), dtype=torch.float32, device=self.ps.device)
        for buffer in self.buffers:
            if not torch.isfinite(buffer.owned_grads).all():
                flag.fill_(1.0)
        comm.all_reduce_max(flag, self.ps.world_group)
        return bool(flag.item())

    @torch.no_grad()
    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        """One AdamW step on the owned elements; gradients are multiplied by grad_scale first
        (the clip coefficient divided by the loss scale)."""
        cfg = self.cfg
        self.step_count += 1
        bias1 = 1.0 - cfg.beta1**self.step_count
        bias2_sqrt = (1.0 - cfg.beta2**self.step_count) ** 0.5
        for buffer, state in zip(self.buffers, self.states):
            grad = buffer.owned_grads  # the scale is folded into the moment updates
            state.exp_avg.mul_(cfg.beta1).add_(grad, alpha=(1.0 - cfg.beta1) * grad_scale)
            state.exp_avg_sq.mul_(cfg.beta2).addcmul_(
                grad, grad, value=(1.0 - cfg.beta2) * grad_scale**2
            )
            denom = state.exp_avg_sq.sqrt().div_(bias2_sqrt).add_(cfg.eps)
            if cfg.weight_decay:
                state.master.addcmul_(state.master, state.decay, value=-lr * cfg.weight_decay)
            state.master.addcdiv_(state.exp_avg, denom, value=-lr / bias1)
            buffer.write_owned_params(state.master)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> tuple[dict[str, torch.Tensor], int]:
        """Per-parameter state keyed `<global name>.<master|exp_avg|exp_avg_sq>`, each shaped
        like the local parameter (owned pieces gathered over dp), so it reloads into any dp."""
        out = {}
        for buffer, state in zip(self.buffers, self.states):
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                full = torch.zeros_like(buffer.grads_flat)
                offset = 0
                for start, end in buffer.owned_ranges:
                    full[start:end] = getattr(state, kind)[offset : offset + end - start]
                    offset += end - start
                if buffer.sharded:
                    comm.all_reduce(full, self.ps.dp_group)  # owners are disjoint: a gather
                for param in buffer.params:
                    start = buffer.offsets[param]
                    out[f"{self.names[param]}.{kind}"] = (
                        full[start : start + param.numel()].view_as(param).clone()
                    )
        return out, self.step_count

    def load_state_dict(self, tensors: dict[str, torch.Tensor], step_count: int) -> None:
        self.step_count = step_count
        for buffer, state in zip(self.buffers, self.states):
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                target = getattr(state, kind)
                for param in buffer.params:
                    flat = tensors[f"{self.names[param]}.{kind}"].reshape(-1)
                    for start, end, inside in buffer.owned_segments(param):
                        target[start:end] = flat[inside : inside + end - start]
