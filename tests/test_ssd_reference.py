"""SSD references on the CPU: the chunked tier against the sequential float64 recurrence,
independent equivalences (packing, prefix/rest, varlen, chunk size), the decode-step update,
gated RMSNorm, and every bad input."""

from __future__ import annotations

import itertools
import math
import random
import zlib

import pytest
import torch
import torch.nn.functional as F
from helpers import SSD_STATE_TOL, SSD_TOL, TOL
from torch.utils._python_dispatch import TorchDispatchMode

from mamba2_rocm.ops.checks import (
    check_chunk_scan_args,
    check_rmsnorm_args,
    check_state_rows,
    check_state_update_args,
)
from mamba2_rocm.reference.ssd import (
    rmsnorm_ref,
    selective_state_update_ref,
    ssd_chunked,
    ssd_sequential,
    ssd_term_magnitude,
)

F64 = torch.float64


def _gen(*key):
    """A generator seeded from the test's key, the same in every process (unlike hash())."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


# ---- inputs ----------------------------------------------------------------------------------


def _strided(shape, gen, dtype):
    """A non-contiguous view: every other element of the last dim of a wider tensor, offset."""
    big = torch.randn(*shape[:-1], 2 * shape[-1] + 1, generator=gen, dtype=F64).to(dtype)
    return big[..., 1::2]


def make_scan_inputs(
    gen, batch, seqlen, nheads, headdim, ngroups, dstate, *, dtype=F64, D=None, z=False,
    dt_bias=False, softplus=False, init=False, strided=False,
):  # fmt: skip
    """Fresh inputs of mamba_chunk_scan_combined in realistic ranges (dt' ~ 0.01..0.3, A < 0)."""

    def randn(*shape):
        if strided:
            return _strided(shape, gen, dtype)
        return torch.randn(*shape, generator=gen, dtype=F64).to(dtype)

    if softplus:  # raw dt before softplus: softplus(-2 +- 1) ~ 0.05..0.3
        dt = torch.randn(batch, seqlen, nheads, generator=gen, dtype=F64) * 0.7 - 2.0
    else:
        dt = torch.rand(batch, seqlen, nheads, generator=gen, dtype=F64) * 0.3 + 0.005
    args = {
        "x": randn(batch, seqlen, nheads, headdim),
        "dt": dt.to(dtype),
        "A": (-(torch.rand(nheads, generator=gen, dtype=F64) * 2.0 + 0.2)).to(dtype),
        "B": randn(batch, seqlen, ngroups, dstate),
        "C": randn(batch, seqlen, ngroups, dstate),
    }
    if D == "h":
        args["D"] = torch.randn(nheads, generator=gen, dtype=F64).to(dtype)
    elif D == "hp":
        args["D"] = torch.randn(nheads, headdim, generator=gen, dtype=F64).to(dtype)
    if z:
        args["z"] = randn(batch, seqlen, nheads, headdim)
    if dt_bias:
        args["dt_bias"] = (torch.randn(nheads, generator=gen, dtype=F64) * 0.3).to(dtype)
    if init:
        args["initial_states"] = torch.randn(
            batch, nheads, headdim, dstate, generator=gen, dtype=F64
        ).to(dtype)
    return args


def seq_idx_from_lengths(lengths):
    return torch.repeat_interleave(
        torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths)
    ).unsqueeze(0)


def cu_from_lengths(lengths):
    return F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)


def random_lengths(seqlen, chunk, gen):
    """Several sequences covering seqlen: one boundary on a chunk boundary when there is one,
    a one-token sequence when there is room, the rest at random positions."""
    cuts = {int(c) for c in torch.randint(1, max(2, seqlen), (3,), generator=gen)}
    if seqlen > chunk:
        cuts.add(chunk)
    if seqlen > 8:
        cuts.add(seqlen // 2)
        cuts.add(seqlen // 2 + 1)
    bounds = [0, *sorted(c for c in cuts if 0 < c < seqlen), seqlen]
    return [b - a for a, b in itertools.pairwise(bounds)]


def to(args, dtype):
    return {
        k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
        for k, v in args.items()
    }


# ---- the pairwise grid -----------------------------------------------------------------------

AXES = {
    "seqlen": [1, 7, 64, 255, 256, 257, 1000],
    "chunk": [64, 256],
    "ngroups": [1, 2, "h"],
    "dstate": [16, 64, 128],
    "headdim": [32, 64],
    "D": [None, "h", "hp"],
    "z": [False, True],
    "dt_bias": [False, True],
    "softplus": [False, True],
    "dt_limit": [False, True],
    "init": [False, True],
    "seq_idx": [False, True],
    "varlen": [False, True],
    "strided": [False, True],
}
NHEADS = 6  # ngroups "h" = 6; 2 groups of 3 heads


def pairwise_cases(axes, seed=0, tries=40):
    """A deterministic all-pairs selection (greedy, AETG-style): every pair of values of every
    two axes occurs in some case, so every value occurs at least twice."""
    names = list(axes)
    sizes = [len(axes[n]) for n in names]
    idx_pairs = list(itertools.combinations(range(len(names)), 2))
    uncovered = {
        (i, a, j, b) for i, j in idx_pairs for a in range(sizes[i]) for b in range(sizes[j])
    }
    rng = random.Random(seed)
    cases = []
    while uncovered:
        i, a, j, b = min(uncovered)
        best, best_gain = None, -1
        for _ in range(tries):
            cand = [rng.randrange(s) for s in sizes]
            cand[i], cand[j] = a, b
            gain = sum((p, cand[p], q, cand[q]) in uncovered for p, q in idx_pairs)
            if gain > best_gain:
                best, best_gain = cand, gain
        cases.append(best)
        uncovered -= {(p, best[p], q, best[q]) for p, q in idx_pairs}
    return [{n: axes[n][k] for n, k in zip(names, case, strict=True)} for case in cases]


GRID = pairwise_cases(AXES)


def _case_id(c):
    flags = "".join(
        k[0] if c[k] else "-" for k in ("z", "dt_bias", "softplus", "dt_limit", "init", "seq_idx")
    )
    return (
        f"L{c['seqlen']}-cs{c['chunk']}-g{c['ngroups']}-n{c['dstate']}-p{c['headdim']}"
        f"-D{c['D']}-{flags}{'-varlen' if c['varlen'] else ''}{'-strided' if c['strided'] else ''}"
    )


def test_grid_is_pairwise():
    """The selection covers every pair of values of every two axes (so each value twice)."""
    for a, b in itertools.combinations(AXES, 2):
        seen = {(repr(c[a]), repr(c[b])) for c in GRID}
        assert len(seen) == len(AXES[a]) * len(AXES[b]), (a, b)
    for axis, values in AXES.items():
        for v in values:
            assert sum(c[axis] == v for c in GRID) >= 2, (axis, v)
    assert len(GRID) < 60  # far below the product (~1.2 million)


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, id=_case_id(c), marks=[pytest.mark.slow] if c["seqlen"] >= 1000 else [])
        for c in GRID
    ],
)
def test_chunked_matches_sequential(case):
    g = _gen("grid", _case_id(case))
    seqlen, chunk = case["seqlen"], case["chunk"]
    ngroups = NHEADS if case["ngroups"] == "h" else case["ngroups"]
    batch = 1 if case["varlen"] else 2
    args = make_scan_inputs(
        g, batch, seqlen, NHEADS, case["headdim"], ngroups, case["dstate"], D=case["D"],
        z=case["z"], dt_bias=case["dt_bias"], softplus=case["softplus"], init=case["init"],
        strided=case["strided"],
    )  # fmt: skip
    opts = {"dt_softplus": case["softplus"], "return_final_states": True}
    if case["dt_limit"]:
        opts["dt_limit"] = (0.03, 0.2)  # clamps some of dt' ~ 0.005..0.3 on both sides
    lengths = random_lengths(seqlen, chunk, g)
    if case["seq_idx"]:
        rows = [lengths] + [random_lengths(seqlen, chunk, g) for _ in range(batch - 1)]
        args["seq_idx"] = torch.cat([seq_idx_from_lengths(r) for r in rows])
    if case["varlen"]:
        opts |= {"cu_seqlens": cu_from_lengths(lengths), "return_varlen_states": True}

    ref = ssd_sequential(**args, **opts, state_dtype=F64)
    assert ref[0].abs().max() > 0.1  # the comparison is not between zeros

    # float64 throughout: only the summation order differs
    got = ssd_chunked(**args, **opts, chunk_size=chunk, state_dtype=F64, compute_dtype=F64)
    assert len(got) == len(ref) == (3 if case["varlen"] else 2)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, **SSD_TOL[F64])

    # the fallback tier as it runs: float32 inputs, float32 compute, float32 states
    got32 = ssd_chunked(**to(args, torch.float32), **opts, chunk_size=chunk)
    assert got32[0].dtype == torch.float32 and got32[1].dtype == torch.float32
    torch.testing.assert_close(got32[0], ref[0].float(), **SSD_TOL[torch.float32])
    for a, b in zip(got32[1:], ref[1:], strict=True):
        torch.testing.assert_close(a, b.float(), **SSD_STATE_TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_low_precision_inputs(dtype):
    g = _gen("lowp", str(dtype))
    args = make_scan_inputs(g, 2, 151, 4, 32, 2, 16, dtype=dtype, D="hp", z=True, init=True)
    args["dt"], args["A"] = args["dt"].float(), args["A"].float()  # as Mamba2 passes them
    ref_out, ref_state = ssd_sequential(**args, return_final_states=True)
    out, state = ssd_chunked(**args, chunk_size=64, return_final_states=True)
    assert out.dtype == dtype and state.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, **SSD_TOL[dtype])
    torch.testing.assert_close(state, ref_state, **SSD_STATE_TOL[torch.float32])
    out_b, state_b = ssd_chunked(
        **args, chunk_size=64, return_final_states=True, state_dtype=torch.bfloat16
    )
    assert state_b.dtype == torch.bfloat16 and torch.equal(out_b, out)
    torch.testing.assert_close(state_b, ref_state.bfloat16(), **SSD_STATE_TOL[torch.bfloat16])


