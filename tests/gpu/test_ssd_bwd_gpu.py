"""The SSD scan's backward kernels (csrc/ssd_bwd_*.hip) on a GPU against float64 references:
every dtype, odd sizes (partial headdim / dstate tiles, seqlen around the chunk edges), the
three chunk sizes, groups, seq_idx restarts inside chunks and at their edges, initial states
and the final state's gradient, dt_limit, long sequences, poisoned outputs, bit-identical
reruns, and the training entry points (eager autograd, torch.compile) reaching the kernels.

The op is called directly (``mamba_chunk_scan_combined_bwd``, what the scan's autograd formula
calls), with the torch tier's written-out formula disabled in the op so a silent fallback fails
instead of passing. The reference is that formula in float64 (``ssd_chunked_bwd``, which the
CPU tests hold to autograd through the recurrence); small cases also check autograd through
the recurrence itself."""

import math

import pytest
import torch
from helpers import (
    DTYPES,
    assert_bit_identical_runs,
    assert_ssd_out_close,
    check_grads,
    gpu_available,
    poison_allocator,
    refuse_fallback,
    seeded,
    spy_scan_chunks,
)

from mamba2_rocm import mamba_chunk_scan_combined
from mamba2_rocm.ops import ssd as ssd_ops
from mamba2_rocm.reference.ssd import ssd_chunked, ssd_chunked_bwd, ssd_sequential

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not gpu_available(), reason="needs a GPU (run on the device machine)"),
    pytest.mark.usefixtures("ssd_state_paths"),
]

DEV = "cuda"
NAMES = ("dx", "ddt", "dA", "dB", "dC", "dD", "dz", "ddt_bias", "dinit")
#: error bound relative to the largest reference gradient: the inputs are rounded to the dtype
#: for both sides; what differs is fp32 accumulation, the output gradient kept in the inputs'
#: dtype between stages (as mamba_ssm keeps it) and each gradient's own rounding
GTOL = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}


@pytest.fixture(autouse=True)
def no_reference_fallback(monkeypatch):
    refuse_fallback(monkeypatch, ssd_ops, "ssd_chunked_bwd")


def _inputs(g, b, L, h, p, gr, n, dtype, *, z=True, D="1d", bias=True, init=True, dfinal=True,
            seq=None):  # fmt: skip
    r = lambda *s: torch.randn(*s, device=DEV, generator=g)  # noqa: E731
    t = dict(
        x=r(b, L, h, p).to(dtype), dt=(r(b, L, h) * 0.5).to(dtype),
        A=-torch.rand(h, device=DEV, generator=g) * 2 - 0.1,
        B=r(b, L, gr, n).to(dtype), C=r(b, L, gr, n).to(dtype),
        D=None if D is None else (r(h) if D == "1d" else r(h, p)),
        z=r(b, L, h, p).to(dtype) if z else None,
        dt_bias=r(h) * 0.3 if bias else None,
        initial_states=r(b, h, p, n) if init else None,
    )  # fmt: skip
    dout = r(b, L, h, p).to(dtype)
    dfin = r(b, h, p, n) if dfinal else None
    return t, seq, dout, dfin


def _seq_idx(b, L, cuts, first=0):
    s = torch.full((b, L), first, dtype=torch.int32)
    for c in cuts:
        if c < L:
            s[:, c:] += 1
    return s.to(DEV)


def _run(t, seq, dout, dfin, cs, softplus=True, limit=(0.0, math.inf)):
    return ssd_ops.mamba_chunk_scan_combined_bwd(
        t["x"], t["dt"], t["A"], t["B"], t["C"], cs, t["D"], t["z"], t["dt_bias"],
        t["initial_states"], seq, softplus, list(limit), dout, dfin,
    )  # fmt: skip


def _want(t, seq, dout, dfin, cs, softplus=True, limit=(0.0, math.inf)):
    d = lambda v: None if v is None else v.double()  # noqa: E731
    return ssd_chunked_bwd(
        d(t["x"]), d(t["dt"]), d(t["A"]), d(t["B"]), d(t["C"]), cs, d(t["D"]), d(t["z"]),
        d(t["dt_bias"]), d(t["initial_states"]), seq, softplus, limit, d(dout), d(dfin),
        compute_dtype=torch.float64,
    )  # fmt: skip


