"""Qwen3's parameters, FLOPs and saved activations in closed form: Llama's, and the QK-norms'
weights and what they keep (see `models.formulas`)."""

from __future__ import annotations

from megalite.models.formulas import Shapes
from megalite.models.llama.formulas import LlamaFormulas


class Qwen3Formulas(LlamaFormulas):
    qk_norm = True

    def layer_saved(self, x: Shapes) -> list[int]:
        """Llama's block, and each QK-norm's input and per-row statistics (on the CPU, as its
        PyTorch reference keeps them: the fp32 input, the inverse rms, the normed rows)."""
        return super().layer_saved(x) + qk_norm_saved(x)


def qk_norm_saved(x: Shapes) -> list[int]:
    """What RMSNorm over each head of q and of k keeps: per row (token x local head) of
    head_dim, as `RMSNormFormulas.saved` does per token of the hidden size."""
    hd, e = x.cfg.model.head_dim, x.element
    saved = []
    for heads in (x.local_heads, x.local_kv_heads):
        rows = x.tokens * heads
        if x.device == "cuda":  # Triton's RMSNorm: its input and one fp32 rstd per row
            saved += [rows * hd * e, rows * 4]
        else:
            saved += [rows * hd * 4, rows * 4, rows * hd * e]
    return saved


FORMULAS = Qwen3Formulas()
