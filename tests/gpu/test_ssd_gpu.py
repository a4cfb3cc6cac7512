"""mamba_chunk_scan_combined kernels on a GPU against the float64 references.

Every case: fresh seeded inputs at odd sizes, outputs allocated over NaN-poisoned memory, the
kernel result compared with the sequential recurrence (short sequences) or the chunked form
(long ones) computed in float64 from the same rounded inputs.
"""

import math

import pytest
import torch
from helpers import (
    assert_ssd_out_close,
    gpu_available,
    make_seq_idx,
    poison_allocator,
    seeded,
    spy_scan_chunks,
    strided_view,
)

from mamba2_rocm import mamba_chunk_scan_combined, selective_state_update
from mamba2_rocm.kernels import SOURCES, SSD_SCAN_FORMS
from mamba2_rocm.reference.ssd import ssd_chunked, ssd_sequential

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not gpu_available(), reason="needs a GPU"),
    pytest.mark.usefixtures("ssd_state_paths"),
]
DEV = "cuda"
# out: fp32 rtol/atol 1e-3 (the issue's), fp16/bf16 as mamba_ssm's SSD tests plus the rounding
# of the within-chunk weights (helpers.assert_ssd_out_close); states fp32
OUT_TOL = {torch.float32: (1e-3, 1e-3), torch.float16: (1e-2, 1e-2), torch.bfloat16: (2e-2, 5e-2)}
STATE_TOL = (1e-3, 1e-3)


def _inputs(g, b, L, h, p, groups, n, dtype, *, D="h", z=False, bias=False, init=False):
    r = lambda *s: torch.randn(*s, device=DEV, generator=g)  # noqa: E731
    args = dict(
        x=r(b, L, h, p).to(dtype),
        dt=(r(b, L, h) - 2.0).to(dtype),  # softplus(dt - 2 + bias) ~ 0.05 .. 0.5
        A=-torch.rand(h, device=DEV, generator=g) * 2 - 0.05,
        B=r(b, L, groups, n).to(dtype),
        C=r(b, L, groups, n).to(dtype),
    )
    if D == "h":
        args["D"] = r(h)
    elif D == "hp":
        args["D"] = r(h, p)
    if z:
        args["z"] = r(b, L, h, p).to(dtype)
    if bias:
        args["dt_bias"] = r(h) * 0.5
    if init:
        args["initial_states"] = r(b, h, p, n)
    return args


