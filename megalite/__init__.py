"""megalite: a Megatron-style 3D-parallel trainer for GPT-like language models."""

__version__ = "0.1.0"
