"""selective_state_update kernel vs the float64 reference on a GPU (both forms, all dtypes)."""

import pytest
import torch
from helpers import gpu_available, seeded

from mamba2_rocm import selective_state_update
from mamba2_rocm.reference.ssd import selective_state_update_ref, ssd_sequential

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs a GPU")]
DEV = "cuda"
# mamba_ssm's state-update tolerances: fp32 1e-3 (ours tighter), fp16 1e-2/5e-2, bf16 1e-2/5e-2
TOL = {torch.float32: (3e-4, 1e-3), torch.float16: (1e-2, 5e-2), torch.bfloat16: (1e-2, 5e-2)}


def _make(g, b, h, p, n, groups, xdt, sdt, tied, pool=None):
    pool = pool or b
    r = lambda *s: torch.randn(*s, device=DEV, generator=g)  # noqa: E731
    A_h = -torch.rand(h, device=DEV, generator=g) - 0.1
    dt_h = torch.rand(b, h, device=DEV, generator=g)
    bias_h, D_h = r(h) * 0.5, r(h)
    if tied:  # what HF transformers passes: per-head values broadcast with stride 0
        A = A_h[:, None, None].expand(h, p, n)
        dt = dt_h[:, :, None].expand(b, h, p).to(xdt)
        dt_bias, D = bias_h[:, None].expand(h, p), D_h[:, None].expand(h, p)
    else:
        A, dt, dt_bias, D = (
            -torch.rand(h, p, n, device=DEV, generator=g),
            r(b, h, p).to(xdt),
            r(h, p),
            r(h, p),
        )
    return dict(
        state=r(pool, h, p, n).to(sdt), x=r(b, h, p).to(xdt), dt=dt, A=A, B=r(b, groups, n).to(xdt),
        C=r(b, groups, n).to(xdt), D=D, z=r(b, h, p).to(xdt), dt_bias=dt_bias,
    )  # fmt: skip


@pytest.fixture(params=["wide kernel", "per-row kernel"])
def kernel_choice(request, monkeypatch):
    """Both contiguous-layout kernels, whatever the shapes: the wide one (several rows per
    thread) is otherwise picked for big batches."""
    from mamba2_rocm.ops import state_update

    for name in ("WIDE_KERNEL_MIN_BLOCKS", "STD_WIDE_KERNEL_MIN_BLOCKS"):
        monkeypatch.setattr(state_update, name, 0 if request.param == "wide kernel" else 1 << 40)
    return request.param


@pytest.mark.parametrize("n", [16, 64, 128, 256])
@pytest.mark.parametrize("xdt", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("sdt", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tied", [False, True])
def test_multihead(n, xdt, sdt, tied, kernel_choice):
    g = seeded("mh", n, str(xdt), str(sdt), tied, device=DEV)
    groups = 1 if n == 16 else (2 if n == 64 else 8)
    args = _make(g, 5, 8, 24, n, groups, xdt, sdt, tied)
    ref_state = args["state"].clone()
    ref = selective_state_update_ref(
        **{**args, "state": ref_state}, dt_softplus=True, compute_dtype=torch.float64
    )
    torch.cuda.caching_allocator_alloc  # noqa: B018 - allocator in use below
    poison = torch.full((args["x"].numel() + 64,), float("nan"), device=DEV)
    del poison
    out = selective_state_update(**args, dt_softplus=True)
    rtol, atol = TOL[xdt if xdt != torch.float32 else sdt]
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    srtol, satol = TOL[sdt]
    torch.testing.assert_close(args["state"], ref_state, rtol=srtol, atol=satol)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16], ids=str)
def test_mamba1_form(dt, kernel_choice):
    g = seeded("m1", str(dt), device=DEV)
    b, d, n = 4, 200, 16
    args = dict(
        state=torch.randn(b, d, n, device=DEV, generator=g), x=torch.randn(b, d, device=DEV, generator=g).to(dt),
        dt=torch.rand(b, d, device=DEV, generator=g).to(dt), A=-torch.rand(d, n, device=DEV, generator=g),
        B=torch.randn(b, n, device=DEV, generator=g).to(dt), C=torch.randn(b, n, device=DEV, generator=g).to(dt),
        D=torch.randn(d, device=DEV, generator=g), z=torch.randn(b, d, device=DEV, generator=g).to(dt),
        dt_bias=torch.randn(d, device=DEV, generator=g),
    )  # fmt: skip
    ref_state = args["state"].clone()
    ref = selective_state_update_ref(
        **{**args, "state": ref_state}, dt_softplus=True, compute_dtype=torch.float64
    )
    out = selective_state_update(**args, dt_softplus=True)
    torch.testing.assert_close(out, ref, rtol=TOL[dt][0], atol=TOL[dt][1])
    torch.testing.assert_close(args["state"], ref_state, rtol=3e-4, atol=1e-3)


