"""Pure-PyTorch causal depthwise conv1d: the fallback tiers and the ground truth in tests.

Two implementations of the same semantics (see ``csrc/params.h``):

- ``*_torch``: vectorized. For width <= 4 the convolution is ``width`` shifted multiply-adds
  over a left-padded copy of x (the unfold/einsum form without materializing the windows),
  which avoids ``F.conv1d``: MIOpen's small depthwise convolution is slow on ROCm.
- ``*_eager``: a plain loop over positions and taps, obviously right, used as the last-resort
  tier and, in float64, as the reference the other two are tested against.

Both accumulate in ``compute_dtype`` (float32 by default) and return x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mamba2_rocm.reference.ssd import state_rows

__all__ = [
    "causal_conv1d_bwd_torch",
    "causal_conv1d_eager",
    "causal_conv1d_ref",
    "causal_conv1d_torch",
    "causal_conv1d_update_eager",
    "causal_conv1d_update_ref",
    "causal_conv1d_update_torch",
    "causal_conv1d_varlen_states_ref",
]


def _history(x: torch.Tensor, initial_states: torch.Tensor | None, width: int, dt: torch.dtype):
    """x with its width-1 history prepended: (batch, dim, width-1+seqlen)."""
    x = x.to(dt)
    if initial_states is None:
        return F.pad(x, (width - 1, 0))
    return torch.cat([initial_states.to(dt), x], dim=-1)


def _final_states(xp: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    return xp[..., xp.shape[-1] - (width - 1) :].to(dtype)


def causal_conv1d_torch(
    x, weight, bias=None, seq_idx=None, initial_states=None, silu=False, compute_dtype=torch.float32
):
    """Returns ``(out, final_states)``; final_states is x's last width-1 (history included)."""
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    xp = _history(x, initial_states, width, compute_dtype)
    w = weight.to(compute_dtype)
    if seq_idx is not None:
        sp = F.pad(seq_idx.to(torch.int64), (width - 1, 0), value=-1)  # (batch, width-1+seqlen)
        cur = seq_idx.to(torch.int64).unsqueeze(1)  # (batch, 1, seqlen)
    out = torch.zeros(batch, dim, seqlen, dtype=compute_dtype, device=x.device)
    if bias is not None:
        out += bias.to(compute_dtype).view(1, dim, 1)
    for k in range(width):
        tap = xp[..., k : k + seqlen]
        if seq_idx is not None:  # select (0 * a non-finite tap would cross the boundary)
            tap = torch.where(sp[:, k : k + seqlen].unsqueeze(1) == cur, tap, 0.0)
        out.addcmul_(tap, w[:, k].view(1, dim, 1))
    if silu:
        out = F.silu(out)
    if seq_idx is not None:  # padding tokens (negative seq_idx) give 0, selected
        out = torch.where(cur < 0, 0.0, out)
    return out.to(x.dtype), _final_states(xp, width, x.dtype)


