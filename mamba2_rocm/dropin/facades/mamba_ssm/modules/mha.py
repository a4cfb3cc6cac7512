"""``mamba_ssm.modules.mha`` (mamba2-rocm drop-in facade: re-exports only)."""

from mamba2_rocm.models.mha import MHA

__all__ = ["MHA"]
