"""The fused residual-add LayerNorm / RMSNorm of pre-norm blocks: mamba_ssm's
``ops.triton.layer_norm`` API (``layer_norm_fn``, ``rms_norm_fn``, ``layer_norm_linear_fn``,
``RMSNorm``) with its whole signature: the residual add, ``prenorm``, ``residual_in_fp32``,
dropout with ``return_dropout_mask``, ``rowscale``, and the second input / second weight.

Each call's arguments are checked here, once. On the kernel tier (GPU tensors of float32,
float16 or bfloat16) the HIP kernels of ``csrc/add_norm.hip`` run, registered as
``torch.ops.mamba2_rocm.add_norm_fwd`` and ``add_norm_bwd`` (dweight / dbias reduced in fp32
in a fixed order: bit-identical runs); elsewhere ``reference.add_norm``'s math runs as
differentiable PyTorch (the torch tier). Both keep upstream's Triton numerics: the sum and the
statistics in fp32, the stream rounded once to the residual dtype, the outputs in x's dtype.
Dropout masks are drawn with ``torch.rand`` on the host side of either tier (torch's
generator, so seeding works as everywhere in torch).
"""

from __future__ import annotations

import ctypes
import math

import torch
from torch import Tensor

from mamba2_rocm.kernels import ADD_NORM_BWD_RUNS, ADD_NORM_FWD_RUNS
from mamba2_rocm.ops._backend import choose
from mamba2_rocm.ops._launch import (
    COLUMN_SUM_COLS,
    DTYPE_CODE,
    KERNEL_DTYPE,
    launch,
    like,
    needs_autograd,
    register_training,
    resident_blocks,
    sm_count,
    traced,
)
from mamba2_rocm.params import AddNormParams
from mamba2_rocm.reference.add_norm import (
    add_norm_bwd_ref,
    add_norm_torch,
    layer_norm_ref,
    normalize,
    rms_norm_ref,
    row_stats,
    stream_sum,
)

__all__ = [
    "RMSNorm",
    "layer_norm_fn",
    "layer_norm_linear_fn",
    "layer_norm_ref",
    "residual_dtype_of",
    "rms_norm_fn",
    "rms_norm_ref",
]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _floating(name: str, t, device=None) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name} must be float32, float16, bfloat16 or float64, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} (x's device), got {t.device}")


def _like_x(name: str, t, x: Tensor) -> None:
    _floating(name, t, x.device)
    if t.shape != x.shape:
        raise ValueError(f"{name} must have x's shape {tuple(x.shape)}, got {tuple(t.shape)}")


def _vector(name: str, t, hidden: int, device) -> None:
    _floating(name, t, device)
    if t.shape != (hidden,):
        raise ValueError(f"{name} must be ({hidden},) (x's last dim), got {tuple(t.shape)}")


def residual_dtype_of(x: Tensor, residual: Tensor | None, residual_in_fp32: bool) -> torch.dtype:
    """The stream's dtype: the residual's, else float32 with ``residual_in_fp32``, else x's."""
    if residual is not None:
        return residual.dtype
    return torch.float32 if residual_in_fp32 else x.dtype


def _check(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale) -> None:
    _floating("x", x)
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"x must be (..., hidden) with hidden >= 1, got shape {tuple(x.shape)}")
    hidden = x.shape[-1]
    _vector("weight", weight, hidden, x.device)
    if bias is not None:
        _vector("bias", bias, hidden, x.device)
    if residual is not None:
        _like_x("residual", residual, x)
    if x1 is not None:
        _like_x("x1", x1, x)
        if rowscale is not None:
            raise ValueError("rowscale is not supported together with x1 (as upstream)")
    if weight1 is not None:
        _vector("weight1", weight1, hidden, x.device)
    if bias1 is not None:
        if weight1 is None:
            raise ValueError("bias1 was given without weight1")
        _vector("bias1", bias1, hidden, x.device)
    if rowscale is not None:
        _floating("rowscale", rowscale, x.device)
        if rowscale.shape != x.shape[:-1]:
            raise ValueError(f"rowscale must be x's shape without its last dim "
                             f"{tuple(x.shape[:-1])}, got {tuple(rowscale.shape)}")  # fmt: skip
    if (
        isinstance(eps, bool)
        or not isinstance(eps, (int, float))
        or not (math.isfinite(eps) and eps >= 0)
    ):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if (
        isinstance(dropout_p, bool)
        or not isinstance(dropout_p, (int, float))
        or not (0.0 <= dropout_p < 1.0)
    ):
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")


