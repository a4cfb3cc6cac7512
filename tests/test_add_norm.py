"""The fused residual-add norm (``ops.add_norm``, mamba_ssm's ``layer_norm_fn`` API): against
the float64 reference at odd sizes, every argument of the signature, the output / stream dtype
rules, gradients, and the errors."""

from __future__ import annotations

import zlib

import pytest
import torch

from mamba2_rocm.ops.add_norm import (
    RMSNorm,
    layer_norm_fn,
    layer_norm_linear_fn,
    layer_norm_ref,
    rms_norm_fn,
    rms_norm_ref,
)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _inputs(shape, dtype, seed, residual_dtype=None):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, dt=dtype: torch.randn(*s, generator=g).to(dt)  # noqa: E731
    d = shape[-1]
    return dict(x=r(*shape), residual=r(*shape, dt=residual_dtype or dtype), x1=r(*shape),
                weight=r(d, dt=torch.float32) + 1, bias=r(d, dt=torch.float32),
                weight1=r(d, dt=torch.float32), bias1=r(d, dt=torch.float32),
                rowscale=r(*shape[:-1], dt=torch.float32))  # fmt: skip


def _close(got, want, dtype):
    tol = TOL[dtype] * max(1.0, float(want.detach().abs().max()))
    assert got.dtype == want.dtype
    assert (got.detach().double() - want.detach().double()).abs().max() <= tol


@pytest.mark.parametrize("is_rms", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (3, 129), (2, 5, 151), (1134, 40)])
def test_against_the_float64_reference(shape, dtype, is_rms):
    t = _inputs(shape, dtype, zlib.crc32(repr((shape, dtype, is_rms)).encode()))
    ref = rms_norm_ref if is_rms else layer_norm_ref
    y, stream = layer_norm_fn(t["x"], t["weight"], t["bias"], residual=t["residual"], eps=1e-5,
                              prenorm=True, is_rms_norm=is_rms)  # fmt: skip
    d = {k: v.double() for k, v in t.items()}
    want_y, want_s = ref(d["x"], d["weight"], d["bias"], residual=d["residual"], eps=1e-5,
                         prenorm=True)  # fmt: skip
    _close(y, want_y.to(dtype), dtype)
    _close(stream, want_s.to(dtype), dtype)


@pytest.mark.parametrize("is_rms", [False, True])
def test_every_argument(is_rms):
    """x1 with weight1 / bias1, rowscale, dropout with the masks returned: the outputs equal
    the reference given the same masks."""
    t = _inputs((7, 33), torch.float32, 5)
    ref = rms_norm_ref if is_rms else layer_norm_ref
    torch.manual_seed(0)
    y, y1, stream, m, m1 = layer_norm_fn(
        t["x"], t["weight"], t["bias"], residual=t["residual"], x1=t["x1"], weight1=t["weight1"],
        bias1=t["bias1"], eps=1e-6, dropout_p=0.3, prenorm=True, is_rms_norm=is_rms,
        return_dropout_mask=True,
    )  # fmt: skip
    assert m.dtype == m1.dtype == torch.bool and 0.5 < m.float().mean() < 0.9
    w = ref(t["x"], t["weight"], t["bias"], residual=t["residual"], x1=t["x1"],
            weight1=t["weight1"], bias1=t["bias1"], eps=1e-6, dropout_p=0.3, prenorm=True,
            dropout_mask=m, dropout_mask1=m1, upcast=True)  # fmt: skip
    for got, want in zip((y, y1, stream), w, strict=True):
        _close(got, want, torch.float32)
    y = layer_norm_fn(t["x"], t["weight"], None, rowscale=t["rowscale"], is_rms_norm=is_rms)
    want = ref(t["x"], t["weight"], None, rowscale=t["rowscale"], upcast=True)
    _close(y, want, torch.float32)


