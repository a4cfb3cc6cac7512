"""``causal_conv1d.causal_conv1d_interface`` (mamba2-rocm drop-in facade: re-exports only)."""

from mamba2_rocm.ops.conv1d import causal_conv1d_fn, causal_conv1d_update
from mamba2_rocm.reference.conv1d import causal_conv1d_ref, causal_conv1d_update_ref

__all__ = [
    "causal_conv1d_fn",
    "causal_conv1d_ref",
    "causal_conv1d_update",
    "causal_conv1d_update_ref",
]
