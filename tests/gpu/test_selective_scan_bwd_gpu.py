"""The selective scan's backward kernel (csrc/selective_scan_bwd.hip) on a GPU against float64
autograd through the ground truth (``selective_scan_ref``): every dtype, dstate from 1 to 256,
fixed / variable / grouped B and C (also grouped with different counts), seqlens around the
chunk edges (1, 7, 127, 129, 255, 257, odd ones), with and without z, D, delta_bias, softplus
and the last state's gradient, a long sequence (the state and its adjoint carried across many
chunks), poisoned outputs, bit-identical reruns, and the training entry points (eager autograd,
torch.compile) reaching the kernel.

The backward is called directly (``ops._bwd_impl``, what the op's autograd formula calls), with
the PyTorch tier's stand-in refused, so a silent fallback fails instead of passing."""

import pytest
import torch
from helpers import (
    DTYPES,
    assert_bit_identical_runs,
    check_grads,
    gpu_available,
    poison_allocator,
    refuse_fallback,
    seeded,
)

from mamba2_rocm import selective_scan_fn
from mamba2_rocm.ops import selective_scan as ops
from mamba2_rocm.reference.selective_scan import selective_scan_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not gpu_available(), reason="needs a GPU (run on the device machine)"),
]

DEV = "cuda"
NAMES = ("du", "ddelta", "dA", "dB", "dC", "dD", "dz", "ddelta_bias")
#: error bound relative to the largest reference gradient (inputs rounded to the dtype on both
#: sides; the kernel's outputs are rounded to it, its sums are fp32)
GTOL = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}


@pytest.fixture(autouse=True)
def kernel_only(monkeypatch):
    monkeypatch.setenv("MAMBA2_ROCM_BACKEND", "kernel")
    refuse_fallback(monkeypatch, ops, "_torch_grads")


def _inputs(g, b, d, L, n, bmode, cmode, dtype, *, z=True, D=True, bias=True, dlast=True,
            groups=(3, 3)):  # fmt: skip
    """u / delta / z / dout in dtype, the weights float32; delta and delta_bias >= 0 so the
    state decays also without softplus."""
    r = lambda *s: torch.randn(*s, device=DEV, generator=g)  # noqa: E731

    def bc(mode, gr):
        return r(*{"fixed": (d, n), "var": (b, n, L), "grouped": (b, gr, n, L)}[mode])

    t = dict(
        u=r(b, d, L).to(dtype), delta=(torch.rand(b, d, L, device=DEV, generator=g) * 0.5).to(dtype),
        A=-torch.rand(d, n, device=DEV, generator=g) * 2 - 0.1,
        B=bc(bmode, groups[0]), C=bc(cmode, groups[1]), D=r(d) if D else None,
        z=r(b, d, L).to(dtype) if z else None,
        delta_bias=r(d).abs() * 0.2 if bias else None,
    )  # fmt: skip
    dout = r(b, d, L).to(dtype)
    dl = r(b, d, n) if dlast else None
    return t, dout, dl


def _reference(t, softplus, dout, dlast):
    """float64 autograd through the ground truth; None for an absent input."""
    leaves = {k: None if v is None else v.double().requires_grad_() for k, v in t.items()}
    out, last = selective_scan_ref(**leaves, delta_softplus=softplus, return_last_state=True)
    outs, gs = [out], [dout.double()]
    if dlast is not None:
        outs.append(last)
        gs.append(dlast.double())
    torch.autograd.backward(outs, gs)
    return [None if v is None else v.grad for v in leaves.values()]


def _run(t, softplus, dout, dlast):
    return ops._bwd_impl(t["u"], t["delta"], t["A"], t["B"], t["C"], t["D"], t["z"],
                         t["delta_bias"], softplus, dout, dlast)  # fmt: skip


def _check(t, softplus, dout, dlast, dtype):
    poison_allocator(64 << 20)
    got = _run(t, softplus, dout, dlast)
    for g, v in zip(got, t.values(), strict=True):  # each gradient in its input's dtype
        assert v is None or g.dtype == v.dtype
    check_grads(NAMES, got, _reference(t, softplus, dout, dlast), GTOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("b", "d", "L", "n"), [(2, 13, 301, 16), (1, 9, 129, 1),
                                               (2, 10, 257, 17), (1, 20, 7, 64),
                                               (1, 6, 512, 100), (2, 5, 255, 256),
                                               (3, 8, 1, 16), (1, 24, 1000, 16)])  # fmt: skip
