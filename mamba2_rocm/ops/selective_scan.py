"""``selective_scan_fn``: Mamba1's selective scan, mamba_ssm's signature and semantics.

Semantics and the references: :mod:`mamba2_rocm.reference.selective_scan`. There is no GPU
kernel for it yet (the Mamba1 issue): every call runs the PyTorch tier, which steps through time
with all (batch, dim, dstate) elements at once in float32 and differentiates as plain PyTorch
code (so training works). ``MAMBA2_ROCM_BACKEND=kernel`` refuses with that reason instead of
running it, and on a GPU ``auto`` says so once (a warning), so nobody mistakes it for a kernel;
the drop-in ``mamba_ssm`` name keeps raising ImportError for it until the kernel exists.
``eager`` runs the float64 ground truth (cast back), as the other ops' eager tier does.
"""

from __future__ import annotations

import warnings

from mamba2_rocm._torch import require_torch
from mamba2_rocm.ops._backend import requested_backend
from mamba2_rocm.reference.selective_scan import (
    check_selective_scan_args,
    selective_scan_ref,
    selective_scan_torch,
)

torch = require_torch()
Tensor = torch.Tensor

__all__ = ["selective_scan_fn"]

_warned: set[str] = set()


def _tier(device) -> str:
    wanted = requested_backend()
    if wanted == "kernel":
        raise NotImplementedError(
            "MAMBA2_ROCM_BACKEND=kernel, but selective_scan_fn has no GPU kernel yet (Mamba1's "
            "selective scan runs on the PyTorch tier for now); unset it or use "
            "MAMBA2_ROCM_BACKEND=torch"
        )
    if wanted == "eager":
        return "eager"
    if device.type != "cpu" and "gpu" not in _warned:
        _warned.add("gpu")
        warnings.warn(
            "mamba2-rocm: selective_scan_fn has no GPU kernel yet; it runs the PyTorch tier "
            "(a step per token) on the GPU",
            RuntimeWarning,
            stacklevel=3,
        )
    return "torch"


def selective_scan_fn(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
    z: Tensor | None = None, delta_bias: Tensor | None = None, delta_softplus: bool = False,
    return_last_state: bool = False,
):  # fmt: skip
    """Mamba1's selective scan: u, delta, z (batch, dim, seqlen); A (dim, dstate) real; B, C
    (dim, dstate), (batch, dstate, seqlen) or (batch, groups, dstate, seqlen); D, delta_bias
    (dim,). Returns out (u's dtype) [, last_state (batch, dim, dstate), A's type (>= fp32)]."""
    dims = check_selective_scan_args(u, delta, A, B, C, D, z, delta_bias)
    if dims.batch == 0 or dims.seqlen == 0:  # empty input: empty output, zero state
        out = torch.empty(u.shape, dtype=u.dtype, device=u.device)
        if not return_last_state:
            return out
        state_dtype = torch.promote_types(A.dtype, torch.float32)
        return out, torch.zeros(dims.batch, dims.dim, dims.dstate, dtype=state_dtype,
                                device=u.device)  # fmt: skip
    fn = selective_scan_ref if _tier(u.device) == "eager" else selective_scan_torch
    return fn(u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus), bool(return_last_state))