def test_pool_indices_and_padding(kernel_choice):
    g = seeded("pool", device=DEV)
    args = _make(g, 4, 4, 16, 64, 2, torch.bfloat16, torch.float32, True, pool=9)
    idx = torch.tensor([7, -1, 0, 3], dtype=torch.int32, device=DEV)
    before = args["state"].clone()
    ref_state = before.clone()
    ref = selective_state_update_ref(
        **{**args, "state": ref_state}, state_batch_indices=idx, compute_dtype=torch.float64
    )
    out = selective_state_update(**args, state_batch_indices=idx)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    untouched = [1, 2, 4, 5, 6, 8]
    assert torch.equal(args["state"][untouched], before[untouched])
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=5e-2)
    torch.testing.assert_close(args["state"], ref_state, rtol=3e-4, atol=1e-3)
    bad = torch.tensor([9, 0, 0, 0], dtype=torch.int32, device=DEV)
    out = selective_state_update(**{**args, "state": before.clone()}, state_batch_indices=bad)
    assert out[0].isnan().all(), "an out-of-range index must be loud"


@pytest.mark.parametrize("params", ["float32", "bfloat16 D", "float32 dt"])
@pytest.mark.parametrize("xdt", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_rows_std_kernel(params, xdt, monkeypatch):
    """A Mamba2 block's parameters (tied float32 A, float32 D / dt_bias, dt in x's dtype) take
    the per-row kernel with their dtypes fixed at compile time (_rows_std), any other the one
    reading them as passed; both match the reference, and the state only changes where it should."""
    from mamba2_rocm.ops import state_update

    monkeypatch.setattr(state_update, "WIDE_KERNEL_MIN_BLOCKS", 1 << 40)
    g = seeded("std", params, str(xdt), device=DEV)
    args = _make(g, 3, 6, 40, 64, 2, xdt, torch.bfloat16, True)
    if params == "bfloat16 D":
        args["D"] = args["D"].bfloat16()
    elif params == "float32 dt" and xdt != torch.float32:
        args["dt"] = args["dt"].float()
    std = params == "float32" or (xdt == torch.float32 and params == "float32 dt")
    ref_state = args["state"].clone()
    ref = selective_state_update_ref(
        **{**args, "state": ref_state}, dt_softplus=True, compute_dtype=torch.float64
    )
    out = selective_state_update(**args, dt_softplus=True)
    assert state_update._last[1].kernel.rows[0].endswith("_rows_std" if std else "_rows")
    rtol, atol = TOL[xdt if xdt != torch.float32 else torch.bfloat16]
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(args["state"], ref_state, rtol=1e-2, atol=5e-2)


@pytest.mark.parametrize("far", ["pool rows", "batch rows of x and B"])
def test_offsets_past_int32_between_rows(far, kernel_choice):
    """The _rows kernels index within a batch row in 32 bits and move to the row in 64 (the
    _contig kernels all in 64): a pool whose rows lie past 2^31 elements (4.3 GB of bf16
    states), and x / B whose batch rows do, are read and written where they are, by both. The
    pool row between two updated ones is left alone."""
    g = seeded("far", far, device=DEV)
    h, p, n = 2, 64, 128
    args = _make(g, 3, h, p, n, 1, torch.bfloat16, torch.bfloat16, True)
    idx = None
    if far == "pool rows":
        pool = (1 << 31) // (h * p * n) + 3  # rows pool - 3 .. pool - 1 start past 2^31 elements
        state = torch.empty(pool, h, p, n, dtype=torch.bfloat16, device=DEV)
        idx = torch.tensor([pool - 1, 0, pool - 3], dtype=torch.int32, device=DEV)
        state[idx.long()] = args["state"]
        state[pool - 2] = 7.0
        args["state"] = state
        ref_state = args["state"][idx.long()].clone()
        ref_args = {**args, "state": ref_state}
    else:
        far_rows = []
        for name in ("x", "B"):
            t = args[name]
            buf = torch.empty(2 * (1 << 30) + t[0].numel(), dtype=t.dtype, device=DEV)
            view = buf.as_strided(t.shape, (1 << 30, *t.stride()[1:]))  # batch row 2 at 2^31
            view.copy_(t)
            args[name] = view
            far_rows.append(view)
        ref_state = args["state"].clone()
        ref_args = {**args, "state": ref_state, "x": far_rows[0].clone(), "B": far_rows[1].clone()}
    ref = selective_state_update_ref(**ref_args, dt_softplus=True, compute_dtype=torch.float64)
    out = selective_state_update(**args, dt_softplus=True, state_batch_indices=idx)
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=5e-2)
    got = args["state"][idx.long()] if idx is not None else args["state"]
    torch.testing.assert_close(got, ref_state, rtol=1e-2, atol=5e-2)
    if idx is not None:
        assert (args["state"][-2] == 7.0).all()


