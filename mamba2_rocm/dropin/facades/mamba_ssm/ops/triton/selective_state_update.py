"""``mamba_ssm.ops.triton.selective_state_update`` (mamba2-rocm drop-in facade: re-exports)."""

from mamba2_rocm.ops.state_update import selective_state_update
from mamba2_rocm.reference.ssd import selective_state_update_ref

__all__ = ["selective_state_update", "selective_state_update_ref"]
