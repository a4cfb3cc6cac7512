"""The fused residual-add LayerNorm / RMSNorm of pre-norm blocks: mamba_ssm's
``ops.triton.layer_norm`` API (``layer_norm_fn``, ``rms_norm_fn``, ``layer_norm_linear_fn``,
``RMSNorm``) with its whole signature: the residual add, ``prenorm``, ``residual_in_fp32``,
dropout with ``return_dropout_mask``, ``rowscale``, and the second input / second weight.

Each call's arguments are checked here, once; the math is ``reference.add_norm``'s and runs
as differentiable PyTorch (the torch tier): the sum and the statistics in fp32, the stream
rounded once to the residual dtype, the outputs in x's dtype — the numerics of upstream's
Triton kernel.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mamba2_rocm.reference.add_norm import add_norm_torch, layer_norm_ref, rms_norm_ref

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
    compute = _compute_dtype(x, weight, residual, x1)
    y, y1, stream = add_norm_torch(
        x, weight, bias, residual, x1, weight1, bias1, float(eps), float(dropout_p), rowscale,
        residual_dtype_of(x, residual, residual_in_fp32), bool(is_rms_norm), mask, mask1, compute,
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
