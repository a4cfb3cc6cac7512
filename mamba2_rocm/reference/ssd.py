"""Pure-PyTorch Mamba2 SSD scan, decode-step state update and gated RMSNorm.

The ground truth the kernels are tested against, and the fallback tiers:

- :func:`ssd_sequential`: the recurrence one token at a time (float64 by default). Obviously
  right; the reference every other implementation is compared with.
- :func:`ssd_chunked`: the chunked "SSD minimal" form, vectorized (float32 by default): the
  ``torch`` fallback tier of ``mamba_chunk_scan_combined``.
- :func:`selective_state_update_ref`: one decode step, both the multi-head (Mamba2) and the
  head-less (Mamba1) forms of ``selective_state_update``.
- :func:`rmsnorm_ref`: gated RMSNorm as in ``mamba_ssm.ops.triton.layernorm_gated``.

Semantics (mamba_ssm's, where it is self-consistent; see each function for the details):

- dt' = clamp(softplus?(dt + dt_bias), *dt_limit). Like mamba_ssm's ``_chunk_cumsum_fwd``
  kernel the clamp is always applied, so the default (0, inf) floors a negative dt at 0
  (a no-op after softplus). softplus uses threshold 20, as mamba_ssm does.
- Per head h of group g(h) = h // (nheads // ngroups), for each token:
  state = exp(dt' * A[h]) * state + dt' * outer(x, B[g]);  y = state @ C[g] + D * x;
  with z: y * silu(z).
- seq_idx: the state restarts from zero wherever seq_idx changes between consecutive tokens.
  ``initial_states`` belong to an implicit sequence id 0 before the first token, so they are
  used only if the row starts with seq_idx 0 (mamba_ssm compares chunk 0 against id 0).
  For seq_idx whose ids each form one contiguous run (the way it is built from cu_seqlens)
  this is exactly mamba_ssm; where an id reappears after another, mamba_ssm's result depends
  on the chunk size and this one does not (it resets at every change). Negative ids are
  ordinary ids here.
- Final and varlen states are returned in float32 unless ``state_dtype`` says otherwise.

Pure math: the ops check each call once (:mod:`mamba2_rocm.ops.checks`) before they reach
these; called directly, malformed arguments get torch's own errors.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F

__all__ = [
    "empty_varlen_states",
    "rmsnorm_bwd_ref",
    "rmsnorm_ref",
    "scan_sizes",
    "selective_state_update_ref",
    "ssd_chunked",
    "ssd_chunked_bwd",
    "ssd_sequential",
    "ssd_term_magnitude",
    "state_rows",
]  # fmt: skip


def scan_sizes(x, B, cu_seqlens, dt_limit, state_dtype) -> SimpleNamespace:
    """The sizes the scans read from the shapes (the op layer has checked the call:
    :func:`mamba2_rocm.ops.checks.check_chunk_scan_args`)."""
    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    return SimpleNamespace(
        batch=batch, seqlen=seqlen, nheads=nheads, headdim=headdim, ngroups=ngroups,
        dstate=dstate, heads_per_group=nheads // ngroups,
        num_seqs=0 if cu_seqlens is None else cu_seqlens.shape[0] - 1,
        dt_limit=(float(dt_limit[0]), float(dt_limit[1])),
        state_dtype=torch.float32 if state_dtype is None else state_dtype,
    )  # fmt: skip


def state_rows(indices, batch: int) -> list[int]:
    """The pool row each batch row reads and writes (-1: a padded row, left alone)."""
    return list(range(batch)) if indices is None else [int(i) for i in indices.tolist()]


def _masked_exp(mask, x):
    """exp(x) where ``mask``, else 0, with the exponent selected before the exp: a masked-out
    exponent may be large (exp inf), and ``where(mask, exp(x), 0)`` then gives NaN gradients
    (0 * inf) to everything x depends on; exp(-inf) = 0 and its gradient path is cut."""
    return torch.exp(torch.where(mask, x, -math.inf))


def _effective_dt(dt, dt_bias, dt_softplus, dt_limit, cd):
    """dt' (batch, seqlen, nheads) in ``cd``: bias, softplus (threshold 20), clamp."""
    dt = dt.to(cd)
    if dt_bias is not None:
        dt = dt + dt_bias.to(cd)
    if dt_softplus:
        dt = F.softplus(dt)  # beta=1, linear above 20: mamba_ssm's `where(dt <= 20, ...)`
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def _segments(seq_idx, batch, seqlen, device):
    """seg[b, t] = how often seq_idx changed in row b up to token t, starting from an implicit
    id 0 before token 0. Tokens share a state history iff they share a segment; segment 0 is
    the one that starts from initial_states."""
    if seq_idx is None:
        return torch.zeros(batch, seqlen, dtype=torch.int64, device=device)
    s = seq_idx.to(torch.int64)
    prev = F.pad(s[:, :-1], (1, 0), value=0)
    return torch.cumsum((s != prev).to(torch.int64), dim=1)


