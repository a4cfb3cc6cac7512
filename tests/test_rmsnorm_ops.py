"""Gated RMSNorm through the public op and module on the CPU."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import seeded

from mamba2_rocm import RMSNorm, rmsnorm_fn
from mamba2_rocm.ops import rmsnorm as ops


def _direct(x, w, b, z, eps, gs, nbg):
    """The formula written out, in float64."""
    x, w = x.double(), w.double()
    if z is not None and not nbg:
        x = x * F.silu(z.double())
    g = x.reshape(*x.shape[:-1], -1, gs)
    y = (g / torch.sqrt((g * g).mean(-1, keepdim=True) + eps)).reshape(x.shape) * w
    if b is not None:
        y = y + b.double()
    if z is not None and nbg:
        y = y * F.silu(z.double())
    return y


@pytest.mark.parametrize("nbg", [True, False])
@pytest.mark.parametrize("gs", [None, 24])
@pytest.mark.parametrize("with_z", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
def test_fn_matches_formula(nbg, gs, with_z, with_bias):
    g = seeded("rms", nbg, gs, with_z, with_bias)
    x = torch.randn(3, 5, 96, generator=g)
    w = torch.randn(96, generator=g)
    b = torch.randn(96, generator=g) if with_bias else None
    z = torch.randn(3, 5, 96, generator=g) if with_z else None
    out = rmsnorm_fn(x, w, b, z=z, eps=1e-5, group_size=gs, norm_before_gate=nbg)
    torch.testing.assert_close(
        out.double(), _direct(x, w, b, z, 1e-5, gs or 96, nbg), rtol=1e-5, atol=1e-5
    )


def test_module():
    m = RMSNorm(64, eps=1e-5, group_size=16, norm_before_gate=False)
    assert m.bias is None and torch.equal(m.weight, torch.ones(64))
    g = seeded("module")
    x, z = torch.randn(2, 64, generator=g), torch.randn(2, 64, generator=g)
    expect = _direct(x, m.weight.detach(), None, z, 1e-5, 16, False)
    torch.testing.assert_close(m(x, z).double(), expect, rtol=1e-5, atol=1e-5)


def test_bad_inputs():
    x = torch.randn(2, 64)
    with pytest.raises(
        ValueError, match="group_size must divide hidden, got hidden=64, group_size=24"
    ):
        rmsnorm_fn(x, torch.ones(64), None, group_size=24)
    with pytest.raises(ValueError, match=r"weight must have shape \(hidden,\)"):
        rmsnorm_fn(x, torch.ones(63), None)


def test_opcheck_and_compile():
    x, w, z = torch.randn(4, 32), torch.randn(32), torch.randn(4, 32)
    torch.library.opcheck(ops.rmsnorm_fwd, (x, w, None, z, 1e-6, 8, True, True))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(x, z):
        return rmsnorm_fn(x, w, None, z=z, group_size=8)

    torch.testing.assert_close(f(x, z), rmsnorm_fn(x, w, None, z=z, group_size=8))


@pytest.mark.parametrize(
    "group_size, spread, dense",
    [
        # (a call of few runs per multiprocessor, one of many)
        (8, (1, 1), (1, 1)),  # one run: a thread per (row, group), 256 groups per block
        (24, (4, 1), (4, 1)),  # 3 runs: the power of two above
        (256, (32, 1), (32, 1)),  # up to 32 runs: one run a thread either way
        (512, (64, 1), (32, 2)),  # dense: at least 32 threads an item
        (1024, (128, 1), (32, 4)),
        (1536, (256, 1), (64, 3)),  # 192 runs: one each, or 64 x 3
        (2048, (256, 1), (64, 4)),
        (3072, (128, 3), (128, 3)),  # 384 runs: 128 x 3 (256 x 2 idles 128 thread-runs)
        (4096, (256, 2), (128, 4)),
        (5120, (256, 3), (256, 3)),  # 2.5 / 5 runs per thread round up to 3 (no v5)
        (6152, (256, 4), (256, 4)),
        (8192, (256, 4), (256, 4)),
        (8200, None, None),  # more than kThreads * 4 runs: the generic kernel
        (250, None, None),  # not whole 8-element runs
    ],
)
def test_vec_plan(group_size, spread, dense):
    few, many = ops.DENSE_RUNS_PER_SM - 1, ops.DENSE_RUNS_PER_SM
    assert ops.vec_plan(group_size, 2, (0, 4096, 16), few) == spread
    assert ops.vec_plan(group_size, 2, (0, 4096, 16), many) == dense
    assert ops.vec_plan(group_size, 2, (0, 4096, 16)) == dense  # no multiprocessor count: many


@pytest.mark.parametrize(
    "group_size, plan", [(1024, (64, 2)), (1536, (64, 3)), (4096, (256, 2)), (5120, (256, 3))]
)
def test_vec_plan_gate_after_holds_at_most_3_runs_a_thread_when_dense(group_size, plan):
    """The _ga kernels hold z's raw runs too: a dense call gives them at most 3 runs a thread."""
    assert ops.vec_plan(group_size, 2, (0,), ops.DENSE_RUNS_PER_SM, gate_after=True) == plan
    assert ops.vec_plan(
        group_size, 2, (0,), ops.DENSE_RUNS_PER_SM - 1, gate_after=True
    ) == ops.vec_plan(group_size, 2, (0,), ops.DENSE_RUNS_PER_SM - 1)


