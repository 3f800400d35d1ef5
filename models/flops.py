"""Model FLOPs, counted as Megatron-LM does: the numerator of MFU, and the weights the pipeline
partition balances stages by.

Per token, training costs 6 FLOPs per weight of every matmul (forward 2, backward 4) plus the
attention scores and their weighted sum, 12 * layers * q width * seq (q width: heads x
head_dim, the hidden size but in Qwen3-like models), of which a causal mask
skips half (Megatron-LM counts that half as not done; torchtitan counts all of it, so its MFU
reads higher by 6 * layers * hidden * seq FLOPs per token at the same speed:
`flops_per_token(causal=False)`). Recompute is hardware work, not model work, so it never
raises MFU. With the causal halving off this is exactly Narayanan et al. 2021's
72 B s l h^2 (1 + s/(6h) + V/(12 l h)) for GPT (tests/unit/test_flops.py checks it). Each
architecture counts its own layer's matmul weights (`Formulas.layer_matmul_weights`). The peak
FLOP/s MFU divides by is the hardware's (`megalite.hardware`).
"""

from __future__ import annotations

from megalite.models.formulas import formulas_of

from megalite.config import ModelConfig


def matmul_params(cfg: ModelConfig) -> int:
    """Weights that take part in a matmul per token: the layers and the LM head."""
    layer = formulas_of(cfg.arch).layer_matmul_weights(cfg)
    return cfg.n_layers * layer + cfg.vocab_size * cfg.hidden


def flops_per_token(cfg: ModelConfig, causal: bool = True) -> float:
    """Training FLOPs per token (forward + backward). `causal`: count the attention scores that
    a causal mask skips as not done (MFU as Megatron-LM reports it); off to compare with
    formulas that count them (torchtitan's, Narayanan et al.'s)."""
    attention_scores = 12 * cfg.n_layers * cfg.q_width * cfg.seq_len
    return 6 * matmul_params(cfg) + (attention_scores / 2 if causal else attention_scores)
