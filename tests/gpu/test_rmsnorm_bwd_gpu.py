"""The gated norm's backward kernels (csrc/rmsnorm_bwd.hip) on a GPU against autograd through
the float64 reference: RMSNorm and LayerNorm, the gate before / after / absent, group sizes,
odd hidden sizes (partial vectors), unaligned rows, z in another dtype, poisoned outputs, many
rows per block, and bit-identical reruns.

The op is called directly (``rmsnorm_bwd``, what the norm's backward calls) with the torch
tier's formula disabled, so a silent fallback fails instead of passing."""

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

from mamba2_rocm import rmsnorm_fn
from mamba2_rocm.ops import rmsnorm as norm_ops
from mamba2_rocm.reference.ssd import rmsnorm_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not gpu_available(), reason="needs a GPU (run on the device machine)"),
]

DEV = "cuda"
#: error bound relative to the largest reference gradient (inputs rounded alike on both sides)
GTOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def no_reference_fallback(monkeypatch):
    refuse_fallback(monkeypatch, norm_ops, "rmsnorm_bwd_ref")


def _inputs(g, rows, hidden, dtype, gate, bias=True, z_dtype=None, layout="contiguous"):
    def r(*shape, dt=dtype):
        return torch.randn(*shape, device=DEV, generator=g).to(dt)

    x = r(rows, hidden) * 2 + 0.5
    if layout == "sliced":  # rows at an odd offset and stride: the element-wise path
        x = (r(rows, hidden + 3) * 2 + 0.5)[:, 1 : hidden + 1]
    z = None if gate == "none" else r(rows, hidden, dt=z_dtype or dtype)
    w = r(hidden, dt=torch.float32)
    b = r(hidden, dt=torch.float32) if bias else None
    dout = r(rows, hidden)
    return x, w, b, z, dout


def _want(x, w, b, z, eps, gs, nbg, is_rms, dout):
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (x, w, b, z)]
    out = rmsnorm_ref(*leaves, eps, gs, nbg, is_rms_norm=is_rms)
    want = [t for t in leaves if t is not None]
    got = iter(torch.autograd.grad(out, want, dout.double()))
    return [next(got) if t is not None else None for t in leaves]


def _check(got, want, tol):
    check_grads(("dx", "dweight", "dbias", "dz"), got, want, tol)


def _run(x, w, b, z, eps, gs, nbg, is_rms, dout):
    poison_allocator(x.numel() * 8)
    return norm_ops.rmsnorm_bwd(x, w, b, z, eps, gs, nbg, is_rms, dout)


def spy_launches(monkeypatch) -> list[str]:
    """The names of the kernels the op launches, in order."""
    names = []
    launch = norm_ops.launch

    def spy(launcher, x, p, grid, threads):
        names.append(launcher.name)
        launch(launcher, x, p, grid, threads)

    monkeypatch.setattr(norm_ops, "launch", spy)
    return names


@pytest.mark.parametrize("gate", ["none", "before", "after"])
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("hidden", "group"), [(1024, None), (768, 256), (100, 20), (4096, 512)])
def test_backward(hidden, group, dtype, is_rms, gate):
    g = seeded("norm bwd", hidden, group, str(dtype), is_rms, gate, device=DEV)
    x, w, b, z, dout = _inputs(g, 37, hidden, dtype, gate)
    args = (x, w, b, z, 1e-5, group, gate != "before", is_rms, dout)
    got = _run(*args)
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    _check(got, _want(*args), GTOL[dtype])


@pytest.mark.parametrize("gate", ["before", "after"])
def test_backward_unaligned_rows_and_z_dtype(gate):
    """Rows at odd offsets (element by element), z in fp32 with bf16 x (dz comes back fp32),
    no bias."""
    g = seeded("norm bwd odd", gate, device=DEV)
    x, w, b, z, dout = _inputs(g, 21, 264, torch.bfloat16, gate, bias=False,
                               z_dtype=torch.float32, layout="sliced")  # fmt: skip
    args = (x, w, b, z, 1e-6, 88, gate != "before", True, dout)
    got = _run(*args)
    assert got[3].dtype == torch.float32
    _check(got, _want(*args), GTOL[torch.bfloat16])


