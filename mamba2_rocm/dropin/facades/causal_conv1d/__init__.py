"""``causal_conv1d``, served by mamba2-rocm's kernels (drop-in facade: re-exports only)."""

from mamba2_rocm.dropin import facade_version
from mamba2_rocm.ops.conv1d import causal_conv1d_fn, causal_conv1d_update

from . import cpp_functions  # noqa: F401  (mamba_ssm imports causal_conv1d.cpp_functions)

__version__ = facade_version("causal_conv1d")
__all__ = ["causal_conv1d_fn", "causal_conv1d_update"]
