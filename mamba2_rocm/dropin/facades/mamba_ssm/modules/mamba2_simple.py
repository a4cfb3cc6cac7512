"""``mamba_ssm.modules.mamba2_simple`` (mamba2-rocm drop-in facade: re-exports only)."""

from mamba2_rocm.models.mamba2_simple import Mamba2Simple

__all__ = ["Mamba2Simple"]
