"""The SSD stages in mamba_ssm's layouts (mamba2_rocm.reference.ssd_stages, served as
mamba_ssm.ops.triton.ssd_chunk_state / ssd_state_passing / ssd_chunk_scan by the drop-in):
composed, they are the scan; chunk_state_varlen gives each packed sequence's final state; the
split-conv reference is the fused block; upstream's test module imports every name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mamba2_rocm.reference import ssd_stages as st
from mamba2_rocm.reference.ssd import ssd_sequential

D64 = torch.float64


def _inputs(seed, batch=2, seqlen=150, nheads=6, headdim=8, ngroups=2, dstate=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seqlen, nheads, headdim, generator=g, dtype=D64)
    dt = torch.rand(batch, seqlen, nheads, generator=g, dtype=D64) * 0.5
    A = -torch.rand(nheads, generator=g, dtype=D64) - 0.1
    B = torch.randn(batch, seqlen, ngroups, dstate, generator=g, dtype=D64) * 0.5
    C = torch.randn(batch, seqlen, ngroups, dstate, generator=g, dtype=D64) * 0.5
    return x, dt, A, B, C


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("with_seq_idx", [False, True])
def test_the_stages_composed_are_the_scan(chunk_size, with_seq_idx):
    x, dt, A, B, C = _inputs(1)
    g = torch.Generator().manual_seed(2)
    D, z = torch.randn(6, generator=g, dtype=D64), torch.randn(x.shape, generator=g, dtype=D64)
    init = torch.randn(2, 6, 8, 5, generator=g, dtype=D64)
    seq_idx = None
    if with_seq_idx:  # row 0: three sequences, one of them starting mid-chunk; row 1: one
        seq_idx = torch.zeros(2, 150, dtype=torch.int32)
        seq_idx[0, 40:] = 1
        seq_idx[0, 97:] = 2
    dA, dto = st.chunk_cumsum(dt, A, chunk_size, dt_bias=None, dt_softplus=True)
    states = st.chunk_state(B, x, dto, dA, seq_idx=seq_idx)
    flat = states.reshape(*states.shape[:3], -1)
    entering, final = st.state_passing(flat, dA[..., -1], init.reshape(2, 6, -1), seq_idx=seq_idx,
                                       chunk_size=chunk_size)  # fmt: skip
    out = st.chunk_scan(B, C, x, dto, dA, entering.reshape(states.shape), D=D, z=z, seq_idx=seq_idx)
    ref, ref_final = ssd_sequential(x, dt, A, B, C, D=D, z=z, initial_states=init, seq_idx=seq_idx,
                                    dt_softplus=True, return_final_states=True)  # fmt: skip
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final.reshape(ref_final.shape).double(), ref_final.double(),
                               rtol=1e-4, atol=1e-4)  # fmt: skip


def test_chunk_state_varlen_gives_each_sequences_final_state():
    """As upstream's test_chunk_state_varlen, on CPU: packed sequences, seq_idx from cu_seqlens,
    the varlen states against each sequence scanned alone."""
    g = torch.Generator().manual_seed(3)
    seqlens = torch.tensor([37, 5, 64, 90, 1, 70])
    cu = F.pad(seqlens.cumsum(0), (1, 0))
    total = int(cu[-1])
    x, dt, A, B, C = _inputs(4, batch=1, seqlen=total)
    seq_idx = torch.repeat_interleave(torch.arange(len(seqlens), dtype=torch.int32), seqlens)[None]
    chunk = 32
    dA, dto = st.chunk_cumsum(dt, A, chunk)
    states = st.chunk_state(B, x, dto, dA, seq_idx=seq_idx)
    entering, _ = st.state_passing(states.reshape(*states.shape[:3], -1), dA[..., -1],
                                   seq_idx=seq_idx, chunk_size=chunk)  # fmt: skip
    out = st.chunk_state_varlen(
        B[0], x[0], dto[0], dA[0], cu, entering[0].reshape(states.shape[1:])
    )
    for i in range(len(seqlens)):
        a, b = int(cu[i]), int(cu[i + 1])
        _, alone = ssd_sequential(x[:, a:b], dt[:, a:b], A, B[:, a:b], C[:, a:b],
                                  return_final_states=True)  # fmt: skip
        torch.testing.assert_close(out[i].double(), alone[0].double(), rtol=1e-4, atol=1e-4)
    del g


def test_the_split_conv_reference_is_the_fused_block(monkeypatch):
    from mamba2_rocm.ops.mamba2 import mamba_split_conv1d_scan_combined

    g = torch.Generator().manual_seed(5)
    nheads, headdim, ngroups, dstate, width = 4, 8, 2, 6, 4
    dim, conv_dim = nheads * headdim, nheads * headdim + 2 * ngroups * dstate
    zxbcdt = torch.randn(2, 70, 2 * dim + 2 * ngroups * dstate + nheads, generator=g)
    args = (zxbcdt, torch.randn(conv_dim, width, generator=g) * 0.3, torch.randn(conv_dim, generator=g),
            torch.randn(nheads, generator=g), -torch.rand(nheads, generator=g) - 0.1,
            torch.randn(nheads, generator=g), 32)  # fmt: skip
    kw = {"rmsnorm_weight": torch.ones(dim), "outproj_weight": torch.randn(16, dim, generator=g),
          "headdim": headdim, "ngroups": ngroups, "norm_before_gate": False}  # fmt: skip
    ref = st.split_conv1d_scan_ref(*args, **kw)
    ours = mamba_split_conv1d_scan_combined(*args, **kw)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_upstreams_ssd_test_module_imports_under_the_drop_in(monkeypatch):
    """mamba_ssm's tests/ops/triton/test_ssd.py imports these at collection."""
    import importlib
    import sys

    from mamba2_rocm import dropin

    if importlib.util.find_spec("mamba_ssm") is not None and not dropin.is_active():
        pytest.skip("a real mamba_ssm is installed")
    dropin.activate()
    try:
        for module, names in {
            "mamba_ssm.ops.triton.ssd_chunk_state": ["chunk_state", "chunk_state_ref", "_chunk_cumsum_fwd",
                                                     "_chunk_state_fwd", "chunk_state_varlen"],
            "mamba_ssm.ops.triton.ssd_state_passing": ["state_passing", "state_passing_ref", "_state_passing_fwd"],
            "mamba_ssm.ops.triton.ssd_chunk_scan": ["chunk_scan", "chunk_scan_ref"],
            "mamba_ssm.ops.triton.ssd_combined": ["mamba_chunk_scan_combined", "mamba_chunk_scan",
                                                  "ssd_chunk_scan_combined_ref", "ssd_selective_scan",
                                                  "mamba_split_conv1d_scan_combined",
                                                  "mamba_split_conv1d_scan_ref"],
        }.items():  # fmt: skip
            mod = importlib.import_module(module)
            assert all(callable(getattr(mod, n)) for n in names), module
        x, dt, A, B, C = _inputs(6, batch=1, seqlen=40)
        scan = importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
        torch.testing.assert_close(scan.ssd_selective_scan(x.float(), dt.float(), A.float(), B.float(), C.float()),
                                   scan.ssd_chunk_scan_combined_ref(x.float(), dt.float(), A.float(),
                                                                    B.float(), C.float(), 16),
                                   rtol=1e-4, atol=1e-4)  # fmt: skip
    finally:
        for name in [n for n in sys.modules if n == "mamba_ssm" or n.startswith("mamba_ssm.")]:
            del sys.modules[name]
        dropin.deactivate()


