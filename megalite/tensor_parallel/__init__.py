"""Tensor and sequence parallelism: collectives with autograd, parallel layers, the
vocab-parallel loss and layout-independent randomness."""

from megalite.tensor_parallel.cross_entropy import vocab_parallel_head_loss
from megalite.tensor_parallel.layers import (
    ColumnOutput,
    ColumnParallelLinear,
    FusedColumnParallelLinear,
    ParamMeta,
    Part,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelOutput,
    constant_init,
    global_tensors,
    make_param,
    normal_init,
    padded_vocab_size,
    param_parts,
    tp_input,
    tp_output,
)
from megalite.tensor_parallel.mappings import (
    all_gather_sequence,
    copy_to_tp_region,
    gather_from_sequence_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    sequence_shard,
)
from megalite.tensor_parallel.random import TPRandom, init_parameters, recompute, seed_dropout

__all__ = [
    "ColumnParallelLinear",
    "FusedColumnParallelLinear",
    "ColumnOutput",
    "ParamMeta",
    "Part",
    "RowParallelLinear",
    "TPRandom",
    "VocabParallelEmbedding",
    "VocabParallelOutput",
    "all_gather_sequence",
    "constant_init",
    "copy_to_tp_region",
    "gather_from_sequence_region",
    "gather_from_tp_region",
    "global_tensors",
    "init_parameters",
    "make_param",
    "normal_init",
    "padded_vocab_size",
    "param_parts",
    "recompute",
    "reduce_from_tp_region",
    "reduce_scatter_to_sequence_region",
    "seed_dropout",
    "sequence_shard",
    "tp_input",
    "tp_output",
    "vocab_parallel_head_loss",
]
