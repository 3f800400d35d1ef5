"""Dynamic loss scaling for fp16 (Micikevicius et al. 2018): multiply the loss so small
gradients survive fp16, halve the scale and skip the step on overflow, grow it again after a
run of clean steps. bf16 and fp32 use a constant scale of 1."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class LossScaler:
    scale: float = 1.0
    dynamic: bool = False
    growth_interval: int = 1000
    clean_steps: int = 0
    skipped_steps: int = 0

    @classmethod
    def for_precision(cls, precision: str) -> LossScaler:
        return cls(scale=2.0**16, dynamic=True) if precision == "fp16" else cls()

    def update(self, found_non_finite: bool) -> bool:
        """Record this step's overflow check; returns True when the step must be skipped."""
        if not self.dynamic:
            return False
        if found_non_finite:
            self.scale = max(self.scale / 2.0, 1.0)
            self.clean_steps = 0
            self.skipped_steps += 1
            return True
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= 2.0
        return False

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        """Continue the saved scaler where both runs scale dynamically (fp16). A run resumed in
        another precision keeps the scaler its own precision starts with: fp16 after bf16 must
        still scale and skip overflows, bf16 after fp16 must not."""
        if self.dynamic and state["dynamic"]:
            for key, value in state.items():
                setattr(self, key, value)