def test_backward_many_rows_per_block(monkeypatch):
    monkeypatch.setattr(norm_ops, "BWD_BLOCKS_PER_SM", 0.05)
    g = seeded("norm bwd rows", device=DEV)
    x, w, b, z, dout = _inputs(g, 3000, 512, torch.float32, "before")
    assert norm_ops.bwd_row_blocks(3000, 1, norm_ops.sm_count(x.device)) < 100
    args = (x, w, b, z, 1e-5, 128, False, False, dout)
    _check(_run(*args), _want(*args), GTOL[torch.float32])


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("pdtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_backward_parameter_dtypes(bias, pdtype):
    """dweight / dbias come back in the parameters' dtypes from the reduce launch (float64: its
    float32 sums, converted), poisoned memory overwritten: 100 columns, so one of the reduce's
    16-column blocks holds dweight's last columns and dbias's first; 700 rows over many row
    blocks, their count not a multiple of the reduce's 16 slices."""
    g = seeded("norm bwd pdtype", bias, str(pdtype), device=DEV)
    x, w, b, z, dout = _inputs(g, 700, 100, torch.float32, "after", bias=bias)
    w, b = w.to(pdtype), None if b is None else b.to(pdtype)
    args = (x, w, b, z, 1e-5, 20, True, True, dout)
    got = _run(*args)
    assert got[1].dtype == pdtype and (not bias or got[2].dtype == pdtype)
    _check(got, _want(*args), GTOL.get(pdtype, GTOL[torch.float32]))


@pytest.mark.parametrize("walk", ["short", "long"])
@pytest.mark.parametrize("gate", ["none", "before", "after"])
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
@pytest.mark.parametrize(
    ("rows", "hidden", "group"),
    [(700, 64, 16), (333, 48, 48), (100, 3072, 1024), (257, 1536, 1536), (257, 5120, 5120),
     (130, 8192, 8192), (300, 96, 12)],
)  # fmt: skip
def test_backward_rows_walked(monkeypatch, rows, hidden, group, is_rms, gate, walk):
    """16-bit x in aligned rows: the gradient kernel's 16-byte form walks each block's rows
    with the next row's loads requested one row ahead, over few rows (short) or many (long),
    with a last column block partly idle (1536, 5120 columns), small groups (two 8-element
    runs) and both stats forms; groups of 12 elements, whose 16-byte runs would straddle two,
    take the element-wise kernel."""
    if walk == "long":
        monkeypatch.setattr(norm_ops, "BWD_BLOCKS_PER_SM", 0.05)
    names = spy_launches(monkeypatch)
    g = seeded("norm bwd rows walked", rows, hidden, is_rms, gate, walk, device=DEV)
    x, w, b, z, dout = _inputs(g, rows, hidden, torch.bfloat16, gate)
    args = (x, w, b, z, 1e-5, group, gate != "before", is_rms, dout)
    _check(_run(*args), _want(*args), GTOL[torch.bfloat16])
    wave = norm_ops.stats_by_wavefront(rows * (hidden // group), group, norm_ops.sm_count(x.device))
    stats = "_w" if wave else ""
    runs = "_v" if group % 8 == 0 else ""
    assert names == [
        f"m2r_rmsnorm_bwd_stats{stats}_bf16",
        f"m2r_rmsnorm_bwd{runs}_bf16",
        "m2r_rmsnorm_bwd_reduce",
    ]


@pytest.mark.parametrize("bias", [True, False])
def test_strided_parameters(bias):
    """A weight and bias that are strided views (every second element of a longer vector):
    the kernels index the parameters as dense vectors, so the op hands them contiguous copies
    (forward and backward)."""
    g = seeded("norm strided params", bias, device=DEV)
    x, w, b, z, dout = _inputs(g, 64, 256, torch.bfloat16, "before", bias=bias)
    w = torch.stack([w, torch.full_like(w, 1e4)], 1).view(-1)[::2]
    b = None if b is None else torch.stack([b, torch.full_like(b, 1e4)], 1).view(-1)[::2]
    assert w.stride(0) == 2
    out = rmsnorm_fn(x, w, b, z=z, eps=1e-5, group_size=64, norm_before_gate=False)
    want = rmsnorm_ref(x.double(), w.double(), None if b is None else b.double(), z.double(), 1e-5,
                       64, False, is_rms_norm=True)  # fmt: skip
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)
    args = (x, w, b, z, 1e-5, 64, False, True, dout)
    _check(_run(*args), _want(*args), GTOL[torch.bfloat16])


def test_backward_is_bit_identical_across_runs():
    g = seeded("norm bwd det", device=DEV)
    x, w, b, z, dout = _inputs(g, 16384, 2048, torch.bfloat16, "before")
    assert_bit_identical_runs(lambda: _run(x, w, b, z, 1e-5, 256, False, True, dout))


def test_rmsnorm_fn_backward_uses_the_kernels():
    """rmsnorm_fn's autograd on the kernel tier reaches the kernels (the fallback is refused)
    and gives x, z, weight and bias their gradients (Mamba2's gate-first norm, 8 groups)."""
    g = seeded("norm bwd fn", device=DEV)
    x, w, b, z, dout = _inputs(g, 64, 2048, torch.bfloat16, "before")
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b, z)]
    out = rmsnorm_fn(leaves[0], leaves[1], leaves[2], z=leaves[3], eps=1e-5, group_size=256,
                     norm_before_gate=False)  # fmt: skip
    got = torch.autograd.grad(out, leaves, dout)
    want = _want(x, w, b, z, 1e-5, 256, False, True, dout)
    _check(got, want, GTOL[torch.bfloat16])


