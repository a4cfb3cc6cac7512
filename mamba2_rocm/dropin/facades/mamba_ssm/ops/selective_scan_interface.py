"""``mamba_ssm.ops.selective_scan_interface`` (mamba2-rocm drop-in facade: re-exports).

Mamba1's selective scan and block, and the references mamba_ssm's tests compare them with.
"""

from mamba2_rocm.ops.mamba1 import mamba_inner_fn, mamba_inner_ref
from mamba2_rocm.ops.selective_scan import selective_scan_fn
from mamba2_rocm.reference.selective_scan import selective_scan_ref

__all__ = ["mamba_inner_fn", "mamba_inner_ref", "selective_scan_fn", "selective_scan_ref"]
