"""Model FLOPs, achieved TFLOP/s and MFU, counted as Megatron-LM and torchtitan do.

Per token, training costs 6 FLOPs per weight of every matmul (forward 2, backward 4) plus the
attention scores and their weighted sum, 12 * layers * hidden * seq, of which a causal mask
skips half. Recompute is hardware work, not model work, so it never raises MFU.
"""

from __future__ import annotations

import functools
import time

import torch

from megalite.config import ModelConfig

# Dense bf16 peaks (never the 2:4-sparsity figures).
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def matmul_params(cfg: ModelConfig) -> int:
    """Weights that take part in a matmul per token: the layers and the LM head."""
    h, f, kv = cfg.hidden, cfg.ffn_hidden, cfg.n_kv_heads * cfg.head_dim
    attention = h * h + 2 * h * kv + h * h
    mlp = (3 if cfg.arch == "llama" else 2) * h * f
    return cfg.n_layers * (attention + mlp) + cfg.vocab_size * h


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token (forward + backward, causal attention counted once)."""
    attention_scores = 12 * cfg.n_layers * cfg.hidden * cfg.seq_len / 2
    return 6 * matmul_params(cfg) + attention_scores


@functools.cache
def peak_flops(device: torch.device) -> float:
    """Dense peak FLOP/s of one device: the datasheet for known GPUs; on CPU a measured large
    fp32 matmul (so CPU 'MFU' is relative to what this machine can actually do)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12
        return float("nan")
    a = torch.randn(1024, 1024)
    a @ a  # warm-up
    start, repeats = time.perf_counter(), 8
    for _ in range(repeats):
        a @ a
    return 2 * 1024**3 * repeats / (time.perf_counter() - start)
