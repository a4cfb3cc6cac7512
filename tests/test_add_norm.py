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


# ---- the registered ops (the kernel tier's entry points), on the CPU's torch tier ----------

from mamba2_rocm.kernels import ADD_NORM_BWD_RUNS, ADD_NORM_FWD_RUNS, SOURCES  # noqa: E402
from mamba2_rocm.ops import add_norm as ops  # noqa: E402

CASES = {  # name -> (x1, weight1, rowscale, dropout, residual, bias)
    "plain": (False, False, False, False, False, False),
    "residual+bias": (False, False, False, False, True, True),
    "x1+weight1": (True, True, False, False, True, True),
    "x1 alone": (True, False, False, False, True, False),
    "rowscale": (False, False, True, False, True, True),
    "dropout": (True, True, False, True, True, False),
    "dropout+rowscale": (False, False, True, True, False, True),
}


def _op_args(case, is_rms, dtype=torch.float64, shape=(3, 5, 37), seed=0, residual_in_fp32=False):
    x1, w1, rs, drop, res, bias = CASES[case]
    t = _inputs(shape, dtype, seed)
    t = {k: v.to(dtype) for k, v in t.items()}
    g = torch.Generator().manual_seed(seed + 1)
    p = 0.25 if drop else 0.0
    mask = torch.rand(shape, generator=g) >= p if drop else None
    mask1 = torch.rand(shape, generator=g) >= p if drop and x1 else None
    return (t["x"], t["weight"], t["bias"] if bias else None, t["residual"] if res else None,
            t["x1"] if x1 else None, t["weight1"] if w1 else None,
            t["bias1"] if w1 and bias else None, t["rowscale"] if rs else None, mask, mask1,
            1e-5, p, residual_in_fp32, is_rms)  # fmt: skip