def _check(args, chunk, dtype, ref_fn=ssd_sequential, **kw):
    poison_allocator(args["x"].numel() * 4 + (1 << 20))
    out, fin = mamba_chunk_scan_combined(**args, chunk_size=chunk, return_final_states=True, **kw)
    ref, ref_fin = ref_fn(**args, return_final_states=True, compute_dtype=torch.float64, **kw)
    assert out.dtype == args["x"].dtype and fin.dtype == torch.float32
    assert not out.isnan().any(), "unwritten output elements"
    rtol, atol = OUT_TOL[dtype]
    assert_ssd_out_close(out, ref.to(out.dtype), {**args, **kw}, rtol, atol)
    torch.testing.assert_close(fin, ref_fin.float(), rtol=STATE_TOL[0], atol=STATE_TOL[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("chunk", [64, 128, 256])
@pytest.mark.parametrize(
    ("seqlen", "h", "p", "groups", "n"),
    [(1, 3, 32, 1, 16), (7, 4, 64, 2, 64), (255, 4, 32, 4, 128), (257, 6, 64, 2, 64),
     (1000, 2, 128, 1, 256), (600, 4, 40, 2, 100)],
)  # fmt: skip
def test_scan_matches_recurrence(dtype, chunk, seqlen, h, p, groups, n):
    g = seeded("scan", str(dtype), chunk, seqlen, h, p, device=DEV)
    odd = seqlen % 2 == 1
    args = _inputs(g, 2, seqlen, h, p, groups, n, dtype, D="h" if odd else "hp", z=not odd,
                   bias=odd, init=seqlen > 200)  # fmt: skip
    _check(args, chunk, dtype, dt_softplus=True)


# every chunk_scan form the kernel table has, at every chunk size it takes, whichever the host's
# rule picks on this GPU (mamba2_rocm.ops.ssd._scan_form)
_SCAN_CASES = [
    (dtype, chunk, form)
    for dtype, dt_name in ((torch.float32, "f32"), (torch.float16, "f16"), (torch.bfloat16, "bf16"))
    for form, (rows, _threads, _cols) in SSD_SCAN_FORMS.items()
    if f"m2r_ssd_chunk_scan_{dt_name}_{form}" in SOURCES["ssd_chunk_scan"].kernels
    for chunk in (64, 128, 256)
    if rows <= chunk
]


@pytest.mark.parametrize(("dtype", "chunk", "form"), _SCAN_CASES, ids=str)
def test_every_chunk_scan_form(monkeypatch, dtype, chunk, form):
    import mamba2_rocm.ops.ssd as ssd_ops

    monkeypatch.setattr(ssd_ops, "_scan_form", lambda cs, dt_name, matrix_cores, headdim: form)
    g = seeded("form", str(dtype), chunk, form, device=DEV)
    # 3 chunks and part of a fourth, a partial headdim tile, a gate and initial states; then a
    # whole tile of the widest form (128 columns)
    for headdim in (72, 128):
        args = _inputs(g, 2, 3 * chunk + 37, 3, headdim, 1, 48, dtype, D="hp", z=True, bias=True,
                       init=True)  # fmt: skip
        _check(args, chunk, dtype, dt_softplus=True)


@pytest.mark.chunk_rule
@pytest.mark.parametrize(("b", "L", "h", "asked"), [(1, 300, 4, 256), (2, 1000, 8, 64),
                                                    (2, 3300, 8, 128)])  # fmt: skip
def test_forward_runs_the_chunk_rule(monkeypatch, b, L, h, asked):
    """The kernel tier runs the chunk size ``scan_chunk_size`` picks for the call's work, not
    the caller's (on a GPU of 132 multiprocessors: 64, 128 and 256 here, each asked for as
    another size), and the result matches the float64 reference."""
    import mamba2_rocm.ops.ssd as ssd_ops

    ran = spy_scan_chunks(monkeypatch)
    picked = ssd_ops.scan_chunk_size(asked, (b, L, h, 64, 128), torch.device(DEV))
    g = seeded("chunk rule", b, L, h, device=DEV)
    args = _inputs(g, b, L, h, 64, 2, 128, torch.bfloat16, z=True, bias=True, init=True)
    _check(args, asked, torch.bfloat16, ref_fn=lambda **kw: ssd_chunked(chunk_size=64, **kw),
           dt_softplus=True)  # fmt: skip
    assert ran == [picked]


@pytest.mark.parametrize("chunk", [64, 256])
@pytest.mark.parametrize("dt_limit", [(0.0, math.inf), (0.05, 0.3)])
def test_dt_processing(chunk, dt_limit):
    g = seeded("dt", chunk, dt_limit, device=DEV)
    args = _inputs(g, 2, 333, 4, 64, 2, 64, torch.float32, bias=True, z=True)
    _check(args, chunk, torch.float32, dt_softplus=True, dt_limit=dt_limit)
    args["dt"] = args["dt"].abs()  # without softplus dt is taken as given (clamped at 0)
    _check(args, chunk, torch.float32, dt_limit=dt_limit)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("chunk", [64, 256])
def test_seq_idx_restarts(dtype, chunk):
    g = seeded("seq", str(dtype), chunk, device=DEV)
    args = _inputs(g, 3, 700, 4, 64, 2, 64, dtype, z=True, init=True)
    args["seq_idx"] = make_seq_idx(3, 700, device=DEV, gen=torch.Generator().manual_seed(chunk))
    _check(args, chunk, dtype, dt_softplus=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("chunk", [128, 256])
@pytest.mark.parametrize("p", [72, 100, 128])
def test_headdim_over_64(dtype, chunk, p):
    """Headdim over 64 (chunk_scan's second column tile, whole or partial) with restarts,
    initial states, D per column and the gate, against the recurrence."""
    g = seeded("wide", str(dtype), chunk, p, device=DEV)
    args = _inputs(g, 2, 517, 3, p, 1, 96, dtype, D="hp", z=True, bias=True, init=True)
    args["seq_idx"] = make_seq_idx(2, 517, device=DEV, gen=torch.Generator().manual_seed(p))
    _check(args, chunk, dtype, dt_softplus=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("chunk", [64, 256])
@pytest.mark.parametrize("layout", ["contiguous", "h12", "misaligned", "padded", "head_strided"])
def test_dt_layouts(dtype, chunk, layout):
    """chunk_cumsum reads 8 heads' 16-bit dt as one 16-byte run per token where they lie so
    (contiguous, nheads a multiple of 8; a padded token stride; the first 8 of 12 heads), else
    per head (heads 8-11 of 12; a view one element off 16-byte alignment; heads 2 apart): all
    against the recurrence, with restarts, softplus and dt_limit."""
    g = seeded("dtl", str(dtype), chunk, layout, device=DEV)
    h, L = (12 if layout == "h12" else 16), 333
    args = _inputs(g, 2, L, h, 64, 2, 64, dtype, bias=True, z=True, init=True)
    dt = args["dt"]
    if layout == "h12":  # token stride 16: a run block of heads, then a gathered one
        wide = (torch.randn(2, L, 16, device=DEV, generator=g) - 2).to(dtype)
        wide[:, :, :12] = dt
        args["dt"] = wide[:, :, :12]
    elif layout == "misaligned":  # heads 1..16 of 24: 2 bytes past a 16-byte boundary
        wide = (torch.randn(2, L, 24, device=DEV, generator=g) - 2).to(dtype)
        wide[:, :, 1:17] = dt
        args["dt"] = wide[:, :, 1:17]
    elif layout == "padded":  # token stride 24 (48 bytes): runs still aligned
        wide = (torch.randn(2, L, 24, device=DEV, generator=g) - 2).to(dtype)
        wide[:, :, :16] = dt
        args["dt"] = wide[:, :, :16]
    elif layout == "head_strided":
        wide = (torch.randn(2, L, 32, device=DEV, generator=g) - 2).to(dtype)
        wide[:, :, ::2] = dt
        args["dt"] = wide[:, :, ::2]
    args["seq_idx"] = make_seq_idx(2, L, device=DEV, gen=torch.Generator().manual_seed(chunk))
    _check(args, chunk, dtype, dt_softplus=True, dt_limit=(0.02, 0.4))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("dt_shift", "a_scale"), [(1.0, 2.0), (3.0, 6.0), (5.0, 16.0)])
def test_steep_decays(dtype, dt_shift, a_scale):
    """Decays of about 2^-5 .. 2^-150 per token (dt * A up to ~ -100): the intra-chunk weights
    underflow a few tokens apart and the entering states vanish; masked and underflowed terms
    must stay 0 (no inf * 0 NaN), against the recurrence."""
    g = seeded("steep", str(dtype), dt_shift, a_scale, device=DEV)
    args = _inputs(g, 2, 301, 4, 64, 2, 64, dtype, z=True)
    args["dt"] = (args["dt"].float() + 2.0 + dt_shift).to(dtype)
    args["A"] = args["A"] * a_scale
    _check(args, 128, dtype, dt_softplus=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("chunk", [128, 256])
def test_signed_dt(dtype, chunk):
    """dt of either sign (no softplus, dt_limit open below): dA_cs rises and falls inside the
    chunks. The kernels factor the decay between two tokens into two exponentials only where
    dA_cs never rises over the chunk (then neither factor can overflow or flush where their
    product does not); here they must take the per-element form, against the recurrence."""
    g = seeded("signed dt", str(dtype), chunk, device=DEV)
    args = _inputs(g, 2, 517, 4, 64, 2, 64, dtype, z=True, init=True)
    # |dt A| ~ 0.05 per token: the cumulative exponent wanders a few units, well conditioned
    args["dt"] = (args["dt"].float() + 2.0).mul(0.05).to(dtype)
    _check(args, chunk, dtype, dt_limit=(-math.inf, math.inf))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("chunk", [64, 256])
def test_long_sequence_chunk_boundaries(dtype, chunk):
    """seqlen 8192: the state carried across many chunk boundaries (the accumulation bug of the
    original ROCm port); every position (the tokens on either side of each boundary among
    them) and the final states, against the float64 chunked reference."""
    g = seeded("long", str(dtype), chunk, device=DEV)
    args = _inputs(g, 2, 8192, 8, 64, 2, 128, dtype, bias=True)
    args["dt"] = args["dt"] - 2.0  # small dt: slow decay, so early chunks still matter at the end
    _check(args, chunk, dtype, ref_fn=lambda **kw: ssd_chunked(chunk_size=64, **kw),
           dt_softplus=True)  # fmt: skip


@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize(("p", "n"), [(1, 16), (2, 50), (4, 16), (24, 40)])
def test_final_states_every_store_layout(state_dtype, p, n):
    """The state passing's final-state store in each of its layouts: headdim under 4 (a block
    spans more dstate rows than it has threads), 4 and 24 (whole rows or not of the block's
    1024 elements), dstate past the block's last row, fp32 and 16-bit final states, with and
    without initial states (which the kernel reads from its first element's (n, p) on)."""
    for init in (False, True):
        g = seeded("final", str(state_dtype), p, n, init, device=DEV)
        args = _inputs(g, 3, 3 * 64 + 5, 5, p, 1, n, torch.bfloat16, init=init)
        poison_allocator(1 << 22)
        out, fin = mamba_chunk_scan_combined(**args, chunk_size=64, return_final_states=True,
                                             state_dtype=state_dtype, dt_softplus=True)  # fmt: skip
        ref, ref_fin = ssd_chunked(**args, chunk_size=64, return_final_states=True,
                                   dt_softplus=True, compute_dtype=torch.float64)  # fmt: skip
        sd = state_dtype or torch.float32
        tol = STATE_TOL if sd == torch.float32 else (1e-2, 1e-2)
        assert fin.dtype == sd and fin.shape == (3, 5, p, n)
        torch.testing.assert_close(fin, ref_fin.to(sd), rtol=tol[0], atol=tol[1])
        assert_ssd_out_close(out, ref.to(out.dtype), {**args, "dt_softplus": True}, 2e-2, 5e-2)


@pytest.mark.parametrize("cu_view", [False, True])
@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16])
def test_varlen_states(state_dtype, cu_view):
    """Varlen states against the sequential reference and each sequence run alone; cu_view:
    cu_seqlens a strided view (every other element of a longer vector)."""
    g = seeded("varlen", str(state_dtype), device=DEV)
    cu = torch.tensor([0, 5, 70, 300, 301, 777], device=DEV, dtype=torch.int32)
    if cu_view:
        cu = strided_view(cu)
    L = int(cu[-1])
    seq_idx = torch.repeat_interleave(torch.arange(5, device=DEV, dtype=torch.int32), cu.diff())[
        None
    ]
    args = _inputs(g, 1, L, 4, 64, 2, 64, torch.bfloat16, init=True, z=True)
    kw = dict(seq_idx=seq_idx, cu_seqlens=cu, dt_softplus=True, state_dtype=state_dtype,
              return_final_states=True, return_varlen_states=True)  # fmt: skip
    out, fin, var = mamba_chunk_scan_combined(**args, chunk_size=128, **kw)
    ref, ref_fin, ref_var = ssd_sequential(**args, compute_dtype=torch.float64, **kw)
    sd = state_dtype or torch.float32
    assert fin.dtype == sd and var.dtype == sd and var.shape == (5, 4, 64, 64)
    tol = STATE_TOL if sd == torch.float32 else (1e-2, 1e-2)
    torch.testing.assert_close(var, ref_var.to(sd), rtol=tol[0], atol=tol[1])
    torch.testing.assert_close(fin, ref_fin.to(sd), rtol=tol[0], atol=tol[1])
    assert_ssd_out_close(out, ref.to(out.dtype), {**args, **kw}, 2e-2, 5e-2)
    # each varlen state is that sequence's final state run alone
    for i in range(5):
        a, e = int(cu[i]), int(cu[i + 1])
        one = {k: (v[:, a:e] if k in ("x", "dt", "B", "C", "z") else v) for k, v in args.items()}
        if i:
            one.pop("initial_states")
        _, alone = mamba_chunk_scan_combined(**one, chunk_size=128, dt_softplus=True,
                                             return_final_states=True)  # fmt: skip
        torch.testing.assert_close(var[i].float(), alone[0], rtol=tol[0] * 2, atol=tol[1] * 2)


def test_varlen_states_with_a_padded_tail():
    """cu_seqlens ending before seqlen (padding after it, seq_idx -1: mamba_ssm's padded varlen
    generation): the kernel's states and outputs on the real tokens are the unpadded row's."""
    g = seeded("varlen-pad", device=DEV)
    cu = torch.tensor([0, 70, 70, 301], device=DEV, dtype=torch.int32)
    L = 512
    ids = torch.repeat_interleave(torch.tensor([0, 1, 2], device=DEV, dtype=torch.int32), cu.diff())
    seq_idx = torch.cat([ids, ids.new_full((L - 301,), -1)])[None]
    args = _inputs(g, 1, L, 4, 64, 2, 64, torch.bfloat16, z=True)
    real = {k: (v[:, :301] if k in ("x", "dt", "B", "C", "z") else v) for k, v in args.items()}
    kw = dict(cu_seqlens=cu, dt_softplus=True, return_varlen_states=True)
    out, var = mamba_chunk_scan_combined(**args, chunk_size=128, seq_idx=seq_idx, **kw)
    want_out, want = mamba_chunk_scan_combined(**real, chunk_size=128, seq_idx=seq_idx[:, :301],
                                               **kw)  # fmt: skip
    torch.testing.assert_close(var, want, rtol=STATE_TOL[0], atol=STATE_TOL[1])
    torch.testing.assert_close(out[:, :301], want_out, rtol=2e-2, atol=5e-2)


def test_strided_inputs_as_the_mamba2_block_passes_them():
    """x, B, C, z, dt as views of one projection (large seqlen strides), D (h,): no copies."""
    g = seeded("views", device=DEV)
    b, L, h, p, groups, n = 2, 300, 4, 64, 2, 64
    d = 2 * h * p + 2 * groups * n + h
    proj = torch.randn(b, L, d, device=DEV, generator=g).to(torch.bfloat16)
    z, x, Bf, Cf, dt = torch.split(proj, [h * p, h * p, groups * n, groups * n, h], dim=-1)
    args = dict(
        x=x.view(b, L, h, p), dt=dt, A=-torch.rand(h, device=DEV, generator=g),
        B=Bf.view(b, L, groups, n), C=Cf.view(b, L, groups, n), z=z.view(b, L, h, p),
        D=torch.randn(h, device=DEV, generator=g),
    )  # fmt: skip
    _check(args, 128, torch.bfloat16, dt_softplus=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("p", "n"), [(64, 64), (30, 50)])
def test_unaligned_views_and_partial_vectors(dtype, p, n):
    """Views starting one element into a projection with an odd row length: no row is 8-byte
    aligned, so every staged operand takes the element-wise path; headdim 30 and dstate 50 end
    inside a 4-element vector."""
    g = seeded("unaligned", str(dtype), p, n, device=DEV)
    b, L, h, groups = 2, 333, 4, 2
    width = 2 * h * p + 2 * groups * n + h
    d = width + 1 + width % 2  # odd row length: every row start is misaligned in turn
    proj = torch.randn(b, L, d, device=DEV, generator=g).to(dtype)[..., 1 : 1 + width]
    z, x, Bf, Cf, dt = torch.split(proj, [h * p, h * p, groups * n, groups * n, h], dim=-1)
    args = dict(
        x=x.view(b, L, h, p), dt=dt - 2.0, A=-torch.rand(h, device=DEV, generator=g) * 2 - 0.05,
        B=Bf.view(b, L, groups, n), C=Cf.view(b, L, groups, n), z=z.view(b, L, h, p),
        D=torch.randn(h, device=DEV, generator=g),
        initial_states=torch.randn(b, h, p, n, device=DEV, generator=g),
    )  # fmt: skip
    assert x.data_ptr() % 8 != 0 and x.stride(1) % 2 == 1
    _check(args, 64, dtype, dt_softplus=True)


def test_decode_continues_the_scan():
    """The scan over a prefix, then selective_state_update token by token (HF's stride-0 tied
    views), matches the scan over the whole sequence."""
    g = seeded("decode", device=DEV)
    b, L, h, p, groups, n, prefix = 2, 300, 8, 64, 2, 128, 270
    args = _inputs(g, b, L, h, p, groups, n, torch.float32, D="h", z=True, bias=True)
    full = mamba_chunk_scan_combined(**args, chunk_size=128, dt_softplus=True)
    head = {k: (v[:, :prefix] if k in ("x", "dt", "B", "C", "z") else v) for k, v in args.items()}
    _, state = mamba_chunk_scan_combined(**head, chunk_size=128, dt_softplus=True,
                                         return_final_states=True)  # fmt: skip
    A, D, bias = args["A"], args["D"], args["dt_bias"]
    for t in range(prefix, L):
        y = selective_state_update(
            state, args["x"][:, t], args["dt"][:, t, :, None].expand(b, h, p),
            A[:, None, None].expand(h, p, n), args["B"][:, t], args["C"][:, t],
            D=D[:, None].expand(h, p), z=args["z"][:, t], dt_bias=bias[:, None].expand(h, p),
            dt_softplus=True,
        )  # fmt: skip
        torch.testing.assert_close(y, full[:, t], rtol=1e-3, atol=1e-3)


def test_cuda_graph_and_compile():
    g = seeded("graph", device=DEV)
    args = _inputs(g, 2, 500, 4, 64, 1, 128, torch.bfloat16, z=True)
    eager = mamba_chunk_scan_combined(**args, chunk_size=256)
    compiled = torch.compile(
        lambda a: mamba_chunk_scan_combined(**a, chunk_size=256), fullgraph=True
    )
    torch.testing.assert_close(compiled(args), eager, rtol=0, atol=0)
    graph = torch.cuda.CUDAGraph()
    mamba_chunk_scan_combined(**args, chunk_size=256)  # warm-up outside capture
    with torch.cuda.graph(graph):
        captured = mamba_chunk_scan_combined(**args, chunk_size=256)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, eager, rtol=0, atol=0)


def test_gpu_errors():
    """What mamba_ssm refuses is refused on the kernel tier too (mixed dtypes and other chunk
    sizes are accepted: tests/gpu/test_compat_gpu.py)."""
    g = seeded("errors", device=DEV)
    args = _inputs(g, 1, 64, 2, 32, 1, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="chunk_size must be a positive int, got 64.5"):
        mamba_chunk_scan_combined(**args, chunk_size=64.5)
    with pytest.raises(TypeError, match="B must be one of"):
        mamba_chunk_scan_combined(**{**args, "B": args["B"].to(torch.int32)}, chunk_size=64)
