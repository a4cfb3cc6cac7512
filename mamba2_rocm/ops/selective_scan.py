"""``selective_scan_fn``: Mamba1's selective scan, mamba_ssm's signature and semantics.

Semantics and the references: :mod:`mamba2_rocm.reference.selective_scan`. Tiers as for the
other ops (``MAMBA2_ROCM_BACKEND``): the GPU kernel (``csrc/selective_scan.hip``: B / C / A in
float32, the host converts) where code objects serve the device; the PyTorch tier elsewhere,
which steps through time with all (batch, dim, dstate) elements at once in float32 and
differentiates as plain PyTorch code; ``eager`` runs the float64 ground truth (cast back). On
the kernel tier the op is ``torch.ops.mamba2_rocm.selective_scan`` and its backward recomputes
through the PyTorch tier (``_launch.recompute_backward``). Complex A runs on the PyTorch tier
(mamba_ssm's conventions, see the reference module); the kernels take real A.
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
    sm_count,
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
#: Which form of the kernel runs (csrc/selective_scan.hip): "channels" (a thread walks a whole
#: channel's tokens with its state in registers, u / steps / B / C staged in LDS; dstate <= 64
#: with variable B and C, the sequence cut into segments when there are too few channels to fill
#: the GPU; the default), "segments" (parallel along the sequence: a lane per run of tokens, the
#: state carried by a scan over the lanes; dstate <= 64), "butterfly" (one channel per 16 lanes
#: walking the tokens, the per-token cross-lane sum) or "deferred" (the butterfly's sums once per
#: chunk). Where the chosen form does not take the call, the next in that order does (channels,
#: segments, butterfly). All pass the GPU tests; tests and the benchmark set it.
KERNEL_FORMS = {"butterfly": "", "deferred": "_dr", "segments": "_sp", "channels": "_ch"}
kernel_form = "channels"
_SEGMENT_LANES = 32  # csrc/selective_scan.hip: kSeg, lanes per channel in the segment form
_CH_THREADS = 64  # csrc/selective_scan.hip: kChThreads, threads per block of the channel form
_CH_SEG_ALIGN = 64  # segment lengths: a multiple of every chunk length (kChT) the build may use
_CH_MIN_SEG = 128  # the shortest segment worth its second pass
#: The channel form cuts the sequence into segments (each costing its exps twice) only while
#: fewer than CH_FULL_PER_SM blocks per multiprocessor would run, and then into enough for
#: CH_SEG_PER_SM blocks per multiprocessor (measured on the H100, scripts/tune_selective_scan.py: one 5120-channel
#: sequence of 8192 tokens ran 1699 us whole, 614-600 us in 12-16 segments; 8 x 4096 channels
#: ran fastest whole). Tests and bench set ``channel_segments`` to force a count.
CH_FULL_PER_SM = 3
CH_SEG_PER_SM = 8
channel_segments: int | None = None


_CH_PER = 16  # csrc/selective_scan.hip: M2R_SSCAN_PER, state elements per lane


def _channel_lanes(tier: int) -> int:
    """Lanes per channel in the channel form: _CH_PER state elements each."""
    return max(1, tier // _CH_PER)


def _form(tier: int, dims=None) -> str:
    """The form that runs at ``tier`` for a call of ``dims``: kernel_form where it takes it."""
    form = kernel_form
    if form == "channels" and dims is not None and not _channel_form_takes(tier, dims):
        form = "segments"
    if form in ("segments", "channels") and tier not in SELECTIVE_SCAN_SEGMENT_TIERS:
        return "butterfly"
    return form


def _channel_form_takes(tier: int, dims) -> bool:
    """Variable B and C, a block's channels in one group of each, 32-bit offsets in a block."""
    if tier not in SELECTIVE_SCAN_SEGMENT_TIERS or not (dims.b_groups and dims.c_groups):
        return False
    channels = _CH_THREADS // _channel_lanes(tier)
    for groups in (dims.b_groups, dims.c_groups):
        if groups > 1 and (dims.dim // groups) % channels:
            return False
    return max(channels, dims.dstate) * dims.seqlen < 2**31


def channel_segment_len(blocks: int, seqlen: int, sms: int, forced: int | None = None) -> int:
    """Tokens per segment of the channel form (0: one segment) for ``blocks`` blocks per
    segment on ``sms`` multiprocessors: segments only while the blocks cannot fill the GPU."""
    if forced is not None:
        nseg = max(1, min(forced, GRID_YZ_MAX))
    elif blocks >= CH_FULL_PER_SM * sms:
        return 0
    else:
        want = -(-CH_SEG_PER_SM * sms // blocks)
        nseg = min(want, max(1, seqlen // _CH_MIN_SEG))
    if nseg <= 1:
        return 0
    seg = -(-seqlen // nseg)
    seg = -(-seg // _CH_SEG_ALIGN) * _CH_SEG_ALIGN
    return 0 if seg >= seqlen else seg


def _kernel(kset, u, delta, A, B, C, D, z, delta_bias, delta_softplus, dims, out, last) -> None:
    """m2r_selective_scan_<dtype>_n<tier>[form] (csrc/selective_scan.hip): one launch, or two
    for the channel form cut into segments; every operand contiguous (copies only where the
    caller's is not), B / C / A in float32."""
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
    form = _form(tier, dims)
    # channels per block, as the kernel has them: a lane group per channel
    if form == "channels":
        threads = _CH_THREADS
        channels = threads // _channel_lanes(tier)
    else:
        threads = _THREADS
        lanes = _SEGMENT_LANES if form == "segments" else 16 if tier <= 128 else 32
        channels = threads // lanes
    blocks = -(-dims.dim // channels)
    seg_len, seg_state = 0, None
    if form == "channels":
        seg_len = channel_segment_len(blocks * dims.batch, dims.seqlen, sm_count(u.device),
                                      channel_segments)  # fmt: skip
    nseg = -(-dims.seqlen // seg_len) if seg_len else 1
    if nseg > 1:  # (batch, dim, nseg, tier) end states, then (batch, dim, nseg) step sums
        seg_state = torch.empty(dims.batch * dims.dim * nseg * (tier + 1), dtype=torch.float32,
                                device=u.device)  # fmt: skip
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
        ptr(seg_state),
        dims.batch,
        dims.dim,
        dims.seqlen,
        dims.dstate,
        dims.b_groups,
        dims.c_groups,
        int(delta_softplus),
        DTYPE_CODE[D.dtype] if D is not None else 0,
        DTYPE_CODE[delta_bias.dtype] if delta_bias is not None else 0,
        seg_len,
    )  # fmt: skip  (SelectiveScanParams, field order)
    name = f"m2r_selective_scan_{KERNEL_DTYPE[u.dtype]}_n{tier}{KERNEL_FORMS[form]}"
    if nseg > 1:  # every segment's map but the last's, then the outputs
        launch(kset.launcher(name + "s"), u, params, (blocks, dims.batch, nseg - 1), threads)
    launch(kset.launcher(name), u, params, (blocks, dims.batch, nseg), threads)


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
