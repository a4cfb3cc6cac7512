"""``selective_state_update``: one decode step of the selective SSM, as in mamba_ssm.

Both forms: multi-head Mamba2 (state (b, h, p, n), x/dt/z (b, h, p), A (h, p, n), B/C (b, g, n),
D/dt_bias (h, p)) and Mamba1 without the head dim. The state is updated in place. The stride-0
"tied head dim" A/dt/dt_bias/D views that HF transformers passes go to the kernel as they are
(stride 0), never copied. Registered as ``torch.ops.mamba2_rocm.selective_state_update``.

Decode calls the op once per layer and token with the same layouts, so the host work per call
matters as much as the kernel: the argument checks and the static part of the launch are cached
per argument signature (shapes, strides, dtypes, devices, types, flags; see ``_plan``).
"""

from __future__ import annotations

from typing import NamedTuple

from mamba2_rocm._torch import require_torch
from mamba2_rocm.kernels import SSU_CONTIG_MAX_DSTATE, SSU_DSTATE_TIERS, SSU_ROWS_PER_WIDE
from mamba2_rocm.ops._backend import choose
from mamba2_rocm.ops._launch import (
    DTYPE_CODE,
    GRID_YZ_MAX,
    KERNEL_DTYPE,
    as_kernel_float,
    checked_state_rows,
    inference_only,
    launch,
    like,
    remember,
    strides,
    use_registered_op,
)
from mamba2_rocm.ops.checks import StateUpdateDims, check_state_rows, check_state_update_args
from mamba2_rocm.reference.ssd import selective_state_update_ref

torch = require_torch()
Tensor = torch.Tensor

__all__ = ["selective_state_update"]

_THREADS = 128  # csrc/state_update.hip: kThreads
#: Kernel choice when the layout is contiguous (dstate a tier up to SSU_CONTIG_MAX_DSTATE for
#: the state dtype, unit dstate strides, 16-byte aligned state rows, B / C aligned for their
#: runs): a row is tier * itemsize / 16 lanes; the ``_contig`` kernel gives each thread
#: SSU_ROWS_PER_WIDE rows from this many of its blocks on, below that the ``_rows`` kernel (one
#: row per thread, offsets within a batch row in 32 bits: only where ``int32_offsets``, else
#: ``_contig`` at every batch) spreads a small batch over more blocks. Other layouts take the
#: general kernel. Measured on the H100 (bf16, p64 n128, graph-timed, ``scripts/profile_ssu.py
#: --sweep``, blocks of 128 threads), _rows / _contig: 64 heads batch 1 (256 _contig blocks)
#: 2.9 / 3.2 us, batch 4 (1024) 5.2 / 5.3, batch 16 (4096) 14.7 / 14.9, batch 64 (16384) 58.5 /
#: 54.5; 128 heads batch 4 (2048) 8.3 / 8.5, batch 16 (8192) 28.4 / 27.9. (Before _rows took
#: 32-bit offsets: from 512 blocks.) Two rows per thread beat four (88 registers: 123.7 against
#: 105.6 us at batch 64 with 128 heads).
WIDE_KERNEL_MIN_BLOCKS = 8192
#: The same for the ``_rows_std`` kernels (``mamba2_params``): never, they beat ``_contig`` at
#: every batch (H100, graph-timed, 64 heads: batch 16 12.9 / 15.0 us, batch 64 50.0 / 54.6,
#: batch 256 190.9 / 208.2; 128 heads batch 256 379.5 / 414.2).
STD_WIDE_KERNEL_MIN_BLOCKS = 1 << 62
#: The largest batch whose pool indices the contiguous-layout kernels check themselves (one
#: launch a call, csrc/state_rows.h: each wave searches the batch for duplicates); larger batches
#: have m2r_state_rows check them first (two launches). Inside the kernels at every batch
#: (9ba0b2c, H100, graph-timed) batch 1 took 2.68 instead of 3.63 us but batch 256 277.3
#: instead of 186.5: the search grows with the batch in every block. `bench decode`'s pool
#: cases (H100, 2026-12-06, mamba2-1.3b, in kernel vs checked first, device us): batch 4 5.3 vs
#: 5.9, 16 15.7 vs 14.1, 64 62.0 vs 52.8. At 16 the check inside costs 1.6 us of device time and
#: saves a launch: 11 us of host time an eager call (37.6 vs 48.9 us).
SSU_CHECK_IN_KERNEL_MAX_BATCH = 16