@pytest.mark.parametrize(
    "sms, hidden, nbg, kernel, blocks",
    [
        # 1024 x 192 runs, 49k a multiprocessor: 64 x 3, 4 rows a block
        (4, 1536, False, "_v3", 256),
        (1000, 1536, False, "_v1_b", 1024),  # 197 a multiprocessor: a run a thread
        (4, 4096, True, "_v2_ga_b", 1024),  # the gate after the norm: at most 3 runs (256 x 2)
        (4, 4096, False, "_v4_h", 512),  # 128 x 4, two rows a block
    ],
)
def test_the_launch_plans_by_the_calls_runs_per_multiprocessor(
    sms, hidden, nbg, kernel, blocks, monkeypatch
):
    """Both launch paths (the cached plan and ``_kernel``) give vec_plan the call's runs per
    multiprocessor (rows x hidden / 8 / multiprocessors; without a GPU, many)."""
    from helpers import stand_in_kernels

    kset = stand_in_kernels(monkeypatch, ops)
    monkeypatch.setattr(ops, "sm_count", lambda device: sms)
    ops.clear_plan_cache()
    try:
        x, z = torch.randn(1024, hidden).bfloat16(), torch.randn(1024, hidden).bfloat16()
        w = torch.randn(hidden).bfloat16()
        assert ops._runs_per_sm(x) == 1024 * hidden / 8 / sms
        out = rmsnorm_fn(x, w, None, z=z, norm_before_gate=nbg)
        ops._kernel(kset, x, w, None, z, 1e-6, hidden, nbg, False, out)
        for name, _, grid in kset.launches:
            assert name == "m2r_rmsnorm_fwd_bf16" + kernel and grid[0] == blocks
    finally:
        ops.clear_plan_cache()
    monkeypatch.setattr(ops, "sm_count", lambda device: 0)
    assert ops._runs_per_sm(x) == math.inf


@pytest.mark.parametrize(
    ("plan", "rows", "groups", "gate_after", "variant"),
    [
        ((256, 1), 5, 1, False, ("_v1_b", (5, 1, 1))),  # an item fills the block: _b
        ((256, 3), 5, 2, True, ("_v3_ga_b", (10, 1, 1))),
        ((128, 3), 5, 1, False, ("_v3_h", (3, 1, 1))),  # two items a block: _h
        ((128, 1), 5, 8, True, ("_v1_ga_h", (20, 1, 1))),
        ((64, 3), 5, 1, False, ("_v3", (2, 1, 1))),  # four items a block: the run-time sums
        ((1, 1), 300, 1, False, ("_v1", (2, 1, 1))),
    ],
)
def test_vec_variant(plan, rows, groups, gate_after, variant):
    """The kernels with threads per item fixed at compile time (_b: the whole block, _h: half)
    take exactly those plans; the others read it at run time."""
    assert ops._vec_variant(plan, rows, groups, gate_after) == variant


@pytest.mark.parametrize(
    "elem_size, addresses", [(4, (0,)), (2, (8,)), (2, (0, 16 * 3 + 2)), (2, (0, 32, 1))]
)
def test_vec_plan_needs_16_bit_elements_and_16_byte_alignment(elem_size, addresses):
    assert ops.vec_plan(1024, elem_size, addresses) is None


# --- the cached launch plan (decode calls repeat one layout every step) -----------------------