def _d_term(D, x, cd):
    """D * x for x (..., nheads, headdim) with D (nheads,) or (nheads, headdim)."""
    d = D.to(cd)
    return x * (d.unsqueeze(-1) if d.dim() == 1 else d)


def _returns(out, final, varlen, return_final_states, return_varlen_states):
    """mamba_chunk_scan_combined's return convention."""
    if not return_varlen_states:
        return (out, final) if return_final_states else out
    return (out, final, varlen) if return_final_states else (out, varlen)


def ssd_sequential(
    x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
    cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, math.inf), return_final_states=False,
    return_varlen_states=False, state_dtype=None, compute_dtype=torch.float64,
):  # fmt: skip
    """The SSD scan as the plain recurrence, one token at a time (all rows at once).

    Arguments and return value as ``mamba_chunk_scan_combined`` (without chunk_size): ``out``
    (batch, seqlen, nheads, headdim) in x's dtype; with ``return_final_states`` also the state
    after the last token (batch, nheads, headdim, dstate); with ``return_varlen_states`` also
    (num_seqs, nheads, headdim, dstate): varlen_states[i] is the state this scan carries right
    after token cu_seqlens[i+1] - 1. cu_seqlens does not drive the scan: sequences restart only
    where seq_idx says so (as in mamba_ssm). With seq_idx marking the same boundaries, each
    varlen state is the final state of that sequence run alone (the first one starting from
    initial_states). mamba_ssm agrees there, except that it drops initial_states from the first
    sequence's varlen state when that sequence ends inside the first chunk.
    """
    dims = scan_sizes(x, B, cu_seqlens, dt_limit, state_dtype)
    cd = compute_dtype
    batch, seqlen, nheads, headdim = x.shape
    r = dims.heads_per_group
    xc = x.to(cd)
    dtc = _effective_dt(dt, dt_bias, dt_softplus, dims.dt_limit, cd)
    Ac = A.to(cd)
    Bh = B.to(cd).repeat_interleave(r, dim=2)  # (batch, seqlen, nheads, dstate)
    Ch = C.to(cd).repeat_interleave(r, dim=2)
    zc = None if z is None else z.to(cd)
    seg = _segments(seq_idx, batch, seqlen, x.device)
    if initial_states is None:
        state = torch.zeros(batch, nheads, headdim, dims.dstate, dtype=cd, device=x.device)
    else:
        state = initial_states.to(cd).clone()
    ends: dict[int, list[int]] = {}
    if return_varlen_states:
        varlen = empty_varlen_states(cu_seqlens, initial_states, state.shape[1:], cd)
        cu = cu_seqlens.tolist()
        for i in range(dims.num_seqs):
            if cu[i + 1] > cu[i]:
                ends.setdefault(cu[i + 1] - 1, []).append(i)
    out = torch.empty(batch, seqlen, nheads, headdim, dtype=cd, device=x.device)
    prev_seg = torch.zeros(batch, dtype=torch.int64, device=x.device)
    for t in range(seqlen):
        same = (seg[:, t] == prev_seg)[:, None, None, None]  # False where a sequence starts
        prev_seg = seg[:, t]
        decay = torch.exp(dtc[:, t] * Ac)  # (batch, nheads)
        inp = (dtc[:, t, :, None] * xc[:, t])[..., None] * Bh[:, t, :, None, :]
        # a restart selects zero (0 * a non-finite state would be NaN, not a restart)
        state = torch.where(same, decay[:, :, None, None] * state, 0.0) + inp
        y = torch.einsum("bhpn,bhn->bhp", state, Ch[:, t])
        if D is not None:
            y = y + _d_term(D, xc[:, t], cd)
        if zc is not None:
            y = y * F.silu(zc[:, t])
        out[:, t] = y
        for i in ends.get(t, ()):
            varlen[i] = state[0]
    sd = dims.state_dtype
    return _returns(
        out.to(x.dtype),
        state.to(sd),
        varlen.to(sd) if return_varlen_states else None,
        return_final_states,
        return_varlen_states,
    )


