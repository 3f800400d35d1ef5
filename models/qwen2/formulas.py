"""Qwen2's parameters, FLOPs and saved activations in closed form: Llama's, and the q, k and v
biases (see `models.formulas`)."""

from __future__ import annotations

from megalite.models.llama.formulas import LlamaFormulas


class Qwen2Formulas(LlamaFormulas):
    qkv_bias = True


FORMULAS = Qwen2Formulas()
