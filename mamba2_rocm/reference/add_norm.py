"""The fused residual-add norm in plain PyTorch: the math of ``mamba2_rocm.ops.add_norm``.

One row of the pre-norm residual stream: ``s = dropout(rowscale * x) + dropout(x1) +
residual`` accumulated in fp32, then ``norm(s) * weight + bias`` (LayerNorm or RMSNorm over the
last dim) and, with a second weight, ``norm(s) * weight1 + bias1`` from the same statistics.
The stream ``s`` is returned rounded to the residual dtype; the normalized outputs in x's
dtype. These functions are the ground truth of the tests and the torch tier of the op; they
validate nothing (``ops.add_norm`` does).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "add_norm_bwd_ref",
    "add_norm_torch",
    "layer_norm_ref",
    "normalize",
    "rms_norm_ref",
    "row_stats",
    "stream_sum",
]


def normalize(s: Tensor, weight: Tensor, bias: Tensor | None, eps: float, is_rms_norm: bool,
              compute: torch.dtype = torch.float32) -> Tensor:  # fmt: skip
    """``s`` normalized over its last dim, scaled and shifted, in ``compute`` precision."""
    s = s.to(compute)
    if is_rms_norm:
        h = s * torch.rsqrt(s.square().mean(-1, keepdim=True) + eps)
    else:
        centred = s - s.mean(-1, keepdim=True)
        h = centred * torch.rsqrt(centred.square().mean(-1, keepdim=True) + eps)
    h = h * weight.to(compute)
    return h + bias.to(compute) if bias is not None else h


def _dropped(t: Tensor, p: float, mask: Tensor | None) -> Tensor:
    return t.masked_fill(~mask, 0.0) / (1.0 - p) if mask is not None else t


def stream_sum(
    x: Tensor, residual: Tensor | None, x1: Tensor | None, rowscale: Tensor | None,
    mask: Tensor | None, mask1: Tensor | None, dropout_p: float,
    compute: torch.dtype = torch.float32,
) -> Tensor:  # fmt: skip
    """The stream ``dropout(rowscale * x) + dropout(x1) + residual`` in ``compute`` precision."""
    s = x.to(compute)
    if rowscale is not None:
        s = s * rowscale.to(compute).unsqueeze(-1)
    s = _dropped(s, dropout_p, mask)
    if x1 is not None:
        s = s + _dropped(x1.to(compute), dropout_p, mask1)
    if residual is not None:
        s = s + residual.to(compute)
    return s


def row_stats(s: Tensor, eps: float, is_rms_norm: bool) -> tuple[Tensor, Tensor]:
    """``(mean, rstd)`` of each row of ``s`` (its precision; mean 0 for RMSNorm)."""
    mean = torch.zeros_like(s[..., 0]) if is_rms_norm else s.mean(-1)
    centred = s - mean.unsqueeze(-1)
    return mean, torch.rsqrt(centred.square().mean(-1) + eps)


def add_norm_torch(
    x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None, x1: Tensor | None,
    weight1: Tensor | None, bias1: Tensor | None, eps: float, dropout_p: float,
    rowscale: Tensor | None, residual_dtype: torch.dtype, is_rms_norm: bool,
    mask: Tensor | None, mask1: Tensor | None, compute: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor | None, Tensor]:  # fmt: skip
    """``(y, y1, residual_out)``: y / y1 in x's dtype (y1 None without ``weight1``), the
    summed stream in ``residual_dtype``. ``mask`` / ``mask1`` are the dropout keep-masks
    (bool, x's shape) where ``dropout_p > 0``."""
    s = stream_sum(x, residual, x1, rowscale, mask, mask1, dropout_p, compute)
    y = normalize(s, weight, bias, eps, is_rms_norm, compute).to(x.dtype)
    y1 = None
    if weight1 is not None:
        y1 = normalize(s, weight1, bias1, eps, is_rms_norm, compute).to(x.dtype)
    return y, y1, s.to(residual_dtype)


def add_norm_bwd_ref(
    dy: Tensor, dy1: Tensor | None, dstream: Tensor | None, stream: Tensor, weight: Tensor,
    weight1: Tensor | None, rowscale: Tensor | None, mask: Tensor | None,
    mask1: Tensor | None, mean: Tensor | None, rstd: Tensor, dropout_p: float,
    is_rms_norm: bool, has_x1: bool, compute: torch.dtype = torch.float32,
) -> tuple:  # fmt: skip
    """The backward of the add + norm in closed form, from the stream the forward kept and its
    row statistics (the kernels' formula; ``mean`` unused for RMSNorm): ``(ds, dx, dx1, dweight, dbias, dweight1, dbias1)``
    in ``compute`` precision, ds the residual's gradient; dx1 None without x1 (``has_x1``),
    dweight1 / dbias1 None without ``dy1``. With xhat the normalized stream and
    g = dy * weight + dy1 * weight1:
    ds = rstd * (g - xhat * mean(xhat * g) - mean(g)) (RMSNorm: without mean(g)) + dstream."""
    c = compute
    xh = stream.to(c) if is_rms_norm else stream.to(c) - mean.to(c).unsqueeze(-1)
    xh = xh * rstd.to(c).unsqueeze(-1)
    dy_c = dy.to(c)
    g = dy_c * weight.to(c)
    if dy1 is not None:
        g = g + dy1.to(c) * weight1.to(c)
    ds = g - xh * (xh * g).mean(-1, keepdim=True)
    if not is_rms_norm:
        ds = ds - g.mean(-1, keepdim=True)
    ds = ds * rstd.to(c).unsqueeze(-1)
    if dstream is not None:
        ds = ds + dstream.to(c)
    dx = _dropped(ds, dropout_p, mask)
    if rowscale is not None:
        dx = dx * rowscale.to(c).unsqueeze(-1)
    rows = tuple(range(dy.dim() - 1))
    dweight, dbias = (dy_c * xh).sum(rows), dy_c.sum(rows)
    dx1 = _dropped(ds, dropout_p, mask1) if has_x1 else None
    dweight1 = dbias1 = None
    if dy1 is not None:
        dy1_c = dy1.to(c)
        dweight1, dbias1 = (dy1_c * xh).sum(rows), dy1_c.sum(rows)
    return ds, dx, dx1, dweight, dbias, dweight1, dbias1


def _ref(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
         dropout_mask, dropout_mask1, upcast, is_rms_norm):  # fmt: skip
    """mamba_ssm's ``layer_norm_ref`` / ``rms_norm_ref`` contract: the stream kept in x's
    dtype (fp32 with ``upcast``), the norm in the weight's dtype (fp32 with ``upcast``)."""
    dtype = x.dtype
    compute = torch.float32 if upcast else weight.dtype
    if dropout_p > 0.0 and dropout_mask is None:
        dropout_mask = torch.rand_like(x, dtype=torch.float32) >= dropout_p
    if dropout_p > 0.0 and x1 is not None and dropout_mask1 is None:
        dropout_mask1 = torch.rand_like(x1, dtype=torch.float32) >= dropout_p
    stream = torch.float32 if upcast else dtype
    s = x.to(stream)
    if rowscale is not None:
        s = s * rowscale.to(stream).unsqueeze(-1)
    if dropout_p > 0.0:
        s = _dropped(s, dropout_p, dropout_mask)
    if x1 is not None:
        s = s + (_dropped(x1.to(stream), dropout_p, dropout_mask1) if dropout_p > 0.0
                 else x1.to(stream))  # fmt: skip
    if residual is not None:
        s = (s + residual.to(stream)).to(stream)
    out = normalize(s, weight, bias, eps, is_rms_norm, compute).to(dtype)
    outs = (out,)
    if weight1 is not None:
        outs += (normalize(s, weight1, bias1, eps, is_rms_norm, compute).to(dtype),)
    if prenorm:
        outs += (s,)
    return outs[0] if len(outs) == 1 else outs


def layer_norm_ref(
    x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None = None,
    x1: Tensor | None = None, weight1: Tensor | None = None, bias1: Tensor | None = None,
    eps: float = 1e-6, dropout_p: float = 0.0, rowscale: Tensor | None = None,
    prenorm: bool = False, dropout_mask: Tensor | None = None,
    dropout_mask1: Tensor | None = None, upcast: bool = False,
):  # fmt: skip
    """mamba_ssm's ``layer_norm_ref``: out [, out1] [, the summed stream if ``prenorm``]."""
    return _ref(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
                dropout_mask, dropout_mask1, upcast, is_rms_norm=False)  # fmt: skip


def rms_norm_ref(
    x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None = None,
    x1: Tensor | None = None, weight1: Tensor | None = None, bias1: Tensor | None = None,
    eps: float = 1e-6, dropout_p: float = 0.0, rowscale: Tensor | None = None,
    prenorm: bool = False, dropout_mask: Tensor | None = None,
    dropout_mask1: Tensor | None = None, upcast: bool = False,
):  # fmt: skip
    """mamba_ssm's ``rms_norm_ref``: out [, out1] [, the summed stream if ``prenorm``]."""
    return _ref(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
                dropout_mask, dropout_mask1, upcast, is_rms_norm=True)  # fmt: skip
