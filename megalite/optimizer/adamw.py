"""AdamW's update on flat pieces of optimizer state, with its moments stored in fp32 or bf16.

The update is torch's fused AdamW kernel (`torch._fused_adamw_`, on CPU and CUDA alike): one
pass over the master weights, gradient and moments, the same arithmetic as torch.optim.AdamW.
Weight decay applies to matrices only, so each piece is handed over as two lists of views: the
ranges that decay and those that do not.

Lean state (`optim.state_dtype=bf16`), in the manner of Megatron's precision-aware optimizer:
the moments are stored in bf16 and the update computes in fp32. A chunk at a time, they are
upcast into fp32 scratch, updated together with the fp32 master weights (so the step itself uses
the unrounded moments, and the first step equals fp32's exactly), then rounded back:

- exp_avg to nearest: it moves by (1 - beta1) = 10 % of itself per step, far above bf16's
  relative spacing (2^-8), so rounding does not stall it, and its rounding errors are signed
  and average out;
- exp_avg_sq stochastically (round up with probability equal to the distance from the lower
  bf16 neighbour): with beta2 = 0.999 it would move by 0.1 % per step, below half of bf16's
  spacing, and round-to-nearest would freeze it at a stale, too-large value once gradients
  shrink, silently shrinking the steps. Unbiased rounding keeps its expectation exact. Underflow
  is no concern: bf16 has fp32's exponent range, and a v below 1e-16 is dominated by eps^2.
  The rounding noise is drawn from a generator seeded by (step, rank), so a resumed run draws
  the same numbers without saving any generator state.
"""

from __future__ import annotations

import torch

from megalite.config import OptimConfig

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
UPCAST_CHUNK = {"cpu": 1 << 18, "cuda": 1 << 24}
"""Elements per chunk of a bf16-state update (cache-sized on CPU, large on GPUs): its scratch
holds two fp32 moments and the int32 rounding noise of one chunk."""
SCRATCH_BYTES_PER_ELEMENT = 3 * 4  # m and v in fp32, the int32 noise


def complement(ranges: list[tuple[int, int]], numel: int) -> list[tuple[int, int]]:
    """The parts of [0, numel) that sorted, disjoint `ranges` leave out."""
    out, at = [], 0
    for lo, hi in ranges:
        if lo > at:
            out.append((at, lo))
        at = hi
    if at < numel:
        out.append((at, numel))
    return out


def clip_ranges(ranges: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """`ranges` cut to [lo, hi), relative to lo."""
    return [(max(a, lo) - lo, min(b, hi) - lo) for a, b in ranges if a < hi and b > lo]


def scratch_numel(largest_piece: int, state_dtype: str, device_type: str) -> int:
    """Elements of the upcast scratch an update of pieces up to `largest_piece` needs (none for
    fp32 moments, which the kernel updates in place)."""
    if state_dtype == "fp32":
        return 0
    return min(largest_piece, UPCAST_CHUNK[device_type])


def stochastic_round_(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Round fp32 `x` in place to a bf16-representable value, up with probability equal to
    the dropped fraction: add 16 random low bits, then clear them. `noise`: int32 in [0, 2^16),
    like x. (Finite x only; a carry into the exponent is the correct round-up.)"""
    bits = x.view(torch.int32)
    bits.add_(noise).bitwise_and_(-(1 << 16))
    return x


class AdamW:
    """The update of flat optimizer-state pieces stored on `device` (the run's device, or the
    host under offload), with moments in `state_dtype`."""

    def __init__(
        self, cfg: OptimConfig, device: torch.device, largest_piece: int, rank: int
    ) -> None:
        self.cfg, self.device, self.rank = cfg, device, rank
        self.state_dtype = STATE_DTYPES[cfg.state_dtype]
        self.chunk = scratch_numel(largest_piece, cfg.state_dtype, device.type)
        self.scratch = torch.empty(
            self.chunk * 3, dtype=torch.float32, device=device
        )  # m, v, noise
        self.step_tensor = torch.zeros((), dtype=torch.float32, device=device)
        self.generator = torch.Generator(device=device)
        self.inverse_scale: torch.Tensor | None = None

    def zeros(self, numel: int, pin: bool) -> torch.Tensor:
        """A zeroed moment of `numel` elements."""
        return torch.zeros(numel, dtype=self.state_dtype, device=self.device, pin_memory=pin)

    def begin_step(self, step: int, grad_scale: float) -> None:
        """Set the step count (for bias correction) and the gradient scale of this step; seed
        the rounding noise from (step, rank)."""
        self.step_tensor.fill_(step)
        self.inverse_scale = (
            None
            if grad_scale == 1.0
            else torch.full((), 1.0 / grad_scale, dtype=torch.float32, device=self.device)
        )
        self.generator.manual_seed((step << 24) + self.rank)

    @torch.no_grad()
    def update(
        self,
        master: torch.Tensor,
        grads: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        decay: list[tuple[int, int]],
        lr: float,
    ) -> None:
        """One AdamW step on a flat piece: fp32 master weights and gradient, moments in the
        state dtype, weight decay on the `decay` ranges."""
        if self.state_dtype == torch.float32:
            self._kernel(master, grads, exp_avg, exp_avg_sq, decay, lr)
            return
        n = self.chunk
        m32, v32, noise = self.scratch[:n], self.scratch[n : 2 * n], self.scratch[2 * n :]
        noise = noise.view(torch.int32)
        for lo in range(0, master.numel(), n):
            hi = min(lo + n, master.numel())
            m, v = exp_avg[lo:hi], exp_avg_sq[lo:hi]
            m_up, v_up = m32[: hi - lo].copy_(m), v32[: hi - lo].copy_(v)
            self._kernel(master[lo:hi], grads[lo:hi], m_up, v_up, clip_ranges(decay, lo, hi), lr)
            m.copy_(m_up)
            bits = noise[: hi - lo].random_(0, 1 << 16, generator=self.generator)
            v.copy_(stochastic_round_(v_up, bits))

    def _kernel(self, master, grads, exp_avg, exp_avg_sq, decay, lr: float) -> None:
        """torch's fused AdamW on the decayed and the undecayed ranges of one fp32 piece."""
        cfg = self.cfg
        undecayed = complement(decay, master.numel())
        for ranges, weight_decay in ((decay, cfg.weight_decay), (undecayed, 0.0)):
            if not ranges:
                continue
            views = [[t[lo:hi] for lo, hi in ranges] for t in (master, grads, exp_avg, exp_avg_sq)]
            torch._fused_adamw_(
                *views,
                [],
                [self.step_tensor] * len(ranges),
                lr=lr,
                beta1=cfg.beta1,
                beta2=cfg.beta2,
                weight_decay=weight_decay,
                eps=cfg.eps,
                amsgrad=False,
                maximize=False,
                grad_scale=self.inverse_scale,
            )
