"""The conv1d backward kernel (csrc/conv1d_bwd.hip) on a GPU against autograd through the
float64 torch tier: every layout and dtype, odd sizes, sequences shorter than the history,
seq_idx with padding, initial / final states, poisoned outputs, many tiles per block, long
sequences, and bit-identical reruns (the deterministic reduction). Channel-last x takes the
walking kernel where dout and dx share its word-aligned layout (as a Mamba2 block's gradients
arrive) and the LDS tile kernel otherwise; both are run, and which one ran is checked.

The op is called directly (``causal_conv1d_bwd``, what the training op's backward calls), with
the torch tier's formula disabled so a silent fallback fails instead of passing."""

import pytest
import torch
from helpers import (
    DTYPES,
    assert_bit_identical_runs,
    check_grads,
    gpu_available,
    make_seq_idx,
    make_x,
    poison_allocator,
    refuse_fallback,
    seeded,
)

from mamba2_rocm import causal_conv1d_fn
from mamba2_rocm.ops import conv1d as conv_ops
from mamba2_rocm.reference.conv1d import causal_conv1d_torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not gpu_available(), reason="needs a GPU (run on the device machine)"),
]

DEV = "cuda"
LAYOUTS = ["contiguous", "channel_last", "sliced", "channel_last_sliced"]
#: error bound relative to the largest reference gradient: the inputs are rounded to the dtype
#: for both sides, so what differs is fp32 accumulation and the gradient's own rounding
GTOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def no_reference_fallback(monkeypatch):
    refuse_fallback(monkeypatch, conv_ops, "_bwd_reference")


def _case(g, batch, dim, seqlen, width, dtype, layout, mode, param_dtype=None, dout_layout=None):
    """x in ``layout``, dout in ``dout_layout`` (default: x's)."""
    x = make_x(batch, dim, seqlen, dtype, layout, device=DEV, gen=g)
    pdt = param_dtype or dtype
    w = torch.randn(dim, width, device=DEV, generator=g).to(pdt)
    b = torch.randn(dim, device=DEV, generator=g).to(pdt)
    init = seq = None
    if mode == "states":
        init = torch.randn(batch, dim, width - 1, device=DEV, generator=g).to(dtype)
    if mode == "seq":
        seq = make_seq_idx(batch, seqlen, device=DEV, gen=torch.Generator().manual_seed(seqlen))
    dout = make_x(batch, dim, seqlen, dtype, dout_layout or layout, device=DEV, gen=g)
    dfin = None
    if mode == "states":
        dfin = torch.randn(batch, dim, width - 1, device=DEV, generator=g).to(dtype)
    return x, w, b, seq, init, dout, dfin


def _want(x, w, b, seq, init, dout, dfin, silu):
    """Autograd through the float64 torch tier (not the written-out formula the op uses)."""
    leaves = [t.detach().double().requires_grad_() if t is not None else None
              for t in (x, w, b, init)]  # fmt: skip
    out, fin = causal_conv1d_torch(leaves[0], leaves[1], leaves[2], seq, leaves[3], silu,
                                   compute_dtype=torch.float64)  # fmt: skip
    outs, cots = [out], [dout.double()]
    if dfin is not None:
        outs.append(fin)
        cots.append(dfin.double())
    want = [t for t in leaves if t is not None]
    got = iter(torch.autograd.grad(outs, want, cots, allow_unused=True))
    return [next(got) if t is not None else None for t in leaves]


def _check(got, want, tol, names=("dx", "dweight", "dbias", "dinit")):
    check_grads(names, got, want, tol)


def _run(x, w, b, seq, init, dout, dfin, silu):
    poison_allocator(x.numel() * 4)
    return conv_ops.causal_conv1d_bwd(x, w, b, seq, init, dout, dfin, silu)


