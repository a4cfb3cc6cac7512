"""The SSD scan's stages one by one, in mamba_ssm's layouts: pure PyTorch (float32 math).

mamba_ssm's Triton package exposes its five stages as functions of their own
(``mamba_ssm.ops.triton.ssd_chunk_state`` / ``ssd_state_passing`` / ``ssd_chunk_scan``), and its
tests and some research code call them directly. The drop-in serves those names from here. The
layouts are mamba_ssm's: the within-chunk tensors ``dt`` and ``dA_cumsum`` are (batch, nheads,
nchunks, chunk_size), the chunk states (batch, nchunks, nheads, headdim, dstate). The whole scan
(``mamba_chunk_scan_combined``) runs on the kernels; these stages are the reference math,
the same recurrence as :mod:`mamba2_rocm.reference.ssd`:

1. cumsum: dt' = clamp(softplus?(dt + dt_bias), *dt_limit) (0 past the sequence), and the
   running sum of dt' * A within each chunk;
2. chunk state: each chunk's state at its end, from a zero state:
   sum_t exp(dA_cs[last] - dA_cs[t]) dt'[t] x[t] B[t]ᵀ (with seq_idx, only tokens of the chunk's
   last token's sequence);
3. state passing: the state entering each chunk, s_{c+1} = exp(dA_cs[c, last]) s_c + state_c
   (0 instead of the decayed state where seq_idx changes between the chunks' last tokens);
4. chunk scan: each token's output from the state entering its chunk and the chunk's earlier
   tokens, plus D x, gated by silu(z).
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from mamba2_rocm.reference.ssd import _effective_dt

__all__ = [
    "chunk_cumsum", "chunk_scan", "chunk_state", "chunk_state_varlen", "split_conv1d_scan_ref",
    "state_passing",
]  # fmt: skip


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _chunked(t: torch.Tensor, nchunks: int, chunk_size: int) -> torch.Tensor:
    """(batch, seqlen, ...) -> (batch, nchunks, chunk_size, ...), zero-padded past seqlen."""
    pad = nchunks * chunk_size - t.shape[1]
    if pad:
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
    return t.reshape(t.shape[0], nchunks, chunk_size, *t.shape[2:])


def _per_head(t: torch.Tensor, nheads: int) -> torch.Tensor:
    """(..., ngroups, dstate) -> (..., nheads, dstate): each head reads its group."""
    return t.repeat_interleave(nheads // t.shape[-2], dim=-2)


def chunk_cumsum(dt, A, chunk_size: int, dt_bias=None, dt_softplus: bool = False,
                 dt_limit=(0.0, math.inf)):  # fmt: skip
    """dt (batch, seqlen, nheads), A (nheads,) -> (dA_cumsum, dt_out), each (batch, nheads,
    nchunks, chunk_size) float32."""
    _, seqlen, nheads = dt.shape
    _expect(tuple(A.shape) == (nheads,), f"A must be (nheads,) = ({nheads},), got {tuple(A.shape)}")
    nchunks = max(1, math.ceil(seqlen / chunk_size))
    d = _effective_dt(dt, dt_bias, dt_softplus, dt_limit, torch.float32)
    d = _chunked(d, nchunks, chunk_size).permute(0, 3, 1, 2)  # (b, h, c, l), 0 past seqlen
    dA_cumsum = torch.cumsum(d * A.float()[None, :, None, None], dim=-1)
    return dA_cumsum, d.contiguous()


def _last_ids(seq_idx, nchunks: int, chunk_size: int) -> torch.Tensor:
    """The sequence id of each chunk's last token (batch, nchunks)."""
    seqlen = seq_idx.shape[1]
    ends = torch.clamp(torch.arange(1, nchunks + 1, device=seq_idx.device) * chunk_size, max=seqlen)
    return seq_idx[:, ends - 1]


def chunk_state(B, x, dt, dA_cumsum, seq_idx=None, states_in_fp32: bool = True):
    """B (batch, seqlen, ngroups, dstate), x (batch, seqlen, nheads, headdim), dt and dA_cumsum
    (batch, nheads, nchunks, chunk_size) -> states (batch, nchunks, nheads, headdim, dstate):
    each chunk's state at its end from a zero state (float32, else B's dtype)."""
    batch, seqlen, nheads, _ = x.shape
    _, _, nchunks, chunk_size = dt.shape
    _expect(B.shape[:2] == x.shape[:2] and nheads % B.shape[2] == 0,
            f"B must be (batch, seqlen, ngroups, dstate) with ngroups dividing nheads, got "
            f"{tuple(B.shape)} for x {tuple(x.shape)}")  # fmt: skip
    _expect(tuple(dA_cumsum.shape) == tuple(dt.shape) == (batch, nheads, nchunks, chunk_size)
            and nchunks * chunk_size >= seqlen,
            f"dt and dA_cumsum must be (batch, nheads, nchunks, chunk_size) covering seqlen "
            f"{seqlen}, got {tuple(dt.shape)} / {tuple(dA_cumsum.shape)}")  # fmt: skip
    xc = _chunked(x.float(), nchunks, chunk_size)  # (b, c, l, h, p)
    Bc = _per_head(_chunked(B.float(), nchunks, chunk_size), nheads)  # (b, c, l, h, n)
    dA = dA_cumsum.float()
    weight = torch.exp(dA[..., -1:] - dA) * dt.float()  # (b, h, c, l)
    if seq_idx is not None:
        ids = _chunked(seq_idx[..., None], nchunks, chunk_size)[..., 0]  # (b, c, l)
        same = ids == _last_ids(seq_idx, nchunks, chunk_size)[..., None]
        weight = torch.where(same[:, None], weight, 0.0)
    states = torch.einsum("bclhp,bclhn,bhcl->bchpn", xc, Bc, weight)
    return states if states_in_fp32 else states.to(B.dtype)


