"""``mamba_ssm.distributed.tensor_parallel`` (mamba2-rocm drop-in facade: re-exports only)."""

from mamba2_rocm.models.parallel import (
    ColumnParallelEmbedding,
    ColumnParallelLinear,
    ParallelEmbeddings,
    RowParallelLinear,
    VocabParallelEmbedding,
    parallel_linear_func,
)

__all__ = [
    "ColumnParallelEmbedding",
    "ColumnParallelLinear",
    "ParallelEmbeddings",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "parallel_linear_func",
]
