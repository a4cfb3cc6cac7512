"""Mamba1's selective_scan_fn on the CPU: the torch tier against the float64 ground truth (two
independent formulations of the recurrence), gradients, mamba_ssm's argument forms, errors."""

from __future__ import annotations

import cmath
import math

import pytest
import torch
from helpers import seeded
from nonfinite import check_scan_nan_locality

from mamba2_rocm import selective_scan_fn
from mamba2_rocm.reference.selective_scan import selective_scan_ref, selective_scan_torch


def _inputs(g, b=2, d=8, L=37, n=16, bmode="var", cmode="var", groups=2, dtype=torch.float32):
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731

    def bc():
        mode = {"fixed": (d, n), "var": (b, n, L), "grouped": (b, groups, n, L)}
        return lambda m: r(*mode[m])

    make = bc()
    return dict(
        u=r(b, d, L).to(dtype), delta=(torch.rand(b, d, L, generator=g) * 0.5).to(dtype),
        A=-torch.rand(d, n, generator=g) * 2 - 0.1, B=make(bmode), C=make(cmode),
    )  # fmt: skip


@pytest.mark.parametrize("L", [1, 7, 128, 255, 256, 257, 1000])
@pytest.mark.parametrize("bmode, cmode", [("fixed", "fixed"), ("var", "var"),
                                          ("grouped", "var"), ("var", "grouped")])  # fmt: skip
def test_torch_tier_matches_ground_truth(L, bmode, cmode, backend):
    backend("auto")
    g = seeded("ss", L, bmode, cmode)
    a = _inputs(g, L=L, bmode=bmode, cmode=cmode)
    extra = dict(D=torch.randn(8, generator=g), z=torch.randn(2, 8, L, generator=g),
                 delta_bias=torch.randn(8, generator=g) * 0.3, delta_softplus=True)  # fmt: skip
    out, last = selective_scan_fn(**a, **extra, return_last_state=True)
    ref, rlast = selective_scan_ref(**a, **extra, return_last_state=True)
    assert out.dtype == torch.float32 and last.dtype == torch.float32
    assert last.shape == (2, 8, 16)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last, rlast, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("opts", [{}, {"D": True}, {"z": True}, {"delta_bias": True},
                                  {"delta_softplus": True}])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_optional_inputs_and_half_inputs(opts, dtype):
    g = seeded("ss-opt", str(opts), dtype)
    a = _inputs(g, L=65, dtype=dtype)
    kw = {}
    if opts.get("D"):
        kw["D"] = torch.randn(8, generator=g)
    if opts.get("z"):
        kw["z"] = torch.randn(2, 8, 65, generator=g).to(dtype)
    if opts.get("delta_bias"):  # positive: without softplus a negative delta grows the state
        kw["delta_bias"] = torch.rand(8, generator=g) * 0.2
    kw["delta_softplus"] = bool(opts.get("delta_softplus"))
    out = selective_scan_fn(**a, **kw)
    ref = selective_scan_ref(**a, **kw)
    assert out.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def test_the_two_formulations_agree_in_float64():
    g = seeded("ss-64")
    a = {k: v.double() for k, v in _inputs(g, L=100, bmode="grouped", cmode="fixed").items()}
    out, last = selective_scan_torch(**a, return_last_state=True, compute_dtype=torch.float64)
    ref, rlast = selective_scan_ref(**a, return_last_state=True)
    assert last.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(last, rlast, rtol=1e-12, atol=1e-12)


def test_gradcheck_every_input():
    g = seeded("ss-grad")
    a = {k: v.double() for k, v in _inputs(g, b=1, d=4, L=6, n=3, bmode="grouped").items()}
    extra = dict(D=torch.randn(4, generator=g).double(), z=torch.randn(1, 4, 6, generator=g).double(),
                 delta_bias=torch.randn(4, generator=g).double())  # fmt: skip
    leaves = {k: v.requires_grad_() for k, v in {**a, **extra}.items()}

    def fn(*vals):
        kw = dict(zip(leaves, vals, strict=True))
        out, last = selective_scan_torch(**kw, delta_softplus=True, return_last_state=True,
                                         compute_dtype=torch.float64)  # fmt: skip
        return out, last

    assert torch.autograd.gradcheck(fn, tuple(leaves.values()))


def _train_against_ground_truth(key, L, bmode, cmode, check_forward=False):
    """Gradients of selective_scan_fn (every input, through out and the last state) against
    float64 autograd through the ground truth."""
    g = seeded(key)
    a = _inputs(g, L=L, bmode=bmode, cmode=cmode)
    extra = dict(D=torch.randn(8, generator=g), z=torch.randn(2, 8, L, generator=g),
                 delta_bias=torch.randn(8, generator=g))  # fmt: skip
    ours = {k: v.clone().requires_grad_() for k, v in {**a, **extra}.items()}
    ref = {k: v.double().requires_grad_() for k, v in {**a, **extra}.items()}
    out, last = selective_scan_fn(**ours, delta_softplus=True, return_last_state=True)
    rout, rlast = selective_scan_ref(**ref, delta_softplus=True, return_last_state=True)
    if check_forward:
        torch.testing.assert_close(out, rout.float(), rtol=1e-5, atol=1e-5)
    cot = (torch.randn(out.shape, generator=g), torch.randn(last.shape, generator=g))
    torch.autograd.backward((out, last), cot)
    torch.autograd.backward((rout, rlast), tuple(c.double() for c in cot))
    for k in ours:
        torch.testing.assert_close(ours[k].grad, ref[k].grad.float(), rtol=1e-4, atol=1e-4,
                                   msg=lambda m, k=k: f"d{k}: {m}")  # fmt: skip


def test_public_gradients_match_the_ground_truth():
    """Training through selective_scan_fn (the torch tier, float32) against float64 autograd."""
    _train_against_ground_truth("ss-train", 50, "var", "grouped")


def test_a_nonfinite_value_stays_in_its_row_and_after_its_token():
    check_scan_nan_locality(selective_scan_fn, _inputs(seeded("ss-nan"), L=40), 0, 3, 10)


def test_empty_inputs():
    a = _inputs(seeded("ss-empty"), L=0)
    out, last = selective_scan_fn(**a, return_last_state=True)
    assert out.shape == (2, 8, 0) and torch.equal(last, torch.zeros(2, 8, 16))
    a = _inputs(seeded("ss-empty-b"), b=0, L=5)
    assert selective_scan_fn(**a).shape == (0, 8, 5)


