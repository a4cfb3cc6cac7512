"""The compiled extensions' calling conventions served beside the real mamba-ssm
(``ops.extension_abi``: ``causal_conv1d.cpp_functions``, ``selective_scan_cuda``): argument
order, in-place outputs and returns as the C++ extensions have them, values as our ops'."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mamba2_rocm.ops import extension_abi as abi
from mamba2_rocm.ops.conv1d import causal_conv1d_fn, causal_conv1d_update
from mamba2_rocm.ops.selective_scan import selective_scan_fn


def _scan_inputs(with_z: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, d, L, n = 2, 6, 131, 4
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(u=r(b, d, L), delta=torch.rand(b, d, L, generator=g), A=-torch.rand(d, n, generator=g),
                B=r(b, 1, n, L), C=r(b, 1, n, L), D=r(d), z=r(b, d, L) if with_z else None,
                delta_bias=r(d))  # fmt: skip


@pytest.mark.parametrize("with_z", [False, True])
def test_selective_scan_fwd(with_z):
    t = _scan_inputs(with_z)
    res = abi.selective_scan_fwd(t["u"], t["delta"], t["A"], t["B"], t["C"], t["D"], t["z"],
                                 t["delta_bias"], True)  # fmt: skip
    assert len(res) == (3 if with_z else 2)
    out, x = res[:2]
    plain, last = selective_scan_fn(t["u"], t["delta"], t["A"], t["B"], t["C"], t["D"], None,
                                    t["delta_bias"], True, return_last_state=True)  # fmt: skip
    torch.testing.assert_close(out, plain)
    assert x.shape == (2, 6, 1, 8) and x.dtype == torch.float32
    torch.testing.assert_close(x[:, :, -1, 1::2], last)  # what mamba_ssm reads of it
    dt = F.softplus(t["delta"] + t["delta_bias"][:, None]).sum(-1)
    torch.testing.assert_close(x[:, :, 0, 0::2], torch.exp(t["A"][None] * dt[..., None]))
    if with_z:
        torch.testing.assert_close(res[2], plain * F.silu(t["z"]))


@pytest.mark.parametrize("with_z", [False, True])
def test_selective_scan_bwd(with_z):
    t = _scan_inputs(with_z, seed=1)
    names = [k for k in ("u", "delta", "A", "B", "C", "D", "delta_bias", "z") if t[k] is not None]
    leaves = {k: t[k].clone().requires_grad_() for k in names}
    args = {**t, **leaves}
    out = selective_scan_fn(args["u"], args["delta"], args["A"], args["B"], args["C"], args["D"],
                            args["z"], args["delta_bias"], True)  # fmt: skip
    dout = torch.randn_like(out)
    want = dict(zip(names, torch.autograd.grad(out, [leaves[k] for k in names], dout), strict=True))
    fwd = abi.selective_scan_fwd(t["u"], t["delta"], t["A"], t["B"], t["C"], t["D"], t["z"],
                                 t["delta_bias"], True)  # fmt: skip
    dz = torch.full_like(t["u"], float("nan")) if with_z else None  # poisoned: must be written
    got = abi.selective_scan_bwd(t["u"], t["delta"], t["A"], t["B"], t["C"], t["D"], t["z"],
                                 t["delta_bias"], dout, fwd[1], fwd[0], dz, True, with_z)  # fmt: skip
    assert len(got) == (9 if with_z else 7)
    for k, g in zip(("u", "delta", "A", "B", "C", "D", "delta_bias"), got[:7], strict=True):
        torch.testing.assert_close(g, want[k], rtol=1e-4, atol=1e-5, msg=k)
    if with_z:
        assert got[7] is dz
        torch.testing.assert_close(dz, want["z"], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got[8], fwd[2])


def test_selective_scan_bwd_without_optional_inputs():
    t = _scan_inputs(False, seed=2)
    fwd = abi.selective_scan_fwd(t["u"], t["delta"], t["A"], t["B"], t["C"], None, None, None,
                                 False)  # fmt: skip
    got = abi.selective_scan_bwd(t["u"], t["delta"], t["A"], t["B"], t["C"], None, None, None,
                                 torch.ones_like(fwd[0]), fwd[1], fwd[0], None, False, False)  # fmt: skip
    assert got[5] is None and got[6] is None and len(got) == 7


def _conv_inputs(seed=0, channel_last=False):
    g = torch.Generator().manual_seed(seed)
    b, d, L, w = 2, 12, 37, 4
    x = torch.randn(b, L, d, generator=g).transpose(1, 2) if channel_last else torch.randn(
        b, d, L, generator=g)  # fmt: skip
    return x, torch.randn(d, w, generator=g), torch.randn(d, generator=g)


@pytest.mark.parametrize("channel_last", [False, True])
def test_conv_cpp_functions(channel_last):
    x, w, bias = _conv_inputs(channel_last=channel_last)
    fin = torch.full((2, 12, 3), float("nan"))
    out = abi.causal_conv1d_fwd_function(x, w, bias, None, None, fin, True)
    want, want_fin = causal_conv1d_fn(x, w, bias, return_final_states=True, activation="silu")
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(fin, want_fin)
    # the backward writes dx into the caller's buffer: here a view into a packed gradient
    xl, wl, bl = (t.clone().requires_grad_() for t in (x, w, bias))
    y = causal_conv1d_fn(xl, wl, bl, activation="silu")
    dout = torch.randn_like(y)
    gx, gw, gb = torch.autograd.grad(y, (xl, wl, bl), dout)
    packed = torch.full((2, 24, 37), float("nan"))
    dx = packed[:, 12:]
    res = abi.causal_conv1d_bwd_function(x, w, bias, dout, None, None, None, dx, False, True)
    assert res[0] is dx and res[3] is None
    torch.testing.assert_close(packed[:, 12:], gx)
    assert torch.isnan(packed[:, :12]).all()  # nothing written outside the view
    torch.testing.assert_close(res[1], gw)
    torch.testing.assert_close(res[2], gb)


def test_conv_bwd_initial_states_gradient_without_initial_states():
    x, w, bias = _conv_inputs(seed=3)
    init = torch.zeros(2, 12, 3, requires_grad=True)
    y = causal_conv1d_fn(x, w, bias, initial_states=init)
    dout = torch.randn_like(y)
    (want,) = torch.autograd.grad(y, (init,), dout)
    res = abi.causal_conv1d_bwd_function(x, w, bias, dout, None, None, None, None, True, False)
    torch.testing.assert_close(res[3], want)


def test_conv_update_function():
    x, w, bias = _conv_inputs(seed=4)
    state = torch.randn(2, 12, 3)
    s2 = state.clone()
    out = abi.causal_conv1d_update_function(x[:, :, 0], state, w, bias, True, None, None)
    want = causal_conv1d_update(x[:, :, 0], s2, w, bias, "silu")
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(state, s2)
