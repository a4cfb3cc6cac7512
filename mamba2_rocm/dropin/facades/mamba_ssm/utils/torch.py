"""``mamba_ssm.utils.torch`` (mamba2-rocm drop-in facade: re-exports only)."""

from mamba2_rocm.models.compat import custom_bwd, custom_fwd

__all__ = ["custom_bwd", "custom_fwd"]
