"""The bad-step policy. A step whose loss or gradient norm is not finite (NaN / inf), or whose
loss spikes above `fault.loss_spike_factor` times the median of the recent good losses, skips
its update (weights and optimizer state stay as they were) and is counted; the loop's `BadSteps`
hook (`training/hooks.py`) reports the count as `bad_steps` and stops the run after
`fault.max_bad_steps` in a row. An fp16 overflow is not a bad step: the loss scaler skips those
and counts them itself (`skipped_steps`); but a loss that is not finite is one, skipped or not
(weights that give NaN would otherwise halve the scale forever and be saved as good). The
policy sits beside the loss scaler, the other judge of steps, so that the run state
(`checkpoint/state.py`) saves its counters without importing the trainer.

While a streak lasts (`in_a_row` > 0) the weights are the ones that went bad, so the loop saves
no periodic checkpoint, and a save that must happen (preemption, the last step) is marked bad:
a run resumes by itself only from a good one. A resume starts the streak at 0: the bad steps
before it were judged under the configuration the restart usually changed (a lower lr), and a
carried count would stop the run before it took one step (`load_state_dict`). A streak runs
with the weights saved at the step before it began (bad steps skip their updates), perhaps
saved as good: pruning keeps the good checkpoint before the newest good one for that, and a
streak that stops the run demotes the saves holding its weights (`checkpoint/writer.py`:
`last_good_states`, `demote_from`).

Every rank must decide alike, or the replicas' weights part for good. The loss is already global
(reduced over dp and pp) and so is the history of good losses; the gradient norm, though, is
reduced only over the ranks that hold one copy of the model, so a gradient that turns NaN on one
data-parallel replica after the reduction would reach that replica's norm alone. One 4-byte
all-reduce over the world makes the non-finite verdict common.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

import torch

from megalite import comm
from megalite.config import FaultConfig
from megalite.parallel_state import ParallelState


class BadStepPolicy:
    """Judges each step and keeps the counters a checkpoint saves: bad steps in total, in a row
    now, and the recent good losses the spike median is taken over."""

    def __init__(self, max_in_a_row: int = 5, spike_factor: float = 0.0, window: int = 20) -> None:
        self.max_in_a_row, self.spike_factor = max_in_a_row, spike_factor
        self.total = 0
        self.in_a_row = 0
        self.recent: deque[float] = deque(maxlen=window)

    @classmethod
    def from_config(cls, cfg: FaultConfig) -> BadStepPolicy:
        return cls(cfg.max_bad_steps, cfg.loss_spike_factor, cfg.loss_spike_window)

    def judge(self, loss: float, grad_norm: float, ps: ParallelState) -> str | None:
        """Why this step is bad (None: it is good), the same on every rank, and count it.
        Collective over the world."""
        non_finite = torch.tensor(float(not math.isfinite(grad_norm)), device=ps.device)
        comm.all_reduce_max(non_finite, ps.world_group)
        reason = self.reason(loss, bool(non_finite.item()))
        self.count(reason, loss)
        return reason

    def reason(self, loss: float, non_finite_grad: bool) -> str | None:
        """Why a step with this (global) loss is bad, or None. Spikes are judged from the first
        good loss on: losses fall fastest early, so a short window's median errs high, towards
        letting a step pass, and waiting for a full window would let a run that diverges early
        (or soon after a resume) save its diverged weights as good."""
        if not math.isfinite(loss):
            return f"loss is {loss}"
        if non_finite_grad:
            return "gradient norm is not finite"
        if self.spike_factor and self.recent:
            median = statistics.median(self.recent)
            if loss > self.spike_factor * median:
                return (
                    f"loss spike: {loss:.4g} > {self.spike_factor:g} x {median:.4g}, the median "
                    f"of the last {len(self.recent)} good losses"
                )
        return None

    def count(self, reason: str | None, loss: float) -> None:
        if reason is None:
            self.in_a_row = 0
            self.recent.append(loss)
        else:
            self.total += 1
            self.in_a_row += 1

    @property
    def exhausted(self) -> bool:
        """Whether the run must stop: max_in_a_row bad steps in a row."""
        return self.in_a_row >= self.max_in_a_row

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total, "in_a_row": self.in_a_row, "recent": list(self.recent)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The total and the recent good losses carry on; the streak starts at 0 (see above: the
        saved `in_a_row` says only whether the checkpoint was saved during one)."""
        self.total, self.in_a_row = state["total"], 0
        self.recent.clear()
        self.recent.extend(state["recent"])
