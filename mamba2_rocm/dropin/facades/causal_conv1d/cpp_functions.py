"""``causal_conv1d.cpp_functions`` (mamba2-rocm drop-in facade: re-exports only)."""

from mamba2_rocm.ops.extension_abi import (
    causal_conv1d_bwd_function,
    causal_conv1d_fwd_function,
    causal_conv1d_update_function,
)

__all__ = [
    "causal_conv1d_bwd_function",
    "causal_conv1d_fwd_function",
    "causal_conv1d_update_function",
]
