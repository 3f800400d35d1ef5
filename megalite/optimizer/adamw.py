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
  The rounding noise is a hash of (step, tensor, element index) (`rounding_noise`), not a
  generator's draw: a resumed run gets the same numbers without saving any generator state, a
  piece gives the same result in one chunk or many, and it costs a dozen cheap elementwise
  passes, where torch's (serial) CPU generator took most of the update's time. The tensor is
  the global one an element belongs to (a tied copy: the one it copies) and the index is the
  element's in that global tensor, so every copy of an element (data-parallel replicas
  without ZeRO, tp-replicated norms and biases, the tied embedding's copies) rounds alike and
  the copies stay equal, and a tp layout rounds as the single process does (`NoiseSegment`).
"""

from __future__ import annotations

import zlib
from typing import NamedTuple

import torch

from megalite.config import OptimConfig
from megalite.tensor_parallel.layers import PieceInGlobal

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
UPCAST_CHUNK = {"cpu": 1 << 18, "cuda": 1 << 24}
"""Elements per chunk of a bf16-state update (cache-sized on CPU, large on GPUs): its scratch
holds two fp32 moments and the int32 rounding noise of one chunk (the hash's work space is the
first moment's, free by then)."""
SCRATCH_BYTES_PER_ELEMENT = 3 * 4  # m and v in fp32, the int32 noise


def _int32(value: int) -> int:
    """`value` mod 2^32 as a signed int32 (what torch's int32 arithmetic wraps to)."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


WEYL, FMIX1, FMIX2 = 0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35  # 2^32 / golden ratio; murmur3's


class NoiseSegment(NamedTuple):
    """Elements [lo, hi) of a flat piece of optimizer state are elements index, index + 1, ...
    of this rank's piece of one global tensor: they draw the rounding noise of `tensor_key` at
    their indices in the global tensor (`piece`: where the rank's piece lies in it)."""

    lo: int
    hi: int
    tensor_key: int
    index: int
    piece: PieceInGlobal = PieceInGlobal()


def tensor_key(name: str) -> int:
    """The 32-bit key of a global tensor's rounding noise: the same on every rank."""
    return zlib.crc32(name.encode())


def noise_seed(step: int, key: int) -> int:
    """The 32-bit seed of a step's rounding noise for one tensor: splitmix64's finalizer of
    (step, key), so distinct pairs get unrelated seeds."""
    z = ((step << 32) + key) & 0xFFFFFFFFFFFFFFFF
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0xFFFFFFFF


def noise_seeds(step: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`noise_seed(step, key)` for every key at once, as int32 (its bits), where the step count
    is a tensor on the device: the count a skipped step leaves unchanged is known there only.
    int64 arithmetic wraps as uint64 does; its right shifts are made logical by masking."""
    z = (step.to(torch.int64) << 32) + keys
    for shift, multiplier in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        z = (z ^ ((z >> shift) & ((1 << 64 - shift) - 1))) * _int64(multiplier)
    z = (z ^ ((z >> 31) & ((1 << 33) - 1))) & 0xFFFFFFFF
    return (z - (z >= 1 << 31).to(torch.int64) * (1 << 32)).to(torch.int32)


def _int64(value: int) -> int:
    """`value` mod 2^64 as a signed int64."""
    return value - (1 << 64) if value >= 1 << 63 else value


def rounding_noise(start: int, seed: int, out: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
    """Fill int32 `out` with the rounding noise, in [0, 2^16), of elements start, start + 1, ...:
    the top 16 bits of murmur3's fmix32 of (index * WEYL + seed) mod 2^32. `work`: int32 scratch
    of out's size.

    A counter-based hash rather than torch's generator, whose serial CPU draw took most of a
    bf16-state update's time: a dozen elementwise integer passes over `out` and `work` instead
    (no temporaries), which use every core, on CPU and CUDA alike. The value
    depends only on (seed, index), so a chunk at offset `start` gets the same numbers as the
    same elements of a larger call, and a resumed run the same as the first. The Weyl step
    spreads consecutive indices over the 32-bit range before fmix32 (a bijection) mixes them;
    indices wrap at 2^32. Signed int32 arithmetic wraps as unsigned would; shifts are made
    logical by masking."""
    torch.arange(out.numel(), out=out)
    out.mul_(_int32(WEYL)).add_(_int32(start * WEYL + seed))
    return _mix(out, work)


def _mix(out: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
    """`rounding_noise` from the Weyl values (index * WEYL + seed) in `out`: their fmix32, top
    16 bits."""
    for shift, multiplier in ((16, FMIX1), (13, FMIX2)):  # h ^= h >> s; h *= c
        torch.bitwise_right_shift(out, shift, out=work).bitwise_and_((1 << 32 - shift) - 1)
        out.bitwise_xor_(work).mul_(_int32(multiplier))
    return out.bitwise_right_shift_(16).bitwise_and_(0xFFFF)  # fmix32's last step keeps these


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


Piece = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[int, int]]]
"""A flat piece of fp32 state: master weights, gradient, first and second moment, and the
ranges of it that decay."""


class AdamW:
    """The update of flat optimizer-state pieces stored on `device` (the run's device, or the
    host under offload), with moments in `state_dtype`."""

    def __init__(self, cfg: OptimConfig, device: torch.device, largest_piece: int) -> None:
        self.cfg, self.device = cfg, device
        self.state_dtype = STATE_DTYPES[cfg.state_dtype]
        self.chunk = scratch_numel(largest_piece, cfg.state_dtype, device.type)
        self.scratch = torch.empty(
            self.chunk * 3, dtype=torch.float32, device=device
        )  # m, v, noise
        self.step_tensor = torch.zeros((), dtype=torch.float32, device=device)
        """Updates applied: the bias correction's step, moved on the device (a skipped step,
        known only there, leaves it)."""
        self.inverse_scale: torch.Tensor | None = None
        self.skip: torch.Tensor | None = None
        self.seeds: dict[int, torch.Tensor] = {}
        self.noise_for(set())

    def zeros(self, numel: int) -> torch.Tensor:
        """A zeroed moment of `numel` elements (never pinned: only the CPU or the GPU that
        holds it reads it, the copy engine never does)."""
        return torch.zeros(numel, dtype=self.state_dtype, device=self.device)

    def begin_step(
        self,
        grad_scale: torch.Tensor | float,
        skip: torch.Tensor | None = None,
    ) -> None:
        """Start a step: count it unless `skip` (a float flag, 1.0: skipped; both may be on
        another device than the state's, offload's host, and are copied here), take the
        gradient scale of this step, and (bf16 moments) the rounding-noise seeds of the
        tensors `noise_keys` names at the new count."""
        if skip is not None:
            skip = skip.to(self.device, torch.float32)
            self.step_tensor.add_(1.0 - skip)
        else:
            self.step_tensor.add_(1.0)
        self.skip = skip
        if isinstance(grad_scale, torch.Tensor):
            self.inverse_scale = grad_scale.to(self.device, torch.float32).reciprocal()
        elif grad_scale != 1.0:
            self.inverse_scale = torch.full((), 1.0 / grad_scale, device=self.device)
        else:
            self.inverse_scale = None
        if self.noise_keys:
            seeds = noise_seeds(self.step_tensor, self.noise_keys_tensor).unbind()
            self.seeds = dict(zip(self.noise_keys, seeds))

    def noise_for(self, keys: set[int]) -> None:
        """The tensors (`tensor_key`) whose elements the pieces hold: each step draws their
        seeds in one go, on the state's device."""
        self.noise_keys = sorted(keys) if self.state_dtype != torch.float32 else []
        self.noise_keys_tensor = torch.tensor(self.noise_keys, dtype=torch.int64).to(self.device)

    @torch.no_grad()
    def update(
        self,
        master: torch.Tensor,
        grads: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        decay: list[tuple[int, int]],
        lr: float,
        noise: list[NoiseSegment],
    ) -> None:
        """One AdamW step on a flat piece: fp32 master weights and gradient, moments in the
        state dtype, weight decay on the `decay` ranges; `noise`: whose elements the piece holds
        (bf16 moments round with their noise; elements outside every segment, the buckets'
        padding, round down)."""
        if self.state_dtype == torch.float32:
            self.update_in_place([(master, grads, exp_avg, exp_avg_sq, decay)], lr)
            return
        n = self.chunk
        m32, v32, bits = self.scratch[:n], self.scratch[n : 2 * n], self.scratch[2 * n :]
        bits = bits.view(torch.int32)
        for lo in range(0, master.numel(), n):
            hi = min(lo + n, master.numel())
            m, v = exp_avg[lo:hi], exp_avg_sq[lo:hi]
            m_up, v_up = m32[: hi - lo].copy_(m), v32[: hi - lo].copy_(v)
            chunk = (master[lo:hi], grads[lo:hi], m_up, v_up, clip_ranges(decay, lo, hi))
            self.update_in_place([chunk], lr)
            m.copy_(m_up)  # m32 is free now: the hash's work space
            chunk_bits = self._noise(noise, lo, hi, bits[: hi - lo], m_up.view(torch.int32))
            v.copy_(stochastic_round_(v_up, chunk_bits))

    def _noise(
        self, segments: list[NoiseSegment], lo: int, hi: int, out: torch.Tensor, work: torch.Tensor
    ) -> torch.Tensor:
        """The rounding noise of a piece's elements [lo, hi) into `out` (`work`: scratch): each
        segment's `rounding_noise`, in one hash of the chunk. Element p of a segment, the
        segment's piece's element i = index + p - segment.lo, has Weyl value g * WEYL + its
        seed, g = offset + i + (i // run) * gap its global index: p * WEYL plus the segment's
        constant, plus a per-element term only for a piece of several runs; then one mix for
        all (padding mixes p * WEYL, which any noise leaves at zero)."""
        torch.arange(lo, hi, out=out).mul_(_int32(WEYL))
        for segment in segments:
            a, b = max(segment.lo, lo), min(segment.hi, hi)
            if a < b:
                first, piece = segment.index - segment.lo, segment.piece  # i = first + p
                segment_out = out[a - lo : b - lo].add_(self.seeds[segment.tensor_key])
                segment_out.add_(_int32((first + piece.offset) * WEYL))
                if piece.run:
                    runs = torch.arange(first + a, first + b, out=work[: b - a])
                    runs.floor_divide_(piece.run).mul_(_int32(piece.gap * WEYL))
                    out[a - lo : b - lo].add_(runs)
        return _mix(out, work)

    def update_in_place(self, pieces: list[Piece], lr: float) -> None:
        """torch's fused AdamW on fp32 pieces (master, gradient, moments, decayed ranges): one
        kernel call for the ranges that decay, one for the rest, however many pieces."""
        cfg = self.cfg
        lists = {cfg.weight_decay: [[], [], [], []], 0.0: [[], [], [], []]}
        for *tensors, decay in pieces:
            undecayed = complement(decay, tensors[0].numel())
            for ranges, weight_decay in ((decay, cfg.weight_decay), (undecayed, 0.0)):
                for views, t in zip(lists[weight_decay], tensors):
                    views += [t[lo:hi] for lo, hi in ranges]
        for weight_decay, views in lists.items():
            if not views[0]:
                continue
            torch._fused_adamw_(
                *views,
                [],
                [self.step_tensor] * len(views[0]),
                lr=lr,
                beta1=cfg.beta1,
                beta2=cfg.beta2,
                weight_decay=weight_decay,
                eps=cfg.eps,
                amsgrad=False,
                maximize=False,
                grad_scale=self.inverse_scale,
                found_inf=self.skip,
            )
