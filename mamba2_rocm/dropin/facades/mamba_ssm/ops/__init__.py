"""``mamba_ssm.ops`` (mamba2-rocm drop-in facade)."""

from . import selective_scan_interface, triton

__all__ = ["selective_scan_interface", "triton"]
