"""``mamba_ssm.modules.mlp`` (mamba2-rocm drop-in facade: re-exports only)."""

from mamba2_rocm.models.mlp import GatedMLP

__all__ = ["GatedMLP"]