def _check(t, seq, dout, dfin, cs, dtype, **kw):
    poison_allocator(64 << 20)
    got = _run(t, seq, dout, dfin, cs, **kw)
    for name, gt, inp in zip(NAMES, got, (t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], t["z"],
                                          t["dt_bias"], t["initial_states"]), strict=True):  # fmt: skip
        if inp is not None:
            assert gt.dtype == inp.dtype and gt.shape == inp.shape, name
    check_grads(NAMES, got, _want(t, seq, dout, dfin, cs, **kw), GTOL[dtype])
    return got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("b", "L", "h", "p", "gr", "n", "cs"),
    [
        (2, 257, 4, 64, 2, 64, 64),  # seqlen one past a chunk edge
        (1, 1000, 6, 50, 3, 100, 128),  # partial headdim and dstate tiles
        (2, 300, 2, 96, 1, 128, 256),  # two headdim tiles, the second partial
        (3, 63, 4, 32, 4, 16, 64),  # one group per head, less than a chunk
        (1, 1, 2, 64, 1, 128, 256),  # one token
        (2, 512, 8, 64, 1, 128, 256),  # the Mamba2 layout: 8 heads per group, whole chunks
        # 20 heads per group (the checkpoints have 24-80): dC / dB take their heads' weights in
        # batches (of 8 on the matrix cores, 16 on the FMA path), the last one partial
        (1, 300, 40, 64, 2, 128, 128),
    ],
)
def test_matches_reference(dtype, b, L, h, p, gr, n, cs):
    g = seeded("ssd bwd", dtype, b, L, h, p, gr, n, cs, device=DEV)
    _check(*_inputs(g, b, L, h, p, gr, n, dtype), cs, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("cuts", "first", "init"),
    [
        (
            (40, 64, 65, 200),
            0,
            True,
        ),  # restarts inside chunks, at a chunk's first token, twice in one
        ((128,), 1, True),  # the row starts in another sequence: initial_states unused
        ((5, 6, 7, 130, 255), 0, False),
    ],
)
def test_seq_idx(dtype, cuts, first, init):
    b, L, h, p, gr, n, cs = 2, 300, 4, 64, 2, 64, 64
    g = seeded("ssd bwd seq", dtype, cuts, first, device=DEV)
    t, _, dout, dfin = _inputs(g, b, L, h, p, gr, n, dtype, init=init)
    _check(t, _seq_idx(b, L, cuts, first), dout, dfin, cs, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("opts", "softplus", "limit"),
    [
        (dict(z=False, D=None, bias=False, init=False, dfinal=False), True, (0.0, math.inf)),
        (dict(D="2d"), False, (0.05, 0.6)),  # dt clamped both ways: no gradient where clamped
        (dict(z=False, init=True, dfinal=False), True, (0.0, 0.4)),
    ],
)
def test_optional_inputs(dtype, opts, softplus, limit):
    g = seeded("ssd bwd opts", dtype, tuple(opts.items()), softplus, limit, device=DEV)
    t, seq, dout, dfin = _inputs(g, 2, 200, 4, 64, 2, 64, dtype, **opts)
    _check(t, seq, dout, dfin, 128, dtype, softplus=softplus, limit=limit)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_signed_dt(dtype):
    """dt of either sign (no softplus, dt_limit open below): dA_cs rises and falls inside the
    chunks, and the clamp passes every dt (its gradient everywhere)."""
    g = seeded("ssd bwd signed dt", dtype, device=DEV)
    # no dt_bias: dt ~ N(0, 0.05), so the cumulative exponent wanders a few units (a bias would
    # give a head a steady rise, and its state overflows fp32 within a chunk, as it should)
    t, seq, dout, dfin = _inputs(g, 2, 333, 4, 64, 2, 64, dtype, bias=False)
    t["dt"] = (t["dt"].float() * 0.1).to(dtype)
    _check(t, seq, dout, dfin, 128, dtype, softplus=False, limit=(-math.inf, math.inf))


@pytest.mark.parametrize("fp32", ["B", "C", "BC", ""])
@pytest.mark.parametrize("z", [True, False])
def test_float32_B_C_with_half_x(fp32, z):
    """mamba_ssm's callers pass float32 B / C with bf16 x: dB / dC come back float32 (written
    so by the kernel), the other one in x's dtype (written in it), each against the reference;
    with and without z (with z the dz stage runs, without it that stage is skipped)."""
    dtype = torch.bfloat16
    g = seeded("ssd bwd fp32 bc", fp32, z, device=DEV)
    t, seq, dout, dfin = _inputs(g, 2, 300, 8, 64, 2, 64, dtype, z=z)
    for name in fp32:
        t[name] = t[name].float() + 1e-3 * torch.randn(t[name].shape, device=DEV, generator=g)
    got = _check(t, seq, dout, dfin, 128, dtype)
    assert got[3].dtype == t["B"].dtype and got[4].dtype == t["C"].dtype