def _bad(**change):
    a = _inputs(seeded("ss-bad"), L=9)
    a.update(change)
    return a


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        (_bad(A=torch.zeros(8, 16, dtype=torch.complex64), B=torch.zeros(8, 16)), TypeError,
         r"with complex A, B fixed \(complex\) must be one of complex64, complex128, got float32"),
        (_bad(A=torch.zeros(8, 16, dtype=torch.complex64)), ValueError,
         r"B variable must be \(batch=2, dstate=16, 2 \* seqlen=18\)"),
        (_bad(A=torch.zeros(8, 16, dtype=torch.complex64), C=torch.zeros(2, 16, 18,
         dtype=torch.complex64), B=torch.zeros(2, 16, 18)), TypeError,
         r"with complex A, C variable \(real pairs\) must be one of"),
        (_bad(B=torch.zeros(8, 16, dtype=torch.complex64)), TypeError,
         r"B is complex \(complex64\) but A is real"),
        (_bad(A=torch.zeros(8, 300)), ValueError, "dstate must be 1..256, got 300"),
        (_bad(A=torch.zeros(7, 16)), ValueError, r"A must be \(dim=8, dstate\)"),
        (_bad(u=torch.zeros(2, 8)), ValueError, r"u must be \(batch, dim, seqlen\)"),
        (_bad(delta=torch.zeros(2, 8, 10)), ValueError, "delta must have u's shape"),
        (_bad(B=torch.zeros(2, 3, 16, 9)), ValueError, "groups dividing dim=8"),
        (_bad(C=torch.zeros(2, 16, 10)), ValueError, r"C variable must be \(batch=2, dstate=16, seqlen=9\)"),
        (_bad(B=torch.zeros(8, 15)), ValueError, r"B fixed must be \(dim=8, dstate=16\)"),
        (_bad(B=torch.zeros(16)), ValueError, "B must be .dim, dstate."),
        (_bad(D=torch.zeros(7)), ValueError, r"D must have shape \(8,\)"),
        (_bad(u=torch.zeros(2, 8, 9, dtype=torch.int32)), TypeError, "u must be one of"),
        (_bad(B=torch.zeros(2, 16, 9, device="meta")), ValueError, "B is on meta, expected cpu"),
        (_bad(u=[1.0]), TypeError, "u must be a torch.Tensor, got list"),
    ],
)  # fmt: skip
def test_bad_inputs_are_named(args, error, message):
    with pytest.raises(error, match=message):
        selective_scan_fn(**args)


def test_kernel_backend_refuses_cpu_tensors(backend):
    backend("kernel")
    with pytest.raises(ValueError, match="MAMBA2_ROCM_BACKEND=kernel needs GPU tensors"):
        selective_scan_fn(**_inputs(seeded("ss-k")))


def test_eager_tier_is_the_ground_truth(backend):
    backend("eager")
    a = _inputs(seeded("ss-eager"), L=20)
    torch.testing.assert_close(selective_scan_fn(**a), selective_scan_ref(**a).float())


# --- the kernel path, on the CPU with the launch stood in for


@pytest.fixture
def kernel_stand_in(monkeypatch):
    from helpers import stand_in_kernels

    from mamba2_rocm.ops import selective_scan as ops

    return stand_in_kernels(monkeypatch, ops)


@pytest.mark.parametrize(("n", "tier", "channels"), [(16, 16, 8), (5, 16, 8), (100, 128, 8),
                                                     (129, 256, 4)])  # fmt: skip