def causal_conv1d_bwd_torch(
    x, weight, bias, seq_idx, initial_states, dout, dfinal=None, silu=False,
    compute_dtype=torch.float32,
):  # fmt: skip
    """The gradients of ``causal_conv1d_torch``, written out (no autograd, so it also runs
    inside a custom op): returns ``(dx, dweight, dbias, dinitial_states)`` for the output
    gradient ``dout`` and the final states' gradient ``dfinal`` (or None); dbias /
    dinitial_states are None without a bias / initial states. Accumulates in ``compute_dtype``;
    returns each gradient in its input's dtype.

    With the taps tap_k(t) = xp[t + k] (xp: x after its width-1 history, a tap zeroed where it
    crosses a sequence boundary) and pre(t) = bias + sum_k w_k tap_k(t):
    dy = dout * silu'(pre) (0 at padding tokens), dbias = sum dy, dw_k = sum dy tap_k,
    dxp[t + k] += w_k dy(t) over the taps that count, and the final states are xp's last
    width-1 entries, so dfinal adds there. dx and dinitial_states are the two parts of dxp."""
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    ct = compute_dtype
    xp = _history(x, initial_states, width, ct)
    w = weight.to(ct)
    same = []  # per tap: (batch, 1, seqlen) masks, or None without seq_idx
    if seq_idx is not None:
        sp = F.pad(seq_idx.to(torch.int64), (width - 1, 0), value=-1)
        cur = seq_idx.to(torch.int64).unsqueeze(1)
        same = [sp[:, k : k + seqlen].unsqueeze(1) == cur for k in range(width)]
    taps = []
    for k in range(width):
        tap = xp[..., k : k + seqlen]
        taps.append(torch.where(same[k], tap, 0.0) if same else tap)
    dy = dout.to(ct)
    if silu:
        pre = torch.zeros(batch, dim, seqlen, dtype=ct, device=x.device)
        if bias is not None:
            pre += bias.to(ct).view(1, dim, 1)
        for k in range(width):
            pre.addcmul_(taps[k], w[:, k].view(1, dim, 1))
        sig = torch.sigmoid(pre)
        dy = dy * sig * (1 + pre * (1 - sig))
    if seq_idx is not None:  # a padding token's output is 0: nothing flows back from it
        dy = torch.where(cur < 0, 0.0, dy)
    dweight = torch.stack([(dy * taps[k]).sum((0, 2)) for k in range(width)], dim=1)
    dbias = dy.sum((0, 2)).to(bias.dtype) if bias is not None else None
    dxp = torch.zeros_like(xp)
    for k in range(width):
        g = dy * w[:, k].view(1, dim, 1)
        dxp[..., k : k + seqlen] += torch.where(same[k], g, 0.0) if same else g
    if dfinal is not None:
        dxp[..., dxp.shape[-1] - (width - 1) :] += dfinal.to(ct)
    dinit = dxp[..., : width - 1].to(x.dtype) if initial_states is not None else None
    return dxp[..., width - 1 :].to(x.dtype), dweight.to(weight.dtype), dbias, dinit


def causal_conv1d_eager(
    x, weight, bias=None, seq_idx=None, initial_states=None, silu=False, compute_dtype=torch.float64
):
    """Same as :func:`causal_conv1d_torch`, one position and one tap at a time."""
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    xc = x.to(compute_dtype)
    w = weight.to(compute_dtype)
    init = None if initial_states is None else initial_states.to(compute_dtype)
    out = torch.empty(batch, dim, seqlen, dtype=compute_dtype, device=x.device)
    for t in range(seqlen):
        acc = torch.zeros(batch, dim, dtype=compute_dtype, device=x.device)
        if bias is not None:
            acc += bias.to(compute_dtype)
        for k in range(width):
            pos = t - (width - 1) + k
            if pos >= 0:
                val = xc[:, :, pos]
            elif init is not None:
                val = init[:, :, width - 1 + pos]
            else:
                continue
            if seq_idx is not None:
                same = seq_idx[:, pos] == seq_idx[:, t] if pos >= 0 else seq_idx[:, t] == -1
                val = torch.where(same.unsqueeze(1), val, 0.0)
            acc += w[:, k] * val
        y = F.silu(acc) if silu else acc
        if seq_idx is not None:  # a padding token (negative seq_idx): 0
            y = torch.where((seq_idx[:, t] < 0).unsqueeze(1), 0.0, y)
        out[:, :, t] = y
    xp = _history(x, initial_states, width, compute_dtype)
    return out.to(x.dtype), _final_states(xp, width, x.dtype)


def causal_conv1d_update_torch(
    x, conv_state, weight, bias=None, silu=False, cache_seqlens=None, conv_state_indices=None,
    compute_dtype=torch.float32,
):  # fmt: skip
    """x (batch, dim, seqlen); updates conv_state in place; returns out (batch, dim, seqlen)."""
    batch, dim, seqlen = x.shape
    width, state_len = weight.shape[1], conv_state.shape[-1]
    rows = state_rows(conv_state_indices, batch)
    live = [b for b, r in enumerate(rows) if r >= 0]
    out = torch.zeros(batch, dim, seqlen, dtype=x.dtype, device=x.device)
    if not live:
        return out
    live_t = torch.tensor(live, device=x.device)
    row_t = torch.tensor([rows[b] for b in live], device=x.device)
    st = conv_state[row_t]  # (n, dim, state_len), a copy
    xs = x[live_t]
    n = len(live)
    ar = torch.arange(seqlen, device=x.device)
    if cache_seqlens is None:
        hist = st[..., state_len - (width - 1) :]
        new_state = torch.cat([st, xs], dim=-1)[..., -state_len:]
    else:
        head = cache_seqlens.to(torch.int64)[live_t].unsqueeze(1)  # (n, 1)
        hidx = torch.remainder(head + torch.arange(-(width - 1), 0, device=x.device), state_len)
        hist = st.gather(2, hidx.unsqueeze(1).expand(n, dim, width - 1))
        new_state = st.clone()
        # later tokens win when seqlen > state_len: only the last state_len tokens are written
        keep = ar[max(0, seqlen - state_len) :]
        widx = torch.remainder(head + keep, state_len)  # distinct slots per row
        new_state.scatter_(2, widx.unsqueeze(1).expand(n, dim, keep.numel()), xs[..., keep])
    res, _ = causal_conv1d_torch(xs, weight, bias, None, hist, silu, compute_dtype)
    out[live_t] = res
    conv_state[row_t] = new_state.to(conv_state.dtype)
    return out


