"""``mamba_ssm.ops.triton.ssd_combined`` (mamba2-rocm drop-in facade: re-exports only)."""

from mamba2_rocm.ops.mamba2 import mamba_split_conv1d_scan_combined
from mamba2_rocm.ops.ssd import mamba_chunk_scan_combined

__all__ = ["mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined"]