def _compute_dtype(*tensors) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) \
        else torch.float32  # fmt: skip


# ---- the kernel tier --------------------------------------------------------------------------

_THREADS = 256  # csrc/add_norm.hip: kThreads
_WAVE_STEP = 64  # the register forms' block sizes: whole 64-thread steps (wave32 and wave64)
#: The backward's blocks per multiprocessor where the runtime cannot say how many fit.
BWD_BLOCKS_PER_SM = 2


def bwd_row_blocks(rows: int, launcher, threads: int, sms: int) -> int:
    """Blocks of the backward: as many as the GPU holds at once (the runtime's occupancy of the
    kernel at this block size, times the multiprocessors), at most one a row. Each block walks
    its share of the rows with its column sums in registers, so a second, partial wave of
    blocks would run alone: on the H100 (bf16 x, fp32 stream, 16384 rows) exactly the resident
    count was the fastest of 2 / 3 / 4 / 6 / 8 blocks a multiprocessor at every width (d768:
    6 blocks, 76.8 us, 87% of copy, against 113.2 us at 2; d2048: 3 blocks, 197.5 against
    224.0 us at 2 and 231.8 at 4)."""
    per_sm = resident_blocks(launcher, threads) or BWD_BLOCKS_PER_SM
    return max(1, min(rows, per_sm * max(1, sms)))


def kernel_eligible(x: Tensor, weight, bias, residual, weight1, bias1, residual_in_fp32) -> bool:
    """Whether the kernels take this call: x, the stream and every parameter in float32,
    float16 or bfloat16 (float64 anywhere: the torch tier, in float64)."""
    stream = residual_dtype_of(x, residual, residual_in_fp32)
    return (
        x.dtype in KERNEL_DTYPE
        and stream in KERNEL_DTYPE
        and all(t is None or t.dtype in KERNEL_DTYPE for t in (weight, bias, weight1, bias1))
    )