class _KernelPlan(NamedTuple):
    """What a kernel launch needs that does not change while the layouts stay the same."""

    tail: tuple  # SsuParams after the 11 pointers: strides, sizes, flags, dtype codes
    tail_checked: tuple  # the same for rows m2r_state_rows checked (int32, stride 1)
    general: tuple[str, tuple[int, int, int]]  # kernel name and grid, one block per 8 rows
    contig: tuple[str, tuple[int, int, int]] | None  # rows per thread: SSU_ROWS_PER_WIDE
    rows: tuple[str, tuple[int, int, int]] | None  # one row per thread, _rows[_std] (or contig)
    std: bool  # rows is a _rows_std kernel
    blocks: int  # the contig kernel's block count
    align: tuple[int, int, int]  # byte alignment state, B, C must have for the contiguous kernels
    contiguous_out: bool  # out can be allocated as empty_like(x, contiguous_format)


#: The largest element offset the ``_rows`` kernels take in 32 bits: they move each tensor to
#: its batch row (the state to its pool row) in 64 bits and index within it in 32
#: (csrc/state_update.hip, update_lanes; 64-bit offsets were a third of their instructions,
#: all before the first load).
INT32_OFFSET_MAX = 2**31 - 1


def _extent(t, lead: int) -> int:
    """The largest element offset within one row of t: over its dims from ``lead`` on."""
    return sum((n - 1) * s for n, s in zip(t.shape[lead:], t.stride()[lead:], strict=True))


def int32_offsets(state, x, dt, A, B, C, D, z, dt_bias, out) -> bool:
    """Whether every offset the ``_rows`` kernels take in 32 bits fits: within a batch
    row of state, x, dt, B, C, z and out, and anywhere in A, D and dt_bias (multi-head views).
    A size-1 dim contributes nothing, whatever its stride: its index is always 0."""
    rows = all(t is None or _extent(t, 1) <= INT32_OFFSET_MAX for t in (state, x, dt, B, C, z, out))
    return rows and all(t is None or _extent(t, 0) <= INT32_OFFSET_MAX for t in (A, D, dt_bias))


def _a_per_head(A) -> bool:
    """Whether A holds one value per head (stride 0 over headdim and dstate), as Mamba2's."""
    return A.stride(-1) == 0 and A.stride(-2) == 0


def mamba2_params(x, dt, A, D, dt_bias) -> bool:
    """Whether the parameters are a Mamba2 block's, as the ``_rows_std`` kernels read them with
    their dtypes fixed at compile time (csrc/state_update.hip, update_lanes' kStd): A one value
    per head (stride 0 over headdim and dstate), A, D and dt_bias float32 (D, dt_bias optional),
    dt in x's dtype. The dtype branches they drop were 17% of batch 1's time."""
    f32 = all(t is None or t.dtype == torch.float32 for t in (A, D, dt_bias))
    return _a_per_head(A) and f32 and dt.dtype == x.dtype


def _run_alignment(nbytes: int) -> int:
    """The alignment csrc/state_update.hip's Chunk loads need for a run of nbytes (16-byte
    accesses for 16, else 8-byte ones)."""
    return 16 if nbytes == 16 else 8


