"""``selective_scan_cuda``, mamba_ssm's compiled scan extension, served by mamba2-rocm's kernels
(drop-in facade: re-exports; the adapters live in ``mamba2_rocm.ops.extension_abi``)."""

from mamba2_rocm.ops.extension_abi import selective_scan_bwd as bwd
from mamba2_rocm.ops.extension_abi import selective_scan_fwd as fwd

__all__ = ["bwd", "fwd"]
