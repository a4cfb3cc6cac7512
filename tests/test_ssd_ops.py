"""mamba_chunk_scan_combined and mamba_split_conv1d_scan_combined on the CPU tiers: results
against the float64 recurrence, mamba_ssm's return convention, op registration, bad inputs."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import seeded

from mamba2_rocm import mamba_chunk_scan_combined, mamba_split_conv1d_scan_combined
from mamba2_rocm.kernels import source_of
from mamba2_rocm.ops import ssd as ssd_ops
from mamba2_rocm.reference.ssd import rmsnorm_ref, ssd_sequential


def _inputs(g, b=2, L=77, h=4, p=8, groups=2, n=16):
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(
        x=r(b, L, h, p), dt=r(b, L, h) - 1, A=-torch.rand(h, generator=g) - 0.1,
        B=r(b, L, groups, n), C=r(b, L, groups, n),
    )  # fmt: skip


@pytest.mark.parametrize("tier", ["torch", "eager"])
@pytest.mark.parametrize("chunk", [64, 128, 256])
def test_tiers_match_recurrence(tier, chunk, backend):
    backend(tier)
    g = seeded("tiers", tier, chunk)
    a = _inputs(g, L=300)
    extra = dict(D=torch.randn(4, 8, generator=g), z=torch.randn(2, 300, 4, 8, generator=g),
                 dt_bias=torch.randn(4, generator=g), initial_states=torch.randn(2, 4, 8, 16, generator=g),
                 dt_softplus=True, dt_limit=(0.01, 2.0))  # fmt: skip
    out, fin = mamba_chunk_scan_combined(**a, chunk_size=chunk, **extra, return_final_states=True)
    ref, rfin = ssd_sequential(**a, **extra, return_final_states=True)
    assert out.is_contiguous() and out.dtype == torch.float32
    torch.testing.assert_close(out, ref.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fin, rfin.float(), rtol=1e-4, atol=1e-4)


def test_return_convention(backend):
    backend("torch")
    g = seeded("ret")
    a = _inputs(g, b=1, L=40)
    cu = torch.tensor([0, 10, 40], dtype=torch.int32)
    seq = torch.repeat_interleave(torch.arange(2, dtype=torch.int32), cu.diff())[None]
    out = mamba_chunk_scan_combined(**a, chunk_size=64)
    assert isinstance(out, torch.Tensor) and out.shape == a["x"].shape
    out, fin = mamba_chunk_scan_combined(**a, chunk_size=64, return_final_states=True)
    assert fin.shape == (1, 4, 8, 16) and fin.dtype == torch.float32
    kw = dict(seq_idx=seq, cu_seqlens=cu, return_varlen_states=True)
    out, var = mamba_chunk_scan_combined(**a, chunk_size=64, **kw)
    assert var.shape == (2, 4, 8, 16)
    out, fin, var = mamba_chunk_scan_combined(
        **a, chunk_size=64, return_final_states=True, state_dtype=torch.bfloat16, **kw
    )
    assert fin.dtype == var.dtype == torch.bfloat16
    _, ref_var = ssd_sequential(**a, **kw)
    torch.testing.assert_close(var.float(), ref_var.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("tier", ["torch", "eager"])
def test_empty_sequences_in_cu_seqlens(tier, backend):
    """Equal consecutive offsets (what batching code makes of an empty request) are accepted:
    the empty sequence's varlen state is its initial state at offset 0, else zeros."""
    backend(tier)
    g = seeded("empty-seqs", tier)
    a = _inputs(g, b=1, L=150)
    a["initial_states"] = torch.randn(1, 4, 8, 16, generator=g)
    cu = torch.tensor([0, 0, 40, 40, 97, 150, 150], dtype=torch.int32)
    seq = torch.repeat_interleave(torch.arange(6, dtype=torch.int32), cu.diff())[None]
    kw = dict(seq_idx=seq, cu_seqlens=cu, return_varlen_states=True, dt_softplus=True)
    out, var = mamba_chunk_scan_combined(**a, chunk_size=64, **kw)
    ref, ref_var = ssd_sequential(**{k: v.double() for k, v in a.items()}, **kw)
    torch.testing.assert_close(out, ref.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(var, ref_var.float(), rtol=1e-4, atol=1e-4)
    assert var.shape == (6, 4, 8, 16)
    torch.testing.assert_close(var[0], a["initial_states"][0])
    assert not var[[2, 5]].any()


@pytest.mark.parametrize(
    ("change", "err", "match"),
    [
        (dict(chunk_size=64.7), ValueError, "chunk_size must be a positive int, got 64.7"),
        (dict(chunk_size="64"), ValueError, "chunk_size must be a positive int, got '64'"),
        (dict(chunk_size=0), ValueError, "chunk_size must be a positive int, got 0"),
        (dict(chunk_size=True), ValueError, "chunk_size must be a positive int, got True"),
        (dict(B=torch.randn(2, 77, 3, 16), C=torch.randn(2, 77, 3, 16)), ValueError, "divisible"),
        (dict(C=torch.randn(2, 77, 2, 15)), ValueError, "C"),
        (dict(dt=torch.randn(2, 76, 4)), ValueError, "dt"),
        (dict(x=torch.randn(2, 77, 4, 8).to(torch.int32)), TypeError, "x"),
        (dict(x=torch.randn(2, 77, 0, 8)), ValueError, "nheads and headdim must be >= 1"),
        (dict(D=torch.randn(5)), ValueError, "D must have shape"),
        (dict(cu_seqlens=torch.tensor([0, 77])), ValueError, "batch == 1"),
        (dict(return_varlen_states=True), ValueError, "cu_seqlens"),
        (dict(dt_limit=(1.0, 0.5)), ValueError, "dt_limit"),
        (dict(seq_idx=torch.zeros(2, 77, dtype=torch.int64)), TypeError, "seq_idx"),
    ],
)  # fmt: skip
def test_bad_inputs(change, err, match):
    a = {**_inputs(seeded("bad")), "chunk_size": 64, **change}
    with pytest.raises(err, match=match):
        mamba_chunk_scan_combined(**a)


def test_opcheck_and_compile(backend):
    backend("torch")
    a = _inputs(seeded("opcheck"), L=70)
    args = (a["x"], a["dt"], a["A"], a["B"], a["C"], 64, torch.randn(4), None, None, None, None,
            None, True, [0.0, math.inf], False, None)  # fmt: skip
    torch.library.opcheck(ssd_ops.mamba_chunk_scan_combined_op, args)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(x, dt):
        return mamba_chunk_scan_combined(x, dt, a["A"], a["B"], a["C"], 64, dt_softplus=True)

    eager = mamba_chunk_scan_combined(**a, chunk_size=64, dt_softplus=True)
    torch.testing.assert_close(f(a["x"], a["dt"]), eager)


# ---- mamba_split_conv1d_scan_combined -------------------------------------------------------


def _block_reference(zxbcdt, w, cb, dt_bias, A, D, h, p, groups, n, rms_w, out_w, out_b,
                     norm_before_gate, seq_idx=None):  # fmt: skip
    """The Mamba2 block forward written out with torch ops and the float64 recurrence."""
    dim = h * p
    z, xbc, dt = torch.split(zxbcdt.double(), [dim, dim + 2 * groups * n, h], dim=-1)
    width = w.shape[1]
    xbc = F.conv1d(F.pad(xbc.transpose(1, 2), (width - 1, 0)), w.double()[:, None], cb.double(),
                   groups=w.shape[0])  # fmt: skip
    xbc = F.silu(xbc).transpose(1, 2)
    x, B, C = torch.split(xbc, [dim, groups * n, groups * n], dim=-1)
    b, L = zxbcdt.shape[:2]
    y = ssd_sequential(
        x.reshape(b, L, h, p), dt, A.double(), B.reshape(b, L, groups, n),
        C.reshape(b, L, groups, n), D=D.double(), dt_bias=dt_bias.double(), dt_softplus=True,
        z=None if rms_w is not None else z.reshape(b, L, h, p), seq_idx=seq_idx,
    ).reshape(b, L, dim)  # fmt: skip
    if rms_w is not None:
        y = rmsnorm_ref(y, rms_w.double(), None, z=z, eps=1e-6, group_size=dim // groups,
                        norm_before_gate=norm_before_gate)  # fmt: skip
    return F.linear(y, out_w.double(), out_b.double()) if out_w is not None else y


@pytest.mark.parametrize("norm", ["none", "before", "after"])
@pytest.mark.parametrize("d_shape", ["h", "hp"])
def test_split_conv1d_scan_matches_block(norm, d_shape, backend):
    backend("torch")
    g = seeded("block", norm, d_shape)
    b, L, h, p, groups, n, width = 2, 150, 4, 8, 2, 16, 4
    dim, conv_dim = h * p, h * p + 2 * groups * n
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    zxbcdt = r(b, L, 2 * dim + 2 * groups * n + h)
    w, cb, dt_bias = r(conv_dim, width) * 0.5, r(conv_dim), r(h) * 0.5 - 1
    A = -torch.rand(h, generator=g) - 0.1
    D = r(h) if d_shape == "h" else r(h, p)
    rms_w = None if norm == "none" else r(dim)
    out_w, out_b = r(24, dim), r(24)
    res = mamba_split_conv1d_scan_combined(
        zxbcdt, w, cb, dt_bias, A, D, 64, rmsnorm_weight=rms_w, outproj_weight=out_w,
        outproj_bias=out_b, headdim=p if d_shape == "h" else None, ngroups=groups,
        norm_before_gate=norm != "after", return_final_states=True,
    )  # fmt: skip
    out, fin = res
    ref = _block_reference(zxbcdt, w, cb, dt_bias, A, D, h, p, groups, n, rms_w, out_w, out_b,
                           norm != "after")  # fmt: skip
    assert out.shape == (b, L, 24) and fin.shape == (b, h, p, n)
    torch.testing.assert_close(out, ref.float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(D=torch.randn(4)), "headdim must be given"),
        (dict(headdim=7), "does not match"),
        (dict(ngroups=3), "is not 2\\*dim"),
        (dict(activation="relu"), "activation"),
        (dict(conv1d_weight=torch.randn(10, 4)), "conv1d_weight"),
    ],
)  # fmt: skip
def test_split_conv1d_scan_bad_inputs(kw, match):
    h, p, groups, n = 4, 8, 2, 16
    conv_dim = h * p + 2 * groups * n
    args = dict(
        zxbcdt=torch.randn(1, 20, 2 * h * p + 2 * groups * n + h),
        conv1d_weight=torch.randn(conv_dim, 4), conv1d_bias=None, dt_bias=None,
        A=-torch.rand(h), D=torch.randn(h, p), chunk_size=64, ngroups=groups,
    )  # fmt: skip
    with pytest.raises(ValueError, match=match):
        mamba_split_conv1d_scan_combined(**{**args, **kw})


