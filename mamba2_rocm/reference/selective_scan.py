"""Mamba1's selective scan in PyTorch: the argument checks, the torch tier and the ground truth.

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

from mamba2_rocm.reference.ssd_checks import REFERENCE_FLOATS, _dtype_name

__all__ = [
    "MAX_SCAN_DSTATE",
    "ScanDims",
    "check_selective_scan_args",
    "last_state_dtype",
    "selective_scan_ref",
    "selective_scan_torch",
]

MAX_SCAN_DSTATE = 256


COMPLEX_WEIGHTS = (torch.complex64, torch.complex128)


@dataclass(frozen=True)
class ScanDims:
    batch: int
    dim: int
    seqlen: int
    dstate: int
    b_groups: int  # 0: fixed (dim, dstate); else groups of the variable B
    c_groups: int
    complex_a: bool = False


def _check_tensor(name, t, device, dtypes=REFERENCE_FLOATS) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = ", ".join(_dtype_name(d) for d in dtypes)
        raise TypeError(f"{name} must be one of {names}, got {_dtype_name(t.dtype)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (the device of u)")


def _bc_groups(name, t, batch, dim, seqlen, dstate, complex_a=False) -> int:
    """0 for a fixed (dim, dstate) B / C, else its number of groups (1 for (batch, dstate, L));
    with complex A a variable one holds (real, imaginary) pairs: 2 * seqlen values a row."""
    shape = tuple(t.shape)
    if complex_a:
        want = COMPLEX_WEIGHTS if t.dim() == 2 else REFERENCE_FLOATS
        if t.dtype not in want:
            kind = "fixed (complex)" if t.dim() == 2 else "variable (real pairs)"
            raise TypeError(f"with complex A, {name} {kind} must be one of "
                            f"{', '.join(_dtype_name(d) for d in want)}, got "
                            f"{_dtype_name(t.dtype)}")  # fmt: skip
    elif t.is_complex():
        raise TypeError(f"{name} is complex ({_dtype_name(t.dtype)}) but A is real")
    steps, what = (2 * seqlen, "2 * seqlen") if complex_a else (seqlen, "seqlen")
    if t.dim() == 2:
        if shape != (dim, dstate):
            raise ValueError(f"{name} fixed must be (dim={dim}, dstate={dstate}), got {shape}")
        return 0
    if t.dim() == 3:
        if shape != (batch, dstate, steps):
            raise ValueError(
                f"{name} variable must be (batch={batch}, dstate={dstate}, {what}={steps}), "
                f"got {shape}"
            )
        return 1
    if t.dim() == 4:
        groups = shape[1]
        if shape != (batch, groups, dstate, steps) or groups < 1 or dim % groups:
            raise ValueError(
                f"{name} grouped must be (batch={batch}, groups, dstate={dstate}, "
                f"{what}={steps}) with groups dividing dim={dim}, got {shape}"
            )
        return groups
    raise ValueError(
        f"{name} must be (dim, dstate), (batch, dstate, seqlen) or (batch, groups, dstate, "
        f"seqlen), got shape {shape}"
    )


def check_selective_scan_args(u, delta, A, B, C, D=None, z=None, delta_bias=None) -> ScanDims:
    """Shapes, dtypes and devices of a selective-scan call; raises naming the argument."""
    if not isinstance(u, torch.Tensor):
        raise TypeError(f"u must be a torch.Tensor, got {type(u).__name__}")
    if u.dim() != 3:
        raise ValueError(f"u must be (batch, dim, seqlen), got shape {tuple(u.shape)}")
    device = u.device
    _check_tensor("u", u, device)
    batch, dim, seqlen = u.shape
    if dim == 0:
        raise ValueError(f"u is empty along dim (shape {tuple(u.shape)}); dim must be >= 1")
    _check_tensor("delta", delta, device)
    if tuple(delta.shape) != tuple(u.shape):
        raise ValueError(f"delta must have u's shape {tuple(u.shape)}, got {tuple(delta.shape)}")
    _check_tensor("A", A, device, (*REFERENCE_FLOATS, *COMPLEX_WEIGHTS))
    complex_a = A.is_complex()
    if A.dim() != 2 or A.shape[0] != dim:
        raise ValueError(f"A must be (dim={dim}, dstate), got shape {tuple(A.shape)}")
    dstate = A.shape[1]
    if not 1 <= dstate <= MAX_SCAN_DSTATE:
        raise ValueError(f"dstate must be 1..{MAX_SCAN_DSTATE}, got {dstate}")
    bc_types = (*REFERENCE_FLOATS, *COMPLEX_WEIGHTS)  # which of them: _bc_groups, by A's kind
    _check_tensor("B", B, device, bc_types)
    _check_tensor("C", C, device, bc_types)
    b_groups = _bc_groups("B", B, batch, dim, seqlen, dstate, complex_a)
    c_groups = _bc_groups("C", C, batch, dim, seqlen, dstate, complex_a)
    for name, t, shape in (("D", D, (dim,)), ("delta_bias", delta_bias, (dim,)),
                           ("z", z, tuple(u.shape))):  # fmt: skip
        if t is not None:
            _check_tensor(name, t, device)
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    return ScanDims(batch, dim, seqlen, dstate, b_groups, c_groups, complex_a)


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


def _complex_of(cd: torch.dtype) -> torch.dtype:
    return torch.complex128 if cd == torch.float64 else torch.complex64


def _weights(A, B, C, dims: ScanDims, cd):
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
    dims = check_selective_scan_args(u, delta, A, B, C, D, z, delta_bias)
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
    dims = check_selective_scan_args(u, delta, A, B, C, D, z, delta_bias)
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
