"""``mamba_ssm.ops.triton.layer_norm`` (mamba2-rocm drop-in facade: re-exports only)."""

from mamba2_rocm.ops.add_norm import (
    RMSNorm,
    layer_norm_fn,
    layer_norm_linear_fn,
    layer_norm_ref,
    rms_norm_fn,
    rms_norm_ref,
)

__all__ = [
    "RMSNorm",
    "layer_norm_fn",
    "layer_norm_linear_fn",
    "layer_norm_ref",
    "rms_norm_fn",
    "rms_norm_ref",
]