def _kernel_plan(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dims, out,
                 idx=None) -> _KernelPlan:  # fmt: skip
    """The static part of a launch, from one call's tensors (multi-head views; out as passed;
    ``idx`` the state rows as the caller passed them, read and checked by the contiguous-layout
    kernels themselves)."""
    batch, nheads, headdim, dstate = dims.batch, dims.nheads, dims.headdim, dims.dstate
    tier = next(n for n in SSU_DSTATE_TIERS if dstate <= n)
    if batch > GRID_YZ_MAX or nheads > GRID_YZ_MAX:
        raise ValueError(
            f"selective_state_update kernels take batch and nheads <= {GRID_YZ_MAX}, got {batch}, {nheads}"
        )
    head = (
        *state.stride(),
        *x.stride(),
        *dt.stride(),
        *A.stride(),
        *B.stride(),
        *C.stride(),
        *strides(D, 2),
        *strides(z, 3),
        *strides(dt_bias, 2),
        *out.stride(),
    )  # fmt: skip  (SsuParams after the pointers, field order: indices_stride comes next)
    sizes = (
        batch,
        nheads,
        headdim,
        dstate,
        nheads // dims.ngroups,
        state.shape[0],
        int(dt_softplus),
        DTYPE_CODE[dt.dtype],
        DTYPE_CODE[A.dtype],
        DTYPE_CODE[D.dtype] if D is not None else 0,
        DTYPE_CODE[dt_bias.dtype] if dt_bias is not None else 0,
    )  # fmt: skip
    int64 = int(idx is not None and idx.dtype == torch.int64)
    tail = (*head, 0 if idx is None else idx.stride(0), *sizes, int64, 0, 0)
    tail_checked = (*head, 1, *sizes, 0, 1, 0)
    vec = 16 // state.element_size()  # state elements per lane in the contiguous kernels
    b_align = _run_alignment(vec * B.element_size())  # (B and C share a dtype: bcz_operands)
    contig_layout = (
        dstate == tier
        and tier <= SSU_CONTIG_MAX_DSTATE[KERNEL_DTYPE[state.dtype]]
        and state.stride(-1) == 1 and B.stride(-1) == 1 and C.stride(-1) == 1
        and (A.stride(-1) == 1 or _a_per_head(A))  # unit dstate stride, or one value per head
        and all(st % vec == 0 for st in state.stride()[:-1])
        and all(st * t.element_size() % b_align == 0 for t in (B, C) for st in t.stride()[:-1])
    )  # fmt: skip
    bcz = "_f32bcz" if B.dtype != x.dtype else ""  # (bcz_operands: x's dtype or all float32)
    name = f"m2r_ssu_{KERNEL_DTYPE[state.dtype]}_{KERNEL_DTYPE[x.dtype]}{bcz}_n{tier}"
    rows_pass = _THREADS // (tier // vec)  # rows per block and row per thread
    wide = -(-headdim // (rows_pass * SSU_ROWS_PER_WIDE))
    contig = (name + "_contig", (wide, nheads, batch)) if contig_layout else None
    rows, std = contig, False  # (offsets past int32 within a row: the 64-bit _contig throughout)
    if contig_layout and int32_offsets(state, x, dt, A, B, C, D, z, dt_bias, out):
        std = mamba2_params(x, dt, A, D, dt_bias)
        rows = (name + ("_rows_std" if std else "_rows"), (-(-headdim // rows_pass), nheads, batch))
    return _KernelPlan(
        tail=tail,
        tail_checked=tail_checked,
        general=(name, (-(-headdim // (_THREADS // 32)), nheads, batch)),
        contig=contig,
        rows=rows,
        std=std,
        blocks=wide * nheads * batch,
        align=(16, b_align, b_align),
        contiguous_out=type(x) is Tensor,
    )


def bcz_operands(x, B, C, z):
    """B, C, z as the kernels read them: in x's dtype when all of them have it (a converted
    copy of any other with float32 x, exact); otherwise, with half x (mamba_ssm callers pass
    float32 B / C / z), all in float32, read by the ``_f32bcz`` kernels, so that nothing is
    rounded to half first: mamba_ssm reads them unrounded. Only operands not already float32
    are copied."""
    if x.dtype == torch.float32 or all(t is None or t.dtype == x.dtype for t in (B, C, z)):
        return like(B, x), like(C, x), like(z, x)
    return tuple(t if t is None or t.dtype == torch.float32 else t.float() for t in (B, C, z))


def operands_as_is(x, dt, A, B, C, D, z, dt_bias) -> bool:
    """Whether bcz_operands and as_kernel_float return every operand unchanged: a question of
    dtypes only, answered once per cached signature so that a decode step skips both calls."""
    bcz = (B, C, z)
    same = all(t is None or t.dtype == x.dtype for t in bcz)
    wide = all(t is None or t.dtype == torch.float32 for t in bcz)
    return (same or wide) and all(t is None or t.dtype in KERNEL_DTYPE for t in (dt, A, D, dt_bias))


def _as_heads(state, x, dt, A, B, C, D, z, dt_bias):
    """The Mamba1 form as one head with headdim = dim: views only."""
    return (
        state.unsqueeze(1), x.unsqueeze(1), dt.unsqueeze(1), A.unsqueeze(0), B.unsqueeze(1), C.unsqueeze(1),
        None if D is None else D.unsqueeze(0), None if z is None else z.unsqueeze(1),
        None if dt_bias is None else dt_bias.unsqueeze(0),
    )  # fmt: skip


class _Plan:
    """One validated argument signature: its sizes, and its kernel plan once the kernel ran."""

    __slots__ = ("as_is", "device", "dims", "kernel")

    def __init__(self, dims: StateUpdateDims, device, as_is: bool) -> None:
        self.dims, self.device = dims, device
        self.as_is = as_is  # the kernels read every operand as passed (see operands_as_is)
        self.kernel: _KernelPlan | None = None


#: Validated signatures (see ``_signature``) -> their plan. Decode calls the op with the same
#: layouts every step, so after the first call the checks and the parameter layout are a dict
#: lookup. Only signatures that passed ``check_state_update_args`` are stored.
_PLANS: dict[tuple, _Plan] = {}
PLAN_CACHE_SIZE = 256
#: The last (signature, plan): one tuple comparison instead of hashing the signature, for the
#: usual decode loop where every layer's call has the same layouts.
_last: tuple = (None, None)


def _signature(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, idx) -> tuple:
    """Everything the argument checks and a launch's static parameters depend on: per tensor its
    type, shape, strides, dtype and device (not its address, which changes every call)."""
    return (
        type(state), state.shape, state.stride(), state.dtype, state.device,
        type(x), x.shape, x.stride(), x.dtype, x.device,
        type(dt), dt.shape, dt.stride(), dt.dtype, dt.device,
        type(A), A.shape, A.stride(), A.dtype, A.device,
        type(B), B.shape, B.stride(), B.dtype, B.device,
        type(C), C.shape, C.stride(), C.dtype, C.device,
        None if D is None else (type(D), D.shape, D.stride(), D.dtype, D.device),
        None if z is None else (type(z), z.shape, z.stride(), z.dtype, z.device),
        None if dt_bias is None else (
            type(dt_bias), dt_bias.shape, dt_bias.stride(), dt_bias.dtype, dt_bias.device
        ),
        dt_softplus,
        None if idx is None else (type(idx), idx.shape, idx.stride(), idx.dtype, idx.device),
    )  # fmt: skip


def _plan(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, idx) -> _Plan:
    """The cached plan of this signature, or a new one after the full argument checks."""
    global _last
    last_key, last_plan = _last
    try:
        key = _signature(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, idx)
        if key == last_key:
            return last_plan
        plan = _PLANS.get(key)
    except Exception:  # not tensors (or unhashable): the full checks below name the argument
        key = plan = None
    if plan is not None:
        _last = (key, plan)
        return plan
    dims = check_state_update_args(state, x, dt, A, B, C, D, z, dt_bias, idx, allow_empty=True)
    plan = _Plan(dims, x.device, operands_as_is(x, dt, A, B, C, D, z, dt_bias))
    if key is not None:
        remember(_PLANS, key, plan, PLAN_CACHE_SIZE)
        _last = (key, plan)
    return plan


def clear_plan_cache() -> None:
    """Forget every validated signature (tests; the cache never needs it for correctness)."""
    global _last
    _PLANS.clear()
    _last = (None, None)


def _impl(
    state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
    z: Tensor | None, dt_bias: Tensor | None, dt_softplus: bool, state_batch_indices: Tensor | None,
) -> Tensor:  # fmt: skip
    idx = state_batch_indices
    plan = _plan(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, idx)
    if x.shape[0] == 0:  # an empty batch: an empty output, no state touched
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    tier, kset = choose(plan.device)
    if tier != "kernel" or x.dtype not in KERNEL_DTYPE or state.dtype not in KERNEL_DTYPE:
        # every tier accepts the same inputs: float64 x or state, which no kernel reads, take
        # the torch tier (in float64) on the GPU as well
        wide = torch.float64 in (x.dtype, state.dtype)
        cd = torch.float64 if tier == "eager" or wide else torch.float32
        # the rows' range and duplicates, read on the host (this tier reads them anyway)
        check_state_rows("state_batch_indices", idx, plan.dims.pool, plan.dims.batch)
        return selective_state_update_ref(
            state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, idx, cd
        )
    # mamba_ssm's dtype rules: B, C, z, dt, A, D, dt_bias may each differ from x; dt, A, D,
    # dt_bias are read in their own dtype (float64 ones become float32 copies), B / C / z as
    # bcz_operands says
    if not plan.as_is:
        B, C, z = bcz_operands(x, B, C, z)
        dt, A, D, dt_bias = (as_kernel_float(t) for t in (dt, A, D, dt_bias))
    kp = plan.kernel
    if kp is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if plan.dims.has_heads:
            views = (state, x, dt, A, B, C, D, z, dt_bias)
            kp = _kernel_plan(*views, dt_softplus, plan.dims, out, idx)
        else:  # dims already describe the Mamba1 form as one head and one group
            views = _as_heads(state, x, dt, A, B, C, D, z, dt_bias)
            kp = _kernel_plan(*views, dt_softplus, plan.dims, out.unsqueeze(1), idx)
        plan.kernel = kp
    elif kp.contiguous_out:  # same strides as torch.empty(x.shape), cheaper to ask for
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    sp, bp, cp = state.data_ptr(), B.data_ptr(), C.data_ptr()
    a_s, a_b, a_c = kp.align
    tail = kp.tail
    if kp.contig is None or sp % a_s or bp % a_b or cp % a_c:
        name, grid = kp.general
        in_kernel = False  # (the general kernels read rows m2r_state_rows checked)
    else:
        wide_from = STD_WIDE_KERNEL_MIN_BLOCKS if kp.std else WIDE_KERNEL_MIN_BLOCKS
        name, grid = kp.contig if kp.blocks >= wide_from else kp.rows
        in_kernel = plan.dims.batch <= SSU_CHECK_IN_KERNEL_MAX_BATCH
    if idx is not None and not in_kernel:  # int32 rows, range and duplicates checked
        idx, tail = checked_state_rows(kset, idx, plan.dims.pool), kp.tail_checked
    ptrs = (
        sp,
        x.data_ptr(),
        dt.data_ptr(),
        A.data_ptr(),
        bp,
        cp,
        0 if D is None else D.data_ptr(),
        0 if z is None else z.data_ptr(),
        0 if dt_bias is None else dt_bias.data_ptr(),
        out.data_ptr(),
        0 if idx is None else idx.data_ptr(),
    )  # the SsuParams pointers, in field order
    launch(kset.launcher(name), x, ptrs + tail, grid, _THREADS)
    return out


selective_state_update_op = torch.library.custom_op(
    "mamba2_rocm::selective_state_update", _impl, mutates_args=("state",)
)


@selective_state_update_op.register_fake
def _(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices):
    check_state_update_args(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices,
                            allow_empty=True)  # fmt: skip
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def selective_state_update(
    state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
    z: Tensor | None = None, dt_bias: Tensor | None = None, dt_softplus: bool = False,
    state_batch_indices: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """One decode step; ``state`` is updated in place; returns out with x's shape and dtype.

    ``state_batch_indices`` (int32 or int64, (batch,)) maps batch rows to state rows; -1 marks
    a padded row (out zeros, no state touched). An index out of the pool, or a row named by two
    batch entries, raises on the torch tiers; the kernel cannot raise without a device sync, so
    there such rows get NaN outputs and their states are left untouched, never raced over.
    """
    op = _impl
    if use_registered_op(x, dt, A, B, C, D, z, dt_bias):
        op = selective_state_update_op
    out = op(state, x, dt, A, B, C, D, z, dt_bias, bool(dt_softplus), state_batch_indices)
    if op is _impl:  # the torch tiers differentiate as plain PyTorch code
        return out
    return inference_only("selective_state_update", out, x, dt, A, B, C, D, z, dt_bias)
