"""Dynamic loss scaling for fp16 (Micikevicius et al. 2018): multiply the loss so small
gradients survive fp16, halve the scale and skip the step on overflow, grow it again after a
run of clean steps. bf16 and fp32 use a constant scale of 1.

The dynamic scaler keeps its scale and counters on the device, as torch's GradScaler does: the
overflow check is a flag there, and the step must not wait for it to reach the host. They are
read on the host only for the metrics row and checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch


class LossScaler:
    def __init__(
        self,
        scale: float = 1.0,
        dynamic: bool = False,
        growth_interval: int = 1000,
        clean_steps: int = 0,
        skipped_steps: int = 0,
    ) -> None:
        self.dynamic, self.growth_interval = dynamic, growth_interval
        self.state = torch.tensor([scale, clean_steps, skipped_steps], dtype=torch.float64)
        """(scale, clean steps in a row, skipped steps), on the device of the last `update`."""

    @classmethod
    def for_precision(cls, precision: str) -> LossScaler:
        return cls(scale=2.0**16, dynamic=True) if precision == "fp16" else cls()

    def factor(self, device: torch.device) -> torch.Tensor | float:
        """What this step's loss is multiplied by: a float32 scalar on `device` for a dynamic
        scaler, 1.0 otherwise. The state moves to `device` (once)."""
        self.state = self.state.to(device)
        return self.state[0].float() if self.dynamic else 1.0

    def update(self, found_non_finite: torch.Tensor) -> torch.Tensor:
        """Record this step's overflow check (a flag on the device, 1.0: found); returns the
        skip flag (1.0: the step must be skipped), on the device: always 0 for a constant
        scale."""
        found = found_non_finite.to(torch.float64)
        if not self.dynamic:
            return torch.zeros_like(found)
        self.state = self.state.to(found.device)
        scale, clean, skipped = self.state.unbind()
        clean_after = (clean + 1) * (1 - found)
        grows = (clean_after > 0) & (clean_after % self.growth_interval == 0)
        halved = (scale / 2).clamp_min(1.0)
        new_scale = torch.where(found > 0, halved, torch.where(grows, scale * 2, scale))
        self.state = torch.stack([new_scale, clean_after, skipped + found])
        return found

    @property
    def scale(self) -> float:
        """The current scale, on the host (a wait for the device)."""
        return self.state[0].item()

    @property
    def skipped_steps(self) -> int:
        return int(self.state[2].item())

    @property
    def clean_steps(self) -> int:
        return int(self.state[1].item())

    def state_dict(self) -> dict[str, Any]:
        scale, clean, skipped = self.state.tolist()
        return {
            "scale": scale,
            "dynamic": self.dynamic,
            "growth_interval": self.growth_interval,
            "clean_steps": int(clean),
            "skipped_steps": int(skipped),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved scaler where both runs scale dynamically (fp16). A run resumed in
        another precision keeps the scaler its own precision starts with: fp16 after bf16 must
        still scale and skip overflows, bf16 after fp16 must not."""
        if self.dynamic and state["dynamic"]:
            self.growth_interval = state["growth_interval"]
            values = [state["scale"], state["clean_steps"], state["skipped_steps"]]
            self.state = torch.tensor(values, dtype=torch.float64).to(self.state.device)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LossScaler) and self.state_dict() == other.state_dict()