@pytest.mark.parametrize("bmode", ["fixed", "var", "grouped"])
@pytest.mark.parametrize("form", ["butterfly", "deferred", "segments", "channels"])
def test_kernel_launch_fields(kernel_stand_in, n, tier, channels, bmode, form, monkeypatch):
    from mamba2_rocm.ops import selective_scan as ops
    from mamba2_rocm.params import SelectiveScanParams

    monkeypatch.setattr(ops, "kernel_form", form)
    a = _inputs(seeded("ss-launch", n, bmode), d=20, n=n, bmode=bmode, cmode="var",
                dtype=torch.bfloat16)  # fmt: skip
    D = torch.randn(20, dtype=torch.float64)  # float64: a float32 copy goes to the kernel
    out, last = selective_scan_fn(**a, D=D, delta_softplus=True, return_last_state=True)
    assert out.dtype == torch.bfloat16 and last.shape == (2, 20, n) and last.dtype == torch.float32
    (name, params, grid), = kernel_stand_in.launches  # fmt: skip
    suffix = {"butterfly": "", "deferred": "_dr", "segments": "_sp", "channels": "_ch"}[form]
    if form == "channels" and (tier > 64 or bmode != "var"):
        form = "segments"  # fixed B, or 10 channels per group: not whole blocks of 64
    if form == "segments":  # a lane group of 32 per channel; dstate <= 64, else the butterfly
        suffix, channels = ("_sp", 4) if tier <= 64 else ("", channels)
    if form == "channels":  # a thread per channel (dstate <= 16), 64 a block
        channels = 64
    assert name == f"m2r_selective_scan_bf16_n{tier}{suffix}" and grid == (-(-20 // channels), 2, 1)
    f = dict(zip((k for k, _ in SelectiveScanParams._fields_), params, strict=True))
    assert f["u"] == a["u"].data_ptr() and f["delta"] == a["delta"].data_ptr()  # no copies
    assert f["out"] == out.data_ptr() and f["last_state"] == last.data_ptr()
    assert f["B"] == a["B"].data_ptr() and f["C"] == a["C"].data_ptr()  # float32: as they are
    assert (f["batch"], f["dim"], f["seqlen"], f["dstate"]) == (2, 20, 37, n)
    assert f["b_groups"] == {"fixed": 0, "var": 1, "grouped": 2}[bmode] and f["c_groups"] == 1
    assert f["delta_softplus"] == 1 and f["d_dtype"] == 0 and f["z"] == 0
    assert f["seg_len"] == 0 and f["seg_state"] == 0  # one segment


@pytest.mark.parametrize(("n", "tier", "lanes"), [(16, 16, 1), (20, 32, 2), (64, 64, 4)])
def test_channel_form_segments_launch_twice(kernel_stand_in, n, tier, lanes, monkeypatch):
    """Cut into segments, the channel form launches the segment maps' kernel over every segment
    but the last, then the outputs' over all, both with the same parameters: the segment length
    (a multiple of 64 tokens) and a float32 workspace of (batch, dim, nseg, tier) end states and
    (batch, dim, nseg) step sums."""
    from mamba2_rocm.ops import selective_scan as ops
    from mamba2_rocm.params import SelectiveScanParams

    monkeypatch.setattr(ops, "kernel_form", "channels")
    monkeypatch.setattr(ops, "channel_segments", 3)
    workspaces = []
    real_empty = torch.empty

    def spy_empty(*shape, **kw):
        t = real_empty(*shape, **kw)
        if kw.get("dtype") == torch.float32 and len(shape) == 1:
            workspaces.append(t)
        return t

    monkeypatch.setattr(ops.torch, "empty", spy_empty)
    a = _inputs(seeded("ss-seg", n), d=70, n=n, bmode="var", cmode="var", dtype=torch.float16,
                L=1000)  # fmt: skip
    selective_scan_fn(**a, delta_softplus=True)
    (n1, p1, g1), (n2, p2, g2) = kernel_stand_in.launches
    blocks = -(-70 // (64 // lanes))
    assert n1 == f"m2r_selective_scan_f16_n{tier}_chs" and g1 == (blocks, 2, 2)
    assert n2 == f"m2r_selective_scan_f16_n{tier}_ch" and g2 == (blocks, 2, 3)
    assert p1 == p2
    f = dict(zip((k for k, _ in SelectiveScanParams._fields_), p2, strict=True))
    assert f["seg_len"] == 384  # 1000 / 3 tokens, up to a multiple of 64
    (ws,) = [w for w in workspaces if w.data_ptr() == f["seg_state"]]
    assert ws.numel() == 2 * 70 * 3 * (tier + 1)


@pytest.mark.parametrize(
    ("n", "tier", "split", "lanes"),
    [(16, 16, 2, 2), (20, 32, 2, 4), (64, 64, 2, 8), (16, 16, 4, 4), (20, 32, 4, 8), (64, 64, 4, 16)],
)  # fmt: skip
@pytest.mark.parametrize("segments", [None, 3])
def test_channel_form_split_lanes(kernel_stand_in, n, tier, split, lanes, segments, monkeypatch):
    """The _ch2 / _ch4 kernels: half / a quarter of the state elements a lane, so 2 / 4 times the
    lanes a channel and the blocks; cut into segments, their maps' kernel (_ch2s / _ch4s)
    first, with the segment length and the workspace sized as the whole-lane kernels' are."""
    from mamba2_rocm.ops import selective_scan as ops
    from mamba2_rocm.params import SelectiveScanParams

    monkeypatch.setattr(ops, "kernel_form", "channels")
    monkeypatch.setattr(ops, "channel_split", split)
    monkeypatch.setattr(ops, "channel_segments", segments)
    a = _inputs(seeded("ss-split", n, split), d=70, n=n, bmode="var", cmode="var",
                dtype=torch.float16, L=1000)  # fmt: skip
    selective_scan_fn(**a, delta_softplus=True)
    blocks = -(-70 // (64 // lanes))
    if segments is None:
        ((name, _, grid),) = kernel_stand_in.launches
        assert name == f"m2r_selective_scan_f16_n{tier}_ch{split}" and grid == (blocks, 2, 1)
        return
    (n1, p1, g1), (n2, p2, g2) = kernel_stand_in.launches
    assert n1 == f"m2r_selective_scan_f16_n{tier}_ch{split}s" and g1 == (blocks, 2, 2)
    assert n2 == f"m2r_selective_scan_f16_n{tier}_ch{split}" and g2 == (blocks, 2, 3)
    f = dict(zip((k for k, _ in SelectiveScanParams._fields_), p2, strict=True))
    assert p1 == p2 and f["seg_len"] == 384


@pytest.mark.parametrize(
    ("batch", "dim", "suffix", "channels"),
    [
        (8, 4096, "_ch", 64),  # 512 blocks of the whole-lane kernels: whole lanes
        (6, 4224, "_ch", 64),  # exactly 3 x 132
        (6, 4160, "_ch2", 32),  # 390: halves fill the GPU
        (8, 1536, "_ch4", 16),  # 192: halves (384) do not, quarters (768) do
        (1, 1536, "_ch4", 16),  # 24: at 300 tokens (2 segments) halves stay short
    ],
)
def test_channel_form_splits_lanes_only_below_a_full_gpu(kernel_stand_in, batch, dim, suffix,
                                                         channels, monkeypatch):  # fmt: skip
    """With 132 multiprocessors, the channel form's kernel and grid follow channel_lane_split
    (whose cases at the real lengths are the next test's)."""
    from mamba2_rocm.ops import selective_scan as ops

    monkeypatch.setattr(ops, "kernel_form", "channels")
    monkeypatch.setattr(ops, "channel_segments", 1)  # one launch (segments: tests of their own)
    monkeypatch.setattr(ops, "sm_count", lambda device: 132)
    a = _inputs(seeded("ss-rule", batch, dim), b=batch, d=dim, n=16, bmode="var", cmode="var",
                dtype=torch.bfloat16, L=300)  # fmt: skip
    selective_scan_fn(**a, delta_softplus=True)
    ((name, _, grid),) = kernel_stand_in.launches
    assert name == f"m2r_selective_scan_bf16_n16{suffix}"
    assert grid == (-(-dim // channels), batch, 1)


@pytest.mark.parametrize(
    ("blocks", "seqlen", "sms", "forced", "split"),
    [(512, 2048, 132, None, 1),  # b8 d4096: whole lanes fill the GPU
     (396, 2048, 132, None, 1), (395, 2048, 132, None, 2),  # 3 a multiprocessor
     (256, 2048, 132, None, 2),  # b8 d2048: halves fill it
     (192, 2048, 132, None, 4),  # b8 d1536: halves do not, quarters (768) do
     (149, 2048, 132, None, 4), (148, 2048, 132, None, 2),  # 4.5 a multiprocessor
     (128, 2048, 132, None, 2),  # b4 d2048: halves in 5 segments beat quarters' 512 blocks
     (24, 2048, 132, None, 2),  # b1 d1536: halves, 16 segments (768 blocks)
     (12, 2048, 132, None, 4),  # b1 d768: halves reach 384 blocks at most: quarters
     (12, 8192, 132, None, 2),  # the same width, 64 segments
     (12, 100, 132, None, 4),
     (24, 2048, 0, None, 1),  # no GPU (a stand-in)
     (24, 2048, 132, 1, 1), (512, 2048, 132, 4, 4)],  # forced
)  # fmt: skip
def test_channel_lane_split_rule(blocks, seqlen, sms, forced, split):
    from mamba2_rocm.ops.selective_scan import channel_lane_split

    assert channel_lane_split(blocks, seqlen, sms, forced) == split


def test_channel_lane_split_refuses_other_counts():
    from mamba2_rocm.ops.selective_scan import channel_lane_split

    with pytest.raises(ValueError, match="channel_split must be one of"):
        channel_lane_split(24, 2048, 132, 3)


@pytest.mark.parametrize(
    ("blocks", "seqlen", "sms", "forced", "seg_len"),
    [
        (512, 2048, 132, None, 0),  # batch 8 x 4096 channels: the GPU is full, one segment
        (396, 2048, 132, None, 0),  # three blocks per multiprocessor: full
        (80, 8192, 132, None, 640),  # one 5120-channel sequence: ceil(1056 / 80) = 14 segments
        (24, 600, 132, None, 192),  # segments of at least 128 tokens: 4 of 600, 150 -> 192
        (24, 200, 132, None, 0),  # too short to cut
        (80, 8192, 0, None, 0),  # no GPU (a stand-in): one segment
        (512, 2048, 132, 4, 512),  # forced
        (512, 100, 132, 4, 64),  # forced, down to the 64-token alignment
        (512, 60, 132, 4, 0),  # one aligned segment covers the sequence
    ],
)
def test_channel_segment_length(blocks, seqlen, sms, forced, seg_len):
    from mamba2_rocm.ops.selective_scan import channel_segment_len

    assert channel_segment_len(blocks, seqlen, sms, forced) == seg_len


def test_channel_form_refuses_what_it_cannot_take():
    """Fixed B / C, groups whose channels do not fill whole blocks, dstate past 64 and offsets
    past 32 bits go to the other forms."""
    from types import SimpleNamespace as NS

    from mamba2_rocm.ops.selective_scan import _channel_form_takes

    dims = dict(dim=4096, seqlen=2048, dstate=16, b_groups=1, c_groups=1)
    assert _channel_form_takes(16, NS(**dims))
    assert not _channel_form_takes(16, NS(**{**dims, "b_groups": 0}))
    assert not _channel_form_takes(16, NS(**{**dims, "c_groups": 0}))
    assert _channel_form_takes(16, NS(**{**dims, "b_groups": 8}))  # 512 channels a group
    assert not _channel_form_takes(16, NS(**{**dims, "dim": 96 * 8, "b_groups": 8}))  # 96
    assert _channel_form_takes(64, NS(**{**dims, "dim": 96 * 8, "b_groups": 8}))  # 16 a block
    assert not _channel_form_takes(128, NS(**{**dims, "dstate": 100}))
    assert not _channel_form_takes(16, NS(**{**dims, "seqlen": 2**25}))  # 64 rows of 2^25
    assert _channel_form_takes(16, NS(**{**dims, "seqlen": 2**25 - 1}))


def test_kernel_path_trains_through_the_backward_op(kernel_stand_in, monkeypatch):
    """With the launches stood in for (the forward by the float64 ground truth, the backward
    kernel by the PyTorch tier's autograd), the public function takes the eager training entry
    and its backward calls the backward kernel's host code once, which gives the ground
    truth's gradients for every input."""
    from mamba2_rocm.ops import selective_scan as ops

    ran, bwd = [], []

    def stand_in(kset, u, delta, A, B, C, D, z, delta_bias, softplus, dims, out, last):
        ran.append(1)
        res = selective_scan_ref(u, delta, A, B, C, D, z, delta_bias, softplus, True)
        out.copy_(res[0])
        if last is not None:
            last.copy_(res[1])
        return B.float().contiguous(), C.float().contiguous()  # (what the kernel read)

    def bwd_stand_in(kset, u, delta, A, B, C, D, z, delta_bias, softplus, dims, dout, dlast,
                     bc):  # fmt: skip
        bwd.append(1)
        return ops._torch_grads((u, delta, A, B, C, D, z, delta_bias), softplus, dout, dlast)

    monkeypatch.setattr(ops, "_kernel", stand_in)
    monkeypatch.setattr(ops, "_bwd_kernel", bwd_stand_in)
    _train_against_ground_truth("ss-kernel-train", 30, "grouped", "fixed", check_forward=True)
    assert ran == [1] and bwd == [1]


@pytest.mark.parametrize(("bmode", "cmode", "groups", "kind"), [
    ("var", "var", 1, "vv"), ("grouped", "fixed", 2, "vf"), ("fixed", "grouped", 2, "fv"),
    ("fixed", "fixed", 1, "ff"), ("var", "grouped", 2, "vv"),
])  # fmt: skip
@pytest.mark.parametrize("with_z", [False, True])
@pytest.mark.parametrize("ranges", [1, 2])
def test_backward_launch_fields(kernel_stand_in, bmode, cmode, groups, kind, with_z, ranges,
                                monkeypatch):  # fmt: skip
    """The backward's two launches: the carries' kernel (a block per 4 channels of a group),
    then the gradients' over (groups x slices, batch, chunk ranges), each by B / C kind and z,
    on the same buffers and told the ranges; variable B / C padded to 256-token rows, zeros for
    the absent D / delta_bias / last state's gradient, the chunk capacity for 128-token chunks,
    every slice with channels, dD / ddelta_bias partials per chunk range. One range where the
    slices fill the grid the host aims at (the CPU counts as one multiprocessor), 300 tokens'
    two where they do not."""
    from mamba2_rocm.ops import selective_scan as ops
    from mamba2_rocm.params import SelectiveScanBwdParams

    if ranges == 2:
        monkeypatch.setattr(ops, "BWD_BLOCKS_PER_SM", 64)  # more blocks than 2 x groups x tiles

    a = _inputs(seeded("ss-bwd-launch", bmode, cmode), d=20, n=5, L=300, bmode=bmode,
                cmode=cmode, dtype=torch.bfloat16)  # fmt: skip
    z = torch.randn(2, 20, 300).to(torch.bfloat16) if with_z else None
    dims = ops.check_selective_scan_args(a["u"], a["delta"], a["A"], a["B"], a["C"], None, z)
    dout = torch.randn(2, 20, 300).to(torch.bfloat16)
    grads = ops._bwd_impl(a["u"], a["delta"], a["A"], a["B"], a["C"], None, z, None, True,
                          dout, None)  # fmt: skip
    (cname, cparams, cgrid), (name, params, grid) = kernel_stand_in.launches
    tail = f"bf16_{kind}{'_z' if with_z else ''}"
    assert cname == f"m2r_selective_scan_bwd_carry_{tail}"
    assert name == f"m2r_selective_scan_bwd_{tail}"
    names = [k for k, _ in SelectiveScanBwdParams._fields_]
    c = dict(zip(names, cparams, strict=True))
    f = dict(zip(names, params, strict=True))
    assert {k: v for k, v in c.items() if k not in ("slices", "slice_ch")} == {
        k: v for k, v in f.items() if k not in ("slices", "slice_ch")
    }  # the same buffers and sizes: the carries reach the gradients' kernel through ckpt / wckpt
    tiles = -(-(20 // groups) // 4)
    assert (c["slices"], c["slice_ch"]) == (tiles, 4) and cgrid == (groups * tiles, 2, 1)
    assert c["ckpt"] != 0 and c["wckpt"] != 0 and c["ckpt"] != c["wckpt"]
    assert f["groups"] == groups and grid == (groups * f["slices"], 2, ranges)
    assert f["ranges"] == c["ranges"] == ranges
    assert f["ld"] == 512 and f["nck"] == 3  # 300 tokens: two 256-token rows, three 128-chunks
    assert f["slice_ch"] % 4 == 0 and (f["slices"] - 1) * f["slice_ch"] < 20 // groups
    assert all(f[k] != 0 for k in ("D", "delta_bias", "dlast", "dD_part", "ddb_part"))
    assert (f["z"] != 0) == with_z and (f["dz"] != 0) == with_z
    assert f["u"] == a["u"].data_ptr() and f["dout"] == dout.data_ptr()  # contiguous: as they are
    assert (f["b_groups"], f["c_groups"]) == (dims.b_groups, dims.c_groups)
    shapes = [g.shape for g in grads]
    assert shapes[:5] == [a[k].shape for k in ("u", "delta", "A", "B", "C")]
    assert shapes[5] == shapes[7] == (0,) and shapes[6] == ((2, 20, 300) if with_z else (0,))


@pytest.mark.parametrize(("batch", "groups", "gdim", "seqlen", "sms", "cap", "want"), [
    (1, 1, 1536, 2048, 132, 256, (128, 12, 8)),  # mamba-130m: 8 ranges, 3 tiles a slice
    (1, 1, 1536, 2048, 132, 40, (39, 40, 8)),  # the partials' cap
    (8, 1, 4096, 2048, 132, None, (128, 32, 1)),  # fixed B / C: no cap; the slices fill it
    (1, 1, 5120, 8192, 132, None, (640, 8, 1)),  # 1280 tiles: one range
    (2, 4, 10, 100, 132, 1000, (3, 4, 1)),  # fewer channels than the grid wants: a tile each
    (1, 1, 1536, 2048 * 1024, 132, None, (1, 1536, 8192)),  # ranges alone fill the GPU
])  # fmt: skip
def test_backward_grid(batch, groups, gdim, seqlen, sms, cap, want):
    """The gradients' grid: channel slices up to BWD_BLOCKS_PER_SM blocks a multiprocessor,
    under the partials' cap and the group's tiles; a chunk range per 256 tokens only where the
    slices cannot reach that alone (one range otherwise: the carries skip their backward walk);
    every slice has channels, and the slices cover the group."""
    from mamba2_rocm.ops import selective_scan as ops

    slices, slice_ch, ranges = ops.bwd_grid(batch, groups, gdim, seqlen, sms, cap)
    assert (slices, slice_ch, ranges) == want
    assert slice_ch % 4 == 0 and (slices - 1) * slice_ch < gdim <= slices * slice_ch
    assert batch * groups * slices * ranges <= max(
        ops.BWD_BLOCKS_PER_SM * sms + batch * groups * ranges, batch * groups * ranges
    )


def test_backward_checks_its_output_gradients():
    from mamba2_rocm.ops import selective_scan as ops

    a = _inputs(seeded("ss-bwd-bad"), d=4, n=3, L=10, bmode="var", cmode="var")
    args = (a["u"], a["delta"], a["A"], a["B"], a["C"], None, None, None, False)
    with pytest.raises(ValueError, match="dout must be"):
        ops._bwd_impl(*args, torch.zeros(2, 4, 9), None)
    with pytest.raises(TypeError, match="dout must be floating"):
        ops._bwd_impl(*args, torch.zeros(2, 4, 10, dtype=torch.int32), None)
    with pytest.raises(ValueError, match="last state's gradient must be"):
        ops._bwd_impl(*args, torch.zeros(2, 4, 10), torch.zeros(2, 4, 4))
    with pytest.raises(TypeError, match="last state's gradient must be"):
        ops._bwd_impl(*args, torch.zeros(2, 4, 10), torch.zeros(2, 4, 3, dtype=torch.float64))
    fake = ops.selective_scan_bwd  # the registered op's fake checks the same
    with pytest.raises(ValueError, match="dout must be"):
        fake(*(t.to("meta") if isinstance(t, torch.Tensor) else t for t in args),
             torch.zeros(2, 4, 9, device="meta"), None)  # fmt: skip


# --- mamba_inner_fn: the Mamba1 block, against a float64 composition of the references ------


def _inner_ref(xz, conv_w, conv_b, x_proj, dt_proj, out_w, out_b, A, D, dt_bias, rms, eps):
    from mamba2_rocm.reference.conv1d import causal_conv1d_eager
    from mamba2_rocm.reference.ssd import rmsnorm_ref

    b, _, L = xz.shape
    d, n, r = A.shape[0], A.shape[1], dt_proj.shape[1]
    x, z = xz[:, :d], xz[:, d:]
    x = causal_conv1d_eager(x, conv_w, conv_b, silu=True, compute_dtype=torch.float64)[0]
    rows = x.transpose(1, 2).reshape(b * L, d) @ x_proj.t()
    dt, Bv, Cv = rows[:, :r] @ dt_proj.t(), rows[:, r : r + n], rows[:, r + n :]
    if rms is not None:
        Bv, Cv, dt = (
            rmsnorm_ref(v, w, None, eps=eps) for v, w in zip((Bv, Cv, dt), rms, strict=True)
        )
    to_bdl = lambda v: v.reshape(b, L, -1).transpose(1, 2)  # noqa: E731
    y = selective_scan_ref(x, to_bdl(dt), A, to_bdl(Bv), to_bdl(Cv), D, z, dt_bias, True)
    return y.transpose(1, 2) @ out_w.t() + out_b


@pytest.mark.parametrize("rms", [False, True])
def test_mamba_inner_fn_forward_and_gradients(rms):
    from mamba2_rocm import mamba_inner_fn

    g = seeded("inner", rms)
    b, d, L, n, r, width = 2, 12, 33, 8, 3, 4
    t = dict(xz=torch.randn(b, 2 * d, L, generator=g), conv_w=torch.randn(d, 1, width, generator=g) * 0.5,
             conv_b=torch.randn(d, generator=g), x_proj=torch.randn(r + 2 * n, d, generator=g) * 0.3,
             dt_proj=torch.randn(d, r, generator=g) * 0.3, out_w=torch.randn(10, d, generator=g),
             out_b=torch.randn(10, generator=g), A=-torch.rand(d, n, generator=g) - 0.2,
             D=torch.randn(d, generator=g), dt_bias=torch.randn(d, generator=g) * 0.1)  # fmt: skip
    rms_w = (torch.randn(n, generator=g) + 2, torch.randn(n, generator=g) + 2,
             torch.randn(d, generator=g) + 2) if rms else None  # fmt: skip
    ours = {k: v.clone().requires_grad_() for k, v in t.items()}
    ref = {k: v.double().requires_grad_() for k, v in t.items()}
    kw = dict(b_rms_weight=rms_w[0], c_rms_weight=rms_w[1], dt_rms_weight=rms_w[2]) if rms else {}
    out = mamba_inner_fn(ours["xz"], ours["conv_w"], ours["conv_b"], ours["x_proj"], ours["dt_proj"],
                         ours["out_w"], ours["out_b"], ours["A"], D=ours["D"],
                         delta_bias=ours["dt_bias"], **kw)  # fmt: skip
    want = _inner_ref(ref["xz"], ref["conv_w"].squeeze(1), ref["conv_b"], ref["x_proj"],
                      ref["dt_proj"], ref["out_w"], ref["out_b"], ref["A"], ref["D"],
                      ref["dt_bias"], None if not rms else tuple(w.double() for w in rms_w), 1e-6)  # fmt: skip
    assert out.shape == (b, L, 10)
    torch.testing.assert_close(out, want.float(), rtol=1e-4, atol=1e-4)
    cot = torch.randn(out.shape, generator=g)
    out.backward(cot)
    want.backward(cot.double())
    for k in ours:
        torch.testing.assert_close(ours[k].grad, ref[k].grad.float(), rtol=2e-4, atol=2e-4,
                                   msg=lambda m, k=k: f"d{k}: {m}")  # fmt: skip


@pytest.mark.parametrize("rms", [False, True])
def test_mamba_inner_fn_hands_the_scan_its_layout(rms, monkeypatch):
    """Without a dt norm, delta comes out of one batched product as the scan's contiguous
    (batch, dim, seqlen), which the scan reads without a copy, forward and backward (a
    (batch * seqlen, dim) product read as (batch, dim, seqlen) was copied twice a step)."""
    from mamba2_rocm.ops import mamba1

    seen = []
    real = mamba1.selective_scan_fn

    def spy(u, delta, *args, **kwargs):
        seen.append(delta.is_contiguous())
        return real(u, delta, *args, **kwargs)

    monkeypatch.setattr(mamba1, "selective_scan_fn", spy)
    g = seeded("inner-layout", rms)
    b, d, L, n, r = 2, 12, 33, 8, 3
    kw = dict(dt_rms_weight=torch.randn(d, generator=g) + 2) if rms else {}
    out = mamba1.mamba_inner_fn(
        torch.randn(b, 2 * d, L, generator=g), torch.randn(d, 4, generator=g), None,
        torch.randn(r + 2 * n, d, generator=g), torch.randn(d, r, generator=g),
        torch.randn(10, d, generator=g), None, -torch.rand(d, n, generator=g), **kw,
    )  # fmt: skip
    assert out.shape == (b, L, 10) and seen == [not rms]


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"checkpoint_lvl": 2}, ValueError, "checkpoint_lvl must be 0 or 1"),
        ({"x_proj_weight": torch.zeros(5, 4)}, ValueError, r"x_proj_weight must be \(dt_rank \+ dstate \+ dstate = 2, dim = 4\)"),
        ({"A": torch.zeros(4, 1, dtype=torch.complex64)}, ValueError,
         r"x_proj_weight must be \(dt_rank \+ 2 \* dstate \+ 2 \* dstate = 6, dim = 4\)"),
        ({"A": torch.zeros(4, 1, dtype=torch.complex64), "b_rms_weight": torch.ones(1)},
         NotImplementedError, "b_rms_weight / c_rms_weight with complex A"),
        ({"xz": torch.zeros(1, 7, 5)}, ValueError, r"xz must be \(batch, 2 \* dim, seqlen\)"),
    ],
)  # fmt: skip
def test_mamba_inner_fn_bad_inputs(change, error, message):
    from mamba2_rocm import mamba_inner_fn

    args = dict(xz=torch.zeros(1, 8, 5), conv1d_weight=torch.zeros(4, 4), conv1d_bias=None,
                x_proj_weight=torch.zeros(2, 4), delta_proj_weight=torch.zeros(4, 2),
                out_proj_weight=torch.zeros(3, 4), out_proj_bias=None, A=torch.zeros(4, 0))  # fmt: skip
    args.update(change)
    with pytest.raises(error, match=message):
        mamba_inner_fn(**args)


def test_opcheck_with_gradients():
    """The registered op (autograd by recomputation): schema, fake tensor, autograd
    registration, AOT dispatch; with and without the last state and the optional inputs."""
    from mamba2_rocm.ops.selective_scan import selective_scan_op

    g = seeded("ss-opcheck")
    a = _inputs(g, L=21, bmode="fixed", cmode="grouped")
    a.update(D=torch.randn(8, generator=g), z=torch.randn(2, 8, 21, generator=g),
             delta_bias=torch.rand(8, generator=g))  # fmt: skip
    args = tuple(
        a[k].requires_grad_() for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")
    )
    torch.library.opcheck(selective_scan_op, (*args, True, True))
    torch.library.opcheck(selective_scan_op, (*args[:5], None, None, None, False, False))


@pytest.mark.parametrize("with_last", [False, True])
def test_backward_op_through_the_dispatcher(with_last):
    """The registered backward op (what the scan's autograd formula calls while tracing),
    called through the dispatcher on the CPU, gives the ground truth's gradients (its body
    differentiates the PyTorch tier by torch.func, which works below the dispatcher's autograd);
    its fake gives every gradient's shape and dtype. (opcheck's cross-checking modes cannot
    look inside torch.func's tensor wrappers, so it does not run on this op.)"""
    from mamba2_rocm.ops.selective_scan import selective_scan_bwd

    g = seeded("ss-opcheck-bwd", with_last)
    a = _inputs(g, L=21, bmode="var", cmode="grouped")
    D, z = torch.randn(8, generator=g), torch.randn(2, 8, 21, generator=g)
    bias = torch.rand(8, generator=g)
    dout = torch.randn(2, 8, 21, generator=g)
    dlast = torch.randn(2, 8, 16, generator=g) if with_last else None
    args = (a["u"], a["delta"], a["A"], a["B"], a["C"], D, z, bias, True, dout, dlast)
    meta = [t.to("meta") if isinstance(t, torch.Tensor) else t for t in args]
    fake = selective_scan_bwd(*meta)
    assert [(f.shape, f.dtype) for f in fake] == [(t.shape, t.dtype) for t in args[:8]]
    got = selective_scan_bwd(*args)
    leaves = {k: v.clone().double().requires_grad_() for k, v in
              dict(u=a["u"], delta=a["delta"], A=a["A"], B=a["B"], C=a["C"], D=D, z=z,
                   delta_bias=bias).items()}  # fmt: skip
    out, last = selective_scan_ref(**leaves, delta_softplus=True, return_last_state=True)
    outs, cots = [out], [dout.double()]
    if with_last:
        outs.append(last)
        cots.append(dlast.double())
    torch.autograd.backward(outs, cots)
    for name, gv, leaf in zip(leaves, got, leaves.values(), strict=True):
        torch.testing.assert_close(gv.double(), leaf.grad, rtol=1e-4, atol=1e-4, msg=name)


def test_compiles_forward_and_backward_without_graph_breaks():
    """torch.compile(fullgraph=True) traces the op and its autograd formula (aot_eager on the
    CPU); the gradients equal the eager ones."""
    g = seeded("ss-compile")
    a = _inputs(g, L=21)
    a.update(D=torch.randn(8, generator=g))
    leaves = {k: v.clone().requires_grad_() for k, v in a.items()}

    @torch.compile(fullgraph=True, backend="aot_eager")
    def loss(kw):
        return selective_scan_fn(**kw, delta_softplus=True).square().sum()

    loss(leaves).backward()
    eager = {k: v.clone().requires_grad_() for k, v in a.items()}
    selective_scan_fn(**eager, delta_softplus=True).square().sum().backward()
    for k in leaves:
        torch.testing.assert_close(leaves[k].grad, eager[k].grad, rtol=1e-5, atol=1e-5)


# --- complex A (mamba_ssm's S4D-complex variant): the PyTorch tiers


def _complex_loop(u, delta, A, B, C, D, z, delta_bias, softplus):
    """mamba_ssm's complex-A semantics written out element by element (float64 / complex128):
    a variable B / C holds (real, imaginary) of token t at 2t, 2t + 1; y = 2 Re(sum_n C h)."""
    batch, dim, L = u.shape
    n = A.shape[1]

    def at(t, groups, b, d, s, k):
        if t.dim() == 2:
            return complex(t[d, k])
        row = t[b, k] if t.dim() == 3 else t[b, d // (dim // groups), k]
        return complex(float(row[2 * s]), float(row[2 * s + 1]))

    out = torch.zeros(batch, dim, L, dtype=torch.float64)
    last = torch.zeros(batch, dim, n, dtype=torch.complex128)
    gb = B.shape[1] if B.dim() == 4 else 1
    gc = C.shape[1] if C.dim() == 4 else 1
    for b in range(batch):
        for d in range(dim):
            h = [0j] * n
            for s in range(L):
                dl = float(delta[b, d, s]) + (float(delta_bias[d]) if delta_bias is not None else 0)
                if softplus:
                    dl = math.log1p(math.exp(dl)) if dl <= 20 else dl
                y = 0j
                for k in range(n):
                    h[k] = cmath.exp(dl * complex(A[d, k])) * h[k] + dl * at(
                        B, gb, b, d, s, k
                    ) * float(u[b, d, s])
                    y += at(C, gc, b, d, s, k) * h[k]
                v = 2 * y.real + (float(D[d]) * float(u[b, d, s]) if D is not None else 0)
                if z is not None:
                    zz = float(z[b, d, s])
                    v *= zz / (1 + math.exp(-zz))
                out[b, d, s] = v
            last[b, d] = torch.tensor(h, dtype=torch.complex128)
    return out, last


def _complex_inputs(g, b=2, d=4, L=7, n=3, bmode="var", cmode="fixed"):
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    shapes = {"var": (b, n, 2 * L), "grouped": (b, 2, n, 2 * L)}

    def bc(mode):
        return torch.complex(r(d, n), r(d, n)) if mode == "fixed" else r(*shapes[mode])

    A = torch.complex(-torch.rand(d, n, generator=g, dtype=torch.float64) - 0.1, r(d, n))
    return dict(u=r(b, d, L), delta=torch.rand(b, d, L, generator=g, dtype=torch.float64) * 0.5,
                A=A, B=bc(bmode), C=bc(cmode), D=r(d), z=r(b, d, L),
                delta_bias=torch.rand(d, generator=g, dtype=torch.float64) * 0.3)  # fmt: skip


@pytest.mark.parametrize("bmode, cmode", [("var", "fixed"), ("fixed", "var"), ("grouped", "var"),
                                          ("fixed", "fixed")])  # fmt: skip
def test_complex_a_follows_mamba_ssm_semantics(bmode, cmode):
    a = _complex_inputs(seeded("ss complex", bmode, cmode), bmode=bmode, cmode=cmode)
    want, want_last = _complex_loop(*a.values(), True)
    ref, ref_last = selective_scan_ref(**a, delta_softplus=True, return_last_state=True)
    torch.testing.assert_close(ref, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ref_last, want_last, rtol=1e-10, atol=1e-10)
    assert ref_last.dtype == torch.complex128
    # the torch tier, as a float32 / complex64 caller uses it
    f = {k: (v.to(torch.complex64) if v.is_complex() else v.float()) for k, v in a.items()}
    out, last = selective_scan_fn(**f, delta_softplus=True, return_last_state=True)
    assert out.dtype == torch.float32 and last.dtype == torch.complex64
    torch.testing.assert_close(out, want.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last, want_last.to(torch.complex64), rtol=1e-4, atol=1e-4)


def test_complex_a_gradients_by_gradcheck():
    a = _complex_inputs(seeded("ss complex grad"), b=1, d=2, L=5, n=2, bmode="var", cmode="fixed")
    a = {k: v.requires_grad_() for k, v in a.items()}
    names = list(a)

    def f(*xs):
        out, last = selective_scan_torch(**dict(zip(names, xs, strict=True)), delta_softplus=True,
                                         return_last_state=True, compute_dtype=torch.float64)  # fmt: skip
        return out, torch.view_as_real(last)

    assert torch.autograd.gradcheck(f, tuple(a.values()))


def test_mamba_inner_fn_with_complex_a_matches_the_composition():
    """The block with complex A: per-token B / C from 2 * dstate x_proj columns each, read as
    (real, imaginary) pairs; the same as the scan called on them directly."""
    from mamba2_rocm import causal_conv1d_fn, mamba_inner_fn

    g = seeded("inner complex")
    b, d, L, n, rank = 2, 4, 6, 3, 2
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    xz, cw, cb = r(b, 2 * d, L), r(d, 4), r(d)
    xw, dw, ow = r(rank + 4 * n, d), r(d, rank), r(5, d)
    A = torch.complex(-torch.rand(d, n, generator=g) - 0.1, r(d, n))
    D, db = r(d), torch.rand(d, generator=g) * 0.3
    out = mamba_inner_fn(xz, cw, cb, xw, dw, ow, None, A, None, None, D, db)
    x = causal_conv1d_fn(xz[:, :d], cw, cb, activation="silu")
    dbl = torch.einsum("bdl,kd->blk", x, xw)
    delta = torch.einsum("blr,dr->bdl", dbl[..., :rank], dw)
    Bp = dbl[..., rank : rank + 2 * n].reshape(b, L, n, 2).permute(0, 2, 1, 3).reshape(b, n, 2 * L)
    Cp = dbl[..., rank + 2 * n :].reshape(b, L, n, 2).permute(0, 2, 1, 3).reshape(b, n, 2 * L)
    y = selective_scan_fn(x, delta, A, Bp, Cp, D, xz[:, d:], db, True)
    torch.testing.assert_close(out, torch.einsum("bdl,od->blo", y, ow), rtol=1e-4, atol=1e-4)
    xz.requires_grad_()
    mamba_inner_fn(
        xz, cw, cb, xw, dw, ow, None, A.requires_grad_(), None, None, D, db
    ).sum().backward()
    assert xz.grad.isfinite().all() and A.grad.dtype == torch.complex64


@pytest.mark.parametrize(("batch", "gdim", "seqlen", "cap", "want"), [
    (8, 4096, 2048, 256, (49, 84, 1)),  # 392 blocks: one wave of 396 (3 a multiprocessor)
    (1, 1536, 2048, 256, (48, 32, 8)),  # 384 blocks of 8 tiles (was 1024 of 3: 3 waves)
    (1, 768, 2048, 256, (48, 16, 8)),
    (8, 2048, 2048, 128, (37, 56, 8)),
    (2, 40, 100, None, (10, 4, 1)),  # a tile a slice: 20 blocks, less than a wave
])  # fmt: skip
def test_backward_grid_fits_whole_waves(batch, gdim, seqlen, cap, want):
    """Where the runtime tells how many gradients blocks a multiprocessor holds (3 of 132 on
    the H100), the slices take the tiles whose waves times tiles a block is least; of equals the
    fewest slices. The ranges are chosen as without it."""
    from mamba2_rocm.ops import selective_scan as ops

    got = ops.bwd_grid(batch, 1, gdim, seqlen, 132, cap, 3)
    assert got == want
    slices, slice_ch, ranges = got
    assert ranges == ops.bwd_grid(batch, 1, gdim, seqlen, 132, cap)[2]
    assert slice_ch % 4 == 0 and (slices - 1) * slice_ch < gdim <= slices * slice_ch
    assert slices <= (cap or gdim)


def test_wave_fit_tiles_is_the_least_cost():
    """Against every tiles-a-slice choice, by brute force: no other has fewer waves x tiles,
    and none of equal cost has fewer slices."""
    from mamba2_rocm.ops import selective_scan as ops

    for tiles, most, others, slots in [(1024, 256, 8, 396), (384, 256, 8, 396), (10, 10, 16, 396),
                                       (1280, 320, 32, 396), (97, 5, 3, 7), (1, 1, 1, 1)]:  # fmt: skip
        per = ops.wave_fit_tiles(tiles, most, others, slots)

        def cost(p, tiles=tiles, others=others, slots=slots):
            return -(-others * -(-tiles // p) // slots) * p

        allowed = [p for p in range(1, tiles + 1) if -(-tiles // p) <= most]
        assert per in allowed
        assert cost(per) == min(cost(p) for p in allowed)
        assert -(-tiles // per) == min(-(-tiles // p) for p in allowed if cost(p) == cost(per))


def test_backward_reads_whole_rows_in_place(kernel_stand_in):
    """Variable float32 B / C whose rows are whole 256-token rows already go to the backward's
    kernels as they are (no padded copy); one zero-filled workspace holds the partials."""
    from mamba2_rocm.ops import selective_scan as ops
    from mamba2_rocm.params import SelectiveScanBwdParams

    a = _inputs(seeded("ss-bwd-rows"), d=8, n=4, L=256, bmode="var", cmode="var",
                dtype=torch.bfloat16)  # fmt: skip
    dout = torch.randn(2, 8, 256).to(torch.bfloat16)
    ops._bwd_impl(a["u"], a["delta"], a["A"], a["B"], a["C"], None, None, None, True, dout, None)
    _, (_, params, _) = kernel_stand_in.launches
    f = dict(zip((k for k, _ in SelectiveScanBwdParams._fields_), params, strict=True))
    assert f["ld"] == 256 and f["B"] == a["B"].data_ptr() and f["C"] == a["C"].data_ptr()
    parts = sorted(f[k] for k in ("dA_part", "dB_part", "dC_part"))
    assert parts[2] - parts[0] < (1 << 20)  # carved from one buffer


def test_carved_buffers_are_aligned_and_disjoint():
    from mamba2_rocm.ops import selective_scan as ops

    a, b, c = ops.carved(torch.zeros, "cpu", (3, 5), (7,), (2, 2, 2))
    assert (a.shape, b.shape, c.shape) == ((3, 5), (7,), (2, 2, 2))
    starts = [t.data_ptr() for t in (a, b, c)]
    assert all((s - starts[0]) % (ops._CARVE_ALIGN * 4) == 0 for s in starts)
    assert starts[1] - starts[0] >= 15 * 4 and starts[2] - starts[1] >= 7 * 4
    a.fill_(1), b.fill_(2), c.fill_(3)
    assert a.sum() == 15 and b.sum() == 14 and c.sum() == 24  # no overlap


def test_backward_copies_misaligned_whole_rows(kernel_stand_in):
    """Whole rows, but a float32 B that starts 4 bytes into its storage: the kernel reads rows in
    16-byte runs, so it gets an aligned copy, never the misaligned tensor."""
    from mamba2_rocm.ops import selective_scan as ops
    from mamba2_rocm.params import SelectiveScanBwdParams

    a = _inputs(seeded("ss-bwd-misaligned"), d=8, n=4, L=256, bmode="var", cmode="var",
                dtype=torch.bfloat16)  # fmt: skip
    B = torch.empty(a["B"].numel() + 1)[1:].view(a["B"].shape).copy_(a["B"])
    assert B.is_contiguous() and B.data_ptr() % 16 != 0
    dout = torch.randn(2, 8, 256).to(torch.bfloat16)
    ops._bwd_impl(a["u"], a["delta"], a["A"], B, a["C"], None, None, None, True, dout, None)
    _, (_, params, _) = kernel_stand_in.launches
    f = dict(zip((k for k, _ in SelectiveScanBwdParams._fields_), params, strict=True))
    assert f["B"] != B.data_ptr() and f["B"] % 16 == 0 and f["C"] == a["C"].data_ptr()


@pytest.mark.parametrize(("L", "kept"), [(256, True), (512, True), (250, False)])
def test_training_reads_the_forwards_float32_bc(kernel_stand_in, L, kept):
    """Eager training keeps the float32 copies of bf16 B / C the forward's kernel read and the
    backward reads those (no second conversion to float32) where their rows are whole;
    elsewhere the backward converts B / C into padded rows of its own, as before."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from mamba2_rocm.params import SelectiveScanBwdParams

    class Conversions(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            copies = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)
            if func in copies and out.dtype == torch.float32:
                self.seen.append(tuple(out.shape))
            return out

    a = _inputs(seeded("ss-kept", L), d=8, n=4, L=L, dtype=torch.bfloat16)
    a["B"], a["C"] = a["B"].to(torch.bfloat16), a["C"].to(torch.bfloat16)
    ins = {k: v.requires_grad_() for k, v in a.items()}
    out = selective_scan_fn(**ins)
    with Conversions() as mode:
        torch.autograd.grad(out, list(ins.values()), torch.randn_like(out))
    assert mode.seen == ([] if kept else [(2, 1, 4, L)] * 2)
    for _, p, _ in kernel_stand_in.launches[1:]:
        b = dict(zip((k for k, _ in SelectiveScanBwdParams._fields_), p, strict=True))
        assert b["ld"] == (L if kept else 256)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kept_bc_go_through_saved_tensor_hooks(kernel_stand_in, dtype):
    """The kept copies of 16-bit B / C are saved as the inputs are: activation checkpointing's
    and offloading's hooks see them (and may drop or move them). A float32 contiguous B / C is
    read as it is by both kernels: nothing besides the inputs is saved."""
    a = _inputs(seeded("ss-hooks"), d=8, n=4, L=256, dtype=dtype)
    a["B"], a["C"] = a["B"].to(dtype), a["C"].to(dtype)
    ins = {k: v.requires_grad_() for k, v in a.items()}
    packed = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = selective_scan_fn(**ins)
    extra = [(t.dtype, tuple(t.shape)) for t in packed if all(t is not v for v in ins.values())]
    assert extra == ([(torch.float32, (2, 4, 256))] * 2 if dtype == torch.bfloat16 else [])
    torch.autograd.grad(out, list(ins.values()), torch.randn_like(out))


def test_absent_operands_read_zeros_from_the_workspace(kernel_stand_in):
    """No D, no delta_bias and no last-state gradient: the kernels read zeros cut from the
    partials' zero-filled buffer, no fill of their own."""
    from mamba2_rocm.ops import selective_scan as ops
    from mamba2_rocm.params import SelectiveScanBwdParams

    a = _inputs(seeded("ss-absent"), d=8, n=4, L=256, dtype=torch.bfloat16)
    dout = torch.randn(2, 8, 256).to(torch.bfloat16)
    made = []
    real = ops.carved

    def carved(make, device, *shapes):
        views = real(make, device, *shapes)
        made.append((make, views))
        return views

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops, "carved", carved)
        ops._bwd_impl(a["u"], a["delta"], a["A"], a["B"], a["C"], None, None, None, True, dout,
                      None)  # fmt: skip
    _, (_, params, _) = kernel_stand_in.launches
    f = dict(zip((k for k, _ in SelectiveScanBwdParams._fields_), params, strict=True))
    (zeroed,) = [views for make, views in made if make is torch.zeros]
    blank = {v.data_ptr(): v for v in zeroed[3:]}
    assert set(blank) == {f["D"], f["delta_bias"], f["dlast"]}
    shapes = [tuple(blank[f[k]].shape) for k in ("D", "delta_bias", "dlast")]
    assert shapes == [(8,), (8,), (2, 8, 4)]


def test_gradient_through_the_last_state_alone(kernel_stand_in):
    """Only the last state used: out's gradient is never materialized by autograd; the
    backward reads zeros for it and still runs the kernels."""
    a = _inputs(seeded("ss-last"), d=8, n=4, L=256, dtype=torch.bfloat16)
    ins = {k: v.requires_grad_() for k, v in a.items()}
    _, last = selective_scan_fn(**ins, return_last_state=True)
    grads = torch.autograd.grad(last.sum(), list(ins.values()))
    assert [g.shape for g in grads] == [v.shape for v in ins.values()]
    assert len(kernel_stand_in.launches) == 3  # forward, carries, gradients


@pytest.mark.parametrize(("gb", "gc"), [(0, 0), (1, 1), (2, 2), (2, 1), (1, 2), (0, 2), (1, 0)])
@pytest.mark.parametrize(("bdt", "cdt"), [(torch.bfloat16, torch.bfloat16),
                                          (torch.float32, torch.bfloat16)])  # fmt: skip
@pytest.mark.parametrize("extras", [True, False])
def test_summed_partials_match_plain_sums(gb, gc, bdt, cdt, extras):
    """The backward's partials reduced in as few launches as the layouts allow give the sums
    taken one by one (on the CPU exactly; a GPU may order a stacked reduction differently)."""
    from mamba2_rocm.ops import selective_scan as ops
    from mamba2_rocm.ops.checks import ScanDims

    g = seeded("ss-sums", gb, gc, str(bdt), extras)
    batch, dim, L, N, nck, slices, ranges = 3, 10, 300, 5, 3, 4, 2
    groups, ld = math.lcm(gb or 1, gc or 1), 512
    dims = ScanDims(batch, dim, L, N, gb, gc)
    per_chunk, var_part = (batch, dim, nck, N), (batch, groups, slices, N, ld)
    parts = ops.carved(torch.zeros, "cpu", per_chunk, var_part if gb else per_chunk,
                       var_part if gc else per_chunk)  # fmt: skip
    for p in parts:
        p.copy_(torch.randn(p.shape, generator=g))
    dDb = torch.randn(2, ranges, batch, dim, generator=g)
    shape = lambda k: (dim, N) if not k else (batch, N, L) if k == 1 else (batch, k, N, L)  # noqa: E731
    A = torch.zeros(dim, N)
    B, C = torch.zeros(shape(gb), dtype=bdt), torch.zeros(shape(gc), dtype=cdt)
    D = delta_bias = torch.zeros(dim, dtype=torch.bfloat16) if extras else None
    got = ops.summed_partials(*parts, dDb, A, B, C, D, delta_bias, dims, groups)

    def plain(part, t, k):
        if not k:
            return part.sum((0, 2)).to(t.dtype)
        s = part[..., :L].sum(2)
        if k < groups:
            s = s.view(batch, k, groups // k, N, L).sum(2)
        return s.reshape(t.shape).to(t.dtype)

    want = (parts[0].sum((0, 2)), plain(parts[1], B, gb), plain(parts[2], C, gc),
            dDb[0].sum((0, 1)).to(torch.bfloat16) if extras else None,
            dDb[1].sum((0, 1)).to(torch.bfloat16) if extras else None)  # fmt: skip
    for a, b in zip(got, want, strict=True):
        if b is None:
            assert a is None
        else:
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a, b)


def test_stacked_refuses_uneven_parts():
    from mamba2_rocm.ops import selective_scan as ops

    a, b, c = ops.carved(torch.zeros, "cpu", (4, 3), (4, 3), (2, 6))
    assert ops.stacked(a, b).shape == (2, 4, 3)
    with pytest.raises(ValueError, match="equally shaped"):
        ops.stacked(a, b, c)
