"""Causal depthwise conv1d: ``causal_conv1d_fn`` and ``causal_conv1d_update``.

Same signatures and semantics as the ``causal_conv1d`` package, with a superset of its layouts:
x may be seqlen-contiguous, channel-last (``x.stride(1) == 1``) or arbitrarily strided; weights
and bias may be fp32/fp16/bf16 independently of x; initial/final states work in every layout.
As in ``causal_conv1d``, ``seq_idx`` excludes initial and final states.

Registered as ``torch.ops.mamba2_rocm.causal_conv1d_fwd`` / ``causal_conv1d_update`` with fake
implementations, so ``torch.compile`` traces through them.
"""

from __future__ import annotations

from mamba2_rocm._torch import require_torch
from mamba2_rocm.ops._backend import choose
from mamba2_rocm.ops._launch import (
    COLUMN_SUM_COLS,
    DTYPE_CODE,
    GRID_YZ_MAX,
    KERNEL_DTYPE,
    inference_only,
    launch,
    layout,
    needs_autograd,
    ptr,
    register_training,
    remember,
    sm_count,
    strides,
    traced,
    use_registered_op,
)
from mamba2_rocm.ops.checks import check_no_overlap, check_state_rows

torch = require_torch()
Tensor = torch.Tensor

__all__ = ["causal_conv1d_fn", "causal_conv1d_update", "causal_conv1d_varlen_states"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_THREADS = 128
_ROW_VECS = 4  # csrc/conv1d_fwd.hip: kRowVecs
# Launch geometry; must equal the constants in csrc/conv1d_fwd.hip (tests/test_params.py checks).
_CL_POS = 16  # kClPosPerThread
_LONG_THREADS = 64  # kLongThreads: the long-row kernel (_ROW_VECS vectors a thread)
_SHORT_THREADS, _SHORT_VECS = 64, 2  # kShortThreads, kShortVecs: the short-row kernel
# kMultiRows, kMultiVecs: rows per block of the multi-row kernel, vectors a thread
_MULTI_ROWS, _MULTI_VECS = 8, 4
# csrc/conv1d_bwd.hip: threads, and the (channels, positions) tile of each shape
_BWD_THREADS = 256  # kThreads
_REDUCE_THREADS = 256  # conv1d_bwd.hip: kReduceThreads
_BWD_ROWS = (4, 512)  # kRowsC, kRowsL: seqlen-contiguous x
_BWD_CL = (64, 32)  # kClC, kClL: channel-last x
# the walking kernel (channel-last x, dout and dx in whole 32-bit words): threads a block, and
# the positions its ranges are counted in
_WALK_THREADS, _WALK_TILE = 128, 64  # kWalkThreads, kWalkTile
# and its seqlen-contiguous form (16-byte aligned rows): lanes a channel, positions a range's tile
_RWALK_LANES, _RWALK_TILE = 32, 256  # kRLanes, kRWalkTile
#: The backward's blocks per multiprocessor before blocks start walking several tiles (fewer,
#: longer blocks: fewer partial dweight / dbias rows for the reduce launch to add).
BWD_BLOCKS_PER_SM = 8


def _silu_flag(activation: str | None) -> bool:
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    return activation is not None


def _tensor(name: str, t, *, dims: int, dtypes=_FLOATS, device=None) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must be one of {names}, got {str(t.dtype).removeprefix('torch.')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (the device of x)")


def _shape(name: str, t, expected: tuple[int, ...]) -> None:
    if tuple(t.shape) != expected:
        raise ValueError(f"{name} must have shape {expected}, got {tuple(t.shape)}")


def _check_weight_bias(weight, bias, dim: int, device) -> int:
    _tensor("weight", weight, dims=2, device=device)
    if weight.shape[0] != dim:
        raise ValueError(f"weight must have shape (dim={dim}, width), got {tuple(weight.shape)}")
    width = weight.shape[1]
    if width not in (2, 3, 4):
        raise ValueError(f"width must be 2..4, got {width} (weight shape {tuple(weight.shape)})")
    if bias is not None:
        _tensor("bias", bias, dims=1, device=device)
        _shape("bias", bias, (dim,))
    return width


def _check_fwd(x, weight, bias, seq_idx, initial_states, final_states_out) -> int:
    _tensor("x", x, dims=3)
    batch, dim, seqlen = x.shape
    if dim == 0:  # batch 0 or seqlen 0: an empty result, as torch ops give
        raise ValueError(f"x is empty (shape {tuple(x.shape)}); dim must be >= 1")
    width = _check_weight_bias(weight, bias, dim, x.device)
    if seq_idx is not None:
        _tensor("seq_idx", seq_idx, dims=2, dtypes=(torch.int32,), device=x.device)
        _shape("seq_idx", seq_idx, (batch, seqlen))
        if initial_states is not None or final_states_out is not None:
            raise ValueError(
                "initial_states and final states are not supported together with seq_idx"
            )
    for name, t in (("initial_states", initial_states), ("final_states_out", final_states_out)):
        if t is not None:
            _tensor(name, t, dims=3, dtypes=(x.dtype,), device=x.device)
            _shape(name, t, (batch, dim, width - 1))
    if final_states_out is not None:
        check_no_overlap("final_states_out", final_states_out)
    return width


def _check_update(
    x, conv_state, weight, bias, cache_seqlens, conv_state_indices
) -> tuple[int, int]:
    _tensor("x", x, dims=3)
    batch, dim, _seqlen = x.shape
    if dim == 0:  # batch 0 or seqlen 0: an empty result, no state touched
        raise ValueError(f"x is empty (shape {tuple(x.shape)}); dim must be >= 1")
    width = _check_weight_bias(weight, bias, dim, x.device)
    _tensor("conv_state", conv_state, dims=3, dtypes=(x.dtype,), device=x.device)
    check_no_overlap("conv_state", conv_state)
    pool, sdim, state_len = conv_state.shape
    if sdim != dim:
        raise ValueError(
            f"conv_state must have shape (batch, dim={dim}, state_len), got {tuple(conv_state.shape)}"
        )
    if state_len < width - 1:
        raise ValueError(
            f"conv_state's state_len must be >= width - 1 = {width - 1}, got {state_len}"
        )
    if cache_seqlens is not None:
        _tensor("cache_seqlens", cache_seqlens, dims=1, dtypes=(torch.int32,), device=x.device)
        _shape("cache_seqlens", cache_seqlens, (batch,))
    if conv_state_indices is not None:
        _tensor(
            "conv_state_indices", conv_state_indices, dims=1, dtypes=(torch.int32,), device=x.device
        )
        _shape("conv_state_indices", conv_state_indices, (batch,))
    elif pool != batch:
        raise ValueError(
            f"conv_state has {pool} rows for a batch of {batch}; pass conv_state_indices to select rows"
        )
    return width, pool


def _alloc_out(x: Tensor) -> Tensor:
    """Output in x's layout: channel-last stays channel-last, everything else is contiguous.
    A tensor of its own, not a transposed view: a view returned by an op with autograd may not
    be modified in place, and callers do (causal-conv1d's tests add to ``out``)."""
    batch, dim, seqlen = x.shape
    if x.stride(1) == 1 and x.stride(2) != 1 and seqlen > 1:
        return torch.empty_strided((batch, dim, seqlen), (seqlen * dim, 1, dim), dtype=x.dtype,
                                   device=x.device)  # fmt: skip
    return torch.empty(batch, dim, seqlen, dtype=x.dtype, device=x.device)


def _aligned(t: Tensor, strides: tuple[int, ...], n_elts: int, nbytes: int = 16) -> bool:
    """Can ``t`` be accessed in ``nbytes`` chunks of ``n_elts`` elements along every stride?"""
    return t.data_ptr() % nbytes == 0 and all(s % n_elts == 0 for s in strides)


def _launch(launcher, x: Tensor, params: tuple, grid: tuple[int, int, int],
            threads: int = _THREADS) -> None:  # fmt: skip
    launch(launcher, x, params, grid, threads)


#: the seqlen-contiguous kernels (csrc/conv1d_fwd.hip, fwd_rows): (threads a block, 16-byte
#: vectors a thread, rows a block; a row's threads are the block's over its rows)
_ROW_FORMS = {
    "vec_m": (_THREADS, _MULTI_VECS, _MULTI_ROWS),
    "vec_s": (_SHORT_THREADS, _SHORT_VECS, 1),
    "vec": (_LONG_THREADS, _ROW_VECS, 1),
}


def _row_tile(layout: str, n_elts: int) -> int:
    """Tokens of one row a block of seqlen-contiguous kernel ``layout`` covers."""
    threads, vecs, rows = _ROW_FORMS[layout]
    return threads // rows * vecs * n_elts


def _rows_layout(
    batch: int, dim: int, seqlen: int, n_elts: int
) -> tuple[str, tuple[int, int, int]]:
    """Which seqlen-contiguous kernel takes rows of ``seqlen`` (``n_elts`` elements a 16-byte
    vector), and its grid (blocks along seqlen, then over channels -- _MULTI_ROWS of them a block
    for vec_m -- then batch): rows that fit an eighth of a block go eight to a block (vec_m),
    rows up to half the long tile to the short-row kernel (vec_s), longer ones to the long tile
    (vec)."""
    if seqlen <= _row_tile("vec_m", n_elts):
        layout = "vec_m"
    elif 2 * seqlen <= _row_tile("vec", n_elts):  # most of a long block's threads would idle
        layout = "vec_s"
    else:
        layout = "vec"
    rows = _ROW_FORMS[layout][2]
    return layout, (-(-seqlen // _row_tile(layout, n_elts)), -(-dim // rows), batch)


def _cl_layout(
    batch: int, dim: int, seqlen: int, per_word: int, sms: int
) -> tuple[str, tuple[int, int, int]]:
    """The channel-last forward's block order and grid (``per_word`` channels a 32-bit word,
    ``sms`` multiprocessors). Rows of more position tiles than the GPU has multiprocessors take
    the channel blocks fastest (cl_cf: a 1-D grid of channel block, then position tile): the
    blocks resident at once then read whole rows of channels, where walking one channel block
    down its positions (cl_vec) spreads them over a few 512-byte columns of far-apart rows.
    H200 (132 multiprocessors), bf16 width 4, bench conv1d's cases of 64 MB and more (one
    process, three rounds): cl_cf at 90.5-95.6% of a same-size copy at seqlen 4096-16384,
    where cl_vec ran 89.3-92.0%; at 512-2048 tokens cl_vec 90.9-95.2%, cl_cf 89.1-94.6%."""
    tiles, c_blocks = -(-seqlen // _CL_POS), -(-dim // (_THREADS * per_word))
    if tiles > max(sms, 1) and tiles * c_blocks < 2**31:  # (grid x's limit)
        return "cl_cf", (tiles * c_blocks, 1, batch)
    return "cl_vec", (tiles, c_blocks, batch)


def _dense(t: Tensor | None) -> Tensor | None:
    """A vector the kernels index densely (the bias, the update's cache_seqlens: no stride field
    in the parameter structs): torch's ``contiguous`` copies a strided view (``b[::2]``, an
    expanded scalar) and returns a dense one itself."""
    return None if t is None else t.contiguous()


def _sizes_and_codes(x, weight, bias, silu) -> tuple[int, ...]:
    """batch, dim, seqlen, silu, weight_dtype, bias_dtype: the fields Conv{Fwd,Bwd}Params share."""
    return (*x.shape, int(silu), DTYPE_CODE[weight.dtype],
            DTYPE_CODE[bias.dtype] if bias is not None else 0)  # fmt: skip


def _fwd_kernel(kset, x, weight, bias, seq_idx, initial_states, final_states, silu, out) -> None:
    bias = _dense(bias)
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    n_elts = 16 // x.element_size()
    per_word = 4 // x.element_size()
    if (
        x.stride(2) == 1
        and out.stride(2) == 1
        and _aligned(x, x.stride()[:2], n_elts)
        and _aligned(out, out.stride()[:2], n_elts)
    ):
        layout, grid = _rows_layout(batch, dim, seqlen, n_elts)
    elif (
        x.stride(1) == 1
        and out.stride(1) == 1
        and _aligned(x, (x.stride(0), x.stride(2)), per_word, 4)
        and _aligned(out, (out.stride(0), out.stride(2)), per_word, 4)
    ):
        layout, grid = _cl_layout(batch, dim, seqlen, per_word, sm_count(x.device))
    else:  # any other strides: one thread per output
        layout, grid = "strided", (-(-(batch * dim * seqlen) // _THREADS), 1, 1)
    if grid[1] > GRID_YZ_MAX or grid[2] > GRID_YZ_MAX:
        raise ValueError(
            f"conv1d kernel grid {grid} exceeds {GRID_YZ_MAX} in y/z (dim={dim}, batch={batch})"
        )
    p = (
        ptr(x),
        ptr(weight),
        ptr(bias),
        ptr(out),
        ptr(seq_idx),
        ptr(initial_states),
        ptr(final_states),
        *x.stride(),
        *out.stride(),
        *weight.stride(),
        *strides(seq_idx, 2),
        *strides(initial_states, 3),
        *strides(final_states, 3),
        *_sizes_and_codes(x, weight, bias, silu),
        int(abs(x.stride(1)) < abs(x.stride(2))),  # channels_fastest, for the strided kernel
        0,
    )  # (ConvFwdParams, field order)
    seq = "_seq" if seq_idx is not None else ""
    launcher = kset.launcher(f"m2r_conv1d_fwd_{KERNEL_DTYPE[x.dtype]}_w{width}_{layout}{seq}")
    _launch(launcher, x, p, grid, _ROW_FORMS[layout][0] if layout in _ROW_FORMS else _THREADS)


def _channel_last(x: Tensor) -> bool:
    """x's layout has unit stride along dim (and a real sequence axis): channel-last."""
    return x.stride(1) == 1 and x.stride(2) != 1 and x.shape[2] > 1


def bwd_tiles_per_block(tiles: int, other_blocks: int, sms: int) -> int:
    """Tiles of the sequence one backward block walks, for ``tiles`` tiles per row and
    ``other_blocks`` (channel tiles x batch) blocks per tile: one while that gives at most
    BWD_BLOCKS_PER_SM blocks per multiprocessor, then as many as keep about that many."""
    if sms <= 0:
        return 1
    return max(1, min(tiles, int(tiles * other_blocks // (BWD_BLOCKS_PER_SM * sms))))


def bwd_shape(x: Tensor, dout: Tensor, dx: Tensor, has_seq_idx: bool) -> tuple[str, bool]:
    """The backward kernel for these layouts (csrc/conv1d_bwd.hip), and whether x, dout and dx
    all move in 16-byte vectors along the tile's unit-stride index (ConvBwdParams.vec):

    - ``walk``: channel-last x, dout and dx in whole, aligned 32-bit words of channels;
    - ``rwalk``: seqlen-contiguous ones in 16-byte aligned rows, without seq_idx (causal-conv1d
      takes seq_idx with channel-last x only; that form spilled on the wave64 targets);
    - else the LDS tile kernels, ``cl`` for channel-last x, ``rows`` for any other strides."""
    shape = "cl" if _channel_last(x) else "rows"
    fast, n = (1 if shape == "cl" else 2), 16 // x.element_size()
    vec = all(t.stride(fast) == 1 and _aligned(t, [t.stride(i) for i in range(3) if i != fast], n)
              for t in (x, dout, dx))  # fmt: skip
    if shape == "cl":  # the walk: whole, aligned 32-bit words of channels
        per_word = 4 // x.element_size()
        if all(t.stride(1) == 1 and _aligned(t, (t.stride(0), t.stride(2)), per_word, 4)
               for t in (x, dout, dx)):  # fmt: skip
            return "walk", vec
    if shape == "rows" and vec and not has_seq_idx:
        return "rwalk", vec
    return shape, vec


def _bwd_kernel(kset, x, weight, bias, seq_idx, initial_states, dout, dfinal, silu, dx,
                dinit, dweight, dbias) -> None:  # fmt: skip
    """Launch the backward: the kernel for the layouts writes dx (and dinit) and fp32 partial
    sums of dweight and dbias, (rows, dim, width + 1); ``m2r_conv1d_bwd_reduce`` adds them
    over the rows in a fixed order into dweight ((dim, width), contiguous) and dbias (or
    None) in their dtypes."""
    bias = _dense(bias)
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    shape, vec = bwd_shape(x, dout, dx, seq_idx is not None)
    tile_c, tile_l = {
        "rows": _BWD_ROWS,
        "cl": _BWD_CL,
        "walk": (_WALK_THREADS * (4 // x.element_size()), _WALK_TILE),
        "rwalk": (_WALK_THREADS // _RWALK_LANES, _RWALK_TILE),
    }[shape]
    tiles, c_blocks = -(-seqlen // tile_l), -(-dim // tile_c)
    if c_blocks > GRID_YZ_MAX or batch > GRID_YZ_MAX:
        raise ValueError(
            f"conv1d backward grid ({c_blocks}, {batch}) exceeds {GRID_YZ_MAX} in y/z "
            f"(dim={dim}, batch={batch})"
        )
    walking = shape in ("walk", "rwalk")
    per_block = bwd_tiles_per_block(tiles, c_blocks * batch, sm_count(x.device))
    grid = (-(-tiles // per_block), c_blocks, batch)
    rows = batch * grid[0]
    partial = torch.empty(rows, dim, width + 1, dtype=torch.float32, device=x.device)
    p = (
        ptr(x),
        ptr(weight),
        ptr(bias),
        ptr(dout),
        ptr(seq_idx),
        ptr(initial_states),
        ptr(dfinal),
        ptr(dx),
        ptr(dinit),
        ptr(partial),
        ptr(dweight),
        ptr(dbias),
        *x.stride(),
        *dout.stride(),
        *dx.stride(),
        *weight.stride(),
        *strides(seq_idx, 2),
        *_sizes_and_codes(x, weight, bias, silu),
        per_block,
        int(vec),
        width,
        rows,
    )  # fmt: skip  (ConvBwdParams, field order)
    seq = "_seq" if seq_idx is not None else ""
    launcher = kset.launcher(f"m2r_conv1d_bwd_{KERNEL_DTYPE[x.dtype]}_w{width}_{shape}{seq}")
    _launch(launcher, x, p, grid, _WALK_THREADS if walking else _BWD_THREADS)
    reduce = -(-dim * (width + 1) // COLUMN_SUM_COLS)
    _launch(kset.launcher("m2r_conv1d_bwd_reduce"), x, p, (reduce, 1, 1), _REDUCE_THREADS)


def _vec_order(conv_state, width: int) -> str | None:
    """The _vec kernels' name for conv_state's order ("c<S>": each channel's S slots together,
    "s<S>": each slot's channels together; S is width - 1 or width), or None where each batch
    row's states are not one such block a 16-byte multiple apart."""
    _pool, _dim, slots = conv_state.shape
    s0, s1, s2 = conv_state.stride()
    elt = conv_state.element_size()
    if slots not in (width - 1, width) or s0 * elt % 16:
        return None
    if s1 == slots and (slots == 1 or s2 == 1):
        return f"c{slots}"
    if s1 == 1 and s2 * elt % 16 == 0:
        return f"s{slots}"
    return None


#: bytes of each slot a thread of a _vec kernel moves where its channels are not one 16-byte
#: word of states (csrc/conv1d_update.hip, M2R_CONV_VEC_BYTES)
_VEC_BYTES = 8


def _vec_channels(order: str, elt: int) -> int:
    """Channels a thread of a _vec kernel owns (csrc/conv1d_update.hip, VecChannels): in channel
    order where a channel's slots divide 16 bytes, the channels of one 16-byte word of states;
    else _VEC_BYTES' channels."""
    run = int(order[1:]) * elt
    return 16 // run if order[0] == "c" and 16 % run == 0 else _VEC_BYTES // elt


def _update_static(
    x, conv_state, weight, bias, silu, out, indices=None, circular=False
) -> tuple[str, tuple, tuple, str | None, tuple]:
    """The launch's parts that depend only on the arguments' layouts: kernel name, grid, the
    ConvUpdateParams fields after the pointers; the ``_tile`` kernel's name where the layout
    allows it (else None): no circular cache, a state of exactly width - 1 slots, each batch
    row's states one contiguous (dim, width - 1) run of a 16-byte multiple; and the ``_vec``
    kernel's (name or None, grid, alignment of x and out): it needs no circular cache, each
    batch row's states a (dim, width - 1 or width) block in either order (_vec_order), dim a
    multiple of a thread's channels (_vec_channels), x and out channel-contiguous with their
    rows and tokens a multiple of a thread's run of them apart. The addresses are checked per
    call (a cached layout may meet another buffer)."""
    batch, dim, seqlen = x.shape
    if batch > GRID_YZ_MAX:
        raise ValueError(f"conv1d update kernel supports batch <= {GRID_YZ_MAX}, got {batch}")
    tail = (
        *x.stride(),
        *out.stride(),
        *conv_state.stride(),
        *weight.stride(),
        0 if indices is None else indices.stride(0),
        batch,
        dim,
        seqlen,
        conv_state.shape[2],
        conv_state.shape[0],
        int(silu),
        DTYPE_CODE[weight.dtype],
        DTYPE_CODE[bias.dtype] if bias is not None else 0,
        int(indices is not None and indices.dtype == torch.int64),
        0,
    )  # fmt: skip  (ConvUpdateParams after the pointers, field order)
    width = weight.shape[1]
    name = f"m2r_conv1d_update_{KERNEL_DTYPE[x.dtype]}_w{width}"
    order = None if circular else _vec_order(conv_state, width)
    tile = order == f"c{width - 1}"  # the _tile kernel's layout: width - 1 slots, channel order
    per_thread = _vec_channels(order, x.element_size()) if order else 1
    run = per_thread * x.element_size()  # bytes of a thread's x and out of a token
    rows_ok = dim % per_thread == 0 and all(
        t.stride(1) == 1
        and t.stride(0) * t.element_size() % run == 0
        and (seqlen == 1 or t.stride(2) * t.element_size() % run == 0)
        for t in (x, out)
    )
    vec = f"{name}_vec_{order}" if order is not None and rows_ok else None
    vec_grid = (-(-dim // (_THREADS * per_thread)), batch, 1)
    return (name, (-(-dim // _THREADS), batch, 1), tail, name + "_tile" if tile else None,
            (vec, vec_grid, run))  # fmt: skip


def _tokens(t: Tensor) -> Tensor:
    """An update's x or out as (batch, dim, seqlen): a one-token (batch, dim) as its
    (batch, dim, 1) view, anything else as it is."""
    return t.unsqueeze(-1) if t.dim() == 2 else t


def _update_kernel(kset, x, conv_state, weight, bias, silu, cache_seqlens, indices, out,
                   plan) -> None:  # fmt: skip
    if plan.static is None:
        plan.static = _update_static(_tokens(x), conv_state, weight, bias, silu, _tokens(out),
                                     indices, cache_seqlens is not None)  # fmt: skip
    name, grid, tail, tile, (vec, vec_grid, run) = plan.static
    sp, xp, op = conv_state.data_ptr(), x.data_ptr(), out.data_ptr()
    if vec is not None and sp % 16 == 0 and (xp | op) % run == 0:
        name, grid = vec, vec_grid
    elif tile is not None and sp % 16 == 0:
        name = tile
    p = (xp, sp, weight.data_ptr(), ptr(_dense(bias)), op, ptr(_dense(cache_seqlens)),
         ptr(indices), *tail)  # fmt: skip
    _launch(kset.launcher(name), x, p, grid)


class _UpdatePlan:
    """A validated layout of ``causal_conv1d_update``'s arguments; the launch's static part
    once the kernel ran with it."""

    __slots__ = ("static",)

    def __init__(self) -> None:
        self.static: tuple | None = None


#: (type, shape, strides, dtype, device) of every argument, and silu -> its plan. A decode loop
#: calls with the same layouts every step: after the first call the layout checks are a dict
#: lookup (the value checks of conv_state_indices still run every call, on the device or in
#: the torch tiers). Only layouts that passed _check_update are stored.
_UPDATE_PLANS: dict[tuple, _UpdatePlan] = {}
UPDATE_PLAN_CACHE_SIZE = 256


def _update_plan(x, conv_state, weight, bias, silu, cache_seqlens, indices) -> _UpdatePlan:
    try:
        key = (layout(x), layout(conv_state), layout(weight), layout(bias), silu,
               layout(cache_seqlens), layout(indices))  # fmt: skip
        plan = _UPDATE_PLANS.get(key)
    except Exception:  # not tensors (or unhashable): the checks below name the argument
        key = plan = None
    if plan is None:
        _check_update(_tokens(x), conv_state, weight, bias, cache_seqlens, indices)
        plan = _UpdatePlan()
        if key is not None:
            remember(_UPDATE_PLANS, key, plan, UPDATE_PLAN_CACHE_SIZE)
    return plan


# ---- registered ops --------------------------------------------------------------------------


def _fwd_impl(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    seq_idx: Tensor | None,
    initial_states: Tensor | None,
    final_states_out: Tensor | None,
    silu: bool,
) -> Tensor:
    _check_fwd(x, weight, bias, seq_idx, initial_states, final_states_out)
    return _fwd_run(x, weight, bias, seq_idx, initial_states, final_states_out, silu)


def _fwd_run(x, weight, bias, seq_idx, initial_states, final_states_out, silu) -> Tensor:
    """``_fwd_impl`` on checked arguments."""
    if x.numel() == 0:  # batch 0 or seqlen 0: the final states are the entering ones
        if final_states_out is not None:
            if initial_states is not None:
                final_states_out.copy_(initial_states)
            else:
                final_states_out.zero_()
        return _alloc_out(x)
    tier, kset = choose(x.device)
    if tier == "kernel":
        out = _alloc_out(x)
        _fwd_kernel(kset, x, weight, bias, seq_idx, initial_states, final_states_out, silu, out)
        return out
    from mamba2_rocm.reference import conv1d as ref

    fn = ref.causal_conv1d_torch if tier == "torch" else ref.causal_conv1d_eager
    res, fin = fn(x, weight, bias, seq_idx, initial_states, silu)
    if final_states_out is not None:
        final_states_out.copy_(fin)
    out = _alloc_out(x)
    out.copy_(res)
    return out


# Eager calls go straight to the implementation: the dispatcher round trip of a Python custom
# op costs tens of microseconds, more than a decode-step kernel. torch.compile traces the op.
causal_conv1d_fwd = torch.library.custom_op(
    "mamba2_rocm::causal_conv1d_fwd", _fwd_impl, mutates_args=("final_states_out",)
)


@causal_conv1d_fwd.register_fake
def _(x, weight, bias, seq_idx, initial_states, final_states_out, silu):
    _check_fwd(x, weight, bias, seq_idx, initial_states, final_states_out)
    return _alloc_out(x)


def _fwd_func_impl(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    seq_idx: Tensor | None,
    initial_states: Tensor | None,
    silu: bool,
    return_final_states: bool,
) -> tuple[Tensor, Tensor]:
    """The functional form for training: ``(out, final_states)`` as new tensors (final_states
    empty unless asked for), so that autograd can be registered (an op that writes an
    argument, as ``causal_conv1d_fwd`` writes ``final_states_out``, takes no formula)."""
    width = _check_fwd(x, weight, bias, seq_idx, initial_states, None)
    if not return_final_states:
        return _fwd_run(x, weight, bias, seq_idx, initial_states, None, silu), x.new_empty(0)
    fin = torch.empty(x.shape[0], x.shape[1], width - 1, dtype=x.dtype, device=x.device)
    return _fwd_run(x, weight, bias, seq_idx, initial_states, fin, silu), fin


causal_conv1d_fwd_func = torch.library.custom_op(
    "mamba2_rocm::causal_conv1d_fwd_func", _fwd_func_impl, mutates_args=()
)


def _check_bwd(x, weight, bias, seq_idx, initial_states, dout, dfinal) -> int:
    width = _check_fwd(x, weight, bias, seq_idx, initial_states, None)
    _tensor("dout", dout, dims=3, dtypes=(x.dtype,), device=x.device)
    _shape("dout", dout, tuple(x.shape))
    if dfinal is not None:
        _tensor("dfinal_states", dfinal, dims=3, dtypes=(x.dtype,), device=x.device)
        _shape("dfinal_states", dfinal, (x.shape[0], x.shape[1], width - 1))
    return width


def _bwd_impl(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    seq_idx: Tensor | None,
    initial_states: Tensor | None,
    dout: Tensor,
    dfinal_states: Tensor | None,
    silu: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``causal_conv1d_fwd_func``: (dx, dweight, dbias, dinitial_states) for the
    output gradient ``dout`` and, where the final states were returned, their gradient
    ``dfinal_states``. dbias / dinitial_states are empty where there is no bias / no initial
    states. dweight and dbias are reduced in fp32, in a fixed order (deterministic), and
    returned in the parameters' dtypes."""
    _check_bwd(x, weight, bias, seq_idx, initial_states, dout, dfinal_states)
    return _bwd_run(x, weight, bias, seq_idx, initial_states, dout, dfinal_states, silu)


def _bwd_run(x, weight, bias, seq_idx, initial_states, dout, dfinal_states, silu):
    """``_bwd_impl`` on checked arguments (the eager backward's call: the forward checked the
    inputs, and autograd hands over gradients of the outputs' shapes, dtypes and devices)."""
    batch, dim, _seqlen = x.shape
    width = weight.shape[1]
    tier, kset = choose(x.device)
    if x.numel() == 0 or tier != "kernel":
        return _bwd_reference(x, weight, bias, seq_idx, initial_states, dout, dfinal_states, silu)
    dx = _alloc_out(x)
    dinit = None
    if initial_states is not None:
        dinit = torch.empty(batch, dim, width - 1, dtype=x.dtype, device=x.device)
    # the states' strides follow from their sizes in the kernel: small tensors, copied if need be
    init = initial_states.contiguous() if initial_states is not None else None
    dfin = dfinal_states.contiguous() if dfinal_states is not None else None
    dweight = torch.empty(dim, width, dtype=weight.dtype, device=x.device)
    dbias = torch.empty(dim, dtype=bias.dtype, device=x.device) if bias is not None else None
    _bwd_kernel(kset, x, weight, bias, seq_idx, init, dout, dfin, silu, dx, dinit, dweight, dbias)
    return (dx, dweight, dbias if dbias is not None else x.new_empty(0),
            dinit if dinit is not None else x.new_empty(0))  # fmt: skip


def _bwd_reference(x, weight, bias, seq_idx, initial_states, dout, dfinal, silu):
    """``_bwd_impl`` by the written-out formula of the torch tier (any device, empty inputs too;
    no autograd, which does not record inside a custom op)."""
    from mamba2_rocm.reference.conv1d import causal_conv1d_bwd_torch

    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    dx, dw, db, dinit = causal_conv1d_bwd_torch(x, weight, bias, seq_idx, initial_states, dout,
                                                dfinal, silu, compute_dtype=ct)  # fmt: skip
    out = _alloc_out(x)
    out.copy_(dx)
    # (each absent gradient an empty tensor of its own: an op's outputs may not alias)
    return (out, dw, db if db is not None else x.new_empty(0),
            dinit.contiguous() if dinit is not None else x.new_empty(0))  # fmt: skip


causal_conv1d_bwd = torch.library.custom_op(
    "mamba2_rocm::causal_conv1d_bwd", _bwd_impl, mutates_args=()
)


@causal_conv1d_bwd.register_fake
def _(x, weight, bias, seq_idx, initial_states, dout, dfinal_states, silu):
    width = _check_bwd(x, weight, bias, seq_idx, initial_states, dout, dfinal_states)
    dinit = x.new_empty(0)
    if initial_states is not None:
        dinit = x.new_empty(x.shape[0], x.shape[1], width - 1)
    return (_alloc_out(x), torch.empty_like(weight, memory_format=torch.contiguous_format),
            torch.empty_like(bias) if bias is not None else x.new_empty(0), dinit)  # fmt: skip


def _fwd_func_setup(ctx, inputs, output):
    x, weight, bias, seq_idx, initial_states, silu, return_final_states = inputs
    ctx.save_for_backward(x, weight, bias, seq_idx, initial_states)
    ctx.silu, ctx.final = silu, return_final_states


def _fwd_func_backward(ctx, dout, dfinal):
    """The conv's gradients through ``causal_conv1d_bwd`` (HIP kernel on the kernel tier):
    only the inputs are saved, the pre-activation is recomputed in the kernel."""
    x, weight, bias, seq_idx, initial_states = ctx.saved_tensors
    need = ctx.needs_input_grad
    if not (need[0] or need[1] or need[2] or need[4]):
        return (None,) * 7
    if dout is None:
        dout = torch.zeros_like(x)
    # the registered op while compiling (traced, with its fake); in eager mode the function
    # itself: the dispatcher round trip of a Python custom op costs more host time than the
    # kernel takes at training shapes
    bwd = causal_conv1d_bwd if traced(x, dout) else _bwd_run
    dx, dw, db, dinit = bwd(x, weight, bias, seq_idx, initial_states, dout,
                            dfinal if ctx.final else None, ctx.silu)  # fmt: skip
    return (dx if need[0] else None, dw if need[1] else None,
            db if need[2] and bias is not None else None, None,
            dinit if need[4] and initial_states is not None else None, None, None)  # fmt: skip


_train_conv = register_training(causal_conv1d_fwd_func, _fwd_func_impl, _fwd_func_setup,
                                _fwd_func_backward)  # fmt: skip


@causal_conv1d_fwd_func.register_fake
def _(x, weight, bias, seq_idx, initial_states, silu, return_final_states):
    width = _check_fwd(x, weight, bias, seq_idx, initial_states, None)
    shape = (x.shape[0], x.shape[1], width - 1) if return_final_states else (0,)
    return _alloc_out(x), x.new_empty(shape)


def _update_impl(
    x: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    silu: bool,
    cache_seqlens: Tensor | None,
    conv_state_indices: Tensor | None,
) -> Tensor:
    """The update; x (batch, dim, seqlen), or (batch, dim) from the eager public call (one
    token, out (batch, dim)): a (batch, dim, 1) view of x and the squeeze of its result had
    taken a fifth of a decode call's host instructions (callgrind: 14.7k of 78k)."""
    plan = _update_plan(x, conv_state, weight, bias, silu, cache_seqlens, conv_state_indices)
    if x.numel() == 0:  # no batch rows or no new tokens: an empty output, no state touched
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    tier, kset = choose(x.device)
    if tier == "kernel":
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        # conv_state_indices: int32 or int64, range and duplicates checked by the kernel
        _update_kernel(kset, x, conv_state, weight, bias, silu, cache_seqlens,
                       conv_state_indices, out, plan)  # fmt: skip
        return out
    from mamba2_rocm.reference import conv1d as ref

    fn = ref.causal_conv1d_update_torch if tier == "torch" else ref.causal_conv1d_update_eager
    # the rows' range and duplicates, read on the host (the torch tiers read them anyway)
    check_state_rows("conv_state_indices", conv_state_indices, conv_state.shape[0], x.shape[0])
    # (the torch tiers take (batch, dim, seqlen))
    out = fn(_tokens(x), conv_state, weight, bias, silu, cache_seqlens, conv_state_indices)
    return (out.squeeze(-1) if x.dim() == 2 else out).contiguous()


causal_conv1d_update_op = torch.library.custom_op(
    "mamba2_rocm::causal_conv1d_update", _update_impl, mutates_args=("conv_state",)
)


@causal_conv1d_update_op.register_fake
def _(x, conv_state, weight, bias, silu, cache_seqlens, conv_state_indices):
    _check_update(x, conv_state, weight, bias, cache_seqlens, conv_state_indices)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# ---- public API (causal_conv1d's signatures) -------------------------------------------------


def causal_conv1d_fn(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    seq_idx: Tensor | None = None,
    initial_states: Tensor | None = None,
    return_final_states: bool = False,
    final_states_out: Tensor | None = None,
    activation: str | None = None,
):
    """x (batch, dim, seqlen) -> out (batch, dim, seqlen) [, final_states (batch, dim, width-1)].

    With ``seq_idx`` (batch, seqlen) int32, a tap reaches only tokens of the same sequence id,
    and a token whose id is negative is padding: its output is 0 (causal-conv1d's rule)."""
    silu = _silu_flag(activation)
    if final_states_out is not None and not return_final_states:
        raise ValueError("final_states_out was given but return_final_states is False")
    grads = (x, weight, bias, initial_states)
    if use_registered_op(*grads) and needs_autograd(*grads):
        # training on the kernel tier: the functional op, whose backward recomputes
        train = causal_conv1d_fwd_func if torch.compiler.is_compiling() else _train_conv
        out, fin = train(x, weight, bias, seq_idx, initial_states, silu, return_final_states)
        if not return_final_states:
            return out
        if final_states_out is None:
            return out, fin
        final_states_out.copy_(fin)  # the caller's buffer, on the graph through copy_
        return out, final_states_out
    if return_final_states and final_states_out is None:
        width = _check_fwd(x, weight, bias, seq_idx, initial_states, None)
        final_states_out = torch.empty(
            x.shape[0], x.shape[1], width - 1, dtype=x.dtype, device=x.device
        )
    op = causal_conv1d_fwd if use_registered_op(*grads) else _fwd_impl
    out = op(x, weight, bias, seq_idx, initial_states, final_states_out, silu)
    return (out, final_states_out) if return_final_states else out


def causal_conv1d_update(
    x: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    activation: str | None = None,
    cache_seqlens: Tensor | None = None,
    conv_state_indices: Tensor | None = None,
) -> Tensor:
    """x (batch, dim) or (batch, dim, seqlen); conv_state (batch or pool, dim, state_len), in place.

    ``conv_state_indices`` (int32, (batch,)) maps batch rows to state rows; -1 marks a padded
    row (out zeros, no state touched). An index out of the pool, or a row named by two batch
    entries, raises on the torch tiers and gives NaN outputs with the states left untouched on
    the kernel tier (which cannot raise without a device sync).
    """
    silu = _silu_flag(activation)
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in (2, 3):
        raise ValueError(
            f"x must be (batch, dim) or (batch, dim, seqlen), got shape {tuple(x.shape)}"
        )
    if not use_registered_op(x, weight, bias):  # (batch, dim) x as it is: no view, no squeeze
        return _update_impl(x, conv_state, weight, bias, silu, cache_seqlens, conv_state_indices)
    # the registered op (its schema and fake take (batch, dim, seqlen)), then the autograd
    # guard (the torch tiers differentiate as plain PyTorch code and never come here)
    squeeze = x.dim() == 2
    out = causal_conv1d_update_op(
        _tokens(x),
        conv_state,
        weight,
        bias,
        silu,
        cache_seqlens,
        conv_state_indices,
    )
    out = inference_only("causal_conv1d_update", out, x, weight, bias)
    return out.squeeze(-1) if squeeze else out


def causal_conv1d_varlen_states(x: Tensor, cu_seqlens: Tensor, state_len: int) -> Tensor:
    """The conv states of packed sequences, as ``causal_conv1d.causal_conv1d_varlen``'s.

    x (total_tokens, dim) holds the sequences back to back, cu_seqlens (num_seqs + 1,) their
    offsets (0, ..., total_tokens; non-decreasing: equal offsets are an empty sequence).
    Returns (num_seqs, dim, state_len) in x's dtype, laid out channel-last (stride 1 along dim,
    as causal_conv1d_update's conv_state): state i holds the last ``state_len`` tokens of
    sequence i, right-aligned, zeros where the sequence is shorter. One gather, no host sync.
    """
    if not isinstance(x, Tensor) or x.dim() != 2:
        raise ValueError(
            f"x must be a tensor (total_tokens, dim), got {getattr(x, 'shape', type(x).__name__)}"
        )
    if x.dtype not in _FLOATS:
        raise TypeError(f"x must be one of float32, float16, bfloat16, got {x.dtype}")
    _tensor("cu_seqlens", cu_seqlens, dims=1, dtypes=(torch.int32, torch.int64), device=x.device)
    if cu_seqlens.shape[0] < 1:
        raise ValueError("cu_seqlens must hold at least one offset (0)")
    if isinstance(state_len, bool) or not isinstance(state_len, int) or state_len < 1:
        raise ValueError(f"state_len must be a positive int, got {state_len!r}")
    total, dim = x.shape
    num_seqs = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.to(torch.int64)
    start, end = cu[:-1, None], cu[1:, None]  # (num_seqs, 1)
    pos = end - state_len + torch.arange(state_len, device=x.device)  # (num_seqs, state_len)
    valid = (pos >= start) & (pos < end)
    rows = x.index_select(0, pos.clamp(0, max(total - 1, 0)).flatten()) if total else None
    states = torch.zeros(num_seqs, state_len, dim, dtype=x.dtype, device=x.device)
    if rows is not None:
        states = torch.where(valid[..., None], rows.view(num_seqs, state_len, dim), states)
    return states.transpose(1, 2)