def test_return_forms_and_dtypes():
    t = _inputs((4, 16), torch.bfloat16, 1)
    y = rms_norm_fn(t["x"], t["weight"], None)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16
    y, stream = rms_norm_fn(t["x"], t["weight"], None, prenorm=True, residual_in_fp32=True)
    assert stream.dtype == torch.float32 and torch.equal(stream, t["x"].float())
    _, stream = rms_norm_fn(t["x"], t["weight"], None, residual=t["residual"].float(),
                            prenorm=True)  # fmt: skip
    assert stream.dtype == torch.float32  # the residual's dtype wins
    y, m, m1 = rms_norm_fn(t["x"], t["weight"], None, return_dropout_mask=True)
    assert m is None and m1 is None
    y, y1 = rms_norm_fn(t["x"], t["weight"], None, weight1=t["weight1"])
    assert y1.shape == y.shape


@pytest.mark.parametrize("is_rms", [False, True])
def test_gradients(is_rms):
    """Every input's gradient through the stream and the normalized outputs, in float64."""
    t = {k: v.double().requires_grad_() for k, v in _inputs((3, 11), torch.float32, 2).items()}

    def fn(x, residual, x1, weight, bias, weight1):
        y, y1, s = layer_norm_fn(x, weight, bias, residual=residual, x1=x1, weight1=weight1,
                                 prenorm=True, is_rms_norm=is_rms)  # fmt: skip
        return y, y1, s

    torch.autograd.gradcheck(fn, (t["x"], t["residual"], t["x1"], t["weight"], t["bias"],
                                  t["weight1"]))  # fmt: skip


def test_rmsnorm_module_and_linear():
    norm = RMSNorm(24, eps=1e-5, dropout_p=0.1)
    assert norm.bias is None and torch.equal(norm.weight, torch.ones(24))
    assert [k for k, _ in norm.state_dict().items()] == ["weight"]
    x, res = torch.randn(5, 24), torch.randn(5, 24)
    norm.eval()
    y, s = norm(x, residual=res, prenorm=True)
    _close(y, rms_norm_ref(x, norm.weight, None, residual=res, eps=1e-5, upcast=True),
           torch.float32)  # fmt: skip
    lin_w, lin_b = torch.randn(7, 24), torch.randn(7)
    out, s2 = layer_norm_linear_fn(x, norm.weight, None, lin_w, lin_b, residual=res, eps=1e-5,
                                   prenorm=True, is_rms_norm=True)  # fmt: skip
    _close(out, torch.nn.functional.linear(y, lin_w, lin_b), torch.float32)
    assert torch.equal(s, s2)


def test_empty_rows():
    x = torch.empty(0, 8)
    y, s = rms_norm_fn(x, torch.ones(8), None, prenorm=True)
    assert y.shape == (0, 8) and s.shape == (0, 8)


@pytest.mark.parametrize("change, error, match", [
    ({"x": torch.zeros(3, 8, dtype=torch.int32)}, TypeError, "x must be float32, float16"),
    ({"x": torch.zeros(3, 0)}, ValueError, "hidden >= 1"),
    ({"weight": torch.ones(7)}, ValueError, r"weight must be \(8,\)"),
    ({"residual": torch.zeros(3, 9)}, ValueError, r"residual must have x's shape \(3, 8\)"),
    ({"x1": torch.zeros(3, 8), "rowscale": torch.ones(3)}, ValueError, "rowscale is not supported"),
    ({"bias1": torch.zeros(8)}, ValueError, "bias1 was given without weight1"),
    ({"rowscale": torch.ones(4)}, ValueError, r"rowscale must be x's shape without its last dim"),
    ({"dropout_p": 1.0}, ValueError, r"dropout_p must be in \[0, 1\)"),
    ({"eps": -1.0}, ValueError, "eps must be a finite number >= 0"),
    ({"weight": torch.ones(8, device="meta")}, ValueError, "weight must be on cpu"),
])  # fmt: skip
def test_bad_inputs(change, error, match):
    args = dict(x=torch.zeros(3, 8), weight=torch.ones(8), bias=None)
    args.update(change)
    with pytest.raises(error, match=match):
        layer_norm_fn(**args)