# ---- independent checks ----------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["sequential", "chunked"])
def test_two_tokens_by_hand(impl):
    """The recurrence written out for one head, one channel, one state: the current token's
    input is not decayed, the previous one decays by exp(dt1 * A)."""
    x = torch.tensor([0.7, -1.3], dtype=F64).view(1, 2, 1, 1)
    dt = torch.tensor([0.25, 0.5], dtype=F64).view(1, 2, 1)
    A = torch.tensor([-0.8], dtype=F64)
    B = torch.tensor([1.5, -0.4], dtype=F64).view(1, 2, 1, 1)
    C = torch.tensor([0.9, 2.0], dtype=F64).view(1, 2, 1, 1)
    D = torch.tensor([0.3], dtype=F64)
    z = torch.tensor([0.2, -1.1], dtype=F64).view(1, 2, 1, 1)
    h0 = torch.tensor([0.6], dtype=F64).view(1, 1, 1, 1)
    s0 = math.exp(0.25 * -0.8) * 0.6 + 0.25 * 0.7 * 1.5
    s1 = math.exp(0.5 * -0.8) * s0 + 0.5 * -1.3 * -0.4

    def silu(v):
        return v / (1 + math.exp(-v))

    y0 = (0.9 * s0 + 0.3 * 0.7) * silu(0.2)
    y1 = (2.0 * s1 + 0.3 * -1.3) * silu(-1.1)
    fn = ssd_sequential if impl == "sequential" else lambda *a, **k: ssd_chunked(*a, **k)
    kwargs = {"D": D, "z": z, "initial_states": h0, "return_final_states": True}
    if impl == "chunked":
        kwargs |= {"chunk_size": 16, "compute_dtype": F64}
    out, state = fn(x, dt, A, B, C, **kwargs, state_dtype=F64)
    torch.testing.assert_close(out.flatten(), torch.tensor([y0, y1], dtype=F64), rtol=1e-12, atol=0)
    torch.testing.assert_close(state.flatten(), torch.tensor([s1], dtype=F64), rtol=1e-12, atol=0)


@pytest.mark.parametrize("impl", ["sequential", "chunked"])
def test_dt_processing_formula(impl):
    """dt' = clamp(softplus(dt + dt_bias), lo, hi), written out here, fed in with no options;
    and the default (0, inf) limit floors a negative dt at 0, as mamba_ssm's kernel does."""
    g = _gen("dtproc", impl)
    args = make_scan_inputs(g, 2, 77, 4, 8, 2, 16, softplus=True)
    dt_bias = torch.randn(4, generator=g, dtype=F64)
    v = args["dt"] + dt_bias
    sp = torch.where(v <= 20, torch.log1p(torch.exp(v)), v)
    expect_dt = sp.clamp(0.05, 0.15)
    assert (sp < 0.05).any() and (sp > 0.15).any()
    run = ssd_sequential if impl == "sequential" else ssd_chunked
    extra = {} if impl == "sequential" else {"chunk_size": 32, "compute_dtype": F64}
    got = run(**args, dt_bias=dt_bias, dt_softplus=True, dt_limit=(0.05, 0.15), **extra)
    plain = run(**(args | {"dt": expect_dt}), **extra)
    torch.testing.assert_close(got, plain, **SSD_TOL[F64])
    neg = args["dt"] * 0.1  # mostly negative
    assert (neg < 0).any()
    torch.testing.assert_close(
        run(**(args | {"dt": neg}), **extra),
        run(**(args | {"dt": neg.clamp(min=0)}), **extra),
        **SSD_TOL[F64],
    )