@pytest.mark.parametrize("with_z", [False, True], ids=["no-z", "z"])
def test_kernel_backward_reads_dout_itself_without_z(monkeypatch, with_z):
    """The backward's gated output gradient dout * silu(z) takes an x-sized buffer (which the
    dz stage fills) only with z; without z the kernels read dout itself, no copy (training's
    peak memory: 33.5 MB at bench ssd --backward's first shape, 134 MB at its second)."""
    from helpers import stand_in_kernels

    from mamba2_rocm.params import SsdBwdParams

    kset = stand_in_kernels(monkeypatch, ssd_ops)
    g = seeded("dout_g", with_z)
    a = _inputs(g, L=100)
    z = torch.randn(2, 100, 4, 8, generator=g) if with_z else None
    dout = torch.randn(2, 100, 4, 8, generator=g)
    ssd_ops._bwd_impl(a["x"], a["dt"], a["A"], a["B"], a["C"], 64, None, z, None, None, None,
                      False, (0.0, math.inf), dout, None)  # fmt: skip
    names = [f[0] for f in SsdBwdParams._fields_]
    (params,) = [p for name, p, _ in kset.launches if name.startswith("m2r_ssd_bwd_dx_")]
    dout_ptr, dout_g_ptr = params[names.index("dout")], params[names.index("dout_g")]
    assert dout_ptr == dout.data_ptr()
    if with_z:
        assert dout_g_ptr != dout_ptr
    else:
        assert dout_g_ptr == dout_ptr


