"""What mamba_ssm / causal_conv1d callers pass, on the kernel tier: mixed dtypes, any chunk
size, empty sequences in cu_seqlens, the gated LayerNorm and varlen conv states (training through
the kernels: test_backward_gpu.py)."""

import pytest
import torch
from helpers import gpu_available, poison_allocator, seeded

from mamba2_rocm import (
    causal_conv1d_varlen_states,
    layernorm_fn,
    mamba_chunk_scan_combined,
    selective_state_update,
)
from mamba2_rocm.reference.conv1d import causal_conv1d_varlen_states_ref
from mamba2_rocm.reference.ssd import rmsnorm_ref, selective_state_update_ref, ssd_sequential

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs a GPU")]
DEV = "cuda"
TOL = {torch.float32: (1e-3, 1e-3), torch.float16: (1e-2, 1e-2), torch.bfloat16: (2e-2, 5e-2)}


def _scan_inputs(g, b, L, h, p, groups, n, dtype, bc_dtype):
    r = lambda *s: torch.randn(*s, device=DEV, generator=g)  # noqa: E731
    return dict(
        x=r(b, L, h, p).to(dtype), dt=(r(b, L, h) - 2.0).to(dtype),
        A=-torch.rand(h, device=DEV, generator=g) * 2 - 0.05,
        B=r(b, L, groups, n).to(bc_dtype), C=r(b, L, groups, n).to(bc_dtype),
        D=r(h), z=r(b, L, h, p).to(bc_dtype), dt_bias=r(h) * 0.5,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("chunk", [1, 32, 100, 200, 512])
def test_scan_mixed_dtypes_any_chunk(dtype, chunk):
    """fp32 B, C, z, D, dt_bias, A with half x, and chunk sizes mamba_ssm runs with."""
    a = _scan_inputs(
        seeded("mix", chunk, dtype, device=DEV), 2, 151, 4, 32, 2, 16, dtype, torch.float32
    )
    keep = {k: v.clone() for k, v in a.items()}
    poison_allocator(1 << 22)
    out, fin = mamba_chunk_scan_combined(**a, chunk_size=chunk, dt_softplus=True,
                                         return_final_states=True)  # fmt: skip
    # the kernels read B, C, z in x's type (mamba_ssm's Triton products do too): the reference
    # gets the same rounded operands
    rounded = {**a, **{k: a[k].to(dtype) for k in ("B", "C", "z")}}
    ref, ref_fin = ssd_sequential(**rounded, dt_softplus=True, return_final_states=True)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out, ref.to(dtype), rtol=TOL[dtype][0], atol=TOL[dtype][1])
    torch.testing.assert_close(fin, ref_fin.float(), rtol=2e-2, atol=2e-2)
    assert all(torch.equal(a[k], keep[k]) for k in a), "the caller's tensors were written"


