"""Mamba1's selective scan in PyTorch: the torch tier and the ground truth (pure math: the
arguments are checked once by the op layer, :func:`mamba2_rocm.ops.checks.check_selective_scan_args`).

Semantics (mamba_ssm's ``selective_scan_fn``), per batch row b, channel d, state element n:

    delta = softplus(delta + delta_bias) if delta_softplus else delta + delta_bias
    h[t] = exp(delta[t] * A[d, n]) * h[t-1] + delta[t] * B[n, t] * u[t]       (h[-1] = 0)
    y[t] = sum_n C[n, t] * h[t, n]  (+ D[d] * u[t])  (* silu(z[t]))

B and C are each either fixed per channel ``(dim, dstate)``, variable ``(batch, dstate,
seqlen)``, or grouped ``(batch, groups, dstate, seqlen)`` with channel d reading group
``d // (dim // groups)``. Computed in float32 (the ground truth in float64); out has u's dtype;
the last state ``(batch, dim, dstate)`` has A's type (at least float32), as in mamba_ssm.

Complex A (complex64 / complex128: mamba_ssm's S4D-complex variant), with mamba_ssm's
conventions: a fixed B / C is then complex ``(dim, dstate)``; a variable one stays real with
``2 * seqlen`` values per row, (real, imaginary) of token t at 2t and 2t + 1; the state is
complex and y is twice the real part of sum_n C h (the conjugate half of the spectrum); the last
state is complex. Only these PyTorch implementations compute it: the kernels take real A.

Two implementations of the same recurrence: :func:`selective_scan_torch` steps through time
with every (batch, dim, dstate) element at once and never materializes a (batch, dim, seqlen,
dstate) tensor (the torch tier); :func:`selective_scan_ref` materializes the per-step decay and
input terms (mamba_ssm's reference formulation: simple, memory-hungry) and is the ground truth
in float64. Tests compare them with each other. There is no mask anywhere, so a non-finite
value at token t of one row reaches only that row's outputs at positions >= t.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "ScanSizes",
    "last_state_dtype",
    "scan_sizes",
    "selective_scan_ref",
    "selective_scan_torch",
]


def _bc_at(t: torch.Tensor, groups: int, dim: int, step: int) -> torch.Tensor:
    """B or C at one time step, broadcastable against (batch, dim, dstate)."""
    if groups == 0:
        return t  # (dim, dstate)
    if t.dim() == 3:
        return t[:, None, :, step]  # (batch, 1, dstate)
    g = t[:, :, :, step]  # (batch, groups, dstate)
    return (
        g[:, :, None, :]
        .expand(g.shape[0], groups, dim // groups, g.shape[2])
        .reshape(g.shape[0], dim, g.shape[2])
    )


@dataclass(frozen=True)
class ScanSizes:
    """The sizes the recurrences read from the shapes (checked by the op layer:
    :func:`mamba2_rocm.ops.checks.check_selective_scan_args`)."""

    batch: int
    dim: int
    seqlen: int
    dstate: int
    b_groups: int  # 0: fixed (dim, dstate); else groups of the variable B (1: (batch, dstate, L))
    c_groups: int
    complex_a: bool


def _groups(t: torch.Tensor) -> int:
    return 0 if t.dim() == 2 else 1 if t.dim() == 3 else t.shape[1]


def scan_sizes(u, A, B, C) -> ScanSizes:
    batch, dim, seqlen = u.shape
    return ScanSizes(batch, dim, seqlen, A.shape[1], _groups(B), _groups(C), A.is_complex())


def _complex_of(cd: torch.dtype) -> torch.dtype:
    return torch.complex128 if cd == torch.float64 else torch.complex64


def _weights(A, B, C, dims: ScanSizes, cd):
    """A, B, C in the compute type: ``cd``, or its complex type with complex A (a variable B / C
    read as (real, imaginary) pairs along the sequence)."""
    if not dims.complex_a:
        return A.to(cd), B.to(cd), C.to(cd)
    ccd = _complex_of(cd)

    def bc(t):
        if t.dim() == 2:
            return t.to(ccd)
        return torch.view_as_complex(t.to(cd).reshape(*t.shape[:-1], dims.seqlen, 2))

    return A.to(ccd), bc(B), bc(C)


def _y(y: torch.Tensor) -> torch.Tensor:
    """y of the real scan; twice the real part of the complex one (mamba_ssm's convention)."""
    return y.real * 2 if y.is_complex() else y


def last_state_dtype(A: torch.Tensor) -> torch.dtype:
    """The last state's dtype: A's (float32 for the fp32 A mamba_ssm takes; float64 stays)."""
    return torch.promote_types(A.dtype, torch.float32)


def _prepare(u, delta, delta_bias, delta_softplus, cd):
    dl = delta.to(cd)
    if delta_bias is not None:
        dl = dl + delta_bias.to(cd)[:, None]
    if delta_softplus:
        dl = F.softplus(dl)
    return u.to(cd), dl


def _finish(y, u, uc, D, z, cd, out_dtype):
    if D is not None:
        y = y + uc * D.to(cd)[:, None]
    if z is not None:
        y = y * F.silu(z.to(cd))
    return y.to(out_dtype)


def selective_scan_torch(u, delta, A, B, C, D=None, z=None, delta_bias=None,
                         delta_softplus=False, return_last_state=False,
                         compute_dtype=torch.float32):  # fmt: skip
    """The torch tier: one step per token over all (batch, dim, dstate) elements at once."""
    dims = scan_sizes(u, A, B, C)
    cd = compute_dtype
    batch, dim, seqlen, dstate = dims.batch, dims.dim, dims.seqlen, dims.dstate
    uc, dl = _prepare(u, delta, delta_bias, delta_softplus, cd)
    Ac, Bc, Cc = _weights(A, B, C, dims, cd)
    h = torch.zeros(batch, dim, dstate, dtype=Ac.dtype, device=u.device)
    ys = []
    for t in range(seqlen):
        d_t = dl[:, :, t, None]  # (batch, dim, 1)
        h = torch.exp(d_t * Ac) * h + (d_t * uc[:, :, t, None]) * _bc_at(Bc, dims.b_groups, dim, t)
        ys.append(_y((h * _bc_at(Cc, dims.c_groups, dim, t)).sum(-1)))
    y = torch.stack(ys, dim=-1) if ys else uc.new_zeros(batch, dim, 0)
    out = _finish(y, u, uc, D, z, cd, u.dtype)
    return (out, h.to(last_state_dtype(A))) if return_last_state else out


def selective_scan_ref(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                       return_last_state=False, compute_dtype=torch.float64):  # fmt: skip
    """The ground truth (float64 by default; mamba_ssm's ``selective_scan_ref`` signature): the
    per-step decay exp(delta * A) and input delta * B * u for every token, then the recurrence."""
    dims = scan_sizes(u, A, B, C)
    cd = compute_dtype
    batch, dim, seqlen, dstate = dims.batch, dims.dim, dims.seqlen, dims.dstate
    uc, dl = _prepare(u, delta, delta_bias, delta_softplus, cd)
    Ac, Bc, Cc = _weights(A, B, C, dims, cd)
    decay = torch.exp(dl[..., None] * Ac[:, None, :])  # (batch, dim, seqlen, dstate)

    def full(t, groups):  # (batch, dim, seqlen, dstate) view of B or C
        if groups == 0:
            return t[None, :, None, :].expand(batch, dim, seqlen, dstate)
        if t.dim() == 3:
            return t.transpose(1, 2)[:, None].expand(batch, dim, seqlen, dstate)
        return t.transpose(2, 3).repeat_interleave(dim // groups, dim=1)

    drive = (dl * uc)[..., None] * full(Bc, dims.b_groups)
    Cf = full(Cc, dims.c_groups)
    h = torch.zeros(batch, dim, dstate, dtype=Ac.dtype, device=u.device)
    y = uc.new_zeros(batch, dim, seqlen)
    for t in range(seqlen):
        h = decay[:, :, t] * h + drive[:, :, t]
        y[:, :, t] = _y((h * Cf[:, :, t]).sum(-1))
    out = _finish(y, u, uc, D, z, cd, u.dtype)
    return (out, h.to(last_state_dtype(A))) if return_last_state else out
