"""Qwen3-MoE's parameters, FLOPs and saved activations in closed form: Mixtral's, with the
QK-norms' weights and what they keep (`models.qwen3.formulas`)."""

from __future__ import annotations

from megalite.models.formulas import Shapes
from megalite.models.mixtral.formulas import MixtralFormulas
from megalite.models.qwen3.formulas import qk_norm_saved


class Qwen3MoEFormulas(MixtralFormulas):
    qk_norm = True

    def layer_saved(self, x: Shapes) -> list[int]:
        return super().layer_saved(x) + qk_norm_saved(x)


FORMULAS = Qwen3MoEFormulas()