@pytest.mark.parametrize("is_rms", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_registered_op_gradients_equal_autograd(case, is_rms):
    """The closed-form backward (add_norm_bwd, the kernels' formula) through the registered
    op's autograd equals autograd through the float64 torch tier, for every input."""
    args = _op_args(case, is_rms)
    leaves = [a.clone().requires_grad_() if isinstance(a, torch.Tensor) and a.dtype != torch.bool
              and i < 7 else a for i, a in enumerate(args)]  # fmt: skip
    y, y1, stream, _, _ = ops.add_norm_fwd(*leaves)
    g = torch.Generator().manual_seed(9)
    dy, dstream = (
        torch.randn(y.shape, generator=g).double(),
        torch.randn(y.shape, generator=g).double(),
    )
    loss = (y * dy).sum() + (stream * dstream).sum()
    if y1.numel():
        loss = loss + (y1 * dy * 0.5).sum()
    diff = [a for a in leaves[:7] if isinstance(a, torch.Tensor)]
    got = torch.autograd.grad(loss, diff)

    x, weight, bias, residual, x1, weight1, bias1, rowscale, mask, mask1, eps, p, _, _ = leaves
    want_y, want_y1, want_s = ops.add_norm_torch(
        x, weight, bias, residual, x1, weight1, bias1, eps, p, rowscale, torch.float64, is_rms,
        mask, mask1, torch.float64)  # fmt: skip
    want_loss = (want_y * dy).sum() + (want_s * dstream).sum()
    if want_y1 is not None:
        want_loss = want_loss + (want_y1 * dy * 0.5).sum()
    want = torch.autograd.grad(want_loss, diff)
    for a, b in zip(got, want, strict=False):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", ["plain", "x1+weight1", "dropout+rowscale"])
def test_opcheck(case):
    """torch.library.opcheck: schema, fake tensors, autograd registration, AOT dispatch."""
    for dtype in (torch.float32, torch.float64):
        args = _op_args(case, False, dtype=dtype, shape=(4, 24))
        grads = [a.clone().requires_grad_() if isinstance(a, torch.Tensor) and i < 7
                 and a.dtype != torch.bool else a for i, a in enumerate(args)]  # fmt: skip
        torch.library.opcheck(ops.add_norm_fwd, tuple(grads))
        y, y1, stream, mean, rstd = ops.add_norm_fwd(*args)
        has_res, has_x1 = args[3] is not None, args[4] is not None
        bwd = (torch.ones_like(y), torch.ones_like(y1) if y1.numel() else None,
               torch.ones_like(stream), stream, args[1], args[2], args[5], args[6], args[7],
               args[8], args[9], mean, rstd, args[11], False, has_res, has_x1)  # fmt: skip
        torch.library.opcheck(ops.add_norm_bwd, bwd)


def test_op_outputs_and_dtypes():
    """y / y1 in x's dtype, the stream in the residual dtype (float32 with residual_in_fp32),
    mean / rstd per row; y1 and mean empty where absent."""
    args = list(_op_args("plain", True, dtype=torch.bfloat16, shape=(2, 3, 16)))
    args[12] = True  # residual_in_fp32
    y, y1, stream, mean, rstd = ops.add_norm_fwd(*args)
    assert y.dtype == torch.bfloat16 and stream.dtype == torch.float32
    assert y1.numel() == 0 and mean.numel() == 0 and rstd.shape == (2, 3)
    args = list(_op_args("x1+weight1", False, dtype=torch.float16, shape=(2, 3, 16)))
    y, y1, stream, mean, rstd = ops.add_norm_fwd(*args)
    assert y1.shape == y.shape and mean.shape == (2, 3) and stream.dtype == torch.float16


def test_row_plan():
    """The register forms: the fewest runs a thread within 256 threads (64-thread steps); the
    generic kernel past 8 runs (forward) / 4 (backward, which has a 3-run form too), or for
    hidden not a multiple of 4."""
    assert ops.row_plan(768, ADD_NORM_FWD_RUNS) == (1, 192)
    assert ops.row_plan(2048, ADD_NORM_FWD_RUNS) == (2, 256)
    assert ops.row_plan(4096, ADD_NORM_FWD_RUNS) == (4, 256)
    assert ops.row_plan(8192, ADD_NORM_FWD_RUNS) == (8, 256)
    assert ops.row_plan(8196, ADD_NORM_FWD_RUNS) is None
    assert ops.row_plan(4096, ADD_NORM_BWD_RUNS) == (4, 256)
    assert ops.row_plan(5120, ADD_NORM_BWD_RUNS) is None
    assert ops.row_plan(2560, ADD_NORM_BWD_RUNS) == (3, 256)  # (4 runs: 192 threads)
    assert ops.row_plan(4, ADD_NORM_FWD_RUNS) == (1, 64)
    assert ops.row_plan(770, ADD_NORM_FWD_RUNS) is None
    names = set(SOURCES["add_norm"].kernels)
    for d, runs in (("fwd", ADD_NORM_FWD_RUNS), ("bwd", ADD_NORM_BWD_RUNS)):
        for dt in ("f32", "f16", "bf16"):
            assert f"m2r_add_norm_{d}_{dt}" in names
            assert {f"m2r_add_norm_{d}_{dt}_r{r}" for r in runs} <= names


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda a: a.__setitem__(8, None) or a.__setitem__(11, 0.5), "dropout_p > 0 needs mask"),
        (lambda a: a.__setitem__(8, torch.ones(3, 5, 37)), "mask must be a bool tensor"),
        (lambda a: a.__setitem__(8, torch.ones(3, 5, 36, dtype=torch.bool)), "mask must be a bool"),
        (
            lambda a: a.__setitem__(1, torch.ones(36, dtype=torch.float64)),
            r"weight must be \(37,\)",
        ),
        (lambda a: a.__setitem__(0, torch.ones(3, 5, 37, dtype=torch.int32)), "x must be float"),
    ],
)
def test_op_bad_inputs(change, match):
    args = list(_op_args("residual+bias", False))
    change(args)
    with pytest.raises((ValueError, TypeError), match=match):
        ops.add_norm_fwd(*args)


def test_bwd_op_bad_inputs():
    args = _op_args("plain", True)
    y, _, stream, mean, rstd = ops.add_norm_fwd(*args)
    base = [y, None, None, stream, args[1], None, None, None, None, None, None, mean, rstd, 0.0,
            True, False, False]  # fmt: skip
    bad = list(base)
    bad[1] = torch.ones_like(y)  # dy1 without weight1
    with pytest.raises(ValueError, match="dy1 was given without weight1"):
        ops.add_norm_bwd(*bad)
    bad = list(base)
    bad[12] = rstd[:1]
    with pytest.raises(ValueError, match=r"rstd must be \(3, 5\)"):
        ops.add_norm_bwd(*bad)
    bad = list(base)
    bad[3] = stream[..., :-1]
    with pytest.raises(ValueError, match="stream must have x's shape"):
        ops.add_norm_bwd(*bad)