@pytest.mark.parametrize("impl", ["sequential", "chunked"])
def test_seq_idx_equals_separate_runs(impl):
    """Sequences packed in one row with seq_idx give each sequence's own outputs and states;
    initial_states belong to the first sequence of each row (seq_idx 0)."""
    g = _gen("pack", impl)
    rows = [[64, 50, 1, 130, 12], [5, 200, 52]]  # boundaries on and off chunk edges
    seqlen = 257
    args = make_scan_inputs(g, 2, seqlen, 4, 16, 2, 16, D="h", z=True, dt_bias=True, init=True)
    seq_idx = torch.cat([seq_idx_from_lengths(r) for r in rows])
    run = ssd_sequential if impl == "sequential" else ssd_chunked
    extra = {} if impl == "sequential" else {"chunk_size": 64, "compute_dtype": F64}
    opts = {"dt_softplus": True, "return_final_states": True, "state_dtype": F64, **extra}
    out, final = run(**args, seq_idx=seq_idx, **opts)
    for b, lengths in enumerate(rows):
        start = 0
        for i, n in enumerate(lengths):
            part = {
                k: (
                    v[b : b + 1, start : start + n] if v.dim() >= 3 and k != "initial_states" else v
                )
                for k, v in args.items()
            }
            part["initial_states"] = args["initial_states"][b : b + 1] if i == 0 else None
            o, f = ssd_sequential(**part, **{k: v for k, v in opts.items() if k not in extra})
            torch.testing.assert_close(out[b : b + 1, start : start + n], o, **SSD_TOL[F64])
            start += n
        torch.testing.assert_close(final[b : b + 1], f, **SSD_TOL[F64])  # the last sequence's


@pytest.mark.parametrize("impl", ["sequential", "chunked"])
def test_initial_states_of_a_row_that_does_not_start_with_id_0(impl):
    """mamba_ssm compares the first chunk with an implicit id 0: rows starting with another id
    ignore initial_states."""
    g = _gen("id0", impl)
    args = make_scan_inputs(g, 1, 90, 2, 8, 1, 16, init=True)
    run = ssd_sequential if impl == "sequential" else ssd_chunked
    extra = {} if impl == "sequential" else {"chunk_size": 64, "compute_dtype": F64}
    seq_idx = torch.full((1, 90), 3, dtype=torch.int32)
    with_init = run(**args, seq_idx=seq_idx, **extra)
    without = run(**(args | {"initial_states": None}), **extra)
    torch.testing.assert_close(with_init, without, **SSD_TOL[F64])
    starts_at_0 = run(**args, seq_idx=torch.zeros_like(seq_idx), **extra)
    assert not torch.allclose(starts_at_0, without)


@pytest.mark.parametrize("split", [1, 63, 64, 100, 299])
def test_prefix_then_rest_equals_whole(split):
    """Scanning a prefix, then the rest from the prefix's final state, equals one scan."""
    g = _gen("split", split)
    seqlen = 300
    args = make_scan_inputs(g, 2, seqlen, 4, 16, 2, 32, D="hp", z=True, dt_bias=True, init=True)
    opts = {"dt_softplus": True, "return_final_states": True, "state_dtype": F64}
    whole, whole_final = ssd_sequential(**args, **opts)

    def part(sl):
        return {
            k: (v[:, sl] if v.dim() >= 3 and k != "initial_states" else v) for k, v in args.items()
        }

    for run, extra in [
        (ssd_sequential, {}),
        (ssd_chunked, {"chunk_size": 64, "compute_dtype": F64}),
    ]:
        o1, f1 = run(**part(slice(0, split)), **opts, **extra)
        o2, f2 = run(**(part(slice(split, seqlen)) | {"initial_states": f1}), **opts, **extra)
        torch.testing.assert_close(torch.cat([o1, o2], 1), whole, **SSD_TOL[F64])
        torch.testing.assert_close(f2, whole_final, **SSD_TOL[F64])


@pytest.mark.parametrize("with_init", [False, True])
def test_varlen_states_are_final_states_of_each_sequence(with_init):
    g = _gen("varlen", with_init)
    lengths = [3, 61, 64, 1, 130, 40]  # the first ends inside the first chunk
    seqlen = sum(lengths)
    args = make_scan_inputs(g, 1, seqlen, 4, 16, 2, 32, D="h", init=with_init)
    cu, seq_idx = cu_from_lengths(lengths), seq_idx_from_lengths(lengths)
    expect = []
    start = 0
    for i, n in enumerate(lengths):
        part = {
            k: (v[:, start : start + n] if v.dim() >= 3 and k != "initial_states" else v)
            for k, v in args.items()
        }
        if i > 0:
            part["initial_states"] = None
        _, f = ssd_sequential(**part, return_final_states=True, state_dtype=F64)
        expect.append(f[0])
        start += n
    expect = torch.stack(expect)
    for run, extra in [
        (ssd_sequential, {}),
        (ssd_chunked, {"chunk_size": 64, "compute_dtype": F64}),
        (ssd_chunked, {"chunk_size": 16, "compute_dtype": F64}),
    ]:
        _, final, varlen = run(
            **args, seq_idx=seq_idx, cu_seqlens=cu, return_final_states=True,
            return_varlen_states=True, state_dtype=F64, **extra,
        )  # fmt: skip
        torch.testing.assert_close(varlen, expect, **SSD_TOL[F64])
        torch.testing.assert_close(final[0], expect[-1], **SSD_TOL[F64])
    out32, varlen32 = ssd_chunked(
        **to(args, torch.float32), seq_idx=seq_idx, cu_seqlens=cu, return_varlen_states=True
    )
    assert out32.dtype == varlen32.dtype == torch.float32 and varlen32.shape == expect.shape


def test_chunk_size_invariance():
    g = _gen("chunks")
    seqlen = 333
    args = make_scan_inputs(g, 2, seqlen, 6, 16, 3, 32, D="hp", z=True, dt_bias=True, init=True)
    seq_idx = torch.cat([seq_idx_from_lengths([100, 28, 205]), seq_idx_from_lengths([333])])
    opts = {"seq_idx": seq_idx, "dt_softplus": True, "return_final_states": True}
    runs = [
        ssd_chunked(**args, **opts, chunk_size=cs, state_dtype=F64, compute_dtype=F64)
        for cs in (16, 32, 64, 128, 256, 512)
    ]
    for out, state in runs[1:]:
        torch.testing.assert_close(out, runs[0][0], **SSD_TOL[F64])
        torch.testing.assert_close(state, runs[0][1], **SSD_TOL[F64])