def _norm_case(kind, g):
    """(x, weight, bias, z, group_size) of one layout."""
    bf = torch.bfloat16
    if kind == "bf16 z":
        return torch.randn(3, 64, generator=g).to(bf), torch.randn(64, generator=g), None, \
            torch.randn(3, 64, generator=g).to(bf), 32  # fmt: skip
    if kind == "3d bias":
        return torch.randn(2, 5, 48, generator=g).to(bf), torch.randn(48, generator=g), \
            torch.randn(48, generator=g), None, None  # fmt: skip
    if kind == "row stride":  # rows 16-byte aligned, a view of every other row
        x = torch.randn(6, 64, generator=g).to(bf)[::2]
        return x, torch.randn(64, generator=g).to(bf), None, None, 64
    if kind == "misaligned":  # x starts 2 bytes into a 16-byte run: the general kernel
        x = torch.randn(3, 65, generator=g).to(bf)[:, 1:]
        return x, torch.randn(64, generator=g), None, None, 16
    if kind == "float32 z copy":  # float32 z for bf16 x: converted, so the uncached path
        return torch.randn(4, 32, generator=g).to(bf), torch.randn(32, generator=g), None, \
            torch.randn(4, 32, generator=g), None  # fmt: skip
    if kind == "transposed":  # rows not unit-stride: copied, the uncached path
        x = torch.randn(40, 3, generator=g).t()
        return x, torch.randn(40, generator=g), None, None, 8
    if kind == "strided weight":  # every other element of a longer weight: a dense copy
        w = torch.randn(64, generator=g).to(bf)[::2]
        return torch.randn(4, 32, generator=g).to(bf), w, None, None, 16
    raise AssertionError(kind)


_KINDS = ["bf16 z", "3d bias", "row stride", "misaligned", "float32 z copy", "transposed",
          "strided weight"]  # fmt: skip


@pytest.mark.parametrize("kind", _KINDS)
@pytest.mark.parametrize("nbg", [True, False])
def test_cached_launch_equals_the_uncached_one(kind, nbg, monkeypatch):
    """Every call of a cached layout launches what ``_kernel`` (no cache) computes for it."""
    from helpers import stand_in_kernels

    kset = stand_in_kernels(monkeypatch, ops)
    ops.clear_plan_cache()
    try:
        for step in range(3):
            x, w, b, z, gs = _norm_case(kind, seeded("norm-plan", kind, step))
            out = rmsnorm_fn(x, w, b, z=z, group_size=gs, norm_before_gate=nbg)
            got = kset.launches[-1]
            ops._kernel(kset, x, w, b, z, 1e-6, gs or x.shape[-1], nbg, False, out)
            want = kset.launches[-1]
            if kind in ("float32 z copy", "transposed"):  # copies: new addresses each time
                got, want = [(n, (0, 0, *p[2:]), g) for n, p, g in (got, want)]
            if kind == "strided weight":  # (the weight's copy)
                got, want = [(n, (*p[:2], 0, *p[3:]), g) for n, p, g in (got, want)]
            assert got == want
        assert len(ops._PLANS) == 1
        copied = ("float32 z copy", "transposed", "strided weight")
        assert (ops._PLANS.popitem()[1].fast is False) == (kind in copied)
    finally:
        ops.clear_plan_cache()


def test_cached_layout_skips_the_checks_but_never_a_bad_call(monkeypatch):
    from helpers import stand_in_kernels

    kset = stand_in_kernels(monkeypatch, ops)
    ops.clear_plan_cache()
    calls = []
    real = ops.check_rmsnorm_args
    monkeypatch.setattr(ops, "check_rmsnorm_args", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, w = torch.randn(3, 64), torch.randn(64)
    for _ in range(4):
        rmsnorm_fn(x, w, None)
    assert len(calls) == 1 and len(kset.launches) == 4
    with pytest.raises(ValueError, match="group_size must divide hidden"):  # another key: checked
        rmsnorm_fn(x, w, None, group_size=24)
    with pytest.raises(ValueError, match="weight"):
        rmsnorm_fn(x, w[:32], None)
    assert len(kset.launches) == 4
    ops.clear_plan_cache()


def test_opcheck_backward_op():
    """The norm's backward op on the CPU (the written-out formula): schema, fake tensor, no
    aliasing between outputs; z in another dtype than x gets its gradient in its own dtype."""
    from mamba2_rocm.ops import rmsnorm as ops

    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 40, generator=g)
    w, b = torch.randn(40, generator=g), torch.randn(40, generator=g)
    z = torch.randn(6, 40, generator=g, dtype=torch.float64)
    dout = torch.randn(6, 40, generator=g)
    for args in [
        (x, w, b, z, 1e-5, 8, False, True, dout),
        (x, w, None, None, 1e-6, None, True, False, dout),
    ]:
        torch.library.opcheck(ops.rmsnorm_bwd, args)
    assert ops.rmsnorm_bwd(x, w, b, z, 1e-5, 8, False, True, dout)[3].dtype == torch.float64


