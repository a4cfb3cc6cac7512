"""``selective_scan_fn``: Mamba1's selective scan, mamba_ssm's signature and semantics.

Semantics and the references: :mod:`mamba2_rocm.reference.selective_scan`. The GPU kernel
(``csrc/selective_scan.hip``) is compiled and statically verified for every target but has not
been run on a GPU yet, so it runs only when asked for: ``MAMBA2_ROCM_EXPERIMENTAL=selective_scan``
(the GPU tests set it). Otherwise every call runs the PyTorch tier, which steps through time
with all (batch, dim, dstate) elements at once in float32 and differentiates as plain PyTorch
code. ``MAMBA2_ROCM_BACKEND=kernel`` without the opt-in refuses with that reason, and on a GPU
``auto`` says once (a warning) that no kernel runs, so nobody mistakes the fallback for a
kernel; the drop-in ``mamba_ssm`` name keeps raising ImportError for it until the kernel is the
default. ``eager`` runs the float64 ground truth (cast back), as the other ops' eager tier does.
On the kernel tier the op is ``torch.ops.mamba2_rocm.selective_scan`` and its backward
recomputes through the PyTorch tier (``_launch.recompute_backward``).
"""

from __future__ import annotations

import os
import warnings

from mamba2_rocm._torch import require_torch
from mamba2_rocm.kernels import SELECTIVE_SCAN_DSTATE_TIERS
from mamba2_rocm.ops._backend import choose, requested_backend
from mamba2_rocm.ops._launch import (
    DTYPE_CODE,
    GRID_YZ_MAX,
    KERNEL_DTYPE,
    as_kernel_float,
    launch,
    like,
    ptr,
    recompute_backward,
    use_registered_op,
)
from mamba2_rocm.reference.selective_scan import (
    check_selective_scan_args,
    last_state_dtype,
    selective_scan_ref,
    selective_scan_torch,
)

torch = require_torch()
Tensor = torch.Tensor

__all__ = ["selective_scan_fn"]

_warned: set[str] = set()


#: ``MAMBA2_ROCM_EXPERIMENTAL``: comma-separated kernels that run although not yet verified on
#: a GPU ("selective_scan").
EXPERIMENTAL_ENV = "MAMBA2_ROCM_EXPERIMENTAL"
_THREADS = 128  # csrc/selective_scan.hip: kThreads


def kernel_opted_in(environ=None) -> bool:
    value = (os.environ if environ is None else environ).get(EXPERIMENTAL_ENV, "")
    return "selective_scan" in {v.strip() for v in value.split(",")}


def _tier(device) -> tuple[str, object]:
    wanted = requested_backend()
    if wanted == "eager":
        return "eager", None
    if wanted == "torch":
        return "torch", None
    if kernel_opted_in():
        tier, kset = choose(device)  # raises for an unusable kernel request, as the others do
        if tier == "kernel":
            return tier, kset
    elif wanted == "kernel":
        raise NotImplementedError(
            "MAMBA2_ROCM_BACKEND=kernel, but selective_scan_fn's GPU kernel is not verified on a "
            f"GPU yet and runs only with {EXPERIMENTAL_ENV}=selective_scan; unset the backend or "
            "use MAMBA2_ROCM_BACKEND=torch"
        )
    if device.type != "cpu" and "gpu" not in _warned:
        _warned.add("gpu")
        warnings.warn(
            "mamba2-rocm: selective_scan_fn runs the PyTorch tier (a step per token) on the GPU: "
            f"its kernel is not verified yet ({EXPERIMENTAL_ENV}=selective_scan runs it)",
            RuntimeWarning,
            stacklevel=3,
        )
    return "torch", None


