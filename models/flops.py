"""Model FLOPs, counted as Megatron-LM does: the numerator of MFU, and the weights the pipeline
partition balances stages by.

Per token, training costs 6 FLOPs per weight of every matmul (forward 2, backward 4) plus the
attention scores and their weighted sum, 12 * layers * q width * seq (q width: heads x
head_dim, the hidden size but in Qwen3-like models), of which a causal mask
skips half (Megatron-LM counts that half as not done; torchtitan counts all of it, so its MFU
reads higher by 6 * layers * hidden * seq FLOPs per token at the same speed:
`flops_per_token(causal=False)`). Recompute is hardware work, not model work, so it never
raises MFU. A layer with a sliding window of W < seq keys counts the pairs it can see:
each query's min(position + 1, W) keys, about W - W^2 / (2 seq) on average against the
causal seq / 2 (the continuous count, which is Megatron's seq / 2 at W = seq), and the
uncausal count doubles that as it doubles seq / 2. With the causal halving off and no window
this is exactly Narayanan et al. 2021's
72 B s l h^2 (1 + s/(6h) + V/(12 l h)) for GPT (tests/unit/test_flops.py checks it). Each
architecture counts its own layer's matmul weights (`Formulas.layer_matmul_weights`). The peak
FLOP/s MFU divides by is the hardware's (`megalite.hardware`).
"""

from __future__ import annotations

from megalite.models.formulas import formulas_of

from megalite.config import ModelConfig


def flops_per_token(cfg: ModelConfig, causal: bool = True) -> float:
    """Training FLOPs per token (forward + backward). `causal`: count the attention scores that
    a causal mask skips as not done (MFU as Megatron-LM reports it); off to compare with
    formulas that count them (torchtitan's, Narayanan et al.'s)."""
    layers = sum(layer_flops(cfg, layer, causal) for layer in range(cfg.n_layers))
    return layers + head_flops(cfg)


def layer_flops(cfg: ModelConfig, layer: int, causal: bool = True) -> float:
    """Training FLOPs per token of global layer `layer`: its matmuls and its attention (see the
    module docstring for `causal`)."""
    matmuls = 6 * formulas_of(cfg.arch).layer_matmul_weights(cfg)
    attention = attention_flops(cfg, layer)
    return matmuls + (attention if causal else 2 * attention)


def attention_flops(cfg: ModelConfig, layer: int) -> float:
    """Training FLOPs per token of global layer `layer`'s attention scores and weighted sum,
    causal (12 * q width * seq / 2 without a window)."""
    return 12 * cfg.q_width * _keys_seen(cfg.seq_len, cfg.window_of(layer))


def mean_attention_flops(cfg: ModelConfig) -> float:
    """`attention_flops` averaged over the layers."""
    return sum(attention_flops(cfg, layer) for layer in range(cfg.n_layers)) / cfg.n_layers


def head_flops(cfg: ModelConfig) -> float:
    """Training FLOPs per token of the LM head (the embedding is a lookup: none)."""
    return 6 * cfg.vocab_size * cfg.hidden


def _keys_seen(seq: int, window: int | None) -> float:
    """The keys a query sees on average under the causal mask (Megatron's seq / 2) and a
    sliding window."""
    span = seq if window is None else min(window, seq)
    return span - span * span / (2 * seq)