def causal_conv1d_update_eager(
    x, conv_state, weight, bias=None, silu=False, cache_seqlens=None, conv_state_indices=None,
    compute_dtype=torch.float64,
):  # fmt: skip
    """Same as :func:`causal_conv1d_update_torch`, one row and one token at a time."""
    batch, dim, seqlen = x.shape
    width, state_len = weight.shape[1], conv_state.shape[-1]
    rows = state_rows(conv_state_indices, batch)
    w = weight.to(compute_dtype)
    bvec = (
        bias.to(compute_dtype)
        if bias is not None
        else torch.zeros(dim, dtype=compute_dtype, device=x.device)
    )
    out = torch.zeros(batch, dim, seqlen, dtype=x.dtype, device=x.device)
    for b, r in enumerate(rows):
        if r < 0:
            continue
        state = conv_state[r]  # a view: updated in place below
        head = int(cache_seqlens[b]) if cache_seqlens is not None else None
        if head is None:
            window = [
                state[:, state_len - (width - 1) + j].to(compute_dtype) for j in range(width - 1)
            ]
        else:
            window = [
                state[:, (head - (width - 1) + j) % state_len].to(compute_dtype)
                for j in range(width - 1)
            ]
        for t in range(seqlen):
            window.append(x[b, :, t].to(compute_dtype))
            acc = bvec.clone()
            for k in range(width):
                acc += w[:, k] * window[k]
            out[b, :, t] = (F.silu(acc) if silu else acc).to(x.dtype)
            window.pop(0)
        if head is None:
            full = torch.cat([state, x[b].to(state.dtype)], dim=-1)
            state.copy_(full[:, -state_len:])
        else:
            for t in range(seqlen):
                state[:, (head + t) % state_len] = x[b, :, t].to(state.dtype)
    return out


# ---- causal_conv1d's reference functions, with its signatures (tests written for causal_conv1d
# import them from the drop-in names) ------------------------------------------------------------


def _silu(activation) -> bool:
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    return activation is not None


def causal_conv1d_ref(
    x, weight, bias=None, initial_states=None, return_final_states=False, final_states_out=None,
    activation=None,
):  # fmt: skip
    """causal_conv1d's ``causal_conv1d_ref``: float32 math, out in x's dtype [, final states]."""
    out, final = causal_conv1d_torch(x, weight, bias, None, initial_states, _silu(activation))
    if not return_final_states:
        return out
    if final_states_out is not None:
        final_states_out.copy_(final)
        final = final_states_out
    return out, final


def causal_conv1d_update_ref(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None):
    """causal_conv1d's ``causal_conv1d_update_ref``: x (batch, dim) or (batch, dim, seqlen);
    conv_state updated in place (a circular buffer with cache_seqlens)."""
    squeeze = x.dim() == 2
    out = causal_conv1d_update_torch(
        x.unsqueeze(-1) if squeeze else x, conv_state, weight, bias, _silu(activation),
        cache_seqlens,
    )  # fmt: skip
    return out.squeeze(-1) if squeeze else out


def causal_conv1d_varlen_states_ref(x, cu_seqlens, state_len):
    """``causal_conv1d_varlen_states`` one sequence at a time: (num_seqs, dim, state_len), the
    last state_len tokens of each sequence right-aligned, zeros before a short one's start."""
    dim = x.shape[1]
    cu = cu_seqlens.tolist()
    states = torch.zeros(len(cu) - 1, state_len, dim, dtype=x.dtype, device=x.device)
    for i in range(len(cu) - 1):
        n = min(state_len, cu[i + 1] - cu[i])
        if n > 0:
            states[i, state_len - n :] = x[cu[i + 1] - n : cu[i + 1]]
    return states.transpose(1, 2)
