"""mamba2-rocm: Mamba2/Mamba1 state-space-model kernels for AMD GPUs.

The ops import torch lazily, so ``import mamba2_rocm`` (and the build driver, and
``python -m mamba2_rocm doctor``) work on machines without PyTorch.
"""

from __future__ import annotations

from typing import Any

try:
    from ._version import __version__
except ImportError:  # a source tree that was never built or installed
    __version__ = "0.0.0"

__all__ = [
    "LayerNorm", "RMSNorm", "__version__", "causal_conv1d_fn", "causal_conv1d_update",
    "causal_conv1d_varlen_states", "layernorm_fn", "mamba_chunk_scan_combined", "mamba_inner_fn",
    "mamba_split_conv1d_scan_combined", "rmsnorm_fn", "selective_scan_fn", "selective_state_update",
]  # fmt: skip

_LAZY = {
    "causal_conv1d_fn": "mamba2_rocm.ops.conv1d",
    "causal_conv1d_update": "mamba2_rocm.ops.conv1d",
    "causal_conv1d_varlen_states": "mamba2_rocm.ops.conv1d",
    "layernorm_fn": "mamba2_rocm.ops.rmsnorm",
    "LayerNorm": "mamba2_rocm.ops.rmsnorm",
    "selective_scan_fn": "mamba2_rocm.ops.selective_scan",
    "selective_state_update": "mamba2_rocm.ops.state_update",
    "rmsnorm_fn": "mamba2_rocm.ops.rmsnorm",
    "RMSNorm": "mamba2_rocm.ops.rmsnorm",
    "mamba_chunk_scan_combined": "mamba2_rocm.ops.ssd",
    "mamba_split_conv1d_scan_combined": "mamba2_rocm.ops.mamba2",
    "mamba_inner_fn": "mamba2_rocm.ops.mamba1",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mamba2_rocm' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
