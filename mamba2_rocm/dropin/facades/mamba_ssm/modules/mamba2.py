"""``mamba_ssm.modules.mamba2`` (mamba2-rocm drop-in facade: re-exports only)."""

from mamba2_rocm.models.mamba2 import Mamba2

__all__ = ["Mamba2"]
