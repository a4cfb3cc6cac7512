"""``mamba_inner_fn``: the Mamba1 block after the input projection, mamba_ssm's argument list.

xz (batch, 2 * dim, seqlen) splits into x and the gate z; x goes through the causal conv (SiLU),
``x_proj`` gives dt's low-rank input and, unless B / C are given, the per-token B and C
(plus ``B_proj_bias`` / ``C_proj_bias``); ``delta_proj_weight`` lifts dt to dim; the optional
RMSNorms ``b_rms_weight`` / ``c_rms_weight`` / ``dt_rms_weight`` (FalconMamba) normalize B, C
and delta over their last dim; then the selective scan with D, z and delta_bias, and
``out_proj``. Built from this package's ops (``causal_conv1d_fn``, ``rmsnorm_fn``,
``selective_scan_fn``) and torch's products, so it runs and differentiates wherever they do;
each of those ops saves its inputs for the backward (the scan also the float32 B / C it read).
``checkpoint_lvl`` (0 or 1) is accepted for mamba_ssm's signature; what is kept for the
backward is decided by the ops.

``mamba_inner_ref`` is mamba_ssm's name for the unfused block its tests compare the fused one
with; there it is built from the same kernels (``causal_conv1d_fn``, ``selective_scan_fn``).
Ours is unfused already, so the two agree by construction: mamba_ssm's ``test_mamba_inner_fn``
proves nothing about us. Our own tests compare the block with a float64 composition of the
references instead.
"""

from __future__ import annotations

from mamba2_rocm._torch import require_torch
from mamba2_rocm.ops.conv1d import causal_conv1d_fn
from mamba2_rocm.ops.rmsnorm import rmsnorm_fn
from mamba2_rocm.ops.selective_scan import selective_scan_fn

torch = require_torch()
F = torch.nn.functional
Tensor = torch.Tensor

__all__ = ["mamba_inner_fn", "mamba_inner_ref"]


def _tensor(name: str, t, dims: tuple[int, ...]) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() not in dims:
        raise ValueError(f"{name} must have {' or '.join(map(str, dims))} dimensions, "
                         f"got shape {tuple(t.shape)}")  # fmt: skip