@pytest.mark.parametrize(
    "dtype, n, cs, L, kept",
    [
        (torch.bfloat16, 128, 256, 4096, True),  # the Mamba2 models: states as large as out
        (torch.bfloat16, 128, 256, 4000, True),  # a partial last chunk: dA_cumsum's room covers it
        (torch.float32, 128, 256, 1000, True),
        (torch.float32, 128, 64, 1000, False),
        (torch.bfloat16, 256, 256, 4096, False),  # twice out's size: recomputed
        (torch.bfloat16, 128, 128, 4096, False),
    ],
)
def test_kept_states_fit_what_mamba_ssm_keeps(dtype, n, cs, L, kept):
    """Eager training keeps the forward's entering states for the backward only where they
    take no more memory than mamba_ssm's saved out + dA_cumsum (meta tensors: sizes only)."""
    x = torch.empty(2, L, 8, 64, dtype=dtype, device="meta")
    states = torch.empty(2, -(-L // cs), 8, n, 64, dtype=torch.float32, device="meta")
    assert (ssd_ops._kept_states(x, states, cs) is states) == kept


@pytest.mark.parametrize("form", ["chain", "chain_lds", None])
def test_state_passing_chained_or_separate(monkeypatch, form):
    """chunk_state runs chained (the state passing in its blocks, the link from the accumulators
    or through LDS; the flags zeroed by chunk_cumsum) where there are enough chains for the GPU,
    else followed by the separate state-passing kernel; the chain workspace goes to the kernels
    only when chained."""
    from helpers import stand_in_kernels

    from mamba2_rocm.params import SsdParams

    chained = form is not None
    monkeypatch.setattr(ssd_ops, "_chained", lambda chains, chunks, sms: chained)
    monkeypatch.setattr(
        ssd_ops, "_lds_link", lambda chains, chunks, sms, x, B, cs: form == "chain_lds"
    )
    kset = stand_in_kernels(monkeypatch, ssd_ops)
    a = _inputs(seeded("chained", form), L=200)
    ssd_ops._impl(a["x"], a["dt"], a["A"], a["B"], a["C"], 64, None, None, None, None, None, None,
                  False, (0.0, math.inf), False, None)  # fmt: skip
    names = [name for name, _, _ in kset.launches]
    stage = [n for n in names if n.startswith("m2r_ssd_chunk_state")]
    assert stage == (
        [f"m2r_ssd_chunk_state_{form}_f32"] if chained else ["m2r_ssd_chunk_state_f32"]
    )
    assert ("m2r_ssd_state_passing" in names) is not chained
    chain_ptr = kset.launches[0][1][[f[0] for f in SsdParams._fields_].index("chain")]
    assert (chain_ptr != 0) is chained


@pytest.mark.parametrize(
    ("mma", "dtype", "chunk", "headdim", "kernel", "tiles", "block"),
    [
        # matrix cores: the 16-bit types' 64-row tiles on 128 threads at every chunk size;
        # 64 headdim columns a block, all 128 on 256 threads at headdim 128 (NVIDIA)
        (True, torch.bfloat16, 128, 128, "bf16_t64p128", 2, 256),  # 2 row tiles
        (True, torch.float16, 256, 96, "f16_t64b128", 8, 128),  # 4 row x 2 column tiles
        (True, torch.bfloat16, 256, 72, "bf16_t64b128", 8, 128),
        (True, torch.bfloat16, 128, 64, "bf16_t64b128", 2, 128),
        (True, torch.bfloat16, 64, 128, "bf16_t64p128", 1, 256),
        (True, torch.float16, 256, 128, "f16_t64p128", 4, 256),
        (True, torch.float16, 64, 64, "f16_t64b128", 1, 128),
        # the FMA path (fp32 everywhere, every dtype on gfx10.3): 256 threads, 64-row tiles at
        # chunk 64, 128-row ones from 128
        (True, torch.float32, 128, 100, "f32_t128", 2, 256),
        (True, torch.float32, 256, 64, "f32_t128", 2, 256),
        (True, torch.float32, 64, 64, "f32_t64", 1, 256),
        (False, torch.bfloat16, 128, 128, "bf16_t128", 2, 256),
        (False, torch.float16, 256, 96, "f16_t128", 4, 256),
        (False, torch.bfloat16, 64, 128, "bf16_t64", 2, 256),
        (False, torch.float32, 256, 64, "f32_t128", 2, 256),
    ],
)
def test_chunk_scan_tile(monkeypatch, mma, dtype, chunk, headdim, kernel, tiles, block):
    """chunk_scan's kernel, grid and block by matrix cores, chunk size, headdim and dtype."""
    from helpers import stand_in_kernels

    kset = stand_in_kernels(monkeypatch, ssd_ops, matrix_cores=mma)
    a = _inputs(seeded("tile", chunk, headdim), L=300, p=headdim)
    a = {k: v if k == "A" else v.to(dtype) for k, v in a.items()}
    ssd_ops._impl(a["x"], a["dt"], a["A"], a["B"], a["C"], chunk, None, None, None, None, None, None,
                  False, (0.0, math.inf), False, None)  # fmt: skip
    (i,) = [i for i, (name, _, _) in enumerate(kset.launches) if "chunk_scan" in name]
    name, _, grid = kset.launches[i]
    assert name == f"m2r_ssd_chunk_scan_{kernel}"
    assert name in source_of(name).kernels
    assert grid == (-(-300 // chunk) * tiles * 4, 1, 2)
    assert kset.blocks[i] == (block, 1, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_chunk_scan_keeps_64_columns_at_headdim_128_on_amd(monkeypatch, dtype):
    """The 128-column form is NVIDIA's (measured there; its LDS would halve a CDNA compute
    unit's blocks): a ROCm torch keeps the 64-column tiles at headdim 128."""
    from helpers import stand_in_kernels

    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    kset = stand_in_kernels(monkeypatch, ssd_ops, matrix_cores=True)
    a = _inputs(seeded("tile-amd"), L=300, p=128)
    a = {k: v if k == "A" else v.to(dtype) for k, v in a.items()}
    ssd_ops._impl(a["x"], a["dt"], a["A"], a["B"], a["C"], 128, None, None, None, None, None, None,
                  False, (0.0, math.inf), False, None)  # fmt: skip
    (name,) = [name for name, _, _ in kset.launches if "chunk_scan" in name]
    assert name.endswith("_t64b128")


@pytest.mark.parametrize(
    ("chains", "chunks", "chained"),
    [
        # the H100 grid points either side of each step (CHAIN_CHAINS_PER_SM's comment)
        (256, 2, True),  # mamba2-370m b8 l512
        (192, 2, False),  # mamba2-130m b8 l512
        (192, 8, True),  # mamba2-780m b4 l2048
        (128, 8, False),  # mamba2-370m b4 l2048
        (64, 16, False),  # b2 l4096 h32
        (64, 64, True),  # b1 l16384 h64 g8
        (48, 64, False),  # mamba2-780m b1 l16384
        (24, 32, False),  # mamba2-130m b1 l8192
    ],
)
def test_chained_rule(chains, chunks, chained):
    """Few chunks per chain take many chains to chain, long chains few (H100-calibrated)."""
    assert ssd_ops._chained(chains, chunks, 132) is chained


def test_chained_rule_without_gpu():
    assert ssd_ops._chained(1, 1000, 0)  # no GPU (the CPU stand-ins): chained


@pytest.mark.parametrize(
    ("chains", "chunks", "chunk_size", "lds"),
    [
        # the H100 grid points either side of each step (CHAIN_LDS_CHAINS_PER_SM's comment)
        (384, 2, 256, True),  # mamba2-780m b8 l512
        (256, 2, 256, False),  # mamba2-370m b8 l512
        (128, 32, 256, True),  # codestral b1 l8192
        (128, 64, 256, True),  # codestral b1 l16384
        (80, 64, 256, False),  # mamba2-2.7b b1 l16384
        (384, 16, 128, True),  # Falcon-H1 b4 l2048
        (128, 64, 128, False),  # Nemotron-H b1 l8192
        (96, 64, 128, False),  # Falcon-H1 b1 l8192
        (128, 64, 64, False),  # chunks of 64: the 128 table
    ],
)
def test_lds_link_rule(chains, chunks, chunk_size, lds):
    """The LDS link from 2.5 chains per multiprocessor on at 2 chunks, beyond that from 0.96
    with chunks of 256 and 1.5 with shorter ones (H100-calibrated)."""
    x = torch.empty(8, 512, 24, 128, device="meta")
    B = torch.empty(8, 512, 1, 256, device="meta")
    assert ssd_ops._lds_link(chains, chunks, 132, x, B, chunk_size) is lds


def test_lds_link_not_on_rocm(monkeypatch):
    """A ROCm torch keeps the register link (no occupancy for the LDS form to gain on AMD)."""
    x = torch.empty(8, 512, 24, 128, device="meta")
    B = torch.empty(8, 512, 1, 256, device="meta")
    assert ssd_ops._lds_link(10_000, 8, 132, x, B, 256)
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    assert not ssd_ops._lds_link(10_000, 8, 132, x, B, 256)


def test_lds_link_only_within_32_bit_offsets():
    """That kernel holds x's and B's element offsets in 32 bits: a view whose last element lies
    2**32 elements past its first (strides, not storage) takes the other link."""
    B = torch.empty(8, 512, 1, 256, device="meta")
    wide = torch.empty(1, device="meta").as_strided((2, 512, 24, 128), (2**32, 24 * 128, 128, 1))
    assert ssd_ops._lds_link(10_000, 8, 132, torch.empty(2, 512, 24, 128, device="meta"), B, 256)
    assert not ssd_ops._lds_link(10_000, 8, 132, wide, B, 256)


def _sizes(batch, seqlen, nheads, headdim=64, dstate=128):
    return (batch, seqlen, nheads, headdim, dstate)


@pytest.mark.chunk_rule
@pytest.mark.parametrize(
    ("dims", "chunk"),
    [
        (_sizes(1, 8192, 24), 256),  # mamba2-130m b1 l8192: 1489 units per multiprocessor
        (_sizes(1, 1000, 24), 128),  # 182 units
        (_sizes(1, 300, 24), 64),  # 55 units: just under the 128 step
        (_sizes(1, 314, 24), 128),  # 57.1 units
        (_sizes(8, 100, 128), 128),  # enough work for 256, but 128 holds the sequence
        (_sizes(8, 40, 128), 64),  # and 64 holds this one
        (_sizes(1, 8192, 24, 128, 256), 256),  # Falcon-H1-7B's layer asks for 128
        (_sizes(1, 512, 24, 128, 256), 128),  # 372 units: just under the 256 step
        (_sizes(1, 0, 24), 64),  # no tokens
    ],
)
def test_scan_chunk_size_follows_the_work(monkeypatch, dims, chunk):
    monkeypatch.setattr(ssd_ops, "sm_count", lambda device: 132)
    for asked in (64, 128, 256):
        assert ssd_ops.scan_chunk_size(asked, dims, torch.device("cuda")) == chunk


@pytest.mark.chunk_rule
@pytest.mark.parametrize(
    ("dims", "asked", "chunk"),
    [
        (_sizes(1, 300, 24), 256, 256),  # inference: 64
        (_sizes(1, 300, 24), 64, 64),
        (_sizes(1, 1000, 24), 64, 128),  # the rule's 128 over the caller's 64
        (_sizes(1, 8192, 24, 128, 256), 128, 256),
        (_sizes(8, 100, 128), 256, 128),  # still no longer than the sequence needs
    ],
)
def test_scan_chunk_size_in_training_is_never_shorter_than_asked(monkeypatch, dims, asked, chunk):
    monkeypatch.setattr(ssd_ops, "sm_count", lambda device: 132)
    assert ssd_ops.scan_chunk_size(asked, dims, torch.device("cuda"), training=True) == chunk


@pytest.mark.chunk_rule
def test_scan_chunk_size_scales_with_the_gpu(monkeypatch):
    """Work per multiprocessor: the same call takes shorter chunks on a larger GPU."""
    dims = _sizes(1, 8192, 24)  # 196,608 units
    for sms, chunk in ((132, 256), (304, 256), (520, 128), (3500, 64)):
        monkeypatch.setattr(ssd_ops, "sm_count", lambda device, sms=sms: sms)
        assert ssd_ops.scan_chunk_size(256, dims, torch.device("cuda")) == chunk, sms


@pytest.mark.chunk_rule
def test_scan_chunk_size_off_the_gpu_is_the_callers():
    for asked in (64, 128, 256):
        for training in (False, True):
            dims, cpu = _sizes(8, 8192, 128), torch.device("cpu")
            assert ssd_ops.scan_chunk_size(asked, dims, cpu, training=training) == asked


def test_scan_chunk_size_is_pinned_for_the_other_tests():
    """(conftest's fixture: tests that pass a chunk size run it)"""
    assert ssd_ops.scan_chunk_size(64, _sizes(8, 8192, 128), torch.device("cuda")) == 64


@pytest.mark.parametrize("view", [False, True])
def test_cu_seqlens_reaches_the_kernels_dense(monkeypatch, view):
    """The kernels index cu_seqlens densely (no stride field in SsdParams): a strided int32 view
    reaches the launches as a unit-stride copy of its values, a dense one as it is."""
    from helpers import stand_in_kernels, strided_view

    from mamba2_rocm.params import SsdParams

    kset = stand_in_kernels(monkeypatch, ssd_ops)
    a = _inputs(seeded("cu view", view), b=1, L=100)
    ends = torch.tensor([0, 40, 100], dtype=torch.int32)
    cu = strided_view(ends) if view else ends
    seq_idx = torch.repeat_interleave(torch.arange(2, dtype=torch.int32), ends.diff())[None]
    copies = []
    real = torch.Tensor.contiguous
    monkeypatch.setattr(
        torch.Tensor, "contiguous", lambda t, *a: copies.append((t, real(t, *a))) or copies[-1][1]
    )
    ssd_ops._impl(a["x"], a["dt"], a["A"], a["B"], a["C"], 64, None, None, None, None, seq_idx,
                  cu, False, (0.0, math.inf), True, None)  # fmt: skip
    field = [f[0] for f in SsdParams._fields_].index("cu_seqlens")
    got = {p[field] for _, p, _ in kset.launches}
    (dense,) = [c for t, c in copies if t is cu]
    assert torch.equal(dense, ends) and dense.stride() == (1,) and got == {dense.data_ptr()}
    assert (dense.data_ptr() == cu.data_ptr()) is not view


@pytest.mark.parametrize(
    ("blocks", "heads", "sms", "forced", "parts"),
    [
        # the 1.3b training step (b4, 8 chunks of 256, 10 tile pairs, 64 heads): 3 waves of 32
        # heads (+1) in 2 parts, 5 of 16 in 4, 10 of 8 in 8 -> 4, as Triton's dcb
        (320, 64, 132, None, 4),
        (40, 64, 132, None, 4),  # parts divide the heads, 16 heads each at least: 4 of 16
        (320, 32, 132, None, 2),  # b2 l4096 h32: 2 parts of 16
        (160, 24, 132, None, 1),  # mamba2-130m b8 l512: 24 heads, no part of 16 divides them
        (40, 8, 132, None, 1),  # 8 heads a group (the g8 shapes): never split
        (40, 3, 132, None, 1),  # too few heads to split
        (2000, 64, 132, None, 1),  # enough blocks: 8 waves of 65 beat 16 of 33
        (40, 64, 0, None, 1),  # no GPU (a stand-in): one part
        (40, 64, 132, 4, 4),  # forced
        (40, 64, 132, 3, 2),  # forced, down to a divisor
        (40, 2, 132, 5, 2),  # forced, clamped to the heads
        (40, 64, 132, 0, 1),
    ],
)
def test_dcb_parts_rule(blocks, heads, sms, forced, parts):
    assert ssd_ops.dcb_parts(blocks, heads, sms, forced) == parts


@pytest.mark.parametrize(("parts", "ran"), [(1, 1), (3, 3), (4, 3), (7, 6)])
def test_dcb_head_parts_launch(monkeypatch, parts, ran):
    """The dcb stage's heads in parts (a divisor of the group's 6 heads, at most the forced
    count): the one dcb kernel over parts x the blocks, each part a group of its own
    (heads_per_group / parts heads, its C·Bᵀ at group * parts + part of a copy with room for
    every part), the other stages' parameters untouched; one part: the plain launch."""
    from helpers import stand_in_kernels

    from mamba2_rocm.params import SsdBwdParams

    monkeypatch.setattr(ssd_ops, "DCB_PARTS", parts)
    kset = stand_in_kernels(monkeypatch, ssd_ops)
    a = _inputs(seeded("dcb parts", parts), L=300, h=12, groups=2)  # 6 heads a group
    dout = torch.randn_like(a["x"])
    ssd_ops._bwd_impl(a["x"], a["dt"], a["A"], a["B"], a["C"], 64, None, None, None, None, None,
                      False, (0.0, math.inf), dout, None)  # fmt: skip
    names = [f[0] for f in SsdBwdParams._fields_]
    field = lambda p, k: p[names.index(k)]  # noqa: E731
    ((_, dx_params, _),) = [(n, p, g) for n, p, g in kset.launches if "_dx_" in n]
    ((name, params, grid),) = [(n, p, g) for n, p, g in kset.launches if "_dcb_" in n]
    assert name == "m2r_ssd_bwd_dcb_f32"  # the kernel as it is
    nchunks = -(-300 // 64)
    assert grid == (nchunks * 2 * ran, 1, 2)  # one tile pair a 64-token chunk
    assert field(params, "ngroups") == 2 * ran and field(params, "heads_per_group") == 6 // ran
    assert field(dx_params, "ngroups") == 2 and field(dx_params, "heads_per_group") == 6
    same = [k for k in names if k not in ("cb", "ngroups", "heads_per_group")]
    assert [field(params, k) for k in same] == [field(dx_params, k) for k in same]
    assert (field(params, "cb") == field(dx_params, "cb")) == (ran == 1)
