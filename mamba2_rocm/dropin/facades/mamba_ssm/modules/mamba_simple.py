"""``mamba_ssm.modules.mamba_simple`` (mamba2-rocm drop-in facade: re-exports only)."""

from mamba2_rocm.models.mamba1 import Mamba

__all__ = ["Mamba"]
