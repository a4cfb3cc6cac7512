"""``causal_conv1d.causal_conv1d_varlen`` (mamba2-rocm drop-in facade: re-exports only)."""

from mamba2_rocm.ops.conv1d import causal_conv1d_varlen_states
from mamba2_rocm.reference.conv1d import causal_conv1d_varlen_states_ref

__all__ = ["causal_conv1d_varlen_states", "causal_conv1d_varlen_states_ref"]