def test_backward_op_refuses_a_mismatched_dout():
    from mamba2_rocm.ops import rmsnorm as ops

    x, w = torch.zeros(6, 40), torch.ones(40)
    with pytest.raises(ValueError, match=r"dout must match x \(shape \(6, 40\)"):
        ops.rmsnorm_bwd(x, w, None, None, 1e-6, None, True, True, torch.zeros(6, 41))
    with pytest.raises(TypeError, match="dout must be a torch.Tensor"):
        ops.rmsnorm_bwd(x, w, None, None, 1e-6, None, True, True, None)


def test_backward_row_blocks():
    from mamba2_rocm.ops.rmsnorm import BWD_BLOCKS_PER_SM, bwd_row_blocks

    assert bwd_row_blocks(16384, 2, 132) == BWD_BLOCKS_PER_SM * 132 // 2
    assert bwd_row_blocks(7, 1, 132) == 7  # at most one block per row
    assert bwd_row_blocks(10**6, 1, 10**5) == 65535  # the grid's y limit
    assert bwd_row_blocks(100, 4, 0) == 1  # no GPU (stand-ins)


def test_backward_stats_form():
    """A wavefront per (row, group) item for groups up to STATS_WAVE_MAX_GROUP at any count,
    and for larger groups once the items fill the machine; else a block per item."""
    from mamba2_rocm.ops.rmsnorm import STATS_WAVE_MIN_ITEMS_PER_SM as per_sm
    from mamba2_rocm.ops.rmsnorm import stats_by_wavefront

    assert stats_by_wavefront(1, 2048, 132) and stats_by_wavefront(10**6, 256, 132)
    assert not stats_by_wavefront(1000, 2304, 132)  # 2.7b-like rows, few: a block each
    assert stats_by_wavefront(8192, 5120, 132)  # 2.7b b4 l2048
    assert stats_by_wavefront(per_sm * 132, 4096, 132)
    assert not stats_by_wavefront(per_sm * 132 - 1, 4096, 132)


def test_row_pass_threads():
    """The one-pass backward's block: one 8-element run a thread, in whole 64-thread steps (a
    wavefront on every target), at most the kernel's 512; none for groups not of whole runs."""
    from mamba2_rocm.kernels import RMSNORM_BWD_ROW_MAX_THREADS
    from mamba2_rocm.ops.rmsnorm import row_pass_threads

    assert RMSNORM_BWD_ROW_MAX_THREADS == 512
    assert (
        row_pass_threads(8) == 64
        and row_pass_threads(2048) == 256
        and row_pass_threads(4096) == 512
    )
    assert row_pass_threads(3080) == 448 and row_pass_threads(1536) == 192
    for gs in (0, 12, 4104, 5120, 8192):
        assert row_pass_threads(gs) is None, gs


