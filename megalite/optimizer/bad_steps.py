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
from typing import Any

import torch

from megalite import comm
from megalite.config import FaultConfig
from megalite.parallel_state import ParallelState

GOOD, SPIKE, GRAD_NOT_FINITE, LOSS_NOT_FINITE = 0, 1, 2, 3
"""The verdict's codes: the largest that applies."""


class BadStepPolicy:
    """Judges each step and keeps the counters a checkpoint saves: bad steps in total, in a row
    now, and the recent good losses the spike median is taken over. They live on the device
    (`counters`, `recent`), so that a step is judged, and its update skipped, without waiting
    for its loss to reach the host; the host reads them for the metrics row and checkpoints."""

    def __init__(self, max_in_a_row: int = 5, spike_factor: float = 0.0, window: int = 20) -> None:
        self.max_in_a_row, self.spike_factor, self.window = max_in_a_row, spike_factor, window
        self.counters = torch.zeros(3, dtype=torch.float64)
        """(bad steps in total, in a row now, good losses ever recorded)."""
        self.recent = torch.full((window,), math.inf, dtype=torch.float64)
        """The last `window` good losses, a ring: the next goes where the count says; an empty
        slot holds inf, which sorts after every loss."""
        self._tables_on: torch.device | None = None
        self._seen: tuple[int, int] | None = (0, 0)
        """(total, in a row) as the host last saw them; None once `count` moved them."""

    @classmethod
    def from_config(cls, cfg: FaultConfig) -> BadStepPolicy:
        return cls(cfg.max_bad_steps, cfg.loss_spike_factor, cfg.loss_spike_window)

    def judge(
        self,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        ps: ParallelState,
        excused: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This step's verdict, the same on every rank, counted: (code, the spike median, the
        good losses it is over), float64 on the device (`describe` says it in words). An
        `excused` step (a flag: an fp16 overflow the loss scaler skips, its loss finite) is
        good and counts for nothing. Collective over the world."""
        non_finite = ((grad_norm - grad_norm) != 0).float()  # inf - inf and NaN are NaN
        comm.all_reduce_max(non_finite, ps.world_group)
        verdict = self.verdict(loss, non_finite, excused)
        self.count(verdict[:1], loss, excused)
        return verdict

    def verdict(
        self,
        loss: torch.Tensor,
        non_finite_grad: torch.Tensor,
        excused: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The verdict (`judge`) on a step with this (global) loss, not counted. Spikes are
        judged from the first good loss on: losses fall fastest early, so a short window's
        median errs high, towards letting a step pass, and waiting for a full window would let
        a run that diverges early (or soon after a resume) save its diverged weights as good.
        A score of small tensor operations (each a kernel launch on a GPU): the flags in one
        vector, the code the largest one's."""
        self._move_to(loss.device)
        loss = loss.to(torch.float64).view(1)
        held = self.counters[2:].clamp(max=self.window)
        middle = self._middles[held.long()]  # statistics.median's: the two middle ones' mean
        median = self.recent.sort().values[middle].mean(1)
        spike = self._no
        if self.spike_factor > 0:
            spike = (loss > self.spike_factor * median) & (held > 0)
        flags = torch.cat([spike, non_finite_grad.view(1) > 0, (loss - loss) != 0])
        code = (flags * self._codes).amax().view(1)
        if excused is not None:
            code = code * excused.logical_not()
        return torch.cat([code, median, held])

    def count(
        self, code: torch.Tensor, loss: torch.Tensor, excused: torch.Tensor | None = None
    ) -> None:
        """Count a judged step (`code` a 1-element float64 tensor): a bad one in the totals, a
        good one's loss in the window; an `excused` one not at all."""
        self._move_to(code.device)
        bad = (code > GOOD).double()
        slot = self._slots == self.counters[2] % self.window
        write = slot & (bad == 0) if excused is None else slot & (bad == 0) & ~excused
        self.recent = torch.where(write, loss.to(torch.float64), self.recent)
        # (total + bad, (in a row + 1) x bad, recorded + good): counters x keep + add
        keep = torch.addcmul(self._basis[0], bad, self._basis[1])
        add = torch.addcmul(self._basis[2], bad, self._basis[3])
        counters = torch.addcmul(add, self.counters, keep)
        if excused is not None:
            counters = torch.where(excused, self.counters, counters)
        self.counters = counters
        self._seen = None

    def saw(self, counters: list[float]) -> None:
        """The counters (total, in a row) as a copy of `counters[:2]` brought them to the host
        (the step's one read of its metrics), so that reading them costs no wait."""
        self._seen = (int(counters[0]), int(counters[1]))

    def _host_counters(self) -> tuple[int, int]:
        if self._seen is None:
            self.saw(self.counters[:2].tolist())
        return self._seen

    def describe(self, verdict: list[float], loss: float) -> str | None:
        """Why the step with this verdict (`judge`'s, on the host) and loss is bad, or None."""
        code, median, held = verdict
        if code == LOSS_NOT_FINITE:
            return f"loss is {loss}"
        if code == GRAD_NOT_FINITE:
            return "gradient norm is not finite"
        if code == SPIKE:
            return (
                f"loss spike: {loss:.4g} > {self.spike_factor:g} x {median:.4g}, the median "
                f"of the last {int(held)} good losses"
            )
        return None

    def _move_to(self, device: torch.device) -> None:
        """The state, and the constant tables the verdict reads, on `device` (once)."""
        if self._tables_on == device:
            return
        self.counters, self.recent = self.counters.to(device), self.recent.to(device)
        held = torch.arange(self.window + 1)
        self._middles = torch.stack([(held - 1).clamp_min(0) // 2, held // 2], 1).to(device)
        self._slots = torch.arange(self.window, dtype=torch.float64).to(device)
        self._codes = torch.tensor([SPIKE, GRAD_NOT_FINITE, LOSS_NOT_FINITE], dtype=torch.float64)
        self._codes = self._codes.to(device)
        basis = [[1, 0, 1], [0, 1, 0], [0, 0, 1], [1, 1, -1]]  # keep, its bad part; add, its bad
        self._basis = torch.tensor(basis, dtype=torch.float64).to(device)
        self._no = torch.zeros(1, dtype=torch.bool).to(device)
        self._tables_on = device

    @property
    def total(self) -> int:
        return self._host_counters()[0]

    @property
    def in_a_row(self) -> int:
        return self._host_counters()[1]

    @property
    def exhausted(self) -> bool:
        """Whether the run must stop: max_in_a_row bad steps in a row."""
        return self.in_a_row >= self.max_in_a_row

    def recent_losses(self) -> list[float]:
        """The window's good losses, oldest first."""
        recorded = int(self.counters[2].item())
        start = recorded % self.window if recorded >= self.window else 0
        held = min(recorded, self.window)
        return self.recent.roll(-start)[:held].tolist()

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total, "in_a_row": self.in_a_row, "recent": self.recent_losses()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The total and the recent good losses carry on; the streak starts at 0 (see above: the
        saved `in_a_row` says only whether the checkpoint was saved during one)."""
        recent = state["recent"][-self.window :]
        device = self.counters.device
        self.counters = torch.tensor([state["total"], 0, len(recent)], dtype=torch.float64)
        self.recent = torch.full((self.window,), math.inf, dtype=torch.float64)
        self.recent[: len(recent)] = torch.tensor(recent, dtype=torch.float64)
        self._tables_on = None
        self._move_to(device)
        self._seen = None
