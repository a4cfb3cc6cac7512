"""``mamba_ssm.ops.triton`` (mamba2-rocm drop-in facade; the ops are HIP kernels, not Triton)."""

from . import layer_norm, layernorm_gated, selective_state_update, ssd_combined

__all__ = ["layer_norm", "layernorm_gated", "selective_state_update", "ssd_combined"]
