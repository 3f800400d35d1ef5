"""AdamW on the fp32 master copy of the parameter elements this rank owns.

With ZeRO-1 (Rajbhandari et al. 2020; Megatron-LM's distributed optimizer) each data-parallel
rank owns 1/dp of every gradient bucket: it keeps fp32 master weights and Adam moments for that
piece only (12 bytes per owned element), steps on it, and the updated values are all-gathered
back into the model, overlapped with the next forward (`GradBuffer.start_param_gather`). ZeRO-2
changes only where the gradients live: the owned pieces are the same. With ZeRO-0 a rank owns
every element, and this is plain mixed-precision AdamW. The update matches torch.optim.AdamW
(decoupled weight decay, bias-corrected moments).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from megalite import comm
from megalite.config import OptimConfig
from megalite.optimizer.clip import sum_of_squares
from megalite.optimizer.grad_buffer import GradBuffer
from megalite.parallel_state import ParallelState

STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")
"""The optimizer state kept per owned element, each fp32."""


@dataclass
class ShardState:
    """Optimizer state of one owned piece of a bucket (fp32; local coordinates of the piece)."""

    buffer: GradBuffer
    start: int
    """Where the piece starts in the buffer."""
    params: torch.Tensor
    """The piece of the model's parameters (a view)."""
    grads: torch.Tensor
    """Its reduced gradient (a view)."""
    master: torch.Tensor
    """fp32 master weights: the parameters themselves when they are fp32."""
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    decay: list[tuple[int, int]]
    """Ranges where weight decay applies (matrices; not norms and biases)."""
    counted: list[tuple[int, int]]
    """Ranges this rank counts in the global grad norm: each element of the model exactly once
    (tp-replicated parameters on tp rank 0, tied copies on their owner)."""


def _ranges(buffer: GradBuffer, start: int, end: int, include) -> list[tuple[int, int]]:
    """Where the parameters `include` selects meet buffer[start:end], relative to start, with
    adjacent ranges merged."""
    ranges: list[tuple[int, int]] = []
    for param in buffer.params:
        lo = max(start, buffer.offsets[param])
        hi = min(end, buffer.offsets[param] + param.numel())
        if lo >= hi or not include(param):
            continue
        if ranges and ranges[-1][1] == lo - start:
            ranges[-1] = (ranges[-1][0], hi - start)
        else:
            ranges.append((lo - start, hi - start))
    return sorted(ranges)


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
        self.states: list[ShardState] = []
        for buffer in buffers:
            for bucket, (start, end) in zip(buffer.buckets, buffer.owned_ranges):
                params = buffer.params_flat[start:end]
                master = params if params.dtype == torch.float32 else params.float()
                self.states.append(
                    ShardState(
                        buffer=buffer,
                        start=start,
                        params=params,
                        grads=buffer.owned_grads[bucket.owned],
                        master=master,
                        exp_avg=torch.zeros_like(master),
                        exp_avg_sq=torch.zeros_like(master),
                        decay=_ranges(buffer, start, end, lambda p: p.meta.weight_decay),
                        counted=_ranges(buffer, start, end, self._counts_in_norm),
                    )
                )
        # Elements per chunk of the update: cache-sized on CPU, large on GPUs (fewer launches).
        self.chunk_numel = 1 << 18 if ps.device.type == "cpu" else 1 << 24
        largest = max((state.master.numel() for state in self.states), default=0)
        self.scratch = torch.empty(min(largest, self.chunk_numel), device=ps.device)

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
        for state in self.states:
            for start, end in state.counted:
                sumsq += sum_of_squares(state.grads[start:end])
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
        """One AdamW step on the owned elements (torch.optim.AdamW's update); gradients are
        multiplied by grad_scale (the clip coefficient divided by the loss scale), which is
        folded into the moment updates rather than a scaled copy of the gradients."""
        cfg = self.cfg
        self.finish_param_gather()  # the last step's gather must not land on this update
        self.step_count += 1
        bias1 = 1.0 - cfg.beta1**self.step_count
        bias2_sqrt = (1.0 - cfg.beta2**self.step_count) ** 0.5
        chunk = self.chunk_numel
        scratch = self.scratch
        for state in self.states:
            for start, end in state.decay if cfg.weight_decay else ():
                state.master[start:end].mul_(1.0 - lr * cfg.weight_decay)
            for lo in range(0, state.master.numel(), chunk):
                # one cache-sized chunk at a time, with a reused buffer for the denominator
                g, m, v, p = (
                    t[lo : lo + chunk]
                    for t in (state.grads, state.exp_avg, state.exp_avg_sq, state.master)
                )
                m.mul_(cfg.beta1).add_(g, alpha=(1.0 - cfg.beta1) * grad_scale)
                v.mul_(cfg.beta2).addcmul_(g, g, value=(1.0 - cfg.beta2) * grad_scale**2)
                denom = torch.sqrt(v, out=scratch[: v.numel()]).div_(bias2_sqrt).add_(cfg.eps)
                p.addcdiv_(m, denom, value=-lr / bias1)
            if state.master is not state.params:
                state.params.copy_(state.master)
        for buffer in self.buffers:  # chunk order, each in forward order: the next forward's
            buffer.start_param_gather()

    def finish_param_gather(self) -> None:
        """Wait until every parameter updated by the last step has arrived on this rank (the
        next forward waits bucket by bucket; evaluation, checkpoints and the end of training
        read them all)."""
        for buffer in self.buffers:
            buffer.finish_param_gather()

    # ------------------------------------------------------------------ checkpoints

    def owned_pieces(self) -> Iterator[tuple[nn.Parameter, int, int, dict[str, torch.Tensor]]]:
        """(param, lo, hi, {kind: state}) for every range [lo, hi) of a parameter's flattened
        elements whose optimizer state this rank holds, `kind` in STATE_KINDS. The state
        tensors are views: a checkpoint saves and restores exactly what this rank owns, with no
        gather over dp."""
        for state in self.states:
            end = state.start + state.master.numel()
            for param in state.buffer.params:
                p_start = state.buffer.offsets[param]
                lo, hi = max(state.start, p_start), min(end, p_start + param.numel())
                if lo < hi:
                    views = {
                        k: getattr(state, k)[lo - state.start : hi - state.start]
                        for k in STATE_KINDS
                    }
                    yield param, lo - p_start, hi - p_start, views

    @torch.no_grad()
    def load_pieces(
        self, read: Callable[[nn.Parameter, str], torch.Tensor], step_count: int
    ) -> None:
        """Restore the owned state; `read(param, kind)` gives the state of the whole local
        parameter, flattened (read once per owned range, so host memory stays at one
        parameter's piece)."""
        self.finish_param_gather()
        self.step_count = step_count
        for param, lo, hi, views in self.owned_pieces():
            for kind, view in views.items():
                view.copy_(read(param, kind)[lo:hi])
        for state in self.states:
            if state.master is not state.params:
                state.params.copy_(state.master)
