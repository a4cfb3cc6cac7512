"""Empty batches and sequences (batch 0, seqlen 0) give empty results, as torch ops do, on
every CPU tier; the states after no tokens are the entering ones and nothing is written; empty
feature dims still raise. Meta tensors get shapes in O(1), whatever the sizes."""

import time

import pytest
import torch
from helpers import seeded

from mamba2_rocm import (
    causal_conv1d_fn,
    causal_conv1d_update,
    mamba_chunk_scan_combined,
    mamba_split_conv1d_scan_combined,
    rmsnorm_fn,
    selective_state_update,
)

H, P, N, G = 4, 8, 16, 2
TIERS = ["torch", "eager"]


def _scan(g, b, L, **kw):
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return mamba_chunk_scan_combined(
        r(b, L, H, P), r(b, L, H), -torch.rand(H, generator=g), r(b, L, G, N), r(b, L, G, N),
        chunk_size=64, D=r(H), z=r(b, L, H, P), dt_bias=r(H), dt_softplus=True, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize(("b", "L"), [(0, 37), (3, 0), (0, 0)])
def test_scan(tier, b, L, backend):
    backend(tier)
    g = seeded("empty-scan", tier, b, L)
    init = torch.randn(b, H, P, N, generator=g)
    out, final = _scan(g, b, L, initial_states=init, return_final_states=True)
    assert out.shape == (b, L, H, P) and out.dtype == torch.float32
    assert torch.equal(final, init)
    assert b == 0 or final.data_ptr() != init.data_ptr()  # a copy, not the caller's tensor
    out, final = _scan(g, b, L, return_final_states=True, state_dtype=torch.bfloat16)
    assert final.shape == (b, H, P, N) and final.dtype == torch.bfloat16 and not final.any()


@pytest.mark.parametrize("tier", TIERS)
def test_scan_varlen_with_no_tokens(tier, backend):
    backend(tier)
    g = seeded("empty-varlen", tier)
    init = torch.randn(1, H, P, N, generator=g)
    cu = torch.zeros(4, dtype=torch.int32)  # three empty sequences
    seq_idx = torch.zeros(1, 0, dtype=torch.int32)
    out, var = _scan(g, 1, 0, initial_states=init, cu_seqlens=cu, seq_idx=seq_idx,
                     return_varlen_states=True)  # fmt: skip
    assert out.shape == (1, 0, H, P) and var.shape == (3, H, P, N)
    assert torch.equal(var[0], init[0]) and torch.equal(var[1], init[0])  # all start at 0
    assert torch.equal(var[2], init[0])


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize(("b", "L"), [(0, 20), (2, 0)])
def test_conv(tier, b, L, backend):
    backend(tier)
    g = seeded("empty-conv", tier, b, L)
    x, w = torch.randn(b, 8, L, generator=g), torch.randn(8, 4, generator=g)
    init = torch.randn(b, 8, 3, generator=g)
    out, final = causal_conv1d_fn(x, w, initial_states=init, return_final_states=True)
    assert out.shape == (b, 8, L) and torch.equal(final, init)
    out, final = causal_conv1d_fn(x, w, return_final_states=True, activation="silu")
    assert final.shape == (b, 8, 3) and not final.any()


@pytest.mark.parametrize("tier", TIERS)
def test_updates_write_nothing(tier, backend):
    backend(tier)
    g = seeded("empty-update", tier)
    conv_state = torch.randn(3, 8, 3, generator=g)
    keep = conv_state.clone()
    idx = torch.zeros(0, dtype=torch.int32)
    out = causal_conv1d_update(torch.randn(0, 8), conv_state, torch.randn(8, 4, generator=g),
                               conv_state_indices=idx)  # fmt: skip
    assert out.shape == (0, 8) and torch.equal(conv_state, keep)
    out = causal_conv1d_update(torch.randn(3, 8, 0), conv_state, torch.randn(8, 4, generator=g))
    assert out.shape == (3, 8, 0) and torch.equal(conv_state, keep)  # no new tokens
    state = torch.randn(5, H, P, N, generator=g)
    keep = state.clone()
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    out = selective_state_update(state, r(0, H, P), r(0, H, P), -torch.rand(H, P, N), r(0, G, N),
                                 r(0, G, N), state_batch_indices=idx)  # fmt: skip
    assert out.shape == (0, H, P) and torch.equal(state, keep)


@pytest.mark.parametrize("tier", TIERS)
def test_norm_and_fused_block(tier, backend):
    backend(tier)
    g = seeded("empty-norm", tier)
    assert rmsnorm_fn(torch.randn(0, 64), torch.randn(64, generator=g), None).shape == (0, 64)
    d_inner, d_conv = H * P, 4
    d_in_proj = 2 * d_inner + 2 * G * N + H
    zxbcdt = torch.randn(0, 11, d_in_proj, generator=g)
    out = mamba_split_conv1d_scan_combined(
        zxbcdt, torch.randn(d_inner + 2 * G * N, d_conv, generator=g), None,
        torch.randn(H, generator=g), -torch.rand(H, generator=g), torch.randn(H, generator=g),
        chunk_size=64, headdim=P, ngroups=G, rmsnorm_weight=torch.randn(d_inner, generator=g),
    )  # fmt: skip
    assert out.shape == (0, 11, d_inner)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: causal_conv1d_fn(torch.randn(2, 0, 5), torch.randn(0, 4)), "dim must be >= 1"),
        (lambda: mamba_chunk_scan_combined(torch.randn(1, 5, 0, P), torch.randn(1, 5, 0),
                                           torch.randn(0), torch.randn(1, 5, 1, N),
                                           torch.randn(1, 5, 1, N), chunk_size=64),
         "nheads and headdim must be >= 1"),
        (lambda: rmsnorm_fn(torch.randn(3, 0), torch.randn(0), None), "x is empty (shape (3, 0))"),
    ],
)  # fmt: skip
def test_empty_feature_dims_still_raise(call, message):
    with pytest.raises(ValueError, match=f"^.*{message.replace('(', '.').replace(')', '.')}"):
        call()


def test_meta_tensors_are_shapes_only():
    L, m = 2**31, "meta"
    e = lambda *s: torch.empty(*s, device=m)  # noqa: E731
    start = time.monotonic()
    out, final = mamba_chunk_scan_combined(
        e(1, L, 2, 4), e(1, L, 2), e(2), e(1, L, 1, 16), e(1, L, 1, 16), chunk_size=256,
        seq_idx=torch.empty(1, L, dtype=torch.int32, device=m), return_final_states=True,
    )  # fmt: skip
    assert out.shape == (1, L, 2, 4) and final.shape == (1, 2, 4, 16) and out.is_meta
    assert causal_conv1d_fn(e(1, 8, L), e(8, 4)).shape == (1, 8, L)
    assert rmsnorm_fn(e(L, 64), e(64), None).shape == (L, 64)
    assert time.monotonic() - start < 20  # was a Python loop over 2**31 / 256 chunks