def force_stats_form(monkeypatch, form):
    """The stats kernel's item per wavefront ("wave") or per block, whatever the sizes (and the
    two passes where the one-pass kernel would apply)."""
    monkeypatch.setattr(norm_ops, "ROW_PASS", False)
    monkeypatch.setattr(norm_ops, "STATS_WAVE_MAX_GROUP", 10**9 if form == "wave" else 0)
    monkeypatch.setattr(norm_ops, "STATS_WAVE_MIN_ITEMS_PER_SM", 0 if form == "wave" else 10**9)


@pytest.mark.parametrize("form", ["wave", "block"])
@pytest.mark.parametrize(("hidden", "group"), [(1024, 256), (4096, None), (200, 40)])
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
def test_backward_both_stats_forms(monkeypatch, hidden, group, is_rms, form):
    """The per-item statistics by a wavefront or by a block, whichever the size would pick."""
    force_stats_form(monkeypatch, form)
    g = seeded("norm bwd stats", hidden, group, is_rms, form, device=DEV)
    x, w, b, z, dout = _inputs(g, 29, hidden, torch.bfloat16, "after")
    args = (x, w, b, z, 1e-5, group, True, is_rms, dout)
    _check(_run(*args), _want(*args), GTOL[torch.bfloat16])


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset"])
@pytest.mark.parametrize(
    ("dtype", "wdtype"),
    [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
     (torch.float32, torch.bfloat16), (torch.float32, torch.float32)],
    ids=str,
)  # fmt: skip
@pytest.mark.parametrize("form", ["wave", "block"])
@pytest.mark.parametrize("group", [8, 264, 520, 776, 2056, 4616])
def test_backward_stats_runs_and_weight_alignment(monkeypatch, group, form, dtype, wdtype, offset):
    """The statistics' 16-byte walk: 1 to several runs a thread with a shorter last round
    (groups past whole rounds of the wavefront's or the block's runs), each run's weights read
    with its activations (16-bit weights: one 16-byte or, with fp32 x, one 8-byte load; fp32
    weights one or two 16-byte loads), or element by element where the weight vector is a
    contiguous view that does not start 16-byte aligned."""
    force_stats_form(monkeypatch, form)
    g = seeded("norm bwd runs", group, form, dtype, wdtype, offset, device=DEV)
    x, _, _, z, dout = _inputs(g, 6, 2 * group, dtype, "before", bias=False)
    w = torch.randn(2 * group + offset, device=DEV, generator=g).to(wdtype)[offset:]
    assert (w.data_ptr() % 16 == 0) == (offset == 0) and w.is_contiguous()
    args = (x, w, None, z, 1e-5, group, False, True, dout)
    (dx, dw, db, dz), (wx, ww, wb, wz) = _run(*args), _want(*args)
    check_grads(("dx", "dbias", "dz"), (dx, db, dz), (wx, wb, wz), GTOL[dtype])
    # dweight comes back in the weight's dtype: bf16 dweight with fp32 x is rounded to bf16
    check_grads(("dweight",), (dw,), (ww,), max(GTOL[dtype], GTOL[wdtype]))