def test_small_case_against_autograd_through_the_recurrence():
    g = seeded("ssd bwd recurrence", device=DEV)
    t, _, dout, dfin = _inputs(g, 2, 70, 4, 16, 2, 8, torch.float32)
    seq = _seq_idx(2, 70, (33, 64))
    got = _run(t, seq, dout, dfin, 64)
    leaves = {k: None if v is None else v.double().requires_grad_() for k, v in t.items()}
    out, fin = ssd_sequential(**leaves, seq_idx=seq, dt_softplus=True, return_final_states=True)
    names = [k for k, v in leaves.items() if v is not None]
    want = torch.autograd.grad(
        [out, fin], [leaves[k] for k in names], [dout.double(), dfin.double()]
    )
    check_grads(names, [gt for gt, k in zip(got, t, strict=True) if t[k] is not None], want, 2e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("parts", "ran", "b", "L", "h", "gr", "cuts"),
    [
        (2, 2, 2, 512, 8, 1, ()),  # the Mamba2 layout, 4 heads a part
        (3, 2, 1, 300, 40, 2, (100,)),  # 20 heads a group: 3 asked, 2 parts of 10; a restart
        (5, 2, 2, 257, 4, 2, ()),  # more parts than heads (2 a group): one head a part
        (64, 64, 1, 600, 64, 1, (64, 300)),  # a part per head, restarts at and inside chunks
    ],
)
def test_dcb_head_parts(monkeypatch, dtype, parts, ran, b, L, h, gr, cuts):
    """The dcb stage with a group's heads in parts, each a group of its own for the kernel
    (its C·Bᵀ a copy of the group's), the parts' gradients summed by the host: the gradients of
    the one-part run, within the dtype's tolerance of the float64 reference; the part count
    the host used recorded."""
    monkeypatch.setattr(ssd_ops, "DCB_PARTS", parts)
    chosen = []
    real = ssd_ops.dcb_parts
    monkeypatch.setattr(ssd_ops, "dcb_parts", lambda *a: chosen.append(real(*a)) or chosen[-1])
    g = seeded("ssd bwd dcb parts", dtype, parts, b, L, h, gr, device=DEV)
    t, _, dout, dfin = _inputs(g, b, L, h, 64, gr, 128, dtype)
    seq = _seq_idx(b, L, cuts) if cuts else None
    _check(t, seq, dout, dfin, 128, dtype)
    assert chosen == [ran]


def test_dcb_head_parts_bit_identical_runs(monkeypatch):
    monkeypatch.setattr(ssd_ops, "DCB_PARTS", 4)
    g = seeded("ssd bwd dcb parts determinism", device=DEV)
    t, _, dout, dfin = _inputs(g, 2, 1000, 16, 64, 1, 128, torch.bfloat16)
    assert_bit_identical_runs(lambda: _run(t, None, dout, dfin, 256))


def test_long_sequence():
    g = seeded("ssd bwd long", device=DEV)
    t, _, dout, dfin = _inputs(g, 1, 8192, 4, 64, 1, 128, torch.bfloat16)
    _check(t, _seq_idx(1, 8192, (3000,)), dout, dfin, 256, torch.bfloat16)


def test_bit_identical_runs():
    g = seeded("ssd bwd determinism", device=DEV)
    t, _, dout, dfin = _inputs(g, 2, 1000, 8, 64, 2, 128, torch.bfloat16)
    assert_bit_identical_runs(lambda: _run(t, None, dout, dfin, 256))


@pytest.mark.parametrize("compiled", [False, True])
def test_training_reaches_the_kernels(compiled):
    """mamba_chunk_scan_combined under autograd (eager, and compiled with fullgraph) gives the
    kernels' gradients: the fallback formula is refused by the fixture."""
    g = seeded("ssd bwd train", compiled, device=DEV)
    t, _, dout, dfin = _inputs(g, 2, 190, 4, 64, 2, 64, torch.bfloat16)
    leaves = {k: None if v is None else v.detach().clone().requires_grad_() for k, v in t.items()}

    def loss(**kw):
        out, fin = mamba_chunk_scan_combined(**kw, chunk_size=64, dt_softplus=True,
                                             return_final_states=True)  # fmt: skip
        return (out.float() * dout.float()).sum() + (fin * dfin).sum()

    fn = torch.compile(loss, fullgraph=True) if compiled else loss
    names = [k for k, v in leaves.items() if v is not None]
    got = torch.autograd.grad(fn(**leaves), [leaves[k] for k in names])
    want = _run(t, None, dout, dfin, 64)
    want = [w for w, k in zip(want, t, strict=True) if t[k] is not None]
    for name, a, e in zip(names, got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=2e-2, atol=2e-2 * e.abs().max().item(), msg=name)


