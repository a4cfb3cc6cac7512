"""``mamba_ssm.distributed.distributed_utils`` (mamba2-rocm drop-in facade: re-exports only)."""

from mamba2_rocm.models.parallel import (
    all_gather,
    all_gather_raw,
    all_reduce,
    all_reduce_raw,
    allreduce_sequence_parallel_grad,
    get_dim_for_local_rank,
    reduce_scatter,
    reduce_scatter_raw,
    sync_shared_params,
)

__all__ = [
    "all_gather",
    "all_gather_raw",
    "all_reduce",
    "all_reduce_raw",
    "allreduce_sequence_parallel_grad",
    "get_dim_for_local_rank",
    "reduce_scatter",
    "reduce_scatter_raw",
    "sync_shared_params",
]
