"""``selective_scan_fn``: Mamba1's selective scan, mamba_ssm's signature and semantics.

Semantics and the references: :mod:`mamba2_rocm.reference.selective_scan`. Tiers as for the
other ops (``MAMBA2_ROCM_BACKEND``): the GPU kernel (``csrc/selective_scan.hip``: B / C / A in
float32, the host converts) where code objects serve the device; the PyTorch tier elsewhere,
which steps through time with all (batch, dim, dstate) elements at once in float32 and
differentiates as plain PyTorch code; ``eager`` runs the float64 ground truth (cast back). On
the kernel tier the op is ``torch.ops.mamba2_rocm.selective_scan`` and its backward recomputes
through the PyTorch tier (``_launch.recompute_backward``). Complex A is refused by name.
"""

from __future__ import annotations

from mamba2_rocm._torch import require_torch
from mamba2_rocm.kernels import SELECTIVE_SCAN_DSTATE_TIERS, SELECTIVE_SCAN_SEGMENT_TIERS
from mamba2_rocm.ops._backend import choose
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

_THREADS = 128  # csrc/selective_scan.hip: kThreads
#: Which form of the kernel runs (csrc/selective_scan.hip): "segments" (parallel along the
#: sequence: a lane per run of tokens, the state carried by a scan over the lanes; dstate <= 64,
#: the butterfly above that; the default: 3.1-6.3x the others on the H100 at Mamba1's shapes),
#: "butterfly" (one channel per 16 lanes walking the tokens, the per-token cross-lane sum) or
#: "deferred" (the butterfly's sums once per chunk). All pass the GPU tests; tests and the
#: benchmark set it.
KERNEL_FORMS = {"butterfly": "", "deferred": "_dr", "segments": "_sp"}
kernel_form = "segments"
_SEGMENT_LANES = 32  # csrc/selective_scan.hip: kSeg, lanes per channel in the segment form


def _form(tier: int) -> str:
    """The form that runs at ``tier``: kernel_form where the kernel has it."""
    if kernel_form == "segments" and tier not in SELECTIVE_SCAN_SEGMENT_TIERS:
        return "butterfly"
    return kernel_form


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
    form = _form(tier)
    # channels per block, as the kernel has them: a lane group per channel
    channels = _THREADS // (_SEGMENT_LANES if form == "segments" else 16 if tier <= 128 else 32)
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
    name = f"m2r_selective_scan_{KERNEL_DTYPE[u.dtype]}_n{tier}{KERNEL_FORMS[form]}"
    launch(kset.launcher(name), u, params, grid, _THREADS)


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
    tier, kset = choose(u.device)
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
    op = selective_scan_op if use_registered_op(*grads) else _impl
    out, last = op(u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus),
                   bool(return_last_state))  # fmt: skip
    return (out, last) if return_last_state else out