@pytest.mark.parametrize("n, cs, kept", [(128, 256, True), (64, 64, False)])
def test_training_keeps_the_entering_states(n, cs, kept):
    """Eager training saves the forward's entering states for the backward where they fit
    (``_kept_states``: dstate 128 with chunk 256; not dstate 64 with chunk 64), through
    save_for_backward (seen by saved-tensor hooks), and the gradients are bit-identical to the
    backward that computes them again, in a second backward (retain_graph) too."""
    g = seeded("ssd bwd kept states", n, cs, device=DEV)
    t, _, dout, dfin = _inputs(g, 2, 1000, 4, 64, 2, n, torch.bfloat16)
    seq = _seq_idx(2, 1000, (300,))
    leaves = {k: None if v is None else v.detach().clone().requires_grad_() for k, v in t.items()}
    names = [k for k, v in leaves.items() if v is not None]
    packed = []

    def pack(x):
        packed.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out, fin = mamba_chunk_scan_combined(**leaves, chunk_size=cs, seq_idx=seq,
                                             dt_softplus=True, return_final_states=True)  # fmt: skip
    states_shape = (2, -(-1000 // cs), 4, n, 64)
    assert any(x.shape == states_shape and x.dtype == torch.float32 for x in packed) == kept
    loss = (out.float() * dout.float()).sum() + (fin * dfin).sum()
    first = torch.autograd.grad(loss, [leaves[k] for k in names], retain_graph=True)
    second = torch.autograd.grad(loss, [leaves[k] for k in names])
    want = _run(t, seq, dout, dfin, cs)
    want = [w for w, k in zip(want, t, strict=True) if t[k] is not None]
    for name, a, b, e in zip(names, first, second, want, strict=True):
        assert torch.equal(a, e) and torch.equal(b, e), name


@pytest.mark.chunk_rule
@pytest.mark.parametrize(("L", "h", "asked"), [(1000, 8, 64), (3300, 8, 64)])
def test_training_runs_the_chunk_rule(monkeypatch, L, h, asked):
    """Training runs the chunk size ``scan_chunk_size`` picks for the call's work (never shorter
    than the caller's in training), not the caller's (two calls asking for 64, which the rule
    moves to 128 and 256 on a GPU of 132 multiprocessors), in the forward and in the backward
    alike: out, the final states and every gradient match the float64 reference at the
    caller's size (the result does not depend on it)."""
    ran = spy_scan_chunks(monkeypatch)
    g = seeded("ssd chunk rule", L, h, device=DEV)
    t, _, dout, dfin = _inputs(g, 2, L, h, 64, 2, 128, torch.bfloat16)
    picked = ssd_ops.scan_chunk_size(asked, (2, L, h, 64, 128), torch.device(DEV), training=True)
    leaves = {k: None if v is None else v.detach().clone().requires_grad_() for k, v in t.items()}
    names = [k for k, v in leaves.items() if v is not None]
    poison_allocator(64 << 20)
    out, fin = mamba_chunk_scan_combined(**leaves, chunk_size=asked, dt_softplus=True,
                                         return_final_states=True)  # fmt: skip
    got = torch.autograd.grad([out, fin], [leaves[k] for k in names], [dout, dfin])
    assert ran and all(c == picked for c in ran), (ran, picked)
    d = {k: None if v is None else v.double() for k, v in t.items()}
    ref, ref_fin = ssd_chunked(**d, chunk_size=64, dt_softplus=True, return_final_states=True,
                               compute_dtype=torch.float64)  # fmt: skip
    assert_ssd_out_close(out, ref.to(out.dtype), {**t, "dt_softplus": True}, 2e-2, 5e-2)
    torch.testing.assert_close(fin, ref_fin.float(), rtol=1e-3, atol=1e-3)
    want = _want(t, None, dout, dfin, asked)
    want = [w for w, k in zip(want, t, strict=True) if t[k] is not None]
    check_grads(tuple(NAMES[list(t).index(k)] for k in names), got, want, GTOL[torch.bfloat16])