@pytest.mark.parametrize(("bmode", "cmode"), [("var", "var"), ("fixed", "grouped"),
                                              ("grouped", "fixed"), ("fixed", "fixed")])  # fmt: skip
def test_matches_reference(dtype, b, d, L, n, bmode, cmode):
    g = seeded("ss bwd", dtype, b, d, L, n, bmode, cmode, device=DEV)
    groups = (d if d % 3 else 3, d if d % 3 else 3)  # groups dividing d
    t, dout, dl = _inputs(g, b, d, L, n, bmode, cmode, dtype, groups=groups)
    _check(t, True, dout, dl, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("groups", [(1, 4), (4, 2), (2, 8)])
def test_groups_of_b_and_c_differ(dtype, groups):
    """B and C grouped differently: a block's channels lie in one group of each (the finer
    grouping lays out the grid), the partials are summed back to each tensor's groups."""
    g = seeded("ss bwd groups", dtype, groups, device=DEV)
    t, dout, dl = _inputs(g, 2, 40, 300, 16, "grouped", "grouped", dtype, groups=groups)
    _check(t, True, dout, dl, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("opts", [{}, {"z": False}, {"D": False, "bias": False},
                                  {"dlast": False}, {"z": False, "D": False, "bias": False,
                                                     "dlast": False}])  # fmt: skip
@pytest.mark.parametrize("softplus", [False, True])
def test_optional_inputs(dtype, opts, softplus):
    g = seeded("ss bwd opts", dtype, sorted(opts), softplus, device=DEV)
    t, dout, dl = _inputs(g, 2, 11, 270, 16, "var", "var", dtype, **opts)
    _check(t, softplus, dout, dl, dtype)


def test_many_slices_and_channels():
    """More channels than one block's slice: the slices' partials (read-modify-write over a
    slice's channel groups) and the host's sums over them."""
    g = seeded("ss bwd slices", device=DEV)
    t, dout, dl = _inputs(g, 1, 300, 200, 16, "var", "grouped", torch.float32, groups=(1, 3))
    _check(t, True, dout, dl, torch.float32)


def test_long_sequence():
    """16384 tokens: the state and the adjoint carried across 64-128 chunks."""
    g = seeded("ss bwd long", device=DEV)
    t, dout, dl = _inputs(g, 1, 4, 16384, 16, "var", "var", torch.float32)
    _check(t, True, dout, dl, torch.float32)


@pytest.mark.parametrize("range_tokens", [128, 512, 768, 1 << 20])
def test_chunk_ranges_of_any_length(range_tokens, monkeypatch):
    """The gradients' blocks take each range's carry from the carries' kernel and chain it
    through the range's chunks: ranges of several chunks (as on AMD, where a chunk is 128
    tokens), more ranges than chunks (the empty ones still write their dD / ddelta_bias
    partials, as zeros: the buffers are poisoned), and one range for the whole sequence (the
    carries' kernel walks no adjoint back; the last state's gradient enters directly)."""
    monkeypatch.setattr(ops, "_BWD_RANGE", range_tokens)
    g = seeded("ss bwd ranges", range_tokens, device=DEV)
    t, dout, dl = _inputs(g, 2, 13, 1000, 16, "var", "fixed", torch.float32)
    _check(t, True, dout, dl, torch.float32)


def test_bit_identical_runs():
    g = seeded("ss bwd det", device=DEV)
    t, dout, dl = _inputs(g, 2, 40, 700, 16, "var", "grouped", torch.bfloat16, groups=(1, 4))
    assert_bit_identical_runs(lambda: _run(t, True, dout, dl))


@pytest.mark.parametrize("compiled", [False, True])
def test_training_reaches_the_kernel(compiled):
    """selective_scan_fn under autograd (eager, and compiled with fullgraph) gives the kernel's
    gradients: the PyTorch tier's stand-in is refused by the fixture."""
    g = seeded("ss bwd train", compiled, device=DEV)
    t, dout, dl = _inputs(g, 2, 12, 190, 16, "var", "fixed", torch.bfloat16)
    leaves = {k: v.detach().clone().requires_grad_() for k, v in t.items()}

    def loss(**kw):
        out, last = selective_scan_fn(**kw, delta_softplus=True, return_last_state=True)
        return (out.float() * dout.float()).sum() + (last * dl).sum()

    fn = torch.compile(loss, fullgraph=True) if compiled else loss
    got = torch.autograd.grad(fn(**leaves), list(leaves.values()))
    want = _run(t, True, dout, dl)
    for name, a, e in zip(NAMES, got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=2e-2, atol=2e-2 * e.abs().max().item(), msg=name)
