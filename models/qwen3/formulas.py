"""Qwen3's parameters, FLOPs and saved activations in closed form: Llama's, and the QK-norms'
weights and what they keep (see `models.formulas`)."""

from __future__ import annotations

from megalite.models.formulas import Shapes
from megalite.models.llama.formulas import LlamaFormulas


class Qwen3Formulas(LlamaFormulas):
    qk_norm = True

    def layer_saved(self, x: Shapes) -> list[int]:
        """Llama's block, and what its QK-norms keep (`qk_norm_saved`)."""
        return super().layer_saved(x) + qk_norm_saved(x)


def qk_norm_saved(x: Shapes) -> list[int]:
    """What RMSNorm over each head of q and of k keeps, per row (token x local head) of
    head_dim as `RMSNormFormulas.saved` does per token: where the norm keeps its input (Triton's;
    PyTorch's in fp32, whose fp32 copy is the input itself), that input is a view of the fused
    q/k/v output, which it keeps alive whole (v's columns too)."""
    hd, e, tokens = x.cfg.model.head_dim, x.element, x.tokens
    heads = (x.local_heads, x.local_kv_heads)
    fused = [tokens * (x.local_heads + 2 * x.local_kv_heads) * hd * e]
    if x.device == "cuda":  # Triton's RMSNorm: its input and one fp32 rstd per row
        return fused + [tokens * h * 4 for h in heads]
    if e == 4:  # the inverse rms and the normed rows
        return fused + [n for h in heads for n in (tokens * h * 4, tokens * h * hd * e)]
    # the fp32 copy of the input, the inverse rms, the normed rows
    return [n for h in heads for n in (tokens * h * hd * 4, tokens * h * 4, tokens * h * hd * e)]


FORMULAS = Qwen3Formulas()