def ssd_term_magnitude(
    x, dt, A, B, C, z=None, dt_bias=None, seq_idx=None, dt_softplus=False,
    dt_limit=(0.0, math.inf), compute_dtype=torch.float64, block=512,
):  # fmt: skip
    """M (batch, seqlen, nheads, headdim): each output's sum of its token terms' magnitudes,
    |silu(z_t)| * sum over s <= t in t's sequence of |C_t . B_s| exp(cs_t - cs_s) dt'_s |x_s|
    (cs the inclusive cumsum of dt' A), so that out_t = silu(z_t) * (sum of those terms with
    their signs + the entering state's part + D x_t).

    What it bounds: a scan that rounds each term's weight C_t . B_s exp(cs_t - cs_s) dt'_s once
    to a dtype of unit roundoff u (mamba_ssm's Triton kernels and ours for 16-bit inputs: the
    weights meet x in the matrix cores in x's dtype) moves out_t by at most u * M_t, whatever
    the chunk size; where terms cancel that is many times out_t's own rounding. Tests add it
    to their tolerance for 16-bit inputs. Work O(seqlen^2), memory (batch, nheads, block, seqlen).
    """
    dims = scan_sizes(x, B, None, dt_limit, None)
    cd = compute_dtype
    batch, seqlen = x.shape[:2]
    dtc = _effective_dt(dt, dt_bias, dt_softplus, dims.dt_limit, cd)  # (batch, seqlen, nheads)
    cs = torch.cumsum(dtc * A.to(cd), dim=1).transpose(1, 2)  # (batch, nheads, seqlen)
    seg = _segments(seq_idx, batch, seqlen, x.device)
    Bc, Cc, xa, dta = B.to(cd), C.to(cd), x.to(cd).abs(), dtc.abs().transpose(1, 2)[..., None, :]
    m = torch.empty(x.shape, dtype=cd, device=x.device)
    s_pos = torch.arange(seqlen, device=x.device)
    for t0 in range(0, seqlen, block):  # (batch, nheads, block, seqlen) at a time
        t1 = min(t0 + block, seqlen)
        cb = torch.einsum("btgn,bsgn->bgts", Cc[:, t0:t1], Bc).abs()
        cb = cb.repeat_interleave(dims.heads_per_group, dim=1)
        causal = s_pos[None, :] <= s_pos[t0:t1, None]
        keep = (causal & (seg[:, t0:t1, None] == seg[:, None, :]))[:, None]
        decay = _masked_exp(keep, cs[..., t0:t1, None] - cs[..., None, :])
        m[:, t0:t1] = torch.einsum("bhts,bshp->bthp", cb * decay * dta, xa)
    return m if z is None else m * F.silu(z.to(cd)).abs()


def ssd_chunked(
    x, dt, A, B, C, chunk_size=256, D=None, z=None, dt_bias=None, initial_states=None,
    seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, math.inf),
    return_final_states=False, return_varlen_states=False, state_dtype=None,
    compute_dtype=torch.float32,
):  # fmt: skip
    """The SSD scan in chunked form; same arguments and results as :func:`ssd_sequential`.

    The three phases of mamba_ssm's kernels, each vectorized over all chunks:
    1. chunk states: each chunk's contribution to the state at its end, from a zero state;
    2. state passing: the state entering each chunk, a short loop over chunks;
    3. outputs: intra-chunk (the masked, decayed C·Bᵀ "diagonal block") plus the entering
       state read through C and decayed to each token (the "off-diagonal" part), plus D·x,
       then the z gate.
    seq_idx masks every term that would cross a sequence boundary, by selection (a masked
    term is never multiplied by 0). Non-finite values reach only their own sequence at or
    after their position: a non-finite x is kept out of the intra-chunk product, and every
    output it reaches (same sequence, head and headdim column, at or after it) is NaN, as
    in the kernels. Any seqlen works: the last chunk is padded with dt = 0 tokens (no decay,
    no input) and outputs are trimmed.
    chunk_size: any power of two >= 16 (the kernels take 64, 128, 256).
    Memory: O(batch * seqlen * chunk_size * nheads) for the intra-chunk decay matrix.
    """
    dims = scan_sizes(x, B, cu_seqlens, dt_limit, state_dtype)
    cd = compute_dtype
    batch, seqlen, nheads, headdim = x.shape
    n = dims.dstate
    k = _chunk_parts(x, dt, A, B, C, chunk_size, dt_bias, seq_idx, dt_softplus, dims, cd)
    xc, dtc, Bc, Cc, seg, mask, Acs = k.xc, k.dtc, k.Bc, k.Cc, k.seg, k.mask, k.Acs
    entering, state = _entering_states(k, initial_states, headdim, n, cd)

    # 3. outputs; a non-finite x enters the product as 0 and its reach becomes NaN
    seg_diff = Acs[:, :, :, None] - Acs[:, :, None, :]  # (b, c, t, s, g, r)
    cb = torch.einsum("bctgn,bcsgn->bctsg", Cc, Bc)
    # (b, c, t, s, g, r); the exponent is masked too: above the diagonal seg_diff is positive
    # and its exp may overflow, and 0 * inf in the backward would be NaN
    m = mask[..., None, None]
    weights = torch.where(m, cb[..., None] * _masked_exp(m, seg_diff) * dtc[:, :, None], 0.0)
    bad = ~torch.isfinite(xc)
    y = torch.einsum("bctsgr,bcsgrp->bctgrp", weights, torch.where(bad, 0.0, xc))
    if bad.any():
        reach = torch.einsum("bcts,bcsgrp->bctgrp", mask.to(cd), bad.to(cd)) > 0
        y = torch.where(reach, math.nan, y)
    to_token = torch.exp(Acs)[..., None]  # (b, c, t, g, r, 1)
    y = y + torch.where(
        k.from_prev[..., None], torch.einsum("bctgn,bcgrpn->bctgrp", Cc, entering) * to_token, 0.0
    )
    y = y.reshape(batch, k.nchunks * chunk_size, nheads, headdim)[:, :seqlen]
    if D is not None:
        y = y + _d_term(D, x.to(cd), cd)
    if z is not None:
        y = y * F.silu(z.to(cd))

    varlen = None
    if return_varlen_states:
        init = None if initial_states is None else initial_states.reshape(batch, *k.gr, headdim, n)
        varlen = _varlen_states(cu_seqlens, chunk_size, seg, k.seg_before, Acs, dtc, Bc, xc, entering,
                                init)  # fmt: skip
        varlen = varlen.reshape(dims.num_seqs, nheads, headdim, n).to(dims.state_dtype)
    return _returns(
        y.to(x.dtype),
        state.reshape(batch, nheads, headdim, n).to(dims.state_dtype),
        varlen,
        return_final_states,
        return_varlen_states,
    )


