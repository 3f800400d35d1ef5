"""Mistral's parameters, FLOPs and saved activations in closed form: Llama's (a window changes
the attention's FLOPs, which `models.flops` counts per layer, and no tensor a layer keeps)."""

from __future__ import annotations

from megalite.models.llama.formulas import LlamaFormulas

FORMULAS = LlamaFormulas()