def row_plan(hidden: int, runs_choices: tuple[int, ...]) -> tuple[int, int] | None:
    """``(runs, threads)`` of a register-resident form for rows of ``hidden`` elements: the
    fewest 4-element runs a thread that keep the block within 256 threads (whole 64-thread
    steps); None past the largest form (the generic kernel)."""
    if hidden <= 0 or hidden % 4:
        return None
    runs = hidden // 4
    for r in runs_choices:
        threads = -(-runs // r)
        threads = -(-threads // _WAVE_STEP) * _WAVE_STEP
        if threads <= _THREADS:
            return r, threads
    return None


def _rows(t: Tensor | None, hidden: int) -> Tensor | None:
    return None if t is None else t.reshape(-1, hidden).contiguous()


def _ptr(t: Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _code(t: Tensor | None) -> int:
    return 0 if t is None else DTYPE_CODE[t.dtype]


def _aligned(*tensors) -> bool:
    return all(t is None or t.data_ptr() % 16 == 0 for t in tensors)


#: AddNormParams' pointer fields, in order
_POINTERS = tuple(n for n, t in AddNormParams._fields_ if t is ctypes.c_void_p)


def _params(a: dict, rows, hidden, stream_dtype, layer_norm, rows_per_block, partial_rows,
            eps, keep) -> tuple:  # fmt: skip
    """AddNormParams in field order (csrc/params.h), pointers from ``a`` (absent: null)."""
    return (*(_ptr(a.get(n)) for n in _POINTERS), rows, hidden, DTYPE_CODE[stream_dtype],
            _code(a["weight"]), _code(a.get("bias")), _code(a.get("weight1")),
            _code(a.get("bias1")), int(layer_norm), rows_per_block, partial_rows, float(eps),
            float(keep))  # fmt: skip


def _mask_bytes(m: Tensor | None, hidden: int) -> Tensor | None:
    return None if m is None else _rows(m, hidden).view(torch.uint8)


def _fwd_kernel(kset, x, weight, bias, residual, x1, weight1, bias1, rowscale, mask, mask1,
                eps, dropout_p, stream_dtype, is_rms_norm, store_stream):  # fmt: skip
    hidden = x.shape[-1]
    rows = x.numel() // hidden
    a = {"x": _rows(x, hidden), "residual": _rows(residual, hidden),
         "x1": _rows(like(x1, x), hidden), "weight": weight, "bias": bias, "weight1": weight1,
         "bias1": bias1, "mask": _mask_bytes(mask, hidden), "mask1": _mask_bytes(mask1, hidden),
         "rowscale": None if rowscale is None else rowscale.reshape(-1).float().contiguous()}  # fmt: skip
    a["y"] = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    a["y1"] = None if weight1 is None else torch.empty_like(a["y"])
    if store_stream:
        a["stream"] = torch.empty(rows, hidden, dtype=stream_dtype, device=x.device)
    a["mean"] = None if is_rms_norm else torch.empty(rows, dtype=torch.float32, device=x.device)
    a["rstd"] = torch.empty(rows, dtype=torch.float32, device=x.device)
    plan = row_plan(hidden, ADD_NORM_FWD_RUNS)
    dt = KERNEL_DTYPE[x.dtype]
    name, threads = f"m2r_add_norm_fwd_{dt}", _THREADS
    if plan is not None and _aligned(*(a[k] for k in a if k not in ("rowscale", "mean", "rstd"))):
        name, threads = f"m2r_add_norm_fwd_{dt}_r{plan[0]}", plan[1]
        if all(t is None for t in (x1, weight1, rowscale, mask, mask1)):
            name += "_plain"  # a pre-norm block's call: the form without the extras' code
    params = _params(a, rows, hidden, stream_dtype, not is_rms_norm, 0, 0, eps, 1.0 - dropout_p)
    launch(kset.launcher(name), x, params, (rows, 1, 1), threads)
    return a


def _fwd_impl(
    x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None, x1: Tensor | None,
    weight1: Tensor | None, bias1: Tensor | None, rowscale: Tensor | None, mask: Tensor | None,
    mask1: Tensor | None, eps: float, dropout_p: float, residual_in_fp32: bool,
    is_rms_norm: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(y, y1, stream, mean, rstd)``: y / y1 in x's dtype (y1 empty without ``weight1``),
    the stream in the residual dtype, the rows' mean (empty for RMSNorm) and rstd in fp32."""
    _check(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale)
    _check_masks(x, mask, mask1, x1, dropout_p)
    kset = _kernel_set(x, weight, bias, residual, weight1, bias1, residual_in_fp32)
    return _fwd_run(x, weight, bias, residual, x1, weight1, bias1, rowscale, mask, mask1, eps,
                    dropout_p, residual_in_fp32, is_rms_norm, True, kset)  # fmt: skip


def _kernel_set(x, weight, bias, residual, weight1, bias1, residual_in_fp32):
    """The kernel set that runs this call, or None for the torch tier."""
    tier, kset = choose(x.device)
    if tier == "kernel" and kernel_eligible(x, weight, bias, residual, weight1, bias1,
                                            residual_in_fp32):  # fmt: skip
        return kset
    return None


def _fwd_run(x, weight, bias, residual, x1, weight1, bias1, rowscale, mask, mask1, eps,
             dropout_p, residual_in_fp32, is_rms_norm, store_stream, kset):  # fmt: skip
    """``_fwd_impl`` on checked arguments, on ``kset``'s kernels (None: the torch tier); the
    stream is left empty unless ``store_stream``."""
    stream_dtype = residual_dtype_of(x, residual, residual_in_fp32)
    shape, rows_shape = x.shape, x.shape[:-1]

    def empty():  # a fresh one each time: a custom op's outputs may not alias each other
        return x.new_empty(0)

    if kset is not None and x.numel() > 0:
        a = _fwd_kernel(kset, x, weight, bias, residual, x1, weight1, bias1, rowscale, mask,
                        mask1, eps, dropout_p, stream_dtype, is_rms_norm, store_stream)  # fmt: skip
        y1 = empty() if a["y1"] is None else a["y1"].view(shape)
        stream = a["stream"].view(shape) if store_stream else empty()
        mean = empty() if a["mean"] is None else a["mean"].view(rows_shape)
        return a["y"].view(shape), y1, stream, mean, a["rstd"].view(rows_shape)
    compute = _compute_dtype(x, weight, residual, x1)
    stat = torch.float64 if compute == torch.float64 else torch.float32
    if x.numel() == 0:  # no rows (or hidden 0 is refused): empty outputs of the right shapes
        y = torch.empty(shape, dtype=x.dtype, device=x.device)
        return (y, empty() if weight1 is None else torch.empty_like(y),
                torch.empty(shape, dtype=stream_dtype, device=x.device) if store_stream else empty(),
                empty() if is_rms_norm else torch.empty(rows_shape, dtype=stat, device=x.device),
                torch.empty(rows_shape, dtype=stat, device=x.device))  # fmt: skip
    s = stream_sum(x, residual, x1, rowscale, mask, mask1, dropout_p, compute)
    mean, rstd = row_stats(s, eps, is_rms_norm)
    y = normalize(s, weight, bias, eps, is_rms_norm, compute).to(x.dtype)
    y1 = empty() if weight1 is None else normalize(s, weight1, bias1, eps, is_rms_norm,
                                                 compute).to(x.dtype)  # fmt: skip
    stream = s.to(stream_dtype) if store_stream else empty()
    if stream is x:  # (no conversion and nothing added: outputs may not alias inputs)
        stream = stream.clone()
    return (y, y1, stream, empty() if is_rms_norm else mean.to(stat), rstd.to(stat))


add_norm_fwd = torch.library.custom_op("mamba2_rocm::add_norm_fwd", _fwd_impl, mutates_args=())


@add_norm_fwd.register_fake
def _(x, weight, bias, residual, x1, weight1, bias1, rowscale, mask, mask1, eps, dropout_p,
      residual_in_fp32, is_rms_norm):  # fmt: skip
    _check(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale)
    _check_masks(x, mask, mask1, x1, dropout_p)
    stat = torch.float64 if _compute_dtype(x, weight, residual, x1) == torch.float64 \
        else torch.float32  # fmt: skip
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x.shape[:-1]
    return (y, torch.empty_like(y) if weight1 is not None else x.new_empty(0),
            torch.empty(x.shape, dtype=residual_dtype_of(x, residual, residual_in_fp32),
                        device=x.device),
            x.new_empty(0) if is_rms_norm else torch.empty(rows, dtype=stat, device=x.device),
            torch.empty(rows, dtype=stat, device=x.device))  # fmt: skip


def _check_masks(x, mask, mask1, x1, dropout_p) -> None:
    needs = (("mask", mask, dropout_p > 0), ("mask1", mask1, dropout_p > 0 and x1 is not None))
    for name, m, wanted in needs:
        if m is None:
            if wanted:
                raise ValueError(f"dropout_p > 0 needs {name} (the keep-mask of its input)")
            continue
        if not isinstance(m, Tensor) or m.dtype != torch.bool or m.shape != x.shape:
            raise ValueError(f"{name} must be a bool tensor of x's shape {tuple(x.shape)}")
        if m.device != x.device:
            raise ValueError(f"{name} must be on {x.device} (x's device), got {m.device}")


def _bwd_kernel(kset, dy, dy1, dstream, stream, weight, bias, weight1, bias1, rowscale, mask,
                mask1, mean, rstd, dropout_p, is_rms_norm, has_residual, has_x1):  # fmt: skip
    hidden = dy.shape[-1]
    rows = dy.numel() // hidden
    a = {"stream": _rows(stream, hidden), "dy": _rows(dy, hidden), "dy1": _rows(dy1, hidden),
         "dstream": _rows(dstream, hidden), "weight": weight, "bias": bias, "weight1": weight1,
         "bias1": bias1, "mask": _mask_bytes(mask, hidden), "mask1": _mask_bytes(mask1, hidden),
         "rowscale": None if rowscale is None else rowscale.reshape(-1).float().contiguous(),
         "mean": None if is_rms_norm else mean.reshape(-1), "rstd": rstd.reshape(-1)}  # fmt: skip
    a["dx"] = torch.empty(rows, hidden, dtype=dy.dtype, device=dy.device)
    a["dresidual"] = torch.empty(rows, hidden, dtype=stream.dtype, device=dy.device) \
        if has_residual else None  # fmt: skip
    a["dx1"] = torch.empty_like(a["dx"]) if has_x1 else None
    a["dweight"] = torch.empty_like(weight)
    a["dbias"] = None if bias is None else torch.empty_like(bias)
    a["dweight1"] = None if weight1 is None else torch.empty_like(weight1)
    a["dbias1"] = None if bias1 is None else torch.empty_like(bias1)
    plan = row_plan(hidden, ADD_NORM_BWD_RUNS)
    dt = KERNEL_DTYPE[dy.dtype]
    name, threads = f"m2r_add_norm_bwd_{dt}", _THREADS
    rowed = ("stream", "dy", "dy1", "dstream", "weight", "bias", "weight1", "bias1", "mask",
             "mask1", "dx", "dresidual", "dx1")  # fmt: skip
    simple = all(a[k] is None for k in ("dy1", "dx1", "mask", "rowscale"))  # the _r forms' calls
    if plan is not None and simple and _aligned(*(a[k] for k in rowed)):
        name, threads = f"m2r_add_norm_bwd_{dt}_r{plan[0]}", plan[1]
    launcher = kset.launcher(name)
    row_blocks = bwd_row_blocks(rows, launcher, threads, sm_count(dy.device))
    per_block = -(-rows // row_blocks)
    row_blocks = -(-rows // per_block)
    a["partial"] = torch.empty(row_blocks, 4, hidden, dtype=torch.float32, device=dy.device)
    params = _params(a, rows, hidden, stream.dtype, not is_rms_norm, per_block, row_blocks, 0.0,
                     1.0 - dropout_p)  # fmt: skip
    launch(launcher, dy, params, (row_blocks, 1, 1), threads)
    launch(kset.launcher("m2r_add_norm_bwd_reduce"), dy, params,
           (-(-4 * hidden // COLUMN_SUM_COLS), 1, 1), _THREADS)  # fmt: skip
    return a


def _bwd_impl(
    dy: Tensor, dy1: Tensor | None, dstream: Tensor | None, stream: Tensor, weight: Tensor,
    bias: Tensor | None, weight1: Tensor | None, bias1: Tensor | None, rowscale: Tensor | None,
    mask: Tensor | None, mask1: Tensor | None, mean: Tensor, rstd: Tensor, dropout_p: float,
    is_rms_norm: bool, has_residual: bool, has_x1: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """Gradients of ``add_norm_fwd`` from the output gradients dy (y's), dy1 (y1's, or None)
    and dstream (the stream's, or None), the stream it wrote and its mean / rstd: ``(dx,
    dresidual, dx1, dweight, dbias, dweight1, dbias1)`` — dx / dx1 in dy's dtype, dresidual in
    the stream's, the parameters' in theirs; empty where the input is absent."""
    _check_bwd(dy, dy1, dstream, stream, weight, weight1, mean, rstd, is_rms_norm)
    tier, kset = choose(dy.device)

    def empty():  # a fresh one each time (outputs may not alias)
        return dy.new_empty(0)

    kernel = tier == "kernel" and dy.numel() > 0 and stream.dtype in KERNEL_DTYPE and all(
        t is None or t.dtype in KERNEL_DTYPE for t in (dy, weight, bias, weight1, bias1))  # fmt: skip
    if kernel:
        a = _bwd_kernel(kset, dy, like(dy1, dy), like(dstream, stream), stream, weight, bias,
                        weight1, bias1, rowscale, mask, mask1, mean, rstd, dropout_p,
                        is_rms_norm, has_residual, has_x1)  # fmt: skip
        shape = dy.shape
        return tuple(empty() if a[k] is None else a[k].view(shape) if a[k].dim() == 2 else a[k]
                     for k in ("dx", "dresidual", "dx1", "dweight", "dbias", "dweight1",
                               "dbias1"))  # fmt: skip
    compute = _compute_dtype(dy, stream, weight, mean)
    if dy.numel() == 0:
        ds = dx = torch.zeros(dy.shape, dtype=compute, device=dy.device)
        dx1 = dx if has_x1 else None
        dw, db = torch.zeros_like(weight), torch.zeros_like(weight)
        dw1 = db1 = None if weight1 is None else torch.zeros_like(weight1)
    else:
        ds, dx, dx1, dw, db, dw1, db1 = add_norm_bwd_ref(
            dy, dy1, dstream, stream, weight, weight1, rowscale, mask, mask1, mean, rstd,
            dropout_p, is_rms_norm, has_x1, compute)  # fmt: skip
    outs = (dx.to(dy.dtype), ds.to(stream.dtype) if has_residual else empty(),
            dx1.to(dy.dtype) if has_x1 else empty(), dw.to(weight.dtype),
            db.to(bias.dtype) if bias is not None else empty(),
            dw1.to(weight1.dtype) if weight1 is not None else empty(),
            db1.to(bias1.dtype) if bias1 is not None else empty())  # fmt: skip
    # no output may alias another: without dropout or rowscale, ds, dx and dx1 are one tensor
    # (none of them can be an input: each is computed)
    return tuple(t.clone() if any(t is o for o in outs[:i]) else t for i, t in enumerate(outs))


def _check_bwd(dy, dy1, dstream, stream, weight, weight1, mean, rstd, is_rms_norm) -> None:
    _floating("dy", dy)
    _like_x("stream", stream, dy)
    if dy1 is not None:
        if weight1 is None:
            raise ValueError("dy1 was given without weight1")
        _like_x("dy1", dy1, dy)
    if dstream is not None:
        _like_x("dstream", dstream, dy)
    _vector("weight", weight, dy.shape[-1], dy.device)
    rows = dy.shape[:-1]
    for name, t in (("rstd", rstd),) + (() if is_rms_norm else (("mean", mean),)):
        _floating(name, t, dy.device)
        if t.shape != rows:
            raise ValueError(
                f"{name} must be {tuple(rows)} (a value per row), got {tuple(t.shape)}"
            )


add_norm_bwd = torch.library.custom_op("mamba2_rocm::add_norm_bwd", _bwd_impl, mutates_args=())


@add_norm_bwd.register_fake
def _(dy, dy1, dstream, stream, weight, bias, weight1, bias1, rowscale, mask, mask1, mean, rstd,
      dropout_p, is_rms_norm, has_residual, has_x1):  # fmt: skip
    _check_bwd(dy, dy1, dstream, stream, weight, weight1, mean, rstd, is_rms_norm)

    def e():
        return dy.new_empty(0)

    return (torch.empty_like(dy), torch.empty_like(stream) if has_residual else e(),
            torch.empty_like(dy) if has_x1 else e(), torch.empty_like(weight),
            torch.empty_like(bias) if bias is not None else e(),
            torch.empty_like(weight1) if weight1 is not None else e(),
            torch.empty_like(bias1) if bias1 is not None else e())  # fmt: skip


def _setup(ctx, inputs, output):
    (x, weight, bias, residual, x1, weight1, bias1, rowscale, mask, mask1, _eps, dropout_p,
     _residual_in_fp32, is_rms_norm) = inputs  # fmt: skip
    _, _, stream, mean, rstd = output
    ctx.save_for_backward(stream, weight, bias, weight1, bias1, rowscale, mask, mask1, mean, rstd)
    ctx.args = (dropout_p, is_rms_norm, residual is not None, x1 is not None)
    ctx.dtypes = (x.dtype, None if x1 is None else x1.dtype)


def _backward(ctx, dy, dy1, dstream, dmean, drstd):
    stream, weight, bias, weight1, bias1, rowscale, mask, mask1, mean, rstd = ctx.saved_tensors
    dropout_p, is_rms_norm, has_residual, has_x1 = ctx.args
    need = ctx.needs_input_grad
    if not any(need[:7]):
        return (None,) * 14
    if dy is None:
        dy = torch.zeros(stream.shape, dtype=ctx.dtypes[0], device=stream.device)
    if weight1 is None or (dy1 is not None and dy1.numel() == 0):
        dy1 = None
    args = (dy, dy1, dstream, stream, weight, bias, weight1, bias1, rowscale, mask, mask1, mean,
            rstd, dropout_p, is_rms_norm, has_residual, has_x1)  # fmt: skip
    grads = add_norm_bwd(*args) if traced(dy, stream) else _bwd_impl(*args)
    dx, dres, dx1, dw, db, dw1, db1 = grads
    if has_x1 and ctx.dtypes[1] != dx1.dtype:
        dx1 = dx1.to(ctx.dtypes[1])
    g = (dx, dw, db if bias is not None else None, dres if has_residual else None,
         dx1 if has_x1 else None, dw1 if weight1 is not None else None,
         db1 if bias1 is not None else None)  # fmt: skip
    return tuple(t if n else None for t, n in zip(g, need[:7], strict=False)) + (None,) * 7


def _eager_forward(ctx, *inputs):
    """The eager training entry's forward: ``layer_norm_fn`` checked the arguments (and drew
    the masks) already."""
    x, weight, bias, residual, _, weight1, bias1 = inputs[:7]
    kset = _kernel_set(x, weight, bias, residual, weight1, bias1, inputs[12])
    return _fwd_run(*inputs, True, kset)


_train = register_training(add_norm_fwd, _fwd_impl, _setup, _backward, _eager_forward)


def layer_norm_fn(
    x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None = None,
    x1: Tensor | None = None, weight1: Tensor | None = None, bias1: Tensor | None = None,
    eps: float = 1e-6, dropout_p: float = 0.0, rowscale: Tensor | None = None,
    prenorm: bool = False, residual_in_fp32: bool = False, is_rms_norm: bool = False,
    return_dropout_mask: bool = False,
):  # fmt: skip
    """Add, then LayerNorm (RMSNorm with ``is_rms_norm``) over the last dim.

    Returns ``y`` [, ``y1`` with ``weight1``] [, the summed stream with ``prenorm``]
    [, ``dropout_mask``, ``dropout_mask1`` with ``return_dropout_mask``] in upstream's order.
    ``y`` / ``y1`` are in x's dtype; the stream is in the residual's dtype (float32 with
    ``residual_in_fp32`` and no residual; x's dtype otherwise). The masks are bool keep-masks,
    None where there is no dropout (or no x1)."""
    _check(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale)
    mask = mask1 = None
    if dropout_p > 0.0:
        mask = torch.rand(x.shape, device=x.device) >= dropout_p
        if x1 is not None:
            mask1 = torch.rand(x.shape, device=x.device) >= dropout_p
    eps, dropout_p = float(eps), float(dropout_p)
    is_rms_norm, residual_in_fp32 = bool(is_rms_norm), bool(residual_in_fp32)
    params = (weight, bias, residual, x1, weight1, bias1)
    kset = _kernel_set(x, weight, bias, residual, weight1, bias1, residual_in_fp32)
    if kset is not None:
        args = (x, weight, bias, residual, x1, weight1, bias1, rowscale, mask, mask1, eps,
                dropout_p, residual_in_fp32, is_rms_norm)  # fmt: skip
        if torch.compiler.is_compiling():
            y, y1, stream, _, _ = add_norm_fwd(*args)
        elif needs_autograd(x, *params):
            y, y1, stream, _, _ = _train(*args)
        else:
            y, y1, stream, _, _ = _fwd_run(*args, prenorm, kset)
        y1 = y1 if weight1 is not None else None
    else:
        compute = _compute_dtype(x, weight, residual, x1)
        y, y1, stream = add_norm_torch(
            x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale,
            residual_dtype_of(x, residual, residual_in_fp32), is_rms_norm, mask, mask1, compute,
        )  # fmt: skip
    outs: tuple = (y,) if y1 is None else (y, y1)
    if prenorm:
        outs += (stream,)
    if return_dropout_mask:
        outs += (mask, mask1)
    return outs[0] if len(outs) == 1 else outs


def rms_norm_fn(
    x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None = None,
    x1: Tensor | None = None, weight1: Tensor | None = None, bias1: Tensor | None = None,
    eps: float = 1e-6, dropout_p: float = 0.0, rowscale: Tensor | None = None,
    prenorm: bool = False, residual_in_fp32: bool = False, return_dropout_mask: bool = False,
):  # fmt: skip
    """``layer_norm_fn`` with ``is_rms_norm=True``."""
    return layer_norm_fn(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale,
                         prenorm, residual_in_fp32, True, return_dropout_mask)  # fmt: skip


def layer_norm_linear_fn(
    x: Tensor, norm_weight: Tensor, norm_bias: Tensor | None, linear_weight: Tensor,
    linear_bias: Tensor | None, residual: Tensor | None = None, eps: float = 1e-6,
    prenorm: bool = False, residual_in_fp32: bool = False, is_rms_norm: bool = False,
):  # fmt: skip
    """Add + norm, then a linear layer: ``out`` [, the stream with ``prenorm``]. The normalized
    rows meet the linear weight in its dtype (autocast's dtype when autocast is on)."""
    if not isinstance(linear_weight, Tensor) or linear_weight.dim() != 2:
        raise ValueError(f"linear_weight must be a 2-D tensor (out, hidden), got "
                         f"{getattr(linear_weight, 'shape', type(linear_weight).__name__)}")  # fmt: skip
    if linear_weight.shape[1] != x.shape[-1]:
        raise ValueError(f"linear_weight must be (out, {x.shape[-1]}), got "
                         f"{tuple(linear_weight.shape)}")  # fmt: skip
    y, stream = layer_norm_fn(x, norm_weight, norm_bias, residual, eps=eps, prenorm=True,
                              residual_in_fp32=residual_in_fp32, is_rms_norm=is_rms_norm)  # fmt: skip
    dtype = linear_weight.dtype
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
    bias = linear_bias.to(dtype) if linear_bias is not None else None
    out = torch.nn.functional.linear(y.to(dtype), linear_weight.to(dtype), bias)
    return (out, stream) if prenorm else out


class RMSNorm(torch.nn.Module):
    """mamba_ssm's ``ops.triton.layer_norm.RMSNorm(hidden_size, eps=1e-5, dropout_p=0.0)``: a
    weight of ones, ``bias`` registered as None, dropout on the input while training;
    ``forward(x, residual=None, prenorm=False, residual_in_fp32=False)``."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, dropout_p: float = 0.0,
                 device=None, dtype=None) -> None:  # fmt: skip
        super().__init__()
        self.eps = eps
        self.drop = torch.nn.Dropout(dropout_p) if dropout_p > 0.0 else None
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        torch.nn.init.ones_(self.weight)

    def forward(self, x: Tensor, residual: Tensor | None = None, prenorm: bool = False,
                residual_in_fp32: bool = False):  # fmt: skip
        p = self.drop.p if self.drop is not None and self.training else 0.0
        return rms_norm_fn(x, self.weight, self.bias, residual=residual, eps=self.eps,
                           dropout_p=p, prenorm=prenorm, residual_in_fp32=residual_in_fp32)  # fmt: skip