@pytest.mark.parametrize("gate", ["none", "before", "after"])
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
@pytest.mark.parametrize(
    ("rows", "hidden", "group"),
    [(37, 8, 8), (37, 1024, None), (29, 3072, 1024), (23, 4096, 4096), (19, 3080, 3080), (41, 4112, 2056),
     (31, 1536, 1536), (17, 2000, 400)],
)  # fmt: skip
def test_one_pass(monkeypatch, rows, hidden, group, is_rms, gate):
    """The one-pass backward (no bias, bf16 x in aligned rows, groups of whole 8-element runs up
    to 4096 elements), with poisoned outputs: blocks whose last threads lie past the group (3080
    = 385 runs on 448 threads; 2056, 400), 64 to 512 threads, several groups a row, one run a
    group (8 elements on 64 threads)."""
    names = spy_launches(monkeypatch)
    g = seeded("norm bwd one pass", rows, hidden, group, is_rms, gate, device=DEV)
    x, w, b, z, dout = _inputs(g, rows, hidden, torch.bfloat16, gate, bias=False)
    args = (x, w, b, z, 1e-5, group, gate != "before", is_rms, dout)
    _check(_run(*args), _want(*args), GTOL[torch.bfloat16])
    assert names == ["m2r_rmsnorm_bwd_row_bf16", "m2r_rmsnorm_bwd_reduce"]


@pytest.mark.parametrize("walk", ["short", "long"])
@pytest.mark.parametrize(
    "wdtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str
)
@pytest.mark.parametrize(
    ("rows", "hidden", "group"), [(3001, 1024, None), (600, 6144, 3072), (2, 4096, 512)]
)
def test_one_pass_rows_walked(monkeypatch, rows, hidden, group, wdtype, walk):
    """Blocks walking a few rows each or tens (one block a multiprocessor; the last block's
    share short), with the weight in every dtype (fp32 weights: two 16-byte loads a run;
    float64: the op's fp32 copy)."""
    if walk == "long":  # (at least one block a multiprocessor: hundreds of rows each)
        monkeypatch.setattr(norm_ops, "ROW_PASS_THREADS_PER_SM", 1)
    names = spy_launches(monkeypatch)
    g = seeded("norm bwd one pass rows", rows, hidden, str(wdtype), walk, device=DEV)
    x, w, _, z, dout = _inputs(g, rows, hidden, torch.bfloat16, "before", bias=False)
    w = w.to(wdtype)
    args = (x, w, None, z, 1e-5, group, False, True, dout)
    (dx, dw, db, dz), (wx, ww, wb, wz) = _run(*args), _want(*args)
    assert names == ["m2r_rmsnorm_bwd_row_bf16", "m2r_rmsnorm_bwd_reduce"]
    assert dw.dtype == wdtype
    check_grads(("dx", "dbias", "dz"), (dx, db, dz), (wx, wb, wz), GTOL[torch.bfloat16])
    check_grads(("dweight",), (dw,), (ww,), max(GTOL[torch.bfloat16], GTOL.get(wdtype, 0.0)))


def test_one_pass_is_bit_identical_across_runs():
    g = seeded("norm bwd one pass det", device=DEV)
    x, w, _, z, dout = _inputs(g, 16384, 2048, torch.bfloat16, "before", bias=False)
    assert norm_ops.row_pass_threads(2048) == 256
    assert_bit_identical_runs(lambda: _run(x, w, None, z, 1e-5, None, False, True, dout))


@pytest.mark.parametrize(
    "case",
    [
        "bias",
        "fp32 x",
        "fp16 x",
        "unaligned rows",
        "unaligned weight",
        "group of 12",
        "group of 4104",
    ],
)
def test_one_pass_declines(monkeypatch, case):
    """Where the one-pass kernel does not apply, the two passes run (and give the right result)."""
    names = spy_launches(monkeypatch)
    g = seeded("norm bwd one pass declines", case, device=DEV)
    dtype = {"fp32 x": torch.float32, "fp16 x": torch.float16}.get(case, torch.bfloat16)
    hidden, group = {"group of 12": (96, 12), "group of 4104": (4104, None)}.get(case, (512, None))
    layout = "sliced" if case == "unaligned rows" else "contiguous"
    x, w, b, z, dout = _inputs(g, 9, hidden, dtype, "before", bias=case == "bias", layout=layout)
    if case == "unaligned weight":
        w = torch.randn(hidden + 1, device=DEV, generator=g)[1:]
    args = (x, w, b, z, 1e-5, group, False, True, dout)
    _check(_run(*args), _want(*args), GTOL[dtype])
    assert not any("_row_" in n for n in names) and len(names) == 3