def test_return_convention():
    """mamba_chunk_scan_combined's: out | (out, final) | (out, varlen) | (out, final, varlen)."""
    g = _gen("ret")
    args = make_scan_inputs(g, 1, 20, 2, 8, 1, 16, dtype=torch.float32)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    for run, extra in [(ssd_sequential, {}), (ssd_chunked, {"chunk_size": 16})]:
        out = run(**args, **extra)
        assert isinstance(out, torch.Tensor) and out.shape == (1, 20, 2, 8)
        out_f = run(**args, return_final_states=True, **extra)
        assert [t.shape for t in out_f] == [(1, 20, 2, 8), (1, 2, 8, 16)]
        out_v = run(**args, cu_seqlens=cu, return_varlen_states=True, **extra)
        assert [t.shape for t in out_v] == [(1, 20, 2, 8), (2, 2, 8, 16)]
        out_fv = run(
            **args, cu_seqlens=cu, return_final_states=True, return_varlen_states=True, **extra
        )
        assert [t.shape for t in out_fv] == [(1, 20, 2, 8), (1, 2, 8, 16), (2, 2, 8, 16)]
        torch.testing.assert_close(out_fv[1][0], out_fv[2][1])  # last sequence ends the row


# ---- selective_state_update ------------------------------------------------------------------


def _update_inputs(
    gen, batch, nheads, headdim, ngroups, dstate, *, pool=None, dtype=F64, state_dtype=F64
):
    """Mamba2 decode inputs with the tied head dim: A, dt, dt_bias, D as broadcast views."""

    def rand(*shape, scale=1.0, shift=0.0, uniform=False):
        f = torch.rand if uniform else torch.randn
        return (f(*shape, generator=gen, dtype=F64) * scale + shift).to(dtype)

    A_h = rand(nheads, scale=-2.0, shift=-0.2, uniform=True)
    dt_h = rand(batch, nheads, scale=0.7, shift=-2.0)
    dtb_h = rand(nheads, scale=0.3)
    D_h = rand(nheads)
    return {
        "state": rand(pool or batch, nheads, headdim, dstate).to(state_dtype),
        "x": rand(batch, nheads, headdim),
        "dt": dt_h[..., None].expand(batch, nheads, headdim),
        "A": A_h[:, None, None].expand(nheads, headdim, dstate),
        "B": rand(batch, ngroups, dstate),
        "C": rand(batch, ngroups, dstate),
        "D": D_h[:, None].expand(nheads, headdim),
        "z": rand(batch, nheads, headdim),
        "dt_bias": dtb_h[:, None].expand(nheads, headdim),
    }, (A_h, dt_h, dtb_h, D_h)


def _update_formula(state, x, dt, A, B, C, D, z, dt_bias, softplus, heads_per_group):
    """One step written out with explicit per-element broadcasting (multi-head form)."""
    d = dt + dt_bias
    if softplus:
        d = torch.log1p(torch.exp(d))
    Bh = B.repeat_interleave(heads_per_group, 1)
    Ch = C.repeat_interleave(heads_per_group, 1)
    new = torch.exp(A[None] * d[..., None]) * state + d[..., None] * x[..., None] * Bh[:, :, None]
    y = (new * Ch[:, :, None]).sum(-1) + D[None] * x
    return y * z * torch.sigmoid(z), new


def test_update_matches_one_scan_step():
    g = _gen("upd-step")
    args, (A_h, dt_h, dtb_h, D_h) = _update_inputs(g, 3, 6, 16, 2, 32)
    state0 = args["state"].clone()
    out = selective_state_update_ref(**args, dt_softplus=True, compute_dtype=F64)
    ref_out, ref_state = ssd_sequential(
        args["x"][:, None], dt_h[:, None], A_h, args["B"][:, None], args["C"][:, None], D=D_h,
        z=args["z"][:, None], dt_bias=dtb_h, initial_states=state0, dt_softplus=True,
        return_final_states=True, state_dtype=F64,
    )  # fmt: skip
    torch.testing.assert_close(out, ref_out[:, 0], **SSD_TOL[F64])
    torch.testing.assert_close(args["state"], ref_state, **SSD_TOL[F64])


def test_update_mamba1_form_matches_one_scan_step():
    """Mamba1 (no head dim) with A constant over dstate is a scan with dim heads of size 1."""
    g = _gen("upd-m1")
    f = {"generator": g, "dtype": F64}
    batch, dim, dstate = 3, 40, 16
    A_d, D = -(torch.rand(dim, **f) + 0.2), torch.randn(dim, **f)
    # dt + dt_bias stays positive: the scan floors dt' at 0, the update (like mamba_ssm's) not
    dt, dtb = torch.rand(batch, dim, **f) * 0.3, torch.rand(dim, **f) * 0.05
    x, z = torch.randn(batch, dim, **f), torch.randn(batch, dim, **f)
    B, C = torch.randn(batch, dstate, **f), torch.randn(batch, dstate, **f)
    state = torch.randn(batch, dim, dstate, **f)
    state0 = state.clone()
    out = selective_state_update_ref(
        state, x, dt, A_d[:, None].expand(dim, dstate), B, C, D, z, dtb, compute_dtype=F64
    )
    ref_out, ref_state = ssd_sequential(
        x[:, None, :, None], dt[:, None], A_d, B[:, None, None], C[:, None, None], D=D,
        z=z[:, None, :, None], dt_bias=dtb, initial_states=state0[:, :, None],
        return_final_states=True, state_dtype=F64,
    )  # fmt: skip
    assert out.shape == (batch, dim)
    torch.testing.assert_close(out, ref_out[:, 0, :, 0], **SSD_TOL[F64])
    torch.testing.assert_close(state, ref_state[:, :, 0], **SSD_TOL[F64])