def state_passing(states, dA_chunk_cumsum, initial_states=None, seq_idx=None,
                  chunk_size: int | None = None, out_dtype=None):  # fmt: skip
    """states (batch, nchunks, nheads, dim) (each chunk's own), dA_chunk_cumsum (batch, nheads,
    nchunks) -> (the state entering each chunk (batch, nchunks, nheads, dim), the final state
    (batch, nheads, dim) float32)."""
    batch, nchunks, nheads, dim = states.shape
    _expect(tuple(dA_chunk_cumsum.shape) == (batch, nheads, nchunks),
            f"dA_chunk_cumsum must be (batch, nheads, nchunks) = {(batch, nheads, nchunks)}, "
            f"got {tuple(dA_chunk_cumsum.shape)}")  # fmt: skip
    _expect(seq_idx is None or chunk_size is not None, "seq_idx needs chunk_size")
    s = (torch.zeros(batch, nheads, dim, device=states.device) if initial_states is None
         else initial_states.float())  # fmt: skip
    decay = torch.exp(dA_chunk_cumsum.float())
    if seq_idx is not None:
        last = _last_ids(seq_idx, nchunks, chunk_size)
        prev = torch.cat([torch.zeros_like(last[:, :1]), last[:, :-1]], dim=1)
        decay = torch.where((last == prev)[:, None], decay, 0.0)
    entering = []
    for c in range(nchunks):
        entering.append(s)
        s = decay[:, :, c, None] * s + states[:, c].float()
    out = torch.stack(entering, dim=1)
    return out.to(out_dtype or states.dtype), s


def chunk_state_varlen(B, x, dt, dA_cumsum, cu_seqlens, chunk_states):
    """Packed sequences (no batch dim): B (total, ngroups, dstate), x (total, nheads, headdim),
    dt and dA_cumsum (nheads, nchunks, chunk_size), chunk_states (nchunks, nheads, headdim,
    dstate) the states entering each chunk (state passing's output, with seq_idx) -> each
    sequence's final state (num_seqs, nheads, headdim, dstate)."""
    nheads, nchunks, chunk_size = dt.shape
    _expect(tuple(chunk_states.shape[:2]) == (nchunks, nheads),
            f"chunk_states must be (nchunks, nheads, headdim, dstate), got {tuple(chunk_states.shape)}")  # fmt: skip
    cu = [int(v) for v in cu_seqlens.tolist()]
    Bh = _per_head(B.float(), nheads)  # (total, h, n)
    out = []
    for start, end in itertools.pairwise(cu):
        c = (end - 1) // chunk_size  # the chunk of the sequence's last token
        first = max(start, c * chunk_size)
        t = torch.arange(first, end, device=x.device)
        dA = dA_cumsum[:, c].float()  # (h, l)
        last = dA[:, end - 1 - c * chunk_size]
        w = (
            torch.exp(last[:, None] - dA[:, t - c * chunk_size])
            * dt[:, c, t - c * chunk_size].float()
        )
        state = torch.einsum("thp,thn,ht->hpn", x[t].float(), Bh[t], w)
        if start < c * chunk_size:  # the sequence began in an earlier chunk: its carried state
            state = state + torch.exp(last)[:, None, None] * chunk_states[c].float()
        out.append(state)
    return torch.stack(out).to(chunk_states.dtype)


