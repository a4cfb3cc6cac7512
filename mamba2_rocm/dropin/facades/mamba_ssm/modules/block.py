"""``mamba_ssm.modules.block`` (mamba2-rocm drop-in facade: re-exports only)."""

from mamba2_rocm.models.block import Block

__all__ = ["Block"]