@pytest.mark.parametrize("form", ["mamba2", "mamba1"])
def test_update_untied_matches_formula(form):
    """A, dt, dt_bias and D that vary along every dim (no tying), against the formula."""
    g = _gen("upd-untied", form)
    f = {"generator": g, "dtype": F64}
    batch, h, p, n, ng = 2, 4, 8, 16, 2
    if form == "mamba1":
        h, ng = 1, 1
    state = torch.randn(batch, h, p, n, **f)
    x, dt, z = (torch.randn(batch, h, p, **f) for _ in range(3))
    A = -(torch.rand(h, p, n, **f) + 0.1)
    B, C = torch.randn(batch, ng, n, **f), torch.randn(batch, ng, n, **f)
    D, dtb = torch.randn(h, p, **f), torch.randn(h, p, **f)
    exp_out, exp_state = _update_formula(state, x, dt, A, B, C, D, z, dtb, True, h // ng)
    if form == "mamba1":
        sq = {"state": state[:, 0], "x": x[:, 0], "dt": dt[:, 0], "A": A[0], "B": B[:, 0],
              "C": C[:, 0], "D": D[0], "z": z[:, 0], "dt_bias": dtb[0]}  # fmt: skip
        out = selective_state_update_ref(**sq, dt_softplus=True, compute_dtype=F64)
        torch.testing.assert_close(out, exp_out[:, 0], **SSD_TOL[F64])
        torch.testing.assert_close(sq["state"], exp_state[:, 0], **SSD_TOL[F64])
    else:
        out = selective_state_update_ref(state, x, dt, A, B, C, D, z, dtb, True, compute_dtype=F64)
        torch.testing.assert_close(out, exp_out, **SSD_TOL[F64])
        torch.testing.assert_close(state, exp_state, **SSD_TOL[F64])


def test_update_pool_indices_and_padding():
    """Row b uses state[idx[b]]; -1 rows get zeros and touch nothing; other pool rows stay."""
    g = _gen("upd-pool")
    args, _ = _update_inputs(g, 4, 4, 8, 2, 16, pool=7)
    idx = torch.tensor([5, -1, 0, 3], dtype=torch.int32)
    before = args["state"].clone()
    out = selective_state_update_ref(
        **args, dt_softplus=True, state_batch_indices=idx, compute_dtype=F64
    )
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    untouched = [1, 2, 4, 6]
    assert torch.equal(args["state"][untouched], before[untouched])
    live = [0, 2, 3]
    rows = idx[live].long()
    sub = {k: (v[live] if k in ("x", "dt", "B", "C", "z") else v) for k, v in args.items()}
    sub["state"] = before[rows].clone()
    exp = selective_state_update_ref(**sub, dt_softplus=True, compute_dtype=F64)
    torch.testing.assert_close(out[live], exp, **SSD_TOL[F64])
    torch.testing.assert_close(args["state"][rows], sub["state"], **SSD_TOL[F64])
    assert not torch.equal(args["state"][rows], before[rows])
    all_pad = torch.full((4,), -1, dtype=torch.int32)
    assert torch.equal(
        selective_state_update_ref(**args, state_batch_indices=all_pad),
        torch.zeros(4, 4, 8, dtype=F64),
    )


class _CopyWatcher(TorchDispatchMode):
    """Records every op that reads a watched broadcast view and writes a new tensor of that
    view's full shape: a materialized copy of it."""

    def __init__(self, watched):
        super().__init__()
        self.shapes = {t.untyped_storage().data_ptr(): tuple(t.shape) for t in watched}
        self.copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves
        ins = [a for a in leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        outs = [o for o in leaves(result) if isinstance(o, torch.Tensor)]
        for t in ins:
            shape = self.shapes.get(t.untyped_storage().data_ptr())
            for o in outs:
                if tuple(o.shape) == shape and o.untyped_storage().data_ptr() not in self.shapes:
                    self.copies.append(f"{func} materialized a {shape} view")
        return result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_update_tied_head_dim_is_not_copied(dtype):
    """A/dt/dt_bias/D as expand()ed views give the same result as materialized copies, and
    none of the four is ever materialized (float32 compute converts bf16 inputs too)."""
    g = _gen("tied", str(dtype))
    args, _ = _update_inputs(g, 3, 8, 64, 2, 128, dtype=dtype, state_dtype=torch.float32)
    tied = ("A", "dt", "dt_bias", "D")
    assert all(0 in args[k].stride() for k in tied)
    dense = {k: (v.contiguous() if k in tied else v) for k, v in args.items()}
    dense["state"] = args["state"].clone()
    with _CopyWatcher([args[k] for k in tied]) as watch:
        out = selective_state_update_ref(**args, dt_softplus=True)
    assert watch.copies == []
    out_dense = selective_state_update_ref(**dense, dt_softplus=True)
    # same math; broadcasting may change the summation order (float32 rounding, a bf16 ulp)
    torch.testing.assert_close(out, out_dense, **SSD_TOL[dtype])
    torch.testing.assert_close(args["state"], dense["state"], **SSD_STATE_TOL[torch.float32])
    # the watcher does see a copy when one happens
    with _CopyWatcher([args["A"]]) as watch:
        args["A"].to(torch.float64)
    assert watch.copies


def test_update_state_dtype_rounding_and_in_place():
    """A bf16 state is updated in place in bf16; out comes from the unrounded new state, so it
    equals the output of the same step on an fp32 copy of the state exactly."""
    g = _gen("upd-bf16")
    args, _ = _update_inputs(g, 2, 4, 16, 1, 32, dtype=torch.float32, state_dtype=torch.float32)
    big = torch.zeros(2, 4, 16, 40, dtype=torch.bfloat16)  # the state is a strided slice
    state = big[..., 4:36]
    state.copy_(args.pop("state"))
    ptr = state.data_ptr()
    state32 = state.float()
    out = selective_state_update_ref(state, **args, dt_softplus=True)
    out32 = selective_state_update_ref(state32, **args, dt_softplus=True)
    assert state.dtype == torch.bfloat16 and state.data_ptr() == ptr
    assert torch.equal(out, out32)
    assert torch.equal(state, state32.bfloat16())
    assert torch.equal(big[..., :4], torch.zeros(2, 4, 16, 4, dtype=torch.bfloat16))


def test_decode_after_prefill_matches_whole_scan():
    """Prefill with the chunked scan, then decode token by token with the state update: the
    same outputs and final state as one scan over everything."""
    g = _gen("decode")
    seqlen, prefix, h, p, ng, n = 45, 29, 6, 16, 2, 32
    args = make_scan_inputs(g, 2, seqlen, h, p, ng, n, D="h", z=True, dt_bias=True, softplus=True)
    args = to(args, torch.float32)
    whole, whole_state = ssd_sequential(**args, dt_softplus=True, return_final_states=True)
    pre = {k: (v[:, :prefix] if v.dim() >= 3 else v) for k, v in args.items()}
    outs, state = ssd_chunked(**pre, chunk_size=16, dt_softplus=True, return_final_states=True)
    outs = [outs]
    A = args["A"][:, None, None].expand(h, p, n)
    dt_bias = args["dt_bias"][:, None].expand(h, p)
    D = args["D"][:, None].expand(h, p)
    for t in range(prefix, seqlen):
        y = selective_state_update_ref(
            state, args["x"][:, t], args["dt"][:, t, :, None].expand(2, h, p), A,
            args["B"][:, t], args["C"][:, t], D, args["z"][:, t], dt_bias, dt_softplus=True,
        )  # fmt: skip
        outs.append(y[:, None])
    torch.testing.assert_close(torch.cat(outs, 1), whole, **SSD_TOL[torch.float32])
    torch.testing.assert_close(state, whole_state, **SSD_STATE_TOL[torch.float32])


# ---- gated RMSNorm ---------------------------------------------------------------------------


def _rmsnorm_formula(x, w, b, z, eps, group_size, norm_before_gate):
    """Group by group with explicit sqrt, in float64."""
    x, w = x.double(), w.double()
    if z is not None and not norm_before_gate:
        x = x * z.double() * torch.sigmoid(z.double())
    gs = group_size or x.shape[-1]
    pieces = []
    for s in range(0, x.shape[-1], gs):
        v = x[..., s : s + gs]
        pieces.append(v / torch.sqrt((v * v).sum(-1, keepdim=True) / gs + eps))
    y = torch.cat(pieces, -1) * w
    if b is not None:
        y = y + b.double()
    if z is not None and norm_before_gate:
        y = y * z.double() * torch.sigmoid(z.double())
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize("group_size", [None, 96, 32])
@pytest.mark.parametrize(("has_bias", "has_z"), [(True, True), (False, True), (True, False)])
def test_rmsnorm_matches_formula(dtype, norm_before_gate, group_size, has_bias, has_z):
    g = _gen("rms", str(dtype), norm_before_gate, group_size, has_bias, has_z)
    x = (torch.randn(3, 7, 96, generator=g) * 3).to(dtype)
    w = torch.randn(96, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype) if has_bias else None
    z = torch.randn(3, 7, 96, generator=g).to(dtype) if has_z else None
    out = rmsnorm_ref(
        x, w, b, z, eps=1e-5, group_size=group_size, norm_before_gate=norm_before_gate
    )
    assert out.dtype == dtype and out.shape == x.shape
    expect = _rmsnorm_formula(x, w, b, z, 1e-5, group_size, norm_before_gate)
    torch.testing.assert_close(out, expect.to(dtype), **TOL[dtype])


def test_rmsnorm_gate_order_and_groups_matter():
    """The two gate orders and the group split each change the result (the options are used)."""
    g = _gen("rms-order")
    x, z = torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g)
    w = torch.ones(64)
    before = rmsnorm_ref(x, w, None, z, norm_before_gate=True)
    after = rmsnorm_ref(x, w, None, z, norm_before_gate=False)
    grouped = rmsnorm_ref(x, w, None, z, group_size=16, norm_before_gate=True)
    assert not torch.allclose(before, after) and not torch.allclose(before, grouped)
    torch.testing.assert_close(
        rmsnorm_ref(x, w, None), x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    )


# ---- bad inputs: mamba2_rocm.ops.checks, which the ops run once before any tier --------------
# (the references are pure math and check nothing; the ops' own tests show each op raises these)


def _scan_checks(chunked=True, chunk_size=256, **kwargs):
    return check_chunk_scan_args(**kwargs, chunk_size=chunk_size if chunked else None,
                                 chunked=chunked)  # fmt: skip


def _update_checks(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, state_batch_indices=None):
    """The update's checks as its torch tier runs them: shapes, then the rows' values."""
    dims = check_state_update_args(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices)
    check_state_rows("state_batch_indices", state_batch_indices, dims.pool, dims.batch)


_g = torch.Generator().manual_seed(7)
X = torch.randn(2, 16, 4, 8, generator=_g)
DT = torch.rand(2, 16, 4, generator=_g)
A = -torch.rand(4, generator=_g)
B = torch.randn(2, 16, 2, 8, generator=_g)
SCAN = {"x": X, "dt": DT, "A": A, "B": B, "C": B.clone()}
I32 = torch.int32

SCAN_ERRORS = [
    ({"x": [1.0]}, TypeError, "x must be a torch.Tensor, got list"),
    ({"x": X[0]}, ValueError, "x must have 4 dimensions (batch, seqlen, nheads, headdim), got shape (16, 4, 8)"),
    ({"x": X.to(I32)}, TypeError, "x must be one of float32, float16, bfloat16, float64, got int32"),
    ({"x": X[:, :0]}, ValueError, "x is empty (shape (2, 0, 4, 8)); batch, seqlen, nheads and headdim must be >= 1"),
    ({"dt": DT[:, :, :3]}, ValueError, "dt must have shape (batch, seqlen, nheads) = (2, 16, 4), got (2, 16, 3)"),
    ({"A": torch.rand(4, 1)}, ValueError, "A must have 1 dimensions (nheads,), got shape (4, 1)"),
    ({"A": torch.rand(5)}, ValueError, "A must have shape (nheads,) = (4,), got (5,)"),
    ({"B": B[:, :, :, :0], "C": B[:, :, :, :0]}, ValueError, "B is empty (shape (2, 16, 2, 0)); ngroups and dstate must be >= 1"),
    ({"B": torch.randn(2, 15, 2, 8)}, ValueError, "B must have shape (batch, seqlen, ngroups, dstate) = (2, 16, 2, 8), got (2, 15, 2, 8)"),
    ({"C": torch.randn(2, 16, 2, 4)}, ValueError, "C must have shape (batch, seqlen, ngroups, dstate) like B = (2, 16, 2, 8), got (2, 16, 2, 4)"),
    ({"B": torch.randn(2, 16, 3, 8), "C": torch.randn(2, 16, 3, 8)}, ValueError, "nheads must be divisible by ngroups, got nheads=4, ngroups=3"),
    ({"x": torch.randn(2, 16, 4, 160), "z": None}, ValueError, "headdim must be <= 128, got 160"),
    ({"B": torch.randn(2, 16, 2, 512), "C": torch.randn(2, 16, 2, 512)}, ValueError, "dstate must be <= 256, got 512"),
    ({"D": torch.randn(4, 7)}, ValueError, "D must have shape (nheads,) = (4,) or (nheads, headdim) = (4, 8), got (4, 7)"),
    ({"D": torch.randn(4, 8, 1)}, ValueError, "D must have shape (nheads,) = (4,) or (nheads, headdim) = (4, 8), got (4, 8, 1)"),
    ({"D": torch.ones(4, dtype=torch.int64)}, TypeError, "D must be one of float32, float16, bfloat16, float64, got int64"),
    ({"z": torch.randn(2, 16, 4, 7)}, ValueError, "z must have shape like x = (2, 16, 4, 8), got (2, 16, 4, 7)"),
    ({"dt_bias": torch.randn(3)}, ValueError, "dt_bias must have shape (nheads,) = (4,), got (3,)"),
    ({"initial_states": torch.randn(2, 4, 8, 7)}, ValueError, "initial_states must have shape (batch, nheads, headdim, dstate) = (2, 4, 8, 8), got (2, 4, 8, 7)"),
    ({"seq_idx": torch.zeros(2, 16, dtype=torch.int64)}, TypeError, "seq_idx must be one of int32, got int64"),
    ({"seq_idx": torch.zeros(2, 15, dtype=I32)}, ValueError, "seq_idx must have shape (batch, seqlen) = (2, 16), got (2, 15)"),
    ({"return_varlen_states": True}, ValueError, "return_varlen_states=True needs cu_seqlens"),
    ({"cu_seqlens": torch.tensor([0, 16], dtype=I32)}, ValueError, "cu_seqlens needs batch == 1 (sequences packed into one row), got batch=2"),
    ({"cu_seqlens": torch.tensor([0.0, 16.0])}, TypeError, "cu_seqlens must be one of int32, int64, got float32"),
    ({"dt_limit": (0.5, 0.1)}, ValueError, "dt_limit must be (min, max) with min <= max, got (0.5, 0.1)"),
    ({"dt_limit": 0.1}, ValueError, "dt_limit must be a pair (min, max), got 0.1"),
    ({"state_dtype": torch.int32}, TypeError, "state_dtype must be one of float32, float16, bfloat16, float64, got torch.int32"),
    ({"dt": DT.to("meta")}, ValueError, "dt is on meta, expected cpu (the device of x)"),
]  # fmt: skip


def _ids(cases):
    return [f"{i}-{','.join(c[0])}" for i, c in enumerate(cases)]


@pytest.mark.parametrize(("kwargs", "exc", "message"), SCAN_ERRORS, ids=_ids(SCAN_ERRORS))
@pytest.mark.parametrize("chunked", [False, True])
def test_scan_bad_inputs(chunked, kwargs, exc, message):
    with pytest.raises(exc) as info:
        _scan_checks(chunked, **(SCAN | kwargs))
    assert str(info.value) == message


CU_ERRORS = [
    (torch.tensor([0], dtype=I32), "cu_seqlens must hold at least 2 offsets, got shape (1,)"),
    (torch.tensor([1, 16], dtype=I32), "cu_seqlens must start at 0, never decrease and end at or before seqlen=16, got [1, 16]"),
    (torch.tensor([0, 5, 4, 16], dtype=I32), "cu_seqlens must start at 0, never decrease and end at or before seqlen=16, got [0, 5, 4, 16]"),
    (torch.tensor([0, 5, 17]), "cu_seqlens must start at 0, never decrease and end at or before seqlen=16, got [0, 5, 17]"),
]  # fmt: skip


@pytest.mark.parametrize(("cu", "message"), CU_ERRORS)
def test_scan_bad_cu_seqlens(cu, message):
    one = {k: v[:1] if k != "A" else v for k, v in SCAN.items()}
    with pytest.raises(ValueError) as info:
        _scan_checks(**one, chunk_size=16, cu_seqlens=cu, return_varlen_states=True)
    assert str(info.value) == message


@pytest.mark.parametrize("chunk_size", [8, 100, 48])
def test_chunk_size_errors(chunk_size):
    with pytest.raises(ValueError) as info:
        _scan_checks(**SCAN, chunk_size=chunk_size)
    assert str(info.value) == (
        "chunk_size must be a power of two >= 16 (the kernels take 64, 128 or 256), "
        f"got {chunk_size!r}"
    )


@pytest.mark.parametrize("chunk_size", [0, -64, 2.0, 64.7, "64", True, None])
def test_chunk_size_must_be_a_positive_int(chunk_size):
    with pytest.raises(ValueError) as info:
        _scan_checks(**SCAN, chunk_size=chunk_size)
    assert str(info.value) == f"chunk_size must be a positive int, got {chunk_size!r}"


def test_kernel_chunk_sizes_for_the_op_layer():
    from mamba2_rocm.ops.checks import KERNEL_CHUNK_SIZES, check_chunk_scan_args

    dims = check_chunk_scan_args(**SCAN, chunk_size=128, chunk_sizes=KERNEL_CHUNK_SIZES)
    assert (dims.batch, dims.seqlen, dims.nheads, dims.headdim, dims.ngroups, dims.dstate) == (
        2, 16, 4, 8, 2, 8,
    )  # fmt: skip
    assert dims.heads_per_group == 2 and dims.state_dtype == torch.float32
    with pytest.raises(ValueError) as info:
        check_chunk_scan_args(**SCAN, chunk_size=32, chunk_sizes=KERNEL_CHUNK_SIZES)
    assert str(info.value) == "chunk_size must be one of 64, 128, 256, got 32"


ST = torch.randn(2, 4, 8, 16, generator=_g)
UPD = {
    "state": ST,
    "x": torch.randn(2, 4, 8, generator=_g),
    "dt": torch.rand(2, 4, 8, generator=_g),
    "A": -torch.rand(4, 8, 16, generator=_g),
    "B": torch.randn(2, 2, 16, generator=_g),
    "C": torch.randn(2, 2, 16, generator=_g),
}
UPD_ERRORS = [
    ({"x": torch.randn(2, 4, 8, 1)}, ValueError, "x must be (batch, dim) or (batch, nheads, dim), got shape (2, 4, 8, 1)"),
    ({"x": UPD["x"][:0]}, ValueError, "x is empty (shape (0, 4, 8))"),
    ({"state": torch.randn(2, 4, 7, 16)}, ValueError, "state must have shape (batch, nheads, headdim, dstate) = (pool, 4, 8, dstate >= 1), got (2, 4, 7, 16)"),
    ({"state": ST.to(I32)}, TypeError, "state must be one of float32, float16, bfloat16, float64, got int32"),
    ({"state": torch.randn(5, 4, 8, 16)}, ValueError, "state has 5 rows for a batch of 2; pass state_batch_indices to select rows"),
    ({"dt": torch.rand(2, 4, 7)}, ValueError, "dt must have shape like x = (2, 4, 8), got (2, 4, 7)"),
    ({"A": -torch.rand(4, 8, 15)}, ValueError, "A must have shape (nheads, headdim, dstate) = (4, 8, 16), got (4, 8, 15)"),
    ({"A": -torch.rand(4)}, ValueError, "A must have 3 dimensions (nheads, headdim, dstate), got shape (4,)"),
    ({"B": torch.randn(2, 3, 16), "C": torch.randn(2, 3, 16)}, ValueError, "nheads must be divisible by ngroups, got nheads=4, ngroups=3"),
    ({"C": torch.randn(2, 2, 8)}, ValueError, "C must have shape (batch, ngroups, dstate) like B = (2, 2, 16), got (2, 2, 8)"),
    ({"D": torch.randn(4)}, ValueError, "D must have 2 dimensions (nheads, headdim), got shape (4,)"),
    ({"dt_bias": torch.randn(4, 9)}, ValueError, "dt_bias must have shape (nheads, headdim) = (4, 8), got (4, 9)"),
    ({"z": torch.randn(2, 4, 9)}, ValueError, "z must have shape like x = (2, 4, 8), got (2, 4, 9)"),
    ({"state": torch.randn(2, 4, 8, 300), "A": -torch.rand(4, 8, 300), "B": torch.randn(2, 2, 300), "C": torch.randn(2, 2, 300)}, ValueError, "dstate must be <= 256, got 300"),
    ({"state_batch_indices": torch.zeros(3, dtype=I32)}, ValueError, "state_batch_indices must have shape (batch,) = (2,), got (3,)"),
    ({"state_batch_indices": torch.zeros(2)}, TypeError, "state_batch_indices must be one of int32, int64, got float32"),
    ({"state_batch_indices": torch.tensor([0, 2], dtype=I32)}, IndexError, "state_batch_indices[1] = 2 is out of range for a state pool of 2"),
    ({"state_batch_indices": torch.tensor([-2, 0], dtype=I32)}, IndexError, "state_batch_indices[0] = -2 is out of range for a state pool of 2"),
    ({"state_batch_indices": torch.tensor([1, 1], dtype=I32)}, ValueError, "state_batch_indices[0] and [1] are both 1; each live row needs its own state"),
]  # fmt: skip


@pytest.mark.parametrize(("kwargs", "exc", "message"), UPD_ERRORS, ids=_ids(UPD_ERRORS))
def test_update_bad_inputs(kwargs, exc, message):
    args = UPD | kwargs
    before = args["state"].clone()
    with pytest.raises(exc) as info:
        _update_checks(**args)
    assert str(info.value) == message
    assert torch.equal(args["state"], before), "a rejected call must not touch the state"


def test_update_mamba1_bad_inputs():
    state, x = torch.randn(2, 200, 16), torch.randn(2, 200)  # dim > 128 is fine without heads
    ok = selective_state_update_ref(
        state, x, x.abs(), -torch.rand(200, 16), torch.randn(2, 16), torch.randn(2, 16)
    )
    assert ok.shape == (2, 200)
    with pytest.raises(ValueError) as info:
        _update_checks(state, x, x, -torch.rand(200, 16), torch.randn(2, 1, 16), torch.randn(2, 16))
    assert str(info.value) == "B must have 2 dimensions (batch, dstate), got shape (2, 1, 16)"
    with pytest.raises(ValueError) as info:
        _update_checks(
            state,
            x,
            x,
            -torch.rand(200, 16),
            torch.randn(2, 16),
            torch.randn(2, 16),
            D=torch.randn(2, 200),
        )
    assert str(info.value) == "D must have 1 dimensions (dim,), got shape (2, 200)"
    with pytest.raises(ValueError) as info:
        _update_checks(
            torch.randn(2, 4, 160, 16),
            torch.randn(2, 4, 160),
            torch.rand(2, 4, 160),
            -torch.rand(4, 160, 16),
            torch.randn(2, 1, 16),
            torch.randn(2, 1, 16),
        )
    assert str(info.value) == "headdim must be <= 128, got 160"


XN = torch.randn(3, 64, generator=_g)
RMS_ERRORS = [
    ({"x": XN.to(I32)}, TypeError, "x must be one of float32, float16, bfloat16, float64, got int32"),
    ({"x": XN[:, :0], "weight": torch.ones(0)}, ValueError, "x is empty (shape (3, 0))"),
    ({"weight": torch.ones(63)}, ValueError, "weight must have shape (hidden,) = (64,), got (63,)"),
    ({"bias": torch.ones(64, 1)}, ValueError, "bias must have 1 dimensions (hidden,), got shape (64, 1)"),
    ({"z": torch.ones(3, 63)}, ValueError, "z must have shape like x = (3, 64), got (3, 63)"),
    ({"group_size": 24}, ValueError, "group_size must divide hidden, got hidden=64, group_size=24"),
    ({"group_size": 0}, ValueError, "group_size must be a positive int, got 0"),
    ({"eps": -1.0}, ValueError, "eps must be a number >= 0, got -1.0"),
]  # fmt: skip


@pytest.mark.parametrize(("kwargs", "exc", "message"), RMS_ERRORS, ids=_ids(RMS_ERRORS))
def test_rmsnorm_bad_inputs(kwargs, exc, message):
    args = {"x": XN, "weight": torch.ones(64), "bias": None} | kwargs
    with pytest.raises(exc) as info:
        check_rmsnorm_args(**args)
    assert str(info.value) == message


@pytest.mark.parametrize("impl", ["sequential", "chunked", "op"])
def test_varlen_states_with_a_padded_tail(impl):
    """cu_seqlens may end before seqlen: the tokens after it are padding (seq_idx -1, as
    mamba_ssm's varlen generation packs a row). Each sequence's state is the one the unpadded
    row gives, and the padded call's output agrees on the real tokens."""
    from mamba2_rocm.ops.ssd import mamba_chunk_scan_combined

    one = {k: v[:1] if k != "A" else v for k, v in SCAN.items()}  # seqlen 16
    cu = torch.tensor([0, 5, 5, 9], dtype=I32)
    seq_idx = torch.tensor([[0] * 5 + [2] * 4 + [-1] * 7], dtype=I32)
    real = {k: v[:, :9] if k != "A" else v for k, v in one.items()}
    kw = dict(cu_seqlens=cu, return_varlen_states=True)
    if impl == "sequential":
        run = ssd_sequential
    elif impl == "chunked":
        run = lambda **a: ssd_chunked(**a, chunk_size=16)  # noqa: E731
    else:
        run = lambda **a: mamba_chunk_scan_combined(**a, chunk_size=16)  # noqa: E731
    out, states = run(**one, seq_idx=seq_idx, **kw)
    want_out, want = run(**real, seq_idx=seq_idx[:, :9], **kw)
    torch.testing.assert_close(states, want)
    torch.testing.assert_close(out[:, :9], want_out)


def test_term_magnitude_against_loops():
    """ssd_term_magnitude term by term: groups shared by heads, a sequence restart, a gate."""
    g = torch.Generator().manual_seed(7)
    b, L, h, p, G, n = 2, 11, 4, 3, 2, 5
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    x, dt, B, C, z = r(b, L, h, p), r(b, L, h), r(b, L, G, n), r(b, L, G, n), r(b, L, h, p)
    A, bias = -torch.rand(h, generator=g, dtype=torch.float64) - 0.1, r(h)
    seq_idx = torch.tensor([[0] * 4 + [1] * 7, [0] * 11], dtype=I32)
    got = ssd_term_magnitude(x, dt, A, B, C, z=z, dt_bias=bias, seq_idx=seq_idx, dt_softplus=True)
    d = F.softplus(dt + bias)
    want = torch.zeros(b, L, h, p, dtype=torch.float64)
    for i, t, k in itertools.product(range(b), range(L), range(h)):
        grp = k // (h // G)
        for s in range(t + 1):
            if seq_idx[i, s] != seq_idx[i, t]:
                continue
            decay = torch.exp(A[k] * d[i, s + 1 : t + 1].sum(0)[k]) if s < t else 1.0
            w = (C[i, t, grp] @ B[i, s, grp]).abs() * decay * d[i, s, k]
            want[i, t, k] += w * x[i, s, k].abs()
    want *= F.silu(z).abs()
    torch.testing.assert_close(got, want)
    blocks = ssd_term_magnitude(x, dt, A, B, C, z=z, dt_bias=bias, seq_idx=seq_idx,
                                dt_softplus=True, block=4)  # fmt: skip
    torch.testing.assert_close(blocks, want)  # rows in blocks of 4 tokens


def test_term_magnitude_is_the_output_when_no_term_is_negative():
    """With B, C, x >= 0 (every term's sign +), no D, gate or initial state: M == out."""
    g = torch.Generator().manual_seed(3)
    b, L, h, p, n = 1, 37, 2, 4, 3
    x = torch.rand(b, L, h, p, generator=g, dtype=torch.float64)
    B, C = (torch.rand(b, L, 1, n, generator=g, dtype=torch.float64) for _ in range(2))
    dt, A = torch.rand(b, L, h, generator=g, dtype=torch.float64), -torch.rand(h, generator=g)
    out = ssd_sequential(x, dt, A, B, C)
    torch.testing.assert_close(ssd_term_magnitude(x, dt, A, B, C), out)