def test_decode_continues_the_scan():
    """Scan a prefix, then step token by token: equals the scan over the whole sequence."""
    g = seeded("decode", device=DEV)
    b, L, h, p, n, groups, prefix = 2, 40, 4, 16, 32, 2, 25
    x = torch.randn(b, L, h, p, device=DEV, generator=g)
    dt = torch.rand(b, L, h, device=DEV, generator=g)
    A = -torch.rand(h, device=DEV, generator=g)
    B = torch.randn(b, L, groups, n, device=DEV, generator=g)
    C = torch.randn(b, L, groups, n, device=DEV, generator=g)
    D = torch.randn(h, device=DEV, generator=g)
    full = ssd_sequential(x, dt, A, B, C, D=D, dt_softplus=True)
    _, state = ssd_sequential(x[:, :prefix], dt[:, :prefix], A, B[:, :prefix], C[:, :prefix], D=D,
                              dt_softplus=True, return_final_states=True)  # fmt: skip
    state = state.float().contiguous()
    for t in range(prefix, L):
        y = selective_state_update(
            state, x[:, t], dt[:, t, :, None].expand(b, h, p), A[:, None, None].expand(h, p, n), B[:, t], C[:, t],
            D=D[:, None].expand(h, p), dt_softplus=True,
        )  # fmt: skip
        torch.testing.assert_close(y, full[:, t], rtol=1e-3, atol=1e-3)


def test_graph_capture(kernel_choice):
    g = seeded("graph", device=DEV)
    args = _make(g, 8, 8, 16, 128, 8, torch.bfloat16, torch.bfloat16, True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        selective_state_update(**{**args, "state": args["state"].clone()}, dt_softplus=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = selective_state_update(**args, dt_softplus=True)
    for _ in range(2):
        args["x"].copy_(torch.randn(args["x"].shape, device=DEV, generator=g))
        ref_state = args["state"].clone()
        ref = selective_state_update_ref(
            **{**args, "state": ref_state}, dt_softplus=True, compute_dtype=torch.float64
        )
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, ref, rtol=1e-2, atol=5e-2)
        torch.testing.assert_close(args["state"], ref_state, rtol=1e-2, atol=5e-2)


@pytest.mark.parametrize("n", [64, 100])
def test_strided_state_and_odd_dstate(n):
    """A state with a non-unit dstate stride, and a dstate that fills no tier: the general path."""
    g = seeded("strided", n, device=DEV)
    args = _make(g, 3, 4, 16, n, 2, torch.bfloat16, torch.float32, False)
    big = torch.randn(3, 4, 16, 2 * n, device=DEV, generator=g)
    args["state"] = big[..., ::2]
    ref_state = args["state"].clone()
    ref = selective_state_update_ref(
        **{**args, "state": ref_state}, dt_softplus=True, compute_dtype=torch.float64
    )
    untouched = big[..., 1::2].clone()
    out = selective_state_update(**args, dt_softplus=True)
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=5e-2)
    torch.testing.assert_close(args["state"], ref_state, rtol=3e-4, atol=1e-3)
    assert torch.equal(big[..., 1::2], untouched), "only the state's own elements may be written"
