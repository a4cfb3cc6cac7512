"""``mamba_ssm.models.config_mamba`` (mamba2-rocm drop-in facade: re-exports only)."""

from mamba2_rocm.models.config import MambaConfig

__all__ = ["MambaConfig"]
