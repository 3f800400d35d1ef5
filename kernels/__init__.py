"""Fused kernels: Triton on GPU, PyTorch references everywhere else.

Each module holds one kernel: the Triton code, the ``torch.autograd.Function`` that launches
it, the PyTorch reference, and a public function that picks between the two at every call
(see :mod:`megalite.kernels.dispatch` for the ``MEGALITE_KERNELS`` switch).
"""

if __name__ != "megalite.kernels":  # its folder imported by the bare name `kernels`
    from megalite.folder_names import give_way

    give_way(__name__, __file__, "megalite.kernels")
else:
    from .cross_entropy import softmax_cross_entropy
    from .dispatch import kernel_backend
    from .flash_attention import (
        attention_block_backward,
        attention_block_forward,
        doc_start_from_cu_seqlens,
        flash_attention,
    )
    from .gelu import bias_gelu
    from .grouped_gemm import grouped_mm, grouped_weight_grad
    from .norms import layer_norm, rms_norm
    from .rotary import rotary_embedding
    from .swiglu import swiglu
    from .wgrad import wgrad_accumulate

__all__ = [
    "attention_block_backward",
    "attention_block_forward",
    "bias_gelu",
    "doc_start_from_cu_seqlens",
    "flash_attention",
    "grouped_mm",
    "grouped_weight_grad",
    "kernel_backend",
    "layer_norm",
    "rms_norm",
    "rotary_embedding",
    "softmax_cross_entropy",
    "swiglu",
    "wgrad_accumulate",
]