def ssd_chunked_bwd(
    x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus, dt_limit,
    dout, dfinal=None, compute_dtype=torch.float32,
):  # fmt: skip
    """The gradients of :func:`ssd_chunked`'s ``out`` and final state, written out (no
    autograd, so it also runs inside a custom op): ``(dx, ddt, dA, dB, dC, dD, dz, ddt_bias,
    dinitial_states)`` for the output gradient ``dout`` and the final state's ``dfinal``
    (or None), each in its input's dtype, None for an absent input. The same steps as the
    kernels of csrc/ssd_bwd_*.hip, where the derivation is spelled out:

    1. with y the scan's output before D and the gate: dz = dout (y + D x) silu'(z) and the
       gated gradient g = dout silu(z); dD = sum g x;
    2. the gradient of the state entering each chunk, from the tokens that read it;
    3. back through the state passing: the gradient of each chunk's own final state (G), of
       its carry exponent, and of initial_states;
    4. dx = dt (B·G decayed to the chunk end + the transposed intra-chunk product of g) + D g;
    5. the gradient of C·Bᵀ, summed over a group's heads; 6. dC and dB from it and from the
       entering states / G;
    7. the gradients of the decay exponents summed back over each sequence segment give ddt'
       and dA, and ddt goes back through the clamp, softplus and bias.
    """
    dims = scan_sizes(x, B, None, dt_limit, None)
    cd = compute_dtype
    batch, seqlen, nheads, headdim = x.shape
    n = dims.dstate
    k = _chunk_parts(x, dt, A, B, C, chunk_size, dt_bias, seq_idx, dt_softplus, dims, cd)
    xc, dtc, Bc, Cc, Acs = k.xc, k.dtc, k.Bc, k.Cc, k.Acs
    g, r = k.gr
    entering, _ = _entering_states(k, initial_states, headdim, n, cd)
    m = k.mask[..., None, None]  # (b, c, t, s, 1, 1)
    decay = _masked_exp(m, Acs[:, :, :, None] - Acs[:, :, None, :])  # (b, c, t, s, g, r)
    cb = torch.einsum("bctgn,bcsgn->bctsg", Cc, Bc)
    to_token = torch.where(k.from_prev, torch.exp(Acs), 0.0)  # (b, c, t, g, r)
    Dv = None
    if D is not None:
        Dv = D.to(cd).reshape(nheads, -1).expand(nheads, headdim).reshape(g, r, headdim)

    # 1. the output before D and the gate; the gate's gradients
    y = torch.einsum("bctsgr,bcsgrp->bctgrp", cb[..., None] * decay * dtc[:, :, None], xc)
    y = y + torch.einsum("bctgn,bcgrpn->bctgrp", Cc, entering) * to_token[..., None]
    go = k.chunked(dout.to(cd), g, r, headdim)
    dzc = None
    if z is not None:
        zc = k.chunked(z.to(cd), g, r, headdim)
        sz = torch.sigmoid(zc)
        dzc = go * (y + (xc * Dv if Dv is not None else 0.0)) * (sz * (1 + zc * (1 - sz)))
        go = go * zc * sz
    r_tok = (go * y).sum(-1)  # (b, c, t, g, r): the exponent gradient of every output term

    # 2. + 3. the entering states' gradients, then back through the state passing
    dS = torch.einsum("bctgrp,bctgn->bcgrpn", go * to_token[..., None], Cc)
    carries = k.carries[..., None, None]  # (b, c, 1, 1)
    kc = torch.exp(Acs[:, :, -1])  # (b, c, g, r)
    grad = torch.zeros_like(entering[:, 0])
    if dfinal is not None:
        grad = dfinal.to(cd).reshape(batch, g, r, headdim, n)
    G, dA_last = [None] * k.nchunks, [None] * k.nchunks
    for c in reversed(range(k.nchunks)):
        G[c] = grad
        dA_last[c] = torch.where(
            carries[:, c], kc[:, c] * (grad * entering[:, c]).sum((-1, -2)), 0.0
        )
        grad = dS[:, c] + torch.where(
            carries[:, c, ..., None, None], kc[:, c, ..., None, None] * grad, 0.0
        )
    G, dA_last = (
        torch.stack(G, dim=1),
        torch.stack(dA_last, dim=1),
    )  # (b, c, g, r, p, n), (b, c, g, r)

    # 4. dx
    w_end = torch.where(
        k.in_last, _masked_exp(k.in_last, Acs[:, :, -1:] - Acs), 0.0
    )  # (b, c, s, g, r)
    off = torch.einsum("bcsgn,bcgrpn->bcsgrp", Bc, G) * w_end[..., None]
    dxpre = off + torch.einsum("bctsgr,bctgrp->bcsgrp", cb[..., None] * decay, go)
    dxc = dtc[..., None] * dxpre + (go * Dv if Dv is not None else 0.0)
    ddt_direct = (xc * dxpre).sum(-1)  # (b, c, s, g, r)
    end_sum = (dtc * (xc * off).sum(-1)).sum(2) + dA_last  # (b, c, g, r): at the chunk end

    # 5. + 6. dC, dB
    dcb = torch.einsum("bctgrp,bcsgrp,bctsgr->bctsg", go, xc, decay * dtc[:, :, None])
    dCc = torch.einsum("bctgrp,bcgrpn->bctgn", go * to_token[..., None], entering)
    dCc = dCc + torch.einsum("bctsg,bcsgn->bctgn", dcb, Bc)
    dBc = torch.einsum("bcsgrp,bcgrpn->bcsgn", xc * (w_end * dtc)[..., None], G)
    dBc = dBc + torch.einsum("bctsg,bctgn->bcsgn", dcb, Cc)

    # 7. the exponents: summed back over each segment (s <= t, same segment)
    dAcs = r_tok - dtc * ddt_direct
    dAcs = torch.cat([dAcs[:, :, :-1], dAcs[:, :, -1:] + end_sum[:, :, None]], dim=2)
    back = torch.einsum("bcts,bctgr->bcsgr", k.mask.to(cd), dAcs)
    ddt_eff = ddt_direct + A.to(cd).view(g, r) * back
    dA = (dtc * back).sum((0, 1, 2)).reshape(nheads)

    def unchunk(t, *inner):
        return t.reshape(batch, k.nchunks * chunk_size, *inner)[:, :seqlen]

    raw = dt.to(cd) + (dt_bias.to(cd) if dt_bias is not None else 0.0)
    slope = torch.ones_like(raw)
    val = raw
    if dt_softplus:
        slope = torch.where(raw <= 20.0, torch.sigmoid(raw), 1.0)
        val = F.softplus(raw)
    kept = (val >= dims.dt_limit[0]) & (val <= dims.dt_limit[1])
    ddt = torch.where(kept, unchunk(ddt_eff, nheads) * slope, 0.0)
    dD = None
    if D is not None:
        dD = (go * xc).sum((0, 1, 2)).reshape(nheads, headdim)
        dD = dD.sum(-1) if D.dim() == 1 else dD

    def out(t, like):  # contiguous, as the kernels return them
        return None if like is None else t.to(like.dtype).contiguous()

    return (
        out(unchunk(dxc, nheads, headdim), x), out(ddt, dt), out(dA, A),
        out(unchunk(dBc, g, n), B), out(unchunk(dCc, g, n), C), out(dD, D),
        out(unchunk(dzc, nheads, headdim), z) if z is not None else None,
        out(ddt.sum((0, 1)), dt_bias),
        out(grad.reshape(batch, nheads, headdim, n), initial_states),
    )  # fmt: skip