def test_bad_shapes_are_refused_naming_them():
    x, dt, A, B, _ = _inputs(7, batch=1, seqlen=40)
    with pytest.raises(ValueError) as info:
        st.chunk_cumsum(dt, A[:5], 16)
    assert str(info.value) == "A must be (nheads,) = (6,), got (5,)"
    dA, dto = st.chunk_cumsum(dt, A, 16)
    with pytest.raises(ValueError) as info:
        st.chunk_state(B[:, :, :, :], x[:, :, :5], dto, dA)
    assert str(info.value) == ("B must be (batch, seqlen, ngroups, dstate) with ngroups dividing "
                               "nheads, got (1, 40, 2, 5) for x (1, 40, 5, 8)")  # fmt: skip
    with pytest.raises(ValueError) as info:
        st.chunk_state(B, x, dto[..., :8], dA[..., :8])
    assert str(info.value) == ("dt and dA_cumsum must be (batch, nheads, nchunks, chunk_size) "
                               "covering seqlen 40, got (1, 6, 3, 8) / (1, 6, 3, 8)")  # fmt: skip
    states = st.chunk_state(B, x, dto, dA).reshape(1, 3, 6, -1)
    with pytest.raises(ValueError) as info:
        st.state_passing(states, dA[:, :, :2, -1])
    assert (
        str(info.value)
        == "dA_chunk_cumsum must be (batch, nheads, nchunks) = (1, 6, 3), got (1, 6, 2)"
    )
    with pytest.raises(ValueError, match="^seq_idx needs chunk_size$"):
        st.state_passing(states, dA[..., -1], seq_idx=torch.zeros(1, 40, dtype=torch.int32))
    with pytest.raises(ValueError) as info:
        st.chunk_state_varlen(
            B[0], x[0], dto[0], dA[0], torch.tensor([0, 40]), states[0, :2].reshape(2, 6, 8, 5)
        )
    assert (
        str(info.value)
        == "chunk_states must be (nchunks, nheads, headdim, dstate), got (2, 6, 8, 5)"
    )
    zxbcdt = torch.randn(1, 10, 2 * 32 + 2 * 2 * 6 + 4 + 1)
    args = (zxbcdt, torch.randn(32 + 24, 4), None, None, -torch.rand(4), torch.randn(4), 16)
    with pytest.raises(ValueError, match="^headdim must be given when D is \\(nheads,\\)$"):
        st.split_conv1d_scan_ref(*args, ngroups=2)
    with pytest.raises(ValueError) as info:
        st.split_conv1d_scan_ref(*args, headdim=8, ngroups=2)
    assert (
        str(info.value)
        == "zxbcdt's last dim must be 2 * dim + 2 * ngroups * dstate + nheads = 92, got 93"
    )
