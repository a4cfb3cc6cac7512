"""Gated RMSNorm and LayerNorm, as in mamba_ssm's layernorm_gated: ``rmsnorm_fn`` /
``RMSNorm`` and ``layernorm_fn`` / ``LayerNorm`` (the same kernels; LayerNorm subtracts each
group's mean first).

Registered as ``torch.ops.mamba2_rocm.rmsnorm_fwd`` and, for training, ``rmsnorm_bwd`` (the
HIP backward kernels: dx, dweight, dbias, dz; dweight / dbias reduced in fp32 in a fixed order).
x and z may be any shape (..., hidden); rows that are not unit-stride along hidden are copied
once; z may have another float dtype than x (converted to x's), weight and bias any float dtype.
"""

from __future__ import annotations

import math

from mamba2_rocm._torch import require_torch
from mamba2_rocm.kernels import RMSNORM_BWD_ROW_MAX_THREADS, RMSNORM_VECS
from mamba2_rocm.ops._backend import choose
from mamba2_rocm.ops._launch import (
    COLUMN_SUM_COLS,
    DTYPE_CODE,
    GRID_YZ_MAX,
    KERNEL_DTYPE,
    as_kernel_float,
    launch,
    layout,
    like,
    register_training,
    remember,
    sm_count,
    traced,
    use_registered_op,
)
from mamba2_rocm.ops.checks import check_rmsnorm_args
from mamba2_rocm.reference.ssd import rmsnorm_bwd_ref, rmsnorm_ref

torch = require_torch()
Tensor = torch.Tensor

__all__ = ["LayerNorm", "RMSNorm", "layernorm_fn", "rmsnorm_fn"]