def _kernel(kset, u, delta, A, B, C, D, z, delta_bias, delta_softplus, dims, out, last) -> None:
    """One launch of m2r_selective_scan_<dtype>_n<tier> (csrc/selective_scan.hip); every
    operand contiguous (copies only where the caller's is not), B / C / A in float32."""
    if dims.batch > GRID_YZ_MAX:
        raise ValueError(
            f"the selective-scan kernel takes batch <= {GRID_YZ_MAX}, got {dims.batch}"
        )
    u = u.contiguous()
    delta = like(delta, u).contiguous()
    z = None if z is None else like(z, u).contiguous()
    A, B, C = (t.float().contiguous() for t in (A, B, C))
    D, delta_bias = (
        None if t is None else as_kernel_float(t).contiguous() for t in (D, delta_bias)
    )
    tier = next(n for n in SELECTIVE_SCAN_DSTATE_TIERS if dims.dstate <= n)
    channels = _THREADS // (16 if tier <= 128 else 32)  # channels per block, as the kernel has
    params = (
        u.data_ptr(),
        delta.data_ptr(),
        A.data_ptr(),
        B.data_ptr(),
        C.data_ptr(),
        ptr(D),
        ptr(z),
        ptr(delta_bias),
        out.data_ptr(),
        ptr(last),
        dims.batch,
        dims.dim,
        dims.seqlen,
        dims.dstate,
        dims.b_groups,
        dims.c_groups,
        int(delta_softplus),
        DTYPE_CODE[D.dtype] if D is not None else 0,
        DTYPE_CODE[delta_bias.dtype] if delta_bias is not None else 0,
        0,
    )  # fmt: skip  (SelectiveScanParams, field order)
    grid = (-(-dims.dim // channels), dims.batch, 1)
    launch(kset.launcher(f"m2r_selective_scan_{KERNEL_DTYPE[u.dtype]}_n{tier}"), u, params, grid,
           _THREADS)  # fmt: skip


def _impl(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
    z: Tensor | None, delta_bias: Tensor | None, delta_softplus: bool, return_last_state: bool,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(out, last_state)``, last_state empty unless asked for."""
    dims = check_selective_scan_args(u, delta, A, B, C, D, z, delta_bias)
    shape = _last_shape(dims, return_last_state)
    if dims.batch == 0 or dims.seqlen == 0:  # empty input: empty output, zero state
        return (torch.empty(u.shape, dtype=u.dtype, device=u.device),
                torch.zeros(shape, dtype=last_state_dtype(A), device=u.device))  # fmt: skip
    tier, kset = _tier(u.device)
    if tier == "kernel" and u.dtype in KERNEL_DTYPE and last_state_dtype(A) == torch.float32:
        out = torch.empty(u.shape, dtype=u.dtype, device=u.device)
        last = torch.empty(shape, dtype=torch.float32, device=u.device)
        _kernel(kset, u, delta, A, B, C, D, z, delta_bias, delta_softplus, dims, out,
                last if return_last_state else None)  # fmt: skip
        return out, last
    fn = selective_scan_ref if tier == "eager" else selective_scan_torch
    return _torch_tier(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state, fn)


def _last_shape(dims, return_last_state: bool) -> tuple[int, ...]:
    return (dims.batch, dims.dim, dims.dstate) if return_last_state else (0,)


def _torch_tier(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state,
                fn=selective_scan_torch):  # fmt: skip
    """What the torch tier computes for ``_impl``'s arguments (also the backward's
    recomputation); ``fn`` the eager tier's ground truth instead."""
    out, last = fn(u, delta, A, B, C, D, z, delta_bias, delta_softplus, True)
    return out.contiguous(), last if return_last_state else last.new_empty(0)


selective_scan_op = torch.library.custom_op("mamba2_rocm::selective_scan", _impl, mutates_args=())
# u, delta, A, B, C, D, z, delta_bias
recompute_backward(selective_scan_op, _torch_tier, (0, 1, 2, 3, 4, 5, 6, 7))


@selective_scan_op.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state):
    dims = check_selective_scan_args(u, delta, A, B, C, D, z, delta_bias)
    return (torch.empty(u.shape, dtype=u.dtype, device=u.device),
            torch.empty(_last_shape(dims, return_last_state), dtype=last_state_dtype(A),
                        device=u.device))  # fmt: skip


def selective_scan_fn(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
    z: Tensor | None = None, delta_bias: Tensor | None = None, delta_softplus: bool = False,
    return_last_state: bool = False,
):  # fmt: skip
    """Mamba1's selective scan: u, delta, z (batch, dim, seqlen); A (dim, dstate) real; B, C
    (dim, dstate), (batch, dstate, seqlen) or (batch, groups, dstate, seqlen); D, delta_bias
    (dim,). Returns out (u's dtype) [, last_state (batch, dim, dstate), A's type (>= fp32)]."""
    grads = (u, delta, A, B, C, D, z, delta_bias)
    # the registered op (autograd by recomputation) where the kernel would run, or compiling;
    # else plain PyTorch code, which autograd differentiates directly
    registered = use_registered_op(*grads) and (kernel_opted_in() or torch.compiler.is_compiling())
    op = selective_scan_op if registered else _impl
    out, last = op(u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus),
                   bool(return_last_state))  # fmt: skip
    return (out, last) if return_last_state else out