@pytest.mark.parametrize(
    ("rows", "groups", "group", "want_blocks"),
    [(600, 2, 96, 32), (3, 1, 96, 3), (10**5, 1, 4096, 8), (10**5, 8, 1024, 4)],
)  # fmt: skip
def test_backward_one_pass_launch(monkeypatch, rows, groups, group, want_blocks):
    """No bias, 16-bit x in aligned rows, groups of whole runs: the one-pass kernel on grid
    (groups, row blocks) with row_pass_threads' block, ROW_PASS_THREADS_PER_SM / threads blocks
    a multiprocessor over the groups (at most one a row), its row blocks the reduce's partial
    rows; no stats launch."""
    from helpers import stand_in_kernels

    from mamba2_rocm.params import RmsNormBwdParams

    kset = stand_in_kernels(monkeypatch, ops)
    monkeypatch.setattr(ops, "sm_count", lambda device: 4)
    hidden = group * groups
    x = torch.randn(rows, hidden, dtype=torch.bfloat16)
    z = torch.randn(rows, hidden, dtype=torch.bfloat16)
    ops.rmsnorm_bwd(x, torch.randn(hidden), None, z, 1e-5, group, False, True, x.clone())
    (row, p, grid), (red, r, _) = kset.launches  # fmt: skip
    assert (row, red) == ("m2r_rmsnorm_bwd_row_bf16", "m2r_rmsnorm_bwd_reduce") and p == r
    assert kset.blocks[0] == (ops.row_pass_threads(group), 1, 1)
    f = RmsNormBwdParams(*r)
    assert grid == (groups, want_blocks, 1) and f.partial_rows == want_blocks
    assert f.rows_per_block * want_blocks >= rows > f.rows_per_block * (want_blocks - 1)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    ("dtype", "pdtype"),
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float64),
    ],
    ids=str,
)
def test_backward_reduce_launch(monkeypatch, dtype, pdtype, bias):
    """After the stats and gradient kernels, the reduce launch with the same parameters: 16
    columns a block over dweight's columns (and dbias's with a bias), the gradient kernel's row
    blocks as its partial rows, and dweight / dbias as the op returns them (new, contiguous, in
    the parameters' dtypes) or, for float64 parameters, float32 buffers converted after; dbias
    null without a bias."""
    from helpers import stand_in_kernels

    from mamba2_rocm.params import DTYPE_CODES, RmsNormBwdParams

    kset = stand_in_kernels(monkeypatch, ops)
    monkeypatch.setattr(ops, "sm_count", lambda device: 4)
    x = torch.randn(300, 2, 100, dtype=dtype)
    w = torch.randn(200, dtype=pdtype)[::2]  # (a strided weight: dweight is contiguous)
    b = torch.randn(100, dtype=pdtype) if bias else None
    dx, dw, db, _ = ops.rmsnorm_bwd(x, w, b, None, 1e-5, 25, True, True, x.clone())
    (stats, p, _), (grads, q, ggrid), (red, r, rgrid) = kset.launches  # fmt: skip
    assert (
        "stats" in stats
        and grads.startswith("m2r_rmsnorm_bwd_")
        and red == "m2r_rmsnorm_bwd_reduce"
    )
    assert p == q == r  # (one parameter struct for the three launches)
    f = RmsNormBwdParams(*r)
    # 600 rows over BWD_BLOCKS_PER_SM blocks x 4 multiprocessors
    assert ggrid[1] == ops.BWD_BLOCKS_PER_SM * 4 == f.partial_rows
    assert rgrid == (-(-100 * (2 if bias else 1) // 16), 1, 1)
    kernel_float = torch.float32 if pdtype == torch.float64 else pdtype
    assert f.weight_dtype == DTYPE_CODES[str(kernel_float).removeprefix("torch.")]
    assert dw.dtype == pdtype and dw.shape == (100,) and dw.is_contiguous()
    assert (f.dweight == dw.data_ptr()) == (pdtype != torch.float64)
    if bias:
        assert f.bias_dtype == f.weight_dtype and db.dtype == pdtype and db.shape == (100,)
        assert (f.dbias == db.data_ptr()) == (pdtype != torch.float64)
    else:
        assert f.dbias is None and db.numel() == 0
    assert f.dx == dx.data_ptr() and len({f.dweight, f.dbias, f.partial, f.dx, f.stats}) == 5


def test_kernel_params_are_dense_vectors():
    """The kernels index weight and bias as dense vectors: strided views reach them as
    contiguous copies (float64 ones as float32), contiguous ones as they are."""
    w = torch.arange(20.0)[::2]
    b = torch.arange(20.0, dtype=torch.float64)[1::2]
    kw, kb = ops._kernel_params(w, b)
    assert kw.is_contiguous() and torch.equal(kw, w)
    assert kb.is_contiguous() and kb.dtype == torch.float32 and torch.equal(kb, b.float())
    dense = torch.randn(10, dtype=torch.bfloat16)
    kw, kb = ops._kernel_params(dense, None)
    assert kw is dense and kb is None


@pytest.mark.parametrize(("group", "runs"), [(16, "_v"), (48, "_v"), (12, "")])
def test_backward_16_byte_runs_lie_in_one_group(monkeypatch, group, runs):
    """The gradient kernel's 16-byte form (``_v``: a run's stats taken once, the next row's
    loads requested a row ahead) runs where rows are aligned and the group is whole 16-byte
    runs (8 bf16 elements); groups of 12 take the element-wise kernel."""
    from helpers import stand_in_kernels

    kset = stand_in_kernels(monkeypatch, ops)
    monkeypatch.setattr(ops, "sm_count", lambda device: 4)
    monkeypatch.setattr(ops, "ROW_PASS", False)
    x = torch.randn(5, 96, dtype=torch.bfloat16)
    assert x.data_ptr() % 16 == 0
    ops.rmsnorm_bwd(x, torch.randn(96), None, None, 1e-5, group, True, True, x.clone())
    assert kset.launches[1][0] == f"m2r_rmsnorm_bwd{runs}_bf16"
