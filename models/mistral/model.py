"""Mistral: Llama's chunk, whose blocks take their layer's sliding window
(`ModelConfig.window_of`); read it beside models/llama/model.py."""

from __future__ import annotations

from megalite.models.llama.model import Llama


class Mistral(Llama):
    """One pipeline chunk of Mistral: Llama's parameter names, windowed attention."""