def mamba_inner_fn(
    xz: Tensor, conv1d_weight: Tensor, conv1d_bias: Tensor | None, x_proj_weight: Tensor,
    delta_proj_weight: Tensor, out_proj_weight: Tensor, out_proj_bias: Tensor | None, A: Tensor,
    B: Tensor | None = None, C: Tensor | None = None, D: Tensor | None = None,
    delta_bias: Tensor | None = None, B_proj_bias: Tensor | None = None,
    C_proj_bias: Tensor | None = None, delta_softplus: bool = True, checkpoint_lvl: int = 1,
    b_rms_weight: Tensor | None = None, c_rms_weight: Tensor | None = None,
    dt_rms_weight: Tensor | None = None, b_c_dt_rms_eps: float = 1e-6,
) -> Tensor:  # fmt: skip
    """Returns out (batch, seqlen, out_proj's output size)."""
    if checkpoint_lvl not in (0, 1):
        raise ValueError(f"checkpoint_lvl must be 0 or 1, got {checkpoint_lvl!r}")
    _tensor("xz", xz, (3,))
    _tensor("conv1d_weight", conv1d_weight, (2, 3))
    _tensor("x_proj_weight", x_proj_weight, (2,))
    _tensor("delta_proj_weight", delta_proj_weight, (2,))
    _tensor("A", A, (2,))
    # complex A: the per-token B / C come as (real, imaginary) pairs, 2 * dstate columns each,
    # and are passed on as (batch, dstate, 2 * seqlen) (selective_scan_fn's convention)
    per = 2 if A.is_complex() else 1
    if per == 2 and (b_rms_weight is not None or c_rms_weight is not None):
        raise NotImplementedError("b_rms_weight / c_rms_weight with complex A: the norms are over "
                                  "real B / C rows")  # fmt: skip
    batch, two_dim, seqlen = xz.shape
    if two_dim % 2:
        raise ValueError(f"xz must be (batch, 2 * dim, seqlen), got shape {tuple(xz.shape)}")
    dim, dstate = two_dim // 2, A.shape[-1]
    rank = delta_proj_weight.shape[1]
    want = rank + (0 if B is not None else per * dstate) + (0 if C is not None else per * dstate)
    if x_proj_weight.shape != (want, dim):
        each = " + dstate" if per == 1 else " + 2 * dstate"
        raise ValueError(
            f"x_proj_weight must be (dt_rank{each * (B is None)}{each * (C is None)}"
            f" = {want}, dim = {dim}), got {tuple(x_proj_weight.shape)}"
        )
    if delta_proj_weight.shape[0] != dim:
        raise ValueError(f"delta_proj_weight must be (dim = {dim}, dt_rank), got "
                         f"{tuple(delta_proj_weight.shape)}")  # fmt: skip
    if conv1d_weight.dim() == 3:  # mamba_ssm's (dim, 1, width)
        conv1d_weight = conv1d_weight.squeeze(1)
    x, z = xz.chunk(2, dim=1)
    x = causal_conv1d_fn(x, conv1d_weight, conv1d_bias, activation="silu")
    rows = x.transpose(1, 2).reshape(batch * seqlen, dim)  # (b l, d)
    x_dbl = F.linear(rows, x_proj_weight)  # (b l, dt_rank [+ dstate] [+ dstate])
    if dt_rms_weight is None:  # (b, d, l) contiguous from a batched product: the scan's layout,
        # which it reads as it is, forward and backward (a (b l, d) product read as (b, d, l)
        # was copied into it twice a training step)
        dt_in = x_dbl.view(batch, seqlen, x_dbl.shape[1])[..., :rank].transpose(1, 2)
        delta = torch.bmm(delta_proj_weight.expand(batch, -1, -1), dt_in)
    else:  # normalized over dim: rows of dim first
        delta = F.linear(x_dbl[:, :rank], delta_proj_weight)  # (b l, d)
        delta = rmsnorm_fn(delta, dt_rms_weight, None, eps=b_c_dt_rms_eps)
        delta = delta.reshape(batch, seqlen, dim).transpose(1, 2)  # (b, d, l)
    at = rank

    def per_token(proj_bias, rms_weight):
        nonlocal at
        v = x_dbl[:, at : at + per * dstate]
        at += per * dstate
        if proj_bias is not None:
            v = v + proj_bias.to(v.dtype)
        if rms_weight is not None:
            v = rmsnorm_fn(v, rms_weight, None, eps=b_c_dt_rms_eps)
        if per == 2:  # (b l, (dstate two)) -> (b, dstate, (l two))
            v = v.reshape(batch, seqlen, dstate, 2).permute(0, 2, 1, 3)
            return v.reshape(batch, dstate, 2 * seqlen)
        return v.reshape(batch, seqlen, dstate).transpose(1, 2)  # (b, dstate, l)

    B = per_token(B_proj_bias, b_rms_weight) if B is None else B
    C = per_token(C_proj_bias, c_rms_weight) if C is None else C
    y = selective_scan_fn(x, delta, A, B, C, D, z=z, delta_bias=delta_bias,
                          delta_softplus=delta_softplus)  # fmt: skip
    return F.linear(y.transpose(1, 2), out_proj_weight, out_proj_bias)


def mamba_inner_ref(
    xz: Tensor, conv1d_weight: Tensor, conv1d_bias: Tensor | None, x_proj_weight: Tensor,
    delta_proj_weight: Tensor, out_proj_weight: Tensor, out_proj_bias: Tensor | None, A: Tensor,
    B: Tensor | None = None, C: Tensor | None = None, D: Tensor | None = None,
    delta_bias: Tensor | None = None, B_proj_bias: Tensor | None = None,
    C_proj_bias: Tensor | None = None, delta_softplus: bool = True,
) -> Tensor:  # fmt: skip
    """mamba_ssm's ``mamba_inner_ref`` (its argument list): the unfused block (module doc)."""
    return mamba_inner_fn(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight,
                          out_proj_weight, out_proj_bias, A, B, C, D, delta_bias, B_proj_bias,
                          C_proj_bias, delta_softplus)  # fmt: skip