@pytest.fixture
def shapes(monkeypatch):
    """The tile shape each backward launch took ("rows", "cl", "walk" or "rwalk"), in order;
    each must be followed by the reduce launch (dweight / dbias from its partial rows)."""
    seen, pending = [], []
    launch = conv_ops._launch

    def spy(launcher, x, p, grid, threads=conv_ops._THREADS):
        if launcher.name == "m2r_conv1d_bwd_reduce":
            assert pending.pop() == p, "the reduce launch follows its backward kernel's"
        elif "_bwd_" in launcher.name:
            assert not pending, "a backward kernel without its reduce launch"
            seen.append(launcher.name.split("_w", 1)[1].split("_")[1])
            pending.append(p)
        launch(launcher, x, p, grid, threads)

    monkeypatch.setattr(conv_ops, "_launch", spy)
    yield seen
    assert not pending, "a backward kernel without its reduce launch"


@pytest.mark.parametrize("mode", ["plain", "states", "seq"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [2, 3, 4])
def test_backward(width, dtype, layout, mode, shapes):
    g = seeded("conv bwd", width, str(dtype), layout, mode, device=DEV)
    silu = width != 3
    args = _case(g, 2, 98, 1037, width, dtype, layout, mode,
                 param_dtype=torch.float32 if width == 4 else None)  # fmt: skip
    got = _run(*args, silu)
    assert got[0].stride() == conv_ops._alloc_out(args[0]).stride()  # dx in x's layout
    _check(got, _want(*args, silu), GTOL[dtype])
    # 1037 positions: rows not 16-byte aligned, the LDS tile kernel (rwalk: below)
    assert shapes == ["rows" if layout in ("contiguous", "sliced") else "walk"]


@pytest.mark.parametrize("ranges", ["short", "long"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("width", [2, 3, 4])
def test_backward_walk_many_short_sequences(monkeypatch, width, dtype, ranges, shapes):
    """The channel-last walk with seq_idx where sequences start every 1-12 positions, padding
    runs (-1) sit between them and long sequences alternate with short ones: chunks whose
    window is one sequence (walked without the id comparisons) next to chunks that hold a
    boundary, padding or a sequence shorter than the width, at every offset within the ring."""
    if ranges == "long":
        monkeypatch.setattr(conv_ops, "BWD_BLOCKS_PER_SM", 0.001)
    g = seeded("conv bwd short seqs", width, str(dtype), ranges, device=DEV)
    cpu = torch.Generator().manual_seed(width * 10 + (ranges == "long"))
    batch, seqlen, rows = 2, 1501, []
    for _ in range(batch):
        ids, sid = [], 0
        while len(ids) < seqlen:
            n = int(torch.randint(1, 13, (1,), generator=cpu)) * (1 if sid % 5 else 20)
            pad = int(torch.randint(0, 4, (1,), generator=cpu)) == 0
            ids += [-1 if pad else sid] * n
            sid += not pad
        rows.append(ids[:seqlen])
    seq = torch.tensor(rows, dtype=torch.int32, device=DEV)
    x, w, b, _, _, dout, _ = _case(g, batch, 96, seqlen, width, dtype, "channel_last", "plain")
    args = (x, w, b, seq, None, dout, None)
    _check(_run(*args, True), _want(*args, True), GTOL[dtype])
    assert shapes == ["walk"]


@pytest.mark.parametrize("ranges", ["short", "long"])
@pytest.mark.parametrize("mode", ["plain", "states", "seq"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [2, 3, 4])
def test_backward_rows_walk(monkeypatch, width, dtype, mode, ranges, shapes):
    """Seqlen-contiguous x, dout and dx in 16-byte aligned rows: the walking kernel, whose
    lanes hold consecutive vectors of one channel (with seq_idx: the LDS rows kernel). 1032
    positions: a last chunk cut short; ranges of one 256-position tile each (the default at
    this size) or one range a row."""
    if ranges == "long":
        monkeypatch.setattr(conv_ops, "BWD_BLOCKS_PER_SM", 0.001)
    g = seeded("conv bwd rows walk", width, str(dtype), mode, ranges, device=DEV)
    silu = width != 3
    args = _case(g, 3, 97, 1032, width, dtype, "contiguous", mode,
                 param_dtype=torch.float32 if width == 4 else None)  # fmt: skip
    _check(_run(*args, silu), _want(*args, silu), GTOL[dtype])
    assert shapes == ["rows" if mode == "seq" else "rwalk"]


@pytest.mark.parametrize("mode", ["plain", "states", "seq"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("width", [2, 3, 4])
def test_backward_odd_channels_of_aligned_rows(width, dtype, mode, shapes):
    """97 16-bit channels sliced out of wider channel-last x and dout whose rows stay
    word-aligned: dx, allocated in x's layout, has rows of 97 channels, half a word out of
    step, so the LDS tile kernel runs (the walking one stores whole words)."""
    g = seeded("conv bwd odd channels", width, str(dtype), mode, device=DEV)
    x, w, b, seq, init, _, dfin = _case(g, 2, 97, 777, width, dtype, "channel_last", mode)
    x, dout = (torch.randn(2, 777, 130, device=DEV, generator=g).to(dtype)[:, :, 8:105].transpose(1, 2)
               for _ in range(2))  # fmt: skip
    args = (x, w, b, seq, init, dout, dfin)
    _check(_run(*args, True), _want(*args, True), GTOL[dtype])
    assert shapes == ["cl"]


@pytest.mark.parametrize("mode", ["plain", "states", "seq"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [2, 3, 4])
def test_backward_channel_last_lds_tiles(width, dtype, mode, shapes):
    """Channel-last x with a seqlen-contiguous dout, and with a channel slice that starts
    mid-word: the LDS tile kernel (the walking one needs x, dout and dx in whole words)."""
    g = seeded("conv bwd cl lds", width, str(dtype), mode, device=DEV)
    silu = width != 2
    x, w, b, seq, init, dout, dfin = _case(g, 2, 97, 1037, width, dtype, "channel_last", mode,
                                           dout_layout="contiguous")  # fmt: skip
    _check(_run(x, w, b, seq, init, dout, dfin, silu), _want(x, w, b, seq, init, dout, dfin, silu),
           GTOL[dtype])  # fmt: skip
    x = make_x(2, 98, 1037, dtype, "channel_last", device=DEV, gen=g)[:, 1:]  # starts mid-word
    dout = make_x(2, 97, 1037, dtype, "channel_last", device=DEV, gen=g)
    _check(_run(x, w, b, seq, init, dout, dfin, silu), _want(x, w, b, seq, init, dout, dfin, silu),
           GTOL[dtype])  # fmt: skip
    assert shapes == ["cl", "walk" if dtype == torch.float32 else "cl"]  # a float is a word


@pytest.mark.parametrize("mode", ["plain", "states", "seq"])
@pytest.mark.parametrize("layout", ["contiguous", "channel_last"])
@pytest.mark.parametrize("seqlen", [1, 2, 3, 8, 16, 63, 64, 65, 511, 512, 513, 1025])
def test_backward_lengths(seqlen, layout, mode):
    """Lengths around both tile shapes' edges (64 / 512 positions) and below the history."""
    g = seeded("conv bwd len", seqlen, layout, mode, device=DEV)
    args = _case(g, 3, 70, seqlen, 4, torch.bfloat16, layout, mode, param_dtype=torch.float32)
    _check(_run(*args, True), _want(*args, True), GTOL[torch.bfloat16])


@pytest.mark.parametrize(
    "layout, dout_layout",
    [("contiguous", None), ("channel_last", None), ("channel_last", "contiguous")],
)
def test_backward_many_tiles_per_block(monkeypatch, layout, dout_layout, shapes):
    """Blocks that walk several tiles (the heuristic's choice on a busy grid), forced here on a
    small one: the carried dweight / dbias sums and each tile's halo (the walking kernel: the
    ranges' edges)."""
    monkeypatch.setattr(conv_ops, "BWD_BLOCKS_PER_SM", 0.01)
    g = seeded("conv bwd tiles", layout, str(dout_layout), device=DEV)
    args = _case(g, 2, 130, 5000, 4, torch.float32, layout, "states", dout_layout=dout_layout)
    x = args[0]
    walk = layout == "channel_last" and dout_layout is None
    tile_c, tile_l = {  # 5000 float32 positions: 16-byte rows, so contiguous x takes rwalk
        "contiguous": (conv_ops._WALK_THREADS // conv_ops._RWALK_LANES, conv_ops._RWALK_TILE),
        "channel_last": (conv_ops._WALK_THREADS, conv_ops._WALK_TILE) if walk else conv_ops._BWD_CL,
    }[layout]
    other = -(-130 // tile_c) * 2
    assert conv_ops.bwd_tiles_per_block(-(-5000 // tile_l), other, conv_ops.sm_count(x.device)) > 1
    _check(_run(*args, True), _want(*args, True), GTOL[torch.float32])
    assert shapes == ["walk" if walk else "rwalk" if layout == "contiguous" else "cl"]


@pytest.mark.parametrize("layout", ["contiguous", "channel_last"])
def test_backward_long(layout):
    g = seeded("conv bwd long", layout, device=DEV)
    args = _case(g, 2, 256, 8192, 4, torch.bfloat16, layout, "seq", param_dtype=torch.float32)
    _check(_run(*args, True), _want(*args, True), GTOL[torch.bfloat16])


@pytest.mark.parametrize("layout", ["contiguous", "channel_last"])
def test_backward_is_bit_identical_across_runs(layout):
    """The dweight / dbias reduction has a fixed order (partials per block, then one sum): five
    runs, in torch's deterministic mode as causal-conv1d's tests run them, agree bit for bit."""
    g = seeded("conv bwd det", layout, device=DEV)
    args = _case(g, 4, 1024, 4096, 4, torch.bfloat16, layout, "plain", param_dtype=torch.float32)
    assert_bit_identical_runs(lambda: _run(*args, True))


def test_training_op_backward_uses_the_kernel():
    """causal_conv1d_fn's autograd reaches the kernel (the fallback is refused here) and gives
    every input's gradient, final states included."""
    g = seeded("conv bwd fn", device=DEV)
    x = make_x(2, 64, 300, torch.bfloat16, "channel_last", device=DEV, gen=g).requires_grad_()
    w = torch.randn(64, 4, device=DEV, generator=g, requires_grad=True)
    b = torch.randn(64, device=DEV, generator=g, requires_grad=True)
    init = torch.randn(2, 64, 3, device=DEV, generator=g).bfloat16().requires_grad_()
    out, fin = causal_conv1d_fn(x, w, b, initial_states=init, return_final_states=True,
                                activation="silu")  # fmt: skip
    dout, dfin = torch.randn_like(out), torch.randn_like(fin)
    got = torch.autograd.grad([out, fin], [x, w, b, init], [dout, dfin])
    want = _want(x, w, b, None, init, dout, dfin, True)
    _check(got, want, GTOL[torch.bfloat16])


def test_first_kernel_load_on_autograd_thread():
    """A fresh process whose first backward kernel is loaded and launched on autograd's device
    thread, which torch's runtime never bound to a context (bench conv1d --backward's first run
    failed there with 'invalid device context' before the driver learned to bind it)."""
    import os
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from mamba2_rocm import causal_conv1d_fn\n"
        "x = torch.randn(2, 64, 300, device='cuda', requires_grad=True)\n"
        "w = torch.randn(64, 4, device='cuda', requires_grad=True)\n"
        "causal_conv1d_fn(x, w, activation='silu').sum().backward()\n"
        "torch.cuda.synchronize()\n"
        "print('grads', bool(x.grad.abs().sum() > 0), bool(w.grad.abs().sum() > 0))\n"
    )
    env = dict(os.environ, MAMBA2_ROCM_BACKEND="kernel")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "grads True True" in proc.stdout
