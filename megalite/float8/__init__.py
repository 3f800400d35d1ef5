"""Float8 training (`train.fp8`): the recipes' scales and casts (`scaling`), the float8 GEMM and
where it runs (`gemm`), and the experts' grouped GEMMs in float8 (`experts`). The tensor-parallel
linears take their float8 GEMMs from `tensor_parallel.gemms`, which builds on these.

This module itself imports no torch: the memory estimate reads `takes_float8` before torch
loads."""


def takes_float8(min_dim: int, in_features: int, out_features: int) -> bool:
    """Whether a linear of these global features runs its GEMMs in float8: the smaller of the
    two at least `train.fp8_min_dim` (a rank's share never decides, so every layout agrees)."""
    return min(in_features, out_features) >= min_dim