def _chunk_parts(x, dt, A, B, C, cs, dt_bias, seq_idx, dt_softplus, dims, cd):
    """What the chunked form's phases share: the inputs padded to whole chunks and split
    (batch, nchunks, cs, ngroups, heads_per_group, ...), dt', the segments and their causal
    mask (b, c, t, s), the decay exponents dA_cs restarted at each sequence start, and which
    tokens read the entering state (``from_prev``) or make the chunk's final state (``in_last``)."""
    batch, seqlen, _, headdim = x.shape
    g, r, n = dims.ngroups, dims.heads_per_group, dims.dstate
    nchunks = -(-seqlen // cs)
    pad = nchunks * cs - seqlen
    dev = x.device

    def chunked(t, *inner):  # (batch, seqlen, ...) -> padded (batch, nchunks, cs, *inner)
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(batch, nchunks, cs, *inner)

    xc = chunked(x.to(cd), g, r, headdim)  # (b, c, s, g, r, p)
    dtc = chunked(_effective_dt(dt, dt_bias, dt_softplus, dims.dt_limit, cd), g, r)
    seg = _segments(seq_idx, batch, seqlen, dev)
    seg = torch.cat([seg, seg[:, -1:].expand(batch, pad)], dim=1).reshape(batch, nchunks, cs)
    causal = torch.ones(cs, cs, dtype=torch.bool, device=dev).tril()
    mask = (seg[:, :, :, None] == seg[:, :, None, :]) & causal  # (b, c, t, s)
    dA = dtc * A.to(cd).view(g, r)  # (b, c, s, g, r)
    if seq_idx is None:
        Acs = torch.cumsum(dA, dim=2)
    else:  # restarted at each sequence start: a non-finite dt stays in its own sequence
        Acs = torch.where(mask[..., None, None], dA[:, :, None], 0.0).sum(3)  # (b, c, t, g, r)
    last_seg = seg[:, :, -1]  # (b, c)
    # the segment of the token before each chunk (an implicit segment 0 before the row)
    seg_before = F.pad(last_seg[:, :-1], (1, 0), value=0)
    return SimpleNamespace(
        chunked=chunked, xc=xc, dtc=dtc, Bc=chunked(B.to(cd), g, n), Cc=chunked(C.to(cd), g, n), seg=seg,
        mask=mask, Acs=Acs, last_seg=last_seg, seg_before=seg_before, nchunks=nchunks,
        gr=(g, r), in_last=(seg == last_seg[..., None])[..., None, None],  # (b, c, s, 1, 1)
        from_prev=(seg == seg_before[..., None])[..., None, None],  # (b, c, t, 1, 1)
        carries=last_seg == seg_before,  # (b, c): the chunk's end continues its entering state
    )  # fmt: skip


def _entering_states(k, initial_states, headdim, n, cd):
    """The state entering each chunk (b, c, g, r, p, n) and the final state (phases 1 and 2)."""
    # 1. chunk states: tokens of the chunk's last segment, decayed to the chunk end (the
    #    others are selected away, never multiplied by 0)
    in_last = k.in_last
    to_end = torch.where(in_last, _masked_exp(in_last, k.Acs[:, :, -1:] - k.Acs) * k.dtc, 0.0)
    Bl = torch.where(in_last, k.Bc, 0.0)
    xl = torch.where(in_last[..., None], k.xc, 0.0)
    chunk_states = torch.einsum("bcsgn,bcsgr,bcsgrp->bcgrpn", Bl, to_end, xl)

    # 2. state passing: carry across a chunk only if its last token continues the segment of
    #    the token before it (an implicit segment 0 before the row: initial_states)
    batch = k.xc.shape[0]
    carries = k.carries[..., None, None, None, None]  # (b, c, 1, 1, 1, 1)
    carry = torch.exp(k.Acs[:, :, -1])[..., None, None]  # (b, c, g, r, 1, 1)
    if initial_states is None:
        state = torch.zeros(batch, *k.gr, headdim, n, dtype=cd, device=k.xc.device)
    else:
        state = initial_states.to(cd).reshape(batch, *k.gr, headdim, n)
    entering = []
    for c in range(k.nchunks):
        entering.append(state)
        state = torch.where(carries[:, c], carry[:, c] * state, 0.0) + chunk_states[:, c]
    return torch.stack(entering, dim=1), state


def empty_varlen_states(cu_seqlens, initial_states, shape, dtype):
    """varlen states for the empty sequences of cu_seqlens (equal consecutive offsets), zeros
    elsewhere: an empty sequence has the state before its first token, which is zero, except
    for empty sequences at offset 0, which have the row's initial state (zero without one)."""
    cu = cu_seqlens.to(torch.int64)
    out = torch.zeros(cu.shape[0] - 1, *shape, dtype=dtype, device=cu.device)
    if initial_states is not None:
        lead = (cu[1:] == 0).view(-1, *([1] * len(shape)))
        out = torch.where(lead, initial_states[0].to(dtype), out)
    return out


def _varlen_states(cu_seqlens, cs, seg, seg_before, Acs, dtc, Bc, xc, entering, initial_states):
    """The scan state right after each token cu_seqlens[i+1] - 1 of row 0: the state entering
    its chunk (if the segment continues) decayed to it, plus the chunk's tokens up to it.
    Empty sequences: see :func:`empty_varlen_states`."""
    cu = cu_seqlens.to(torch.int64)
    empty = cu[1:] == cu[:-1]
    ends = (cu[1:] - 1).clamp(min=0)
    c, j = ends // cs, ends % cs  # chunk and position of each sequence's last token
    seg_row, seg_end = seg[0, c], seg[0, c, j]  # (i, s), (i,)
    pos = torch.arange(cs, device=ends.device)
    take = (pos <= j[:, None]) & (seg_row == seg_end[:, None])  # (i, s)
    a_end = Acs[0, c, j]  # (i, g, r)
    diff = a_end[:, None] - Acs[0, c]  # (i, s, g, r)
    tk = take[..., None, None]
    w = torch.where(tk, _masked_exp(tk, diff) * dtc[0, c], 0.0)  # never 0 * NaN, nor 0 * inf
    Bt = torch.where(tk, Bc[0, c], 0.0)
    xt = torch.where(tk[..., None], xc[0, c], 0.0)
    part = torch.einsum("isgr,isgn,isgrp->igrpn", w, Bt, xt)
    cont = (seg_end == seg_before[0, c])[:, None, None, None, None]
    states = part + torch.where(cont, torch.exp(a_end)[..., None, None] * entering[0, c], 0.0)
    fill = empty_varlen_states(cu_seqlens, initial_states, states.shape[1:], states.dtype)
    return torch.where(empty[:, None, None, None, None], fill, states)


def _compact(t):
    """A view of t with each broadcast (stride-0) dim narrowed to size 1.

    Converting a broadcast view with ``.to()`` materializes it; the compact view converts
    only the distinct values and broadcasts again in the arithmetic.
    """
    if t is None:
        return None
    for d in range(t.dim()):
        if t.stride(d) == 0 and t.shape[d] > 1:
            t = t.narrow(d, 0, 1)
    return t


def selective_state_update_ref(
    state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
    state_batch_indices=None, compute_dtype=torch.float32,
):  # fmt: skip
    """One decode step of the selective SSM; updates ``state`` in place and returns ``out``.

    Multi-head (Mamba2): state (pool, nheads, headdim, dstate), x/dt/z (batch, nheads, headdim),
    A (nheads, headdim, dstate), B/C (batch, ngroups, dstate), D/dt_bias (nheads, headdim).
    Mamba1: the same without the head dim. Mamba2 callers pass A, dt, dt_bias and D as
    broadcast views of per-head values ("tied head dim"); those are read without copying.

    dt' = softplus?(dt + dt_bias) (no dt_limit clamp, as in mamba_ssm);
    state = exp(A * dt') * state + dt' * B * x;  out = sum_n(state * C) + D * x, * silu(z).
    The state is stored in its own dtype; out is computed from the new state before that
    rounding (as mamba_ssm's kernel does). With state_batch_indices, row b reads and writes
    state[state_batch_indices[b]]; -1 marks a padded row: its out is zero, no state is touched.
    """
    has_heads = state.dim() == 4
    rows = state_rows(state_batch_indices, x.shape[0])
    if not has_heads:  # Mamba1: one head, one group, headdim = dim (views: in place)
        state, x, dt, A, B, C = (
            state.unsqueeze(1), x.unsqueeze(1), dt.unsqueeze(1), A.unsqueeze(0),
            B.unsqueeze(1), C.unsqueeze(1),
        )  # fmt: skip
        D = None if D is None else D.unsqueeze(0)
        z = None if z is None else z.unsqueeze(1)
        dt_bias = None if dt_bias is None else dt_bias.unsqueeze(0)
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    live = [b for b, row in enumerate(rows) if row >= 0]
    if live:
        cd = compute_dtype
        r = x.shape[1] // B.shape[1]  # heads per group
        live_t = torch.tensor(live, device=x.device)
        rows_t = torch.tensor([rows[b] for b in live], device=x.device)
        xb = x[live_t].to(cd)  # (n, h, p)
        dtb = _compact(dt)[live_t].to(cd)  # (n, h, p or 1)
        if dt_bias is not None:
            dtb = dtb + _compact(dt_bias).to(cd)
        if dt_softplus:
            dtb = F.softplus(dtb)
        dA = torch.exp(_compact(A).to(cd) * dtb[..., None])  # (n, h, p or 1, n or 1)
        Bh = B[live_t].to(cd).repeat_interleave(r, dim=1)[:, :, None, :]  # (n, h, 1, dstate)
        Ch = C[live_t].to(cd).repeat_interleave(r, dim=1)[:, :, None, :]
        new = state[rows_t].to(cd) * dA + (dtb[..., None] * Bh) * xb[..., None]
        y = (new * Ch).sum(-1)
        if D is not None:
            y = y + _compact(D).to(cd) * xb
        if z is not None:
            y = y * F.silu(z[live_t].to(cd))
        state[rows_t] = new.to(state.dtype)
        out[live_t] = y.to(x.dtype)
    return out if has_heads else out.squeeze(1)


def rmsnorm_ref(
    x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True, upcast=True,
    is_rms_norm=True,
):  # fmt: skip
    """Gated RMSNorm (``layernorm_gated.rmsnorm_fn``), or with ``is_rms_norm=False`` the gated
    LayerNorm (``layernorm_fn``), computed in float32 (in x's dtype when ``upcast`` is False,
    as mamba_ssm's ``rms_norm_ref``), returned in x's dtype.

    norm_before_gate=True: y = (x - mean) / std(x) * weight + bias, then y * silu(z).
    norm_before_gate=False: x * silu(z) first, then normalized the same way.
    group_size splits the last dim into groups, each normalized on its own; the default is
    one group. RMSNorm: mean = 0, std(v) = sqrt(mean(v^2) + eps); LayerNorm: the group's mean
    and std(v) = sqrt(var(v) + eps) (biased variance). bias may be None.
    """
    hidden = x.shape[-1]
    gs = group_size or hidden
    cd = torch.promote_types(x.dtype, torch.float32) if upcast else x.dtype
    v = x.to(cd)
    if z is not None and not norm_before_gate:
        v = v * F.silu(z.to(cd))
    grouped = v.unflatten(-1, (hidden // gs, gs))
    if not is_rms_norm:
        grouped = grouped - grouped.mean(-1, keepdim=True)
    rstd = torch.rsqrt(grouped.square().mean(-1, keepdim=True) + eps)
    y = (grouped * rstd).flatten(-2) * weight.to(cd)
    if bias is not None:
        y = y + bias.to(cd)
    if z is not None and norm_before_gate:
        y = y * F.silu(z.to(cd))
    return y.to(x.dtype)


def rmsnorm_bwd_ref(
    x, weight, bias, z, eps, group_size, norm_before_gate, is_rms_norm, dout,
    compute_dtype=torch.float32,
):  # fmt: skip
    """The gradients of :func:`rmsnorm_ref` written out (no autograd, so it also runs inside a
    custom op): ``(dx, dweight, dbias, dz)`` for the output gradient ``dout``, each in its
    input's dtype (dbias / dz None without bias / z). With v the norm's input (x, times silu(z)
    when the gate comes first), xhat = (v - mean) rstd, y = xhat w + b:
    dy = dout (times silu(z) when the gate comes after, which gives dz = dout y silu'(z)),
    dw = sum dy xhat, db = sum dy, dv = rstd (dy w - mean(dy w) [LayerNorm] - xhat mean(dy w xhat)),
    dx = dv (times silu(z) when the gate comes first, which gives dz = dv x silu'(z))."""
    hidden = x.shape[-1]
    gs = group_size or hidden
    cd = compute_dtype
    xv, g = x.to(cd), dout.to(cd)
    w = weight.to(cd)
    sz = dsz = None
    if z is not None:
        zc = z.to(cd)
        sz = torch.sigmoid(zc)
        dsz = sz * (1 + zc * (1 - sz))  # silu'(z)
        sz = zc * sz  # silu(z)
    v = xv * sz if z is not None and not norm_before_gate else xv
    grouped = v.unflatten(-1, (hidden // gs, gs))
    centered = grouped - grouped.mean(-1, keepdim=True) if not is_rms_norm else grouped
    rstd = torch.rsqrt(centered.square().mean(-1, keepdim=True) + eps)
    xhat = (centered * rstd).flatten(-2)
    dz = None
    if z is not None and norm_before_gate:
        y = xhat * w + (bias.to(cd) if bias is not None else 0)
        dz = g * y * dsz
        g = g * sz
    rows = tuple(range(g.dim() - 1))
    dweight = (g * xhat).sum(rows) if rows else g * xhat
    dbias = (g.sum(rows) if rows else g) if bias is not None else None
    dxhat = (g * w).unflatten(-1, (hidden // gs, gs))
    xh = xhat.unflatten(-1, (hidden // gs, gs))
    dv = dxhat - xh * (dxhat * xh).mean(-1, keepdim=True)
    if not is_rms_norm:
        dv = dv - dxhat.mean(-1, keepdim=True)
    dv = (dv * rstd).flatten(-2)
    dx = dv
    if z is not None and not norm_before_gate:
        dz = dv * xv * dsz
        dx = dv * sz
    return (dx.to(x.dtype), dweight.to(weight.dtype),
            dbias.to(bias.dtype) if dbias is not None else None,
            dz.to(z.dtype) if dz is not None else None)  # fmt: skip
