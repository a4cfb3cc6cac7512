"""``mamba_ssm.ops.triton.layernorm_gated`` (mamba2-rocm drop-in facade: re-exports only)."""

from mamba2_rocm.ops.rmsnorm import LayerNorm, RMSNorm, layernorm_fn, rmsnorm_fn
from mamba2_rocm.reference.ssd import rmsnorm_ref as rms_norm_ref

__all__ = ["LayerNorm", "RMSNorm", "layernorm_fn", "rms_norm_ref", "rmsnorm_fn"]