_THREADS = 256  # csrc/rmsnorm.hip and csrc/rmsnorm_bwd.hip: kThreads
#: vec_plan's threads per item that have kernels with them fixed at compile time: the whole
#: block (``_b``) or half of it (``_h``)
_FIXED_TPI = {_THREADS: "_b", _THREADS // 2: "_h"}
#: The backward's blocks per multiprocessor (column blocks x row blocks); beyond, blocks walk
#: more rows (fewer partial dweight / dbias rows for the reduce launch to add). With the next
#: row's loads requested a row ahead, 2 was fastest of 1 / 1.5 / 2 / 3 / 4 / 8 at every Mamba2
#: block shape (H200, bf16, the 16-byte path before it became a kernel of its own: 370m b4 l2048
#: 121.9 / 108.6 / 95.0 / 114.4 / 105.2 / 126.3 us, 2.7b 317.4 / 278.3 / 234.2 / 276.0 / 238.8 /
#: 247.3).
BWD_BLOCKS_PER_SM = 2
#: Groups up to this many elements get a wavefront each in the backward's stats kernel (else a
#: block each: 256 threads for a few elements each left most of them idle at d2048 in groups
#: of 256, H100) ...
STATS_WAVE_MAX_GROUP = 2048
#: ... and larger groups too where there are at least this many items (rows x groups) per
#: multiprocessor: a block per item took 13-41% longer than a wavefront per item from 8192
#: items of d3072 / d4096 / d5120 up (2.7b b4 l2048: 91.8 against 75.2 us, H200; 5% less at
#: fp16 8192 x d4096), tied at 4096 items of d4096 and was faster at 1000 of d2304 (8.2 against
#: 10.6 us: 125 blocks of 8 wavefronts leave the machine under-filled).
STATS_WAVE_MIN_ITEMS_PER_SM = 48
_VEC = 8  # elements per 16-byte run of the register-resident kernels
#: The one-pass backward (``m2r_rmsnorm_bwd_row_bf16``): a block of a multiple of 64 threads
#: (a wavefront on every target) per (row, group), one 8-element run a thread, so groups of up
#: to 8 * RMSNORM_BWD_ROW_MAX_THREADS elements; ROW_PASS_THREADS_PER_SM / threads blocks a
#: multiprocessor (at least one), each walking its share of the rows. 1024 is what the kernel's
#: 64 registers a thread leave resident on NVIDIA (65536 a multiprocessor). Against 512 and 2048
#: (H200, bf16, z gate first, graph us, 1024 / 512 / 2048): 16384 rows of d1536 115.1 / 172.0 /
#: 121.1, d2048 139.0 / 175.2 / 138.3, d3072 221.5 / 341.9 / 236.0, d4096 267.3 / 361.6 / 271.3,
#: Codestral b4 l2048 (groups of 1024) 266.5 / 333.7 / 259.4, mamba2-130m b8 l512 37.9 / 48.9 /
#: 36.9: within 4% of the faster of the others everywhere.
_ROW_THREAD_STEP = 64
ROW_PASS_THREADS_PER_SM = 1024
#: whether the backward takes the one-pass kernel where it applies (else the two passes)
ROW_PASS = True


#: Runs (8 elements) per thread above which the register-resident kernel is the last resort.
PREFERRED_MAX_RUNS = 3
#: Runs of a call (rows x hidden / 8) per multiprocessor from which ``vec_plan`` gives each
#: thread as many runs as it can hold (up to 4, the fewest threads per item) instead of one:
#: enough work that every multiprocessor is full either way, where a thread's bytes in flight
#: decide the rate. H200, bf16, 16384 rows (25-100k runs per multiprocessor), graph us against
#: one run a thread: d1536 64 x 3 38.7 against 256 x 1 44.6, d2048 64 x 4 51.3 against 53.2,
#: d8192 in groups of 1024 32 x 4 188.6 against 128 x 1 206.2; d3072 128 x 3 71.5, d4096 128 x 4
#: 94.1-94.9 (93-103% of a same-size copy). A decode step (64 rows of d8192 in groups of 1024, 500
#: runs per multiprocessor) takes one run a thread: 128 x 1 2.9 us, 32 x 4 3.7. Near the threshold
#: (about 4000 runs a multiprocessor) neither is faster everywhere: 512 rows of d8192 in groups of
#: 1024 7.5 packed against 8.2 spread, 1024 rows of d4096 7.2 against 6.8.
DENSE_RUNS_PER_SM = 4096
#: The most runs a thread of a dense call holds where the z gate comes after the norm (its raw
#: z runs stay in registers too: v4 95 registers on sm_90): 16384 rows of d4096 256 x 2 101.8 us
#: against 128 x 4 109.1-111.0 (H200, bf16).
DENSE_GATE_AFTER_MAX_RUNS = 3


def vec_plan(
    group_size: int, elem_size: int, addresses: tuple[int, ...], runs_per_sm: float = math.inf,
    gate_after: bool = False,
) -> tuple[int, int] | None:  # fmt: skip
    """(threads per (row, group), runs per thread) of the register-resident kernel, or None.

    It needs 16-bit elements, a group made of whole 8-element runs, at most kThreads * 4 runs,
    and 16-byte alignment of every address in ``addresses`` (data pointers, and row strides
    in bytes). A call of ``DENSE_RUNS_PER_SM`` runs or more per multiprocessor (``runs_per_sm``;
    unknown counts as many) gives each thread up to 4 runs (``DENSE_GATE_AFTER_MAX_RUNS`` with
    ``gate_after``): the fewest threads per item, a power of two from 32 (groups of up to 32
    runs: one run a thread). A smaller call spreads its runs:
    up to kThreads runs, the power of two covering them, one run each; beyond, the power of two
    in 32..kThreads with at most ``PREFERRED_MAX_RUNS`` runs each if there is one, then the
    fewest thread-runs left idle, then the fewest runs each (set on the H100 with register-capped
    kernels, for every call then).
    """
    if elem_size != 2 or group_size % _VEC or any(a % 16 for a in addresses):
        return None
    runs = group_size // _VEC
    if runs > _THREADS * RMSNORM_VECS[-1]:
        return None
    if runs_per_sm >= DENSE_RUNS_PER_SM and runs > 32:
        most = DENSE_GATE_AFTER_MAX_RUNS if gate_after else RMSNORM_VECS[-1]
        threads = min(_THREADS, max(32, 1 << (-(-runs // most) - 1).bit_length()))
        per = -(-runs // threads)
        return threads, next(v for v in RMSNORM_VECS if v >= per)
    if runs <= _THREADS:
        return 1 << (runs - 1).bit_length(), 1
    best = None
    for threads in (32, 64, 128, _THREADS):
        per = -(-runs // threads)
        vecs = next((v for v in RMSNORM_VECS if v >= per), None)
        if vecs is None:
            continue
        score = (per > PREFERRED_MAX_RUNS, threads * per - runs, per)
        if best is None or score < best[0]:
            best = (score, threads, vecs)
    return best[1:]  # (kThreads threads always fit: at most 4 runs each)


def _runs_per_sm(x2: Tensor) -> float:
    """The call's 8-element runs per multiprocessor (``vec_plan``); unknown (no GPU): many."""
    sms = sm_count(x2.device)
    return x2.numel() / _VEC / sms if sms else math.inf


def _vec_choice(gs: int, x2: Tensor, addresses: tuple[int, ...], gate_after: bool, groups: int):
    """The register-resident kernel for this call of (rows, hidden) ``x2``: (threads per item,
    kernel name suffix, grid) from ``vec_plan`` and ``_vec_variant``, or None."""
    plan = vec_plan(gs, x2.element_size(), addresses, _runs_per_sm(x2), gate_after)
    return None if plan is None else (plan[0], *_vec_variant(plan, x2.shape[0], groups, gate_after))


def _kernel_params(weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """weight and bias as the kernels read them: in a kernel dtype (float32 for float64) and
    contiguous (they index the parameters as dense vectors; a strided view is copied)."""
    weight = as_kernel_float(weight).contiguous()
    return weight, None if bias is None else as_kernel_float(bias).contiguous()


def _rows(t: Tensor, hidden: int) -> Tensor:
    """(rows, hidden) with unit stride along hidden: a view when possible, else one copy."""
    t2 = t.reshape(-1, hidden)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _kernel(kset, x, weight, bias, z, eps, group_size, norm_before_gate, layer_norm, out) -> None:
    hidden = x.shape[-1]
    weight, bias = _kernel_params(weight, bias)
    x2 = _rows(x, hidden)
    z2 = None if z is None else _rows(like(z, x), hidden)
    rows = x2.shape[0]
    out2 = out.view(-1, hidden)
    flags = (norm_before_gate, layer_norm)
    groups = hidden // group_size
    el = x2.element_size()
    addresses = [x2.data_ptr(), x2.stride(0) * el, out2.data_ptr(), out2.stride(0) * el]
    addresses += [weight.data_ptr()] + ([] if bias is None else [bias.data_ptr()])
    if z2 is not None:
        addresses += [z2.data_ptr(), z2.stride(0) * el]
    vec = _vec_choice(group_size, x2, tuple(addresses), z2 is not None and norm_before_gate, groups)
    if vec is not None and rows * groups < 2**31:  # (the kernel's 32-bit item index, grid.x)
        threads, variant, grid = vec
        _launch(kset, x2, weight, bias, z2, eps, group_size, flags, out2, grid[:2], variant,
                threads)  # fmt: skip
        return
    if rows > GRID_YZ_MAX:  # grid.y limit: launch in slices of rows
        for start in range(0, rows, GRID_YZ_MAX):
            sl = slice(start, start + GRID_YZ_MAX)
            _launch(kset, x2[sl], weight, bias, None if z2 is None else z2[sl], eps, group_size,
                    flags, out2[sl], (groups, out2[sl].shape[0]))  # fmt: skip
        return
    _launch(kset, x2, weight, bias, z2, eps, group_size, flags, out2, (groups, rows))


def _vec_variant(plan: tuple[int, int], rows: int, groups: int, gate_after: bool):
    """The register-resident kernel's name suffix and grid for ``vec_plan``'s (threads, runs):
    ``_v<runs>``, ``_ga`` when the z gate comes after the norm, ``_b`` / ``_h`` when an item
    takes the whole block / half of it (its sums without the per-item predicates); (row, group)
    items per block."""
    threads, vecs = plan
    fixed = _FIXED_TPI.get(threads, "")
    suffix = f"_v{vecs}" + ("_ga" if gate_after else "") + fixed
    return suffix, (-(-rows * groups // (_THREADS // threads)), 1, 1)


def _tail(x2, z2, out_row_stride, weight, bias, eps, group_size, flags, item_threads) -> tuple:
    """RmsNormParams after the five pointers, in field order."""
    norm_before_gate, layer_norm = flags
    return (
        x2.stride(0),
        0 if z2 is None else z2.stride(0),
        out_row_stride,
        x2.shape[0],
        x2.shape[1],
        group_size,
        int(norm_before_gate),
        float(eps),
        DTYPE_CODE[weight.dtype],
        DTYPE_CODE[bias.dtype] if bias is not None else 0,
        item_threads,
        int(layer_norm),
        0,
    )  # fmt: skip


def _launch(kset, x2, weight, bias, z2, eps, group_size, flags, out2, grid,
            variant="", item_threads=0) -> None:  # fmt: skip
    ptrs = (x2.data_ptr(), 0 if z2 is None else z2.data_ptr(), weight.data_ptr(),
            0 if bias is None else bias.data_ptr(), out2.data_ptr())  # fmt: skip
    tail = _tail(x2, z2, out2.stride(0), weight, bias, eps, group_size, flags, item_threads)
    name = f"m2r_rmsnorm_fwd_{KERNEL_DTYPE[x2.dtype]}{variant}"
    launch(kset.launcher(name), x2, ptrs + tail, (*grid, 1), _THREADS)


class _NormPlan:
    """A validated argument layout: its group size, and once the kernel ran, the launch's static
    part for calls that need no copy (see ``_fast_plan``), or False when they do."""

    __slots__ = ("fast", "gs")

    def __init__(self, gs: int) -> None:
        self.gs = gs
        self.fast: tuple | bool | None = None


#: (layouts of x, weight, bias, z; eps, group_size, flags) -> its plan. Decode calls the norm
#: with the same layouts every step: after the first call the checks are one dict lookup. Only
#: layouts that passed ``check_rmsnorm_args`` are stored.
_PLANS: dict[tuple, _NormPlan] = {}
PLAN_CACHE_SIZE = 256


def _fast_plan(x, weight, bias, z, eps, gs, norm_before_gate, layer_norm) -> tuple | bool:
    """The launch's static part, when a call with this layout needs no copy (x and z rows are
    views with unit stride, z in x's dtype, weight and bias in kernel dtypes) and one launch:
    ``(vec, general)``, each ``(kernel name, grid, RmsNormParams after the pointers)``, vec
    None when the strides rule the register-resident kernel out (the data pointers' 16-byte
    alignment is checked per call). False when the call must take ``_kernel``'s general path."""
    hidden = x.shape[-1]
    x2, z2 = x.reshape(-1, hidden), None if z is None else z.reshape(-1, hidden)
    rows, groups = x2.shape[0], hidden // gs
    if (
        x2.data_ptr() != x.data_ptr() or x2.stride(-1) != 1  # reshape copied, or not unit-stride
        or (z2 is not None and (z2.data_ptr() != z.data_ptr() or z2.stride(-1) != 1 or z.dtype != x.dtype))
        or weight.dtype not in KERNEL_DTYPE or (bias is not None and bias.dtype not in KERNEL_DTYPE)
        or weight.stride(0) != 1 or (bias is not None and bias.stride(0) != 1)  # (dense vectors)
        or rows > GRID_YZ_MAX or rows * groups >= 2**31
    ):  # fmt: skip
        return False
    el = x2.element_size()
    flags = (norm_before_gate, layer_norm)

    def tail(item_threads: int) -> tuple:  # out is contiguous: its row stride is hidden
        return _tail(x2, z2, hidden, weight, bias, eps, gs, flags, item_threads)

    name = f"m2r_rmsnorm_fwd_{KERNEL_DTYPE[x.dtype]}"
    general = (name, (groups, rows, 1), tail(0))
    strides = (x2.stride(0) * el, hidden * el) + (() if z2 is None else (z2.stride(0) * el,))
    choice = _vec_choice(gs, x2, strides, z is not None and norm_before_gate, groups)
    if choice is None:
        return None, general
    threads, variant, grid = choice
    return (name + variant, grid, tail(threads)), general


def _impl(
    x: Tensor, weight: Tensor, bias: Tensor | None, z: Tensor | None, eps: float,
    group_size: int | None, norm_before_gate: bool, is_rms_norm: bool,
) -> Tensor:  # fmt: skip
    try:
        key = (layout(x), layout(weight), layout(bias), layout(z), eps, group_size,
               norm_before_gate, is_rms_norm)  # fmt: skip
        plan = _PLANS.get(key)
    except Exception:  # not tensors (or unhashable): the checks below name the argument
        key = plan = None
    if plan is None:
        _, gs = check_rmsnorm_args(x, weight, bias, z, eps, group_size, allow_empty=True)
        plan = _NormPlan(gs)
        if key is not None:
            remember(_PLANS, key, plan, PLAN_CACHE_SIZE)
    gs = plan.gs
    if x.numel() == 0:  # no rows: an empty output
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    tier, kset = choose(x.device)
    if tier != "kernel" or x.dtype not in KERNEL_DTYPE:
        return rmsnorm_ref(x, weight, bias, z, eps, gs, norm_before_gate, is_rms_norm=is_rms_norm)
    if plan.fast is None:
        plan.fast = _fast_plan(x, weight, bias, z, eps, gs, norm_before_gate, not is_rms_norm)
    if type(x) is Tensor:  # same shape, dtype, device and (contiguous) strides, cheaper to get
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if plan.fast is False:
        _kernel(kset, x, weight, bias, z, eps, gs, norm_before_gate, not is_rms_norm, out)
        return out
    vec, general = plan.fast
    ptrs = (x.data_ptr(), 0 if z is None else z.data_ptr(), weight.data_ptr(),
            0 if bias is None else bias.data_ptr(), out.data_ptr())  # fmt: skip
    name, grid, tail = general
    if vec is not None and not (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3] | ptrs[4]) & 15:
        name, grid, tail = vec
    launch(kset.launcher(name), x, ptrs + tail, grid, _THREADS)
    return out


def clear_plan_cache() -> None:
    """Forget every validated layout (tests; the cache never needs it for correctness)."""
    _PLANS.clear()


rmsnorm_fwd = torch.library.custom_op("mamba2_rocm::rmsnorm_fwd", _impl, mutates_args=())


# ---- backward --------------------------------------------------------------------------------


def _check_bwd(x, weight, bias, z, eps, group_size, dout) -> int:
    _, gs = check_rmsnorm_args(x, weight, bias, z, eps, group_size, allow_empty=True)
    if not isinstance(dout, Tensor):
        raise TypeError(f"dout must be a torch.Tensor, got {type(dout).__name__}")
    if dout.shape != x.shape or dout.dtype != x.dtype or dout.device != x.device:
        raise ValueError(
            f"dout must match x (shape {tuple(x.shape)}, {x.dtype}, {x.device}), got shape "
            f"{tuple(dout.shape)}, {dout.dtype}, {dout.device}"
        )
    return gs


def bwd_row_blocks(rows: int, col_blocks: int, sms: int) -> int:
    """Row blocks of the gradient kernel: BWD_BLOCKS_PER_SM blocks per multiprocessor over
    the column blocks, at most one per row and at most the grid's y limit."""
    if sms <= 0:
        return 1
    return max(1, min(rows, GRID_YZ_MAX, int(BWD_BLOCKS_PER_SM * sms // col_blocks)))


def stats_by_wavefront(items: int, group_size: int, sms: int) -> bool:
    """Whether the backward's stats kernel takes an item per wavefront (else per block)."""
    return group_size <= STATS_WAVE_MAX_GROUP or items >= STATS_WAVE_MIN_ITEMS_PER_SM * sms


def row_pass_threads(group_size: int) -> int | None:
    """Threads a block of the one-pass backward for groups of this many 16-bit elements: one
    8-element run each, in whole 64-thread steps; None for groups not of whole runs or past
    the kernel's RMSNORM_BWD_ROW_MAX_THREADS runs."""
    if group_size <= 0 or group_size % _VEC:
        return None
    threads = -(-group_size // (_VEC * _ROW_THREAD_STEP)) * _ROW_THREAD_STEP
    return threads if threads <= RMSNORM_BWD_ROW_MAX_THREADS else None


def _bwd_kernel(kset, x, weight, bias, z, eps, gs, norm_before_gate, layer_norm, dout):
    """dx and dz (x's dtype, x's shape; dz None without z), and dweight and dbias (None without
    a bias; new, contiguous, in the dtypes the kernels read the parameters in: float32 for
    float64 ones), which ``m2r_rmsnorm_bwd_reduce`` writes from the gradient kernel's fp32
    partial rows, added in a fixed order. The gradients come from the one-pass kernel where it
    applies (bf16 x, no bias, 16-byte aligned rows and weight, groups of whole 8-element runs
    up to its 4096 elements: x, z and dout read once), else from the stats and gradient
    kernels (read twice)."""
    hidden = x.shape[-1]
    weight, bias = _kernel_params(weight, bias)
    dweight = torch.empty_like(weight)  # (new: an op's outputs may not alias its inputs)
    dbias = None if bias is None else torch.empty_like(bias)
    x2, g2 = _rows(x, hidden), _rows(dout, hidden)
    z2 = None if z is None else _rows(like(z, x), hidden)
    rows, groups = x2.shape[0], hidden // gs
    if rows * groups >= 2**31:
        raise ValueError(f"rmsnorm backward supports rows * groups < 2**31, got {rows * groups}")
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dz = None if z is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dx2, dz2 = dx.view(-1, hidden), None if dz is None else dz.view(-1, hidden)
    el = x2.element_size()
    sms = sm_count(x.device)
    rowed = [t for t in (x2, g2, z2, dx2, dz2) if t is not None]
    vec = all(t.data_ptr() % 16 == 0 and (t.stride(0) * el) % 16 == 0 for t in rowed)
    dt = KERNEL_DTYPE[x.dtype]
    one_pass = ROW_PASS and bias is None and vec and x.dtype == torch.bfloat16
    threads = row_pass_threads(gs) if one_pass and weight.data_ptr() % 16 == 0 else None
    if threads is not None:  # one pass: grid (groups, row blocks)
        per_sm = max(1, ROW_PASS_THREADS_PER_SM // threads)
        row_blocks = max(1, min(rows, GRID_YZ_MAX, -(-per_sm * sms // groups)))
    else:
        col_blocks = -(-hidden // (_THREADS * (16 // el)))
        row_blocks = bwd_row_blocks(rows, col_blocks, sms)
    per_block = -(-rows // row_blocks)
    row_blocks = -(-rows // per_block)
    stats = None if threads else torch.empty(rows * groups, 4, dtype=torch.float32, device=x.device)
    partial = torch.empty(row_blocks, 2, hidden, dtype=torch.float32, device=x.device)
    ptrs = (x2.data_ptr(), 0 if z2 is None else z2.data_ptr(), weight.data_ptr(),
            0 if bias is None else bias.data_ptr(), g2.data_ptr(), 0 if stats is None else stats.data_ptr(),
            dx2.data_ptr(), 0 if dz2 is None else dz2.data_ptr(), partial.data_ptr(),
            dweight.data_ptr(), 0 if dbias is None else dbias.data_ptr())  # fmt: skip
    tail = (
        x2.stride(0),
        0 if z2 is None else z2.stride(0),
        g2.stride(0),
        dx2.stride(0),
        0 if dz2 is None else dz2.stride(0),
        rows,
        hidden,
        gs,
        int(norm_before_gate),
        float(eps),
        DTYPE_CODE[weight.dtype],
        DTYPE_CODE[bias.dtype] if bias is not None else 0,
        int(layer_norm),
        per_block,
        int(vec),
        row_blocks,
        0,
    )  # fmt: skip  (RmsNormBwdParams after the pointers, field order)
    if threads is not None:
        grid = (groups, row_blocks, 1)
        launch(kset.launcher("m2r_rmsnorm_bwd_row_bf16"), x2, ptrs + tail, grid, threads)
    else:
        # a block holds 256 / wavefront items: 4 on wave64 targets, 8 on wave32 ones (the grid
        # is sized for 4; wave32's extra blocks find no item and exit)
        items = rows * groups
        if stats_by_wavefront(items, gs, sms):
            stats_grid, stats_name = (-(-items // 4), 1, 1), f"m2r_rmsnorm_bwd_stats_w_{dt}"
        else:
            stats_grid, stats_name = (items, 1, 1), f"m2r_rmsnorm_bwd_stats_{dt}"
        launch(kset.launcher(stats_name), x2, ptrs + tail, stats_grid, _THREADS)
        # _v: 16-byte runs, each within one group (aligned rows, groups of whole runs)
        runs = "_v" if vec and gs % (16 // el) == 0 else ""
        launch(kset.launcher(f"m2r_rmsnorm_bwd{runs}_{dt}"), x2, ptrs + tail,
               (col_blocks, row_blocks, 1), _THREADS)  # fmt: skip
    red_cols = hidden * (1 if bias is None else 2)
    launch(kset.launcher("m2r_rmsnorm_bwd_reduce"), x2, ptrs + tail,
           (-(-red_cols // COLUMN_SUM_COLS), 1, 1), _THREADS)  # fmt: skip
    return dx, dz, dweight, dbias


def _bwd_impl(
    x: Tensor, weight: Tensor, bias: Tensor | None, z: Tensor | None, eps: float,
    group_size: int | None, norm_before_gate: bool, is_rms_norm: bool, dout: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """Gradients of the gated norm for the output gradient ``dout``: (dx, dweight, dbias, dz),
    each in its input's dtype; dbias / dz are empty where there is no bias / no z. dweight and
    dbias are reduced in fp32 in a fixed order (bit-identical runs)."""
    gs = _check_bwd(x, weight, bias, z, eps, group_size, dout)
    return _bwd_run(x, weight, bias, z, eps, gs, norm_before_gate, is_rms_norm, dout)


def _bwd_run(x, weight, bias, z, eps, gs, norm_before_gate, is_rms_norm, dout):
    """``_bwd_impl`` on checked arguments, ``gs`` the group size resolved (the eager backward's
    call: the forward checked the inputs, autograd's dout has the output's shape and dtype)."""
    tier, kset = choose(x.device)
    if x.numel() == 0 or tier != "kernel" or x.dtype not in KERNEL_DTYPE:
        ct = torch.float64 if x.dtype == torch.float64 else torch.float32
        if x.numel() == 0:  # (the reference's checks refuse empty rows)
            dx, dw = torch.zeros_like(x), torch.zeros_like(weight)
            db = None if bias is None else torch.zeros_like(bias)
            dz = None if z is None else torch.zeros_like(z)
        else:
            dx, dw, db, dz = rmsnorm_bwd_ref(x, weight, bias, z, eps, gs, norm_before_gate,
                                             is_rms_norm, dout, compute_dtype=ct)  # fmt: skip
        return (dx.contiguous(), dw.contiguous(),
                db.contiguous() if db is not None else x.new_empty(0),
                dz.contiguous() if dz is not None else x.new_empty(0))  # fmt: skip
    dx, dz, dw, db = _bwd_kernel(kset, x, weight, bias, z, eps, gs, norm_before_gate,
                                 not is_rms_norm, dout)  # fmt: skip
    dw = dw.to(weight.dtype)  # (float64 parameters: the kernels' float32 sums, converted)
    db = db.to(bias.dtype) if db is not None else x.new_empty(0)
    if dz is None:
        dz = x.new_empty(0)
    elif dz.dtype != z.dtype:
        dz = dz.to(z.dtype)
    return dx, dw, db, dz


rmsnorm_bwd = torch.library.custom_op("mamba2_rocm::rmsnorm_bwd", _bwd_impl, mutates_args=())


@rmsnorm_bwd.register_fake
def _(x, weight, bias, z, eps, group_size, norm_before_gate, is_rms_norm, dout):
    _check_bwd(x, weight, bias, z, eps, group_size, dout)
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty_like(weight),
            torch.empty_like(bias) if bias is not None else x.new_empty(0),
            torch.empty(z.shape, dtype=z.dtype, device=z.device) if z is not None
            else x.new_empty(0))  # fmt: skip


def _norm_setup(ctx, inputs, output):
    x, weight, bias, z, eps, group_size, norm_before_gate, is_rms_norm = inputs
    ctx.save_for_backward(x, weight, bias, z)
    ctx.args = (eps, group_size, norm_before_gate, is_rms_norm)


def _norm_backward(ctx, dout):
    """The norm's gradients through ``rmsnorm_bwd`` (the HIP kernels on the kernel tier); the
    registered op while compiling, the function itself in eager mode (no dispatcher)."""
    x, weight, bias, z = ctx.saved_tensors
    need = ctx.needs_input_grad
    if not any(need[:4]):
        return (None,) * 8
    eps, group_size, norm_before_gate, is_rms_norm = ctx.args
    if traced(x, dout):
        dx, dw, db, dz = rmsnorm_bwd(x, weight, bias, z, *ctx.args, dout)
    else:  # checked by the forward; group_size resolved as check_rmsnorm_args does
        gs = x.shape[-1] if group_size is None else group_size
        dx, dw, db, dz = _bwd_run(x, weight, bias, z, eps, gs, norm_before_gate, is_rms_norm, dout)
    return (dx if need[0] else None, dw if need[1] else None,
            db if need[2] and bias is not None else None,
            dz if need[3] and z is not None else None, None, None, None, None)  # fmt: skip


_train_norm = register_training(rmsnorm_fwd, _impl, _norm_setup, _norm_backward)


@rmsnorm_fwd.register_fake
def _(x, weight, bias, z, eps, group_size, norm_before_gate, is_rms_norm):
    check_rmsnorm_args(x, weight, bias, z, eps, group_size, allow_empty=True)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def layernorm_fn(
    x: Tensor, weight: Tensor, bias: Tensor | None, z: Tensor | None = None, eps: float = 1e-6,
    group_size: int | None = None, norm_before_gate: bool = True, is_rms_norm: bool = False,
) -> Tensor:  # fmt: skip
    """Gated LayerNorm over the last dim (in groups of ``group_size``), or RMSNorm with
    ``is_rms_norm``; mamba_ssm's ``layernorm_fn``. Returns x's dtype."""
    op = _impl
    if use_registered_op(x, weight, bias, z):  # compiling, or training on the kernel tier
        op = rmsnorm_fwd if torch.compiler.is_compiling() else _train_norm
    return op(x, weight, bias, z, float(eps), group_size, bool(norm_before_gate), bool(is_rms_norm))


def rmsnorm_fn(
    x: Tensor, weight: Tensor, bias: Tensor | None, z: Tensor | None = None, eps: float = 1e-6,
    group_size: int | None = None, norm_before_gate: bool = True,
) -> Tensor:  # fmt: skip
    """Gated RMSNorm over the last dim (in groups of ``group_size``); returns x's dtype."""
    return layernorm_fn(x, weight, bias, z, eps, group_size, norm_before_gate, is_rms_norm=True)


class _GatedNorm(torch.nn.Module):
    is_rms_norm = True

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = True, device=None, dtype=None) -> None:  # fmt: skip
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: Tensor, z: Tensor | None = None) -> Tensor:
        return layernorm_fn(
            x, self.weight, self.bias, z, self.eps, self.group_size, self.norm_before_gate,
            self.is_rms_norm,
        )  # fmt: skip


class RMSNorm(_GatedNorm):
    """mamba_ssm's gated ``RMSNorm(hidden_size, eps=1e-5, group_size=None, norm_before_gate=True)``:
    a weight initialized to ones and no bias; ``forward(x, z=None)``."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = True, device=None, dtype=None) -> None:  # fmt: skip
        super().__init__(hidden_size, eps, group_size, norm_before_gate, device, dtype)
        self.register_parameter("bias", None)


class LayerNorm(_GatedNorm):
    """mamba_ssm's gated ``LayerNorm(hidden_size, eps=1e-5, group_size=None,
    norm_before_gate=True)``: weight ones, bias zeros; ``forward(x, z=None)``."""

    is_rms_norm = False

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = True, device=None, dtype=None) -> None:  # fmt: skip
        super().__init__(hidden_size, eps, group_size, norm_before_gate, device, dtype)
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype))
