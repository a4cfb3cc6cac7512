"""``mamba_ssm``, served by mamba2-rocm's kernels (drop-in facade: re-exports only)."""

from mamba2_rocm.dropin import facade_version, missing
from mamba2_rocm.ops.mamba1 import mamba_inner_fn
from mamba2_rocm.ops.mamba2 import mamba_split_conv1d_scan_combined
from mamba2_rocm.ops.selective_scan import selective_scan_fn
from mamba2_rocm.ops.ssd import mamba_chunk_scan_combined
from mamba2_rocm.ops.state_update import selective_state_update

from . import ops  # noqa: F401  (as upstream's __init__ does: mamba_ssm.ops.triton.* resolve as attributes)

__version__ = facade_version("mamba_ssm")
__all__ = [
    "mamba_chunk_scan_combined",
    "mamba_inner_fn",
    "mamba_split_conv1d_scan_combined",
    "selective_scan_fn",
    "selective_state_update",
]
__getattr__ = missing(
    "mamba_ssm",
    {
        "Mamba": "mamba2-rocm provides mamba_ssm's ops, not its nn modules",
        "Mamba2": "mamba2-rocm provides mamba_ssm's ops, not its nn modules",
        "Mamba3": "mamba2-rocm provides mamba_ssm's ops, not its nn modules",
        "MambaLMHeadModel": "mamba2-rocm provides mamba_ssm's ops, not its models",
    },
)
