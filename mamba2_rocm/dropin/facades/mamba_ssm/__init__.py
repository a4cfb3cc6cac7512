"""``mamba_ssm``, served by mamba2-rocm's kernels (drop-in facade: re-exports only)."""

from mamba2_rocm.dropin import facade_version, missing
from mamba2_rocm.models.lm import NOT_PROVIDED, MambaLMHeadModel
from mamba2_rocm.models.mamba1 import Mamba
from mamba2_rocm.models.mamba2 import Mamba2
from mamba2_rocm.ops.mamba1 import mamba_inner_fn
from mamba2_rocm.ops.mamba2 import mamba_split_conv1d_scan_combined
from mamba2_rocm.ops.selective_scan import selective_scan_fn
from mamba2_rocm.ops.ssd import mamba_chunk_scan_combined
from mamba2_rocm.ops.state_update import selective_state_update

# as upstream's __init__ does: mamba_ssm.ops.triton.* and the model packages resolve as attributes
from . import distributed, models, modules, ops, utils  # noqa: F401

__version__ = facade_version("mamba_ssm")
__all__ = [
    "Mamba",
    "Mamba2",
    "MambaLMHeadModel",
    "mamba_chunk_scan_combined",
    "mamba_inner_fn",
    "mamba_split_conv1d_scan_combined",
    "selective_scan_fn",
    "selective_state_update",
]
__getattr__ = missing("mamba_ssm", NOT_PROVIDED)