def test_kernel_tier_launch_plans(monkeypatch):
    """On a stand-in kernel tier: the register form for aligned rows (the block size the plan
    names), the generic form for odd hidden, the backward's generic form for dropout / x1
    calls, the reduce launch after it; every parameter tuple packs into AddNormParams."""
    from helpers import stand_in_kernels

    from mamba2_rocm.params import AddNormParams, packer

    kset = stand_in_kernels(monkeypatch, ops)
    pack = packer(AddNormParams).pack
    x, w = torch.randn(5, 768, dtype=torch.bfloat16), torch.ones(768)
    res = torch.randn(5, 768)
    ops._fwd_run(x, w, None, res, None, None, None, None, None, None, 1e-5, 0.0, False, True,
                 True, kset)  # fmt: skip
    (name, params, grid), block = kset.launches[-1], kset.blocks[-1]
    assert (name, grid, block) == ("m2r_add_norm_fwd_bf16_r1_plain", (5, 1, 1), (192, 1, 1))
    pack(*params)
    fields = dict(zip([f for f, _ in AddNormParams._fields_], params, strict=False))
    assert fields["rows"] == 5 and fields["hidden"] == 768 and fields["stream_dtype"] == 0
    assert fields["mean"] == 0 and fields["rstd"] != 0 and fields["layer_norm"] == 0
    # any of x1 / weight1, rowscale, dropout: the register form that reads them
    x1, mask = torch.randn_like(x), torch.ones(5, 768, dtype=torch.bool)
    for extra in ({"x1": x1}, {"weight1": w}, {"rowscale": torch.ones(5)}, {"mask": mask}):
        a = dict(x1=None, weight1=None, rowscale=None, mask=None)
        a.update(extra)
        ops._fwd_run(x, w, None, res, a["x1"], a["weight1"], None, a["rowscale"], a["mask"], None,
                     1e-5, 0.1 if "mask" in extra else 0.0, False, True, True, kset)  # fmt: skip
        assert kset.launches[-1][0] == "m2r_add_norm_fwd_bf16_r1", extra
        pack(*kset.launches[-1][1])

    ops._fwd_run(x[:, :767], w[:767], None, None, None, None, None, None, None, None, 1e-5, 0.0,
                 False, False, False, kset)  # fmt: skip
    assert kset.launches[-1][0] == "m2r_add_norm_fwd_bf16" and kset.blocks[-1] == (256, 1, 1)
    assert (
        dict(zip([f for f, _ in AddNormParams._fields_], kset.launches[-1][1], strict=False))[
            "stream"
        ]
        == 0
    )

    stream, mean, rstd = torch.randn(5, 768), torch.zeros(5), torch.ones(5)
    bwd = (x, None, None, stream, w, None, None, None, None, None, None, mean, rstd, 0.0, False,
           True, False)  # fmt: skip
    ops._bwd_impl(*bwd)
    (n1, p1, _), (n2, p2, g2) = kset.launches[-2:]
    assert (n1, n2) == ("m2r_add_norm_bwd_bf16_r1", "m2r_add_norm_bwd_reduce")
    assert g2 == (768 * 4 // 16, 1, 1) and p1 == p2
    pack(*p1)
    mask = torch.ones(5, 768, dtype=torch.bool)
    ops._bwd_impl(*bwd[:9], mask, None, mean, rstd, 0.1, False, True, False)
    assert kset.launches[-2][0] == "m2r_add_norm_bwd_bf16"


def test_backward_grid_is_the_resident_block_count():
    """bwd_row_blocks: the runtime's resident blocks a multiprocessor times the multiprocessors
    (one wave), at most a block a row; BWD_BLOCKS_PER_SM where the runtime cannot tell."""

    class Launcher:
        def __init__(self, n):
            self.n = n

        def resident_blocks(self, threads):
            return self.n

    assert ops.bwd_row_blocks(16384, Launcher(6), 192, 132) == 792
    assert ops.bwd_row_blocks(100, Launcher(6), 192, 132) == 100
    assert ops.bwd_row_blocks(16384, Launcher(None), 256, 132) == ops.BWD_BLOCKS_PER_SM * 132
    assert ops.bwd_row_blocks(16384, lambda *a: None, 256, 0) == ops.BWD_BLOCKS_PER_SM