def test_scan_empty_sequences_in_cu_seqlens():
    g = seeded("empty", device=DEV)
    a = _scan_inputs(g, 1, 200, 4, 32, 1, 16, torch.float32, torch.float32)
    a["initial_states"] = torch.randn(1, 4, 32, 16, device=DEV, generator=g)
    cu = torch.tensor([0, 0, 70, 70, 70, 131, 200, 200], dtype=torch.int32, device=DEV)
    seq_idx = torch.repeat_interleave(
        torch.arange(7, dtype=torch.int32, device=DEV), cu.diff()
    ).unsqueeze(0)  # fmt: skip
    kw = dict(seq_idx=seq_idx, cu_seqlens=cu, dt_softplus=True, return_varlen_states=True)
    poison_allocator(1 << 22)
    out, var = mamba_chunk_scan_combined(**a, chunk_size=64, **kw)
    ref, ref_var = ssd_sequential(**a, **kw)
    torch.testing.assert_close(out, ref.float(), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(var, ref_var.float(), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(var[0], a["initial_states"][0])  # empty at offset 0
    assert not var[[2, 3, 6]].any()  # empty later: zero states


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("tied", [False, True])
def test_state_update_mixed_dtypes(dtype, tied):
    """mamba_ssm's test_selective_state_update_with_heads inputs: fp32 B, C, A, D, dt_bias."""
    g = seeded("ssu-mix", dtype, tied, device=DEV)
    b, h, p, n, groups = 3, 8, 64, 32, 2
    r = lambda *s: torch.randn(*s, device=DEV, generator=g)  # noqa: E731
    state = r(b, h, p, n).to(dtype)
    x, z = r(b, h, p).to(dtype), r(b, h, p)
    if tied:
        dt = r(b, h).to(dtype)[..., None].expand(b, h, p)
        A = (-torch.rand(h, device=DEV, generator=g) - 1)[:, None, None].expand(h, p, n)
        D, dt_bias = r(h)[:, None].expand(h, p), (r(h) - 4)[:, None].expand(h, p)
    else:
        dt, A = r(b, h, p).to(dtype), -torch.rand(h, p, n, device=DEV, generator=g) - 1
        D, dt_bias = r(h, p), r(h, p) - 4
    B, C = r(b, groups, n), r(b, groups, n)
    ref_state = state.clone()
    out = selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus=True)
    ref = selective_state_update_ref(ref_state, x, dt, A, B, C, D, z, dt_bias, dt_softplus=True,
                                     compute_dtype=torch.float64)  # fmt: skip
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(state, ref_state, rtol=rtol, atol=atol)


@pytest.mark.parametrize("x_dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("contig", [True, False])
def test_state_update_reads_float32_b_and_c_unrounded(x_dtype, contig):
    """float32 B / C with half x are read as float32, as mamba_ssm reads them. With a zero
    float32 state, x = dt = 1 and A = 0 the new state is B itself: B = 1 + k * 2^-12 survives
    exactly (in half it rounds to 1). With B = +-1 and C = 1 +- 2^-12 the output is exactly
    32 * 2^-12 = 2^-7 (C rounded to half would give 0)."""
    b, h, p, n = 2, 4, 64, 32
    sign = torch.tensor([1.0, -1.0], device=DEV).repeat(n // 2)
    fine = 2.0**-12
    ramp = 1 + torch.arange(1, n + 1, device=DEV) * fine

    def run(B, C):
        full = torch.zeros(b, h, p, 2 * n, device=DEV)  # float32
        state = full[..., :n] if contig else full[..., ::2]
        x = torch.ones(b, h, p, device=DEV, dtype=x_dtype)
        A = torch.zeros(h, p, n, device=DEV)
        out = selective_state_update(state, x, x.clone(), A, B.expand(b, 1, n).contiguous(),
                                     C.expand(b, 1, n).contiguous())  # fmt: skip
        return state, out

    state, _ = run(ramp, torch.ones(n, device=DEV))
    assert torch.equal(state, ramp.expand_as(state))
    _, out = run(sign, 1 + sign * fine)
    assert torch.equal(out, torch.full_like(out, 2.0**-7))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("hidden, group", [(2048, None), (2048, 64), (1000, 200), (4096, 4096)])
@pytest.mark.parametrize("gate", ["none", "before", "after"])
def test_layernorm_kernel(dtype, hidden, group, gate):
    """The gated LayerNorm on both kernel forms (register-resident for 16-bit aligned groups,
    generic otherwise), fp32 weight/bias, z in fp32 with half x."""
    g = seeded("ln", dtype, hidden, group, gate, device=DEV)
    x = (torch.randn(37, hidden, device=DEV, generator=g) * 3 + 1).to(dtype)
    w, bias = (
        torch.randn(hidden, device=DEV, generator=g),
        torch.randn(hidden, device=DEV, generator=g),
    )
    z = None if gate == "none" else torch.randn(37, hidden, device=DEV, generator=g)
    nbg = gate != "after"
    poison_allocator(1 << 22)
    out = layernorm_fn(x, w, bias, z, eps=1e-5, group_size=group, norm_before_gate=nbg)
    ref = rmsnorm_ref(x.double(), w, bias, z, 1e-5, group, nbg, is_rms_norm=False)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out, ref.to(dtype), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_varlen_states(dtype):
    g = seeded("varlen", device=DEV)
    seqlens = torch.tensor([5, 0, 31, 1, 40, 0, 2])
    cu = torch.nn.functional.pad(seqlens.cumsum(0), (1, 0)).to(DEV)
    x = torch.randn(int(seqlens.sum()), 300, device=DEV, generator=g).to(dtype)
    out = causal_conv1d_varlen_states(x, cu, 20)
    assert out.shape == (7, 300, 20) and out.stride(1) == 1
    assert torch.equal(out, causal_conv1d_varlen_states_ref(x, cu, 20))
