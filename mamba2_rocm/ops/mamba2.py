"""``mamba_split_conv1d_scan_combined``: a Mamba2 block's forward after in_proj, composed from
our ops (causal conv1d, the SSD scan, gated RMSNorm) with mamba_ssm's argument list.

zxbcdt (batch, seqlen, 2 dim + 2 ngroups dstate + nheads) is split into z, xBC and dt as
mamba_ssm does; xBC goes through the depthwise causal conv (its channel-last view, no copy)
and SiLU, then splits into x, B, C (views); the scan adds D and, without an RMSNorm, the z
gate; with ``rmsnorm_weight`` the gated norm applies z instead; ``outproj_weight`` projects last.
"""

from __future__ import annotations

import math

from mamba2_rocm._torch import require_torch
from mamba2_rocm.ops.conv1d import causal_conv1d_fn
from mamba2_rocm.ops.rmsnorm import rmsnorm_fn
from mamba2_rocm.ops.ssd import mamba_chunk_scan_combined

torch = require_torch()
Tensor = torch.Tensor

__all__ = ["mamba_split_conv1d_scan_combined"]


def _sizes(zxbcdt, conv1d_weight, D, headdim, ngroups) -> tuple[int, int, int, int]:
    """(nheads, headdim, dim, dstate) from the arguments, with mamba_ssm's conventions."""
    if not isinstance(zxbcdt, torch.Tensor) or zxbcdt.dim() != 3:
        raise ValueError(
            "zxbcdt must be a 3-d tensor (batch, seqlen, 2*dim + 2*ngroups*dstate + nheads), "
            f"got {getattr(zxbcdt, 'shape', type(zxbcdt).__name__)}"
        )
    if not isinstance(D, torch.Tensor) or D.dim() not in (1, 2):
        raise ValueError("D must be a tensor of shape (nheads,) or (nheads, headdim)")
    if D.dim() == 1:
        if headdim is None:
            raise ValueError("headdim must be given when D has shape (nheads,)")
        nheads = D.shape[0]
    else:
        nheads, hd = D.shape
        if headdim is not None and headdim != hd:
            raise ValueError(f"headdim={headdim} does not match D's shape {tuple(D.shape)}")
        headdim = hd
    if not isinstance(ngroups, int) or ngroups < 1:
        raise ValueError(f"ngroups must be a positive int, got {ngroups!r}")
    dim = nheads * headdim
    rest = zxbcdt.shape[-1] - 2 * dim - nheads
    if rest <= 0 or rest % (2 * ngroups):
        raise ValueError(
            f"zxbcdt's last dim {zxbcdt.shape[-1]} is not 2*dim + 2*ngroups*dstate + nheads "
            f"for dim={dim} (nheads={nheads} x headdim={headdim}), ngroups={ngroups}"
        )
    dstate = rest // (2 * ngroups)
    conv_dim = dim + 2 * ngroups * dstate
    if not isinstance(conv1d_weight, torch.Tensor) or conv1d_weight.dim() != 2:
        raise ValueError("conv1d_weight must have shape (dim + 2*ngroups*dstate, width)")
    if conv1d_weight.shape[0] != conv_dim:
        raise ValueError(
            f"conv1d_weight must have {conv_dim} channels (dim + 2*ngroups*dstate), got "
            f"shape {tuple(conv1d_weight.shape)}"
        )
    return nheads, headdim, dim, dstate


def mamba_split_conv1d_scan_combined(
    zxbcdt: Tensor, conv1d_weight: Tensor, conv1d_bias: Tensor | None, dt_bias: Tensor | None,
    A: Tensor, D: Tensor, chunk_size: int, initial_states: Tensor | None = None,
    seq_idx: Tensor | None = None, dt_limit: tuple[float, float] = (0.0, math.inf),
    return_final_states: bool = False, activation: str | None = "silu",
    rmsnorm_weight: Tensor | None = None, rmsnorm_eps: float = 1e-6,
    outproj_weight: Tensor | None = None, outproj_bias: Tensor | None = None,
    headdim: int | None = None, ngroups: int = 1, norm_before_gate: bool = True,
):  # fmt: skip
    """mamba_ssm's ``mamba_split_conv1d_scan_combined``: returns out (batch, seqlen, dim, or
    outproj's size) [, final_states (batch, nheads, headdim, dstate)]. Differentiable through
    its ops (conv, scan, norm, projection), each of which saves only its inputs."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    nheads, headdim, dim, dstate = _sizes(zxbcdt, conv1d_weight, D, headdim, ngroups)
    batch, seqlen, _ = zxbcdt.shape
    z, xbc, dt = torch.split(zxbcdt, [dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    xbc = causal_conv1d_fn(
        xbc.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx=seq_idx,
        activation="silu" if activation is not None else None,
    ).transpose(1, 2)  # fmt: skip
    x, B, C = torch.split(xbc, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    res = mamba_chunk_scan_combined(
        x.unflatten(-1, (nheads, headdim)), dt, A, B.unflatten(-1, (ngroups, dstate)),
        C.unflatten(-1, (ngroups, dstate)), chunk_size, D=D,
        z=None if rmsnorm_weight is not None else z.unflatten(-1, (nheads, headdim)),
        dt_bias=dt_bias, initial_states=initial_states, seq_idx=seq_idx, dt_softplus=True,
        dt_limit=dt_limit, return_final_states=return_final_states,
    )  # fmt: skip
    out, final = res if return_final_states else (res, None)
    out = out.reshape(batch, seqlen, dim)
    if rmsnorm_weight is not None:
        out = rmsnorm_fn(out, rmsnorm_weight, None, z=z, eps=rmsnorm_eps,
                         group_size=dim // ngroups, norm_before_gate=norm_before_gate)  # fmt: skip
    if outproj_weight is not None:
        out = torch.nn.functional.linear(out, outproj_weight, outproj_bias)
    return (out, final) if return_final_states else out