def chunk_scan(B, C, x, dt, dA_cumsum, prev_states, D=None, z=None, seq_idx=None):
    """The outputs (batch, seqlen, nheads, headdim), x's dtype: per token, the state entering
    its chunk (prev_states (batch, nchunks, nheads, headdim, dstate)) read through C and decayed
    to it, plus the chunk's tokens up to it (C·Bᵀ, decayed, times dt x), plus D x, times
    silu(z)."""
    batch, seqlen, nheads, headdim = x.shape
    _, _, nchunks, chunk_size = dt.shape
    xc = _chunked(x.float(), nchunks, chunk_size)  # (b, c, l, h, p)
    Bc = _per_head(_chunked(B.float(), nchunks, chunk_size), nheads)  # (b, c, l, h, n)
    Cc = _per_head(_chunked(C.float(), nchunks, chunk_size), nheads)
    dA = dA_cumsum.float().permute(0, 2, 3, 1)  # (b, c, l, h)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    keep = causal[None, None, :, :, None]  # (1, 1, t, s, 1)
    if seq_idx is not None:
        ids = _chunked(seq_idx[..., None], nchunks, chunk_size)[..., 0]  # (b, c, l)
        keep = keep & (ids[:, :, :, None] == ids[:, :, None, :])[..., None]
    diff = torch.where(keep, dA[:, :, :, None] - dA[:, :, None, :], -math.inf)
    cb = torch.einsum("bcthn,bcshn->bctsh", Cc, Bc)
    w = cb * torch.exp(diff) * dt.float().permute(0, 2, 3, 1)[:, :, None]  # (b, c, t, s, h)
    y = torch.einsum("bctsh,bcshp->bcthp", w, xc)
    to_token = torch.exp(dA)  # (b, c, l, h)
    if seq_idx is not None:  # the entering state belongs to the chunk's first sequence only
        first = torch.cat(
            [
                torch.zeros_like(ids[:, :1, :1]),
                _last_ids(seq_idx, nchunks, chunk_size)[:, :-1, None],
            ],
            1,
        )
        to_token = torch.where((ids == first)[..., None], to_token, 0.0)
    y = y + torch.einsum("bclhn,bchpn->bclhp", Cc, prev_states.float()) * to_token[..., None]
    y = y.reshape(batch, nchunks * chunk_size, nheads, headdim)[:, :seqlen]
    if D is not None:
        y = y + x.float() * (D.float()[:, None] if D.dim() == 1 else D.float())
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype)


def split_conv1d_scan_ref(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size: int,
                          dt_limit=(0.0, math.inf), activation: str = "silu", rmsnorm_weight=None,
                          rmsnorm_eps: float = 1e-6, outproj_weight=None, outproj_bias=None,
                          headdim: int | None = None, ngroups: int = 1,
                          norm_before_gate: bool = True):  # fmt: skip
    """A Mamba2 block after in_proj, written out: split zxbcdt into z, xBC and dt, the causal
    conv (+ silu) over xBC, split it into x, B and C, the SSD scan (dt_softplus, D), the gated
    RMSNorm (or silu(z) gating without a norm weight), then out_proj."""
    from mamba2_rocm.reference.ssd import rmsnorm_ref, ssd_chunked

    nheads = A.shape[0]
    _expect(D.dim() == 2 or headdim is not None, "headdim must be given when D is (nheads,)")
    headdim = headdim if headdim is not None else D.shape[-1]
    dim = nheads * headdim
    conv_dim = conv1d_weight.shape[0]
    dstate = (conv_dim - dim) // (2 * ngroups)
    batch, seqlen, _ = zxbcdt.shape
    _expect(zxbcdt.shape[-1] == 2 * dim + 2 * ngroups * dstate + nheads,
            f"zxbcdt's last dim must be 2 * dim + 2 * ngroups * dstate + nheads = "
            f"{2 * dim + 2 * ngroups * dstate + nheads}, got {zxbcdt.shape[-1]}")  # fmt: skip
    z, xBC, dt = torch.split(zxbcdt, [dim, conv_dim, nheads], dim=-1)
    width = conv1d_weight.shape[-1]
    xBC = F.conv1d(F.pad(xBC.transpose(1, 2).float(), (width - 1, 0)), conv1d_weight.float()[:, None],
                   None if conv1d_bias is None else conv1d_bias.float(), groups=conv_dim)  # fmt: skip
    if activation in ("silu", "swish"):
        xBC = F.silu(xBC)
    xBC = xBC.transpose(1, 2).to(zxbcdt.dtype)
    x, B, C = torch.split(xBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    y = ssd_chunked(x.reshape(batch, seqlen, nheads, headdim), dt, A,
                    B.reshape(batch, seqlen, ngroups, dstate), C.reshape(batch, seqlen, ngroups, dstate),
                    chunk_size, D=D, dt_bias=dt_bias, dt_softplus=True, dt_limit=dt_limit)  # fmt: skip
    y = y.reshape(batch, seqlen, dim)
    if rmsnorm_weight is not None:
        y = rmsnorm_ref(y, rmsnorm_weight, None, z=z, eps=rmsnorm_eps, group_size=dim // ngroups,
                        norm_before_gate=norm_before_gate)  # fmt: skip
    else:
        y = (y.float() * F.silu(z.float())).to(y.dtype)
    return F.linear(y, outproj_weight, outproj_bias) if outproj_weight is not None else y
