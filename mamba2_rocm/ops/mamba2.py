"""``mamba_split_conv1d_scan_combined``: a Mamba2 block's forward after in_proj, composed from
our ops (causal conv1d, the SSD scan, gated RMSNorm) with mamba_ssm's argument list.

zxbcdt (batch, seqlen, 2 dim + 2 ngroups dstate + nheads) is split into z, xBC and dt as
mamba_ssm does; xBC goes through the depthwise causal conv (its channel-last view, no copy)
and SiLU, then splits into x, B, C (views); the scan adds D and, without an RMSNorm, the z
gate; with ``rmsnorm_weight`` the gated norm applies z instead; ``outproj_weight`` projects last.

Training on the kernel tier (eager) goes through ``_FusedBlock``, which keeps what mamba_ssm's
``checkpoint_lvl=1`` keeps: the inputs and the scan's output before the norm; the conv's
output and the norm's output are computed again in the backward, which calls the ops'
backward implementations (HIP kernels) directly. Elsewhere (compiling, the torch tiers) the
block differentiates through its ops, each of which saves its own inputs.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

from mamba2_rocm._torch import require_torch
from mamba2_rocm.ops import conv1d as conv_ops
from mamba2_rocm.ops import rmsnorm as norm_ops
from mamba2_rocm.ops import ssd as ssd_ops
from mamba2_rocm.ops._backend import choose
from mamba2_rocm.ops._launch import needs_autograd
from mamba2_rocm.ops.checks import kernel_chunk_size
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


class _FusedBlock(torch.autograd.Function):
    """The block for eager training, saving what mamba_ssm's checkpoint_lvl=1 saves (the
    inputs and the scan's output before the norm) and recomputing the rest in the backward."""

    @staticmethod
    def forward(ctx, zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, initial_states,
                rmsnorm_weight, outproj_weight, outproj_bias, seq_idx, cfg):  # fmt: skip
        b, seqlen = zxbcdt.shape[:2]
        dim = cfg.sizes[2]
        z, x, B, C, dt = _FusedBlock._inputs(zxbcdt, conv1d_weight, conv1d_bias, seq_idx, cfg)
        out, final, _ = ssd_ops._impl(
            x, dt, A, B, C, cfg.chunk_size, D, None if rmsnorm_weight is not None else z,
            dt_bias, initial_states, seq_idx, None, True, list(cfg.dt_limit), False, None,
        )  # fmt: skip
        out_x = out.reshape(b, seqlen, dim)
        y = _FusedBlock._head(out_x, z, rmsnorm_weight, outproj_weight, outproj_bias, cfg)
        ctx.cfg = cfg
        keep = out_x if rmsnorm_weight is not None or outproj_weight is not None else None
        ctx.save_for_backward(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, initial_states,
                              rmsnorm_weight, outproj_weight, outproj_bias, seq_idx, keep)  # fmt: skip
        if not cfg.return_final_states:
            ctx.mark_non_differentiable(final)
        return y, final

    @staticmethod
    def _inputs(zxbcdt, conv1d_weight, conv1d_bias, seq_idx, cfg):
        """z, then the scan's x, B, C (the conv's output, split) and dt: views, no copies."""
        nheads, headdim, dim, dstate, ngroups = cfg.sizes
        z, xbc, dt = torch.split(zxbcdt, [dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
        xbc, _ = conv_ops._fwd_func_impl(xbc.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx,
                                         None, cfg.silu, False)  # fmt: skip
        x, B, C = torch.split(xbc.transpose(1, 2), [dim, ngroups * dstate, ngroups * dstate], -1)
        return (z.unflatten(-1, (nheads, headdim)), x.unflatten(-1, (nheads, headdim)),
                B.unflatten(-1, (ngroups, dstate)), C.unflatten(-1, (ngroups, dstate)), dt)  # fmt: skip

    @staticmethod
    def _head(out_x, z, rmsnorm_weight, outproj_weight, outproj_bias, cfg):
        """The norm and the out-projection after the scan."""
        y = out_x
        if rmsnorm_weight is not None:
            dim = out_x.shape[-1]
            y = norm_ops._impl(out_x, rmsnorm_weight, None, z.flatten(-2), cfg.eps,
                               dim // cfg.sizes[4], cfg.norm_before_gate, True)  # fmt: skip
        if outproj_weight is not None:
            y = torch.nn.functional.linear(y, outproj_weight, outproj_bias)
        return y

    @staticmethod
    def backward(ctx, dy, dfinal):
        (zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, initial_states, rmsnorm_weight,
         outproj_weight, outproj_bias, seq_idx, out_x) = ctx.saved_tensors  # fmt: skip
        cfg = ctx.cfg
        nheads, headdim, dim, dstate, ngroups = cfg.sizes
        b, seqlen = zxbcdt.shape[:2]
        z, x, B, C, dt = _FusedBlock._inputs(zxbcdt, conv1d_weight, conv1d_bias, seq_idx, cfg)
        if dy is None:
            dy = zxbcdt.new_zeros((*zxbcdt.shape[:2], dim))
        dW = dWb = drms = None
        if outproj_weight is not None:
            y = _FusedBlock._head(out_x, z, rmsnorm_weight, None, None, cfg)
            dW = (
                dy.flatten(0, -2).t().matmul(y.flatten(0, -2).to(dy.dtype)).to(outproj_weight.dtype)
            )
            if outproj_bias is not None:
                dWb = dy.flatten(0, -2).sum(0).to(outproj_bias.dtype)
            dy = dy.matmul(outproj_weight.to(dy.dtype))
        dz = None
        if rmsnorm_weight is not None:
            dy, drms, _, dz = norm_ops._bwd_run(out_x, rmsnorm_weight, None, z.flatten(-2), cfg.eps,
                                                dim // ngroups, cfg.norm_before_gate, True,
                                                dy.to(out_x.dtype).contiguous())  # fmt: skip
        g = ssd_ops._bwd_impl(
            x, dt, A, B, C, cfg.chunk_size, D, None if rmsnorm_weight is not None else z, dt_bias,
            initial_states, seq_idx, True, list(cfg.dt_limit),
            dy.reshape(b, seqlen, nheads, headdim).to(x.dtype), dfinal,
        )  # fmt: skip
        if rmsnorm_weight is None:
            dz = g[6].flatten(-2)
        dxbc = torch.cat([g[0].flatten(-2), g[3].flatten(-2).to(x.dtype),
                          g[4].flatten(-2).to(x.dtype)], dim=-1)  # fmt: skip
        xbc_in = torch.split(zxbcdt, [dim, dim + 2 * ngroups * dstate, nheads], dim=-1)[1]
        dxbc_in, dw, db, _ = conv_ops._bwd_run(xbc_in.transpose(1, 2), conv1d_weight, conv1d_bias,
                                               seq_idx, None, dxbc.transpose(1, 2), None, cfg.silu)  # fmt: skip
        dzxbcdt = torch.cat([dz.to(zxbcdt.dtype), dxbc_in.transpose(1, 2).to(zxbcdt.dtype),
                             g[1].to(zxbcdt.dtype)], dim=-1)  # fmt: skip
        opt = lambda t, like: None if like is None else t  # noqa: E731
        return (dzxbcdt, dw, opt(db, conv1d_bias), opt(g[7], dt_bias), g[2], g[5],
                opt(g[8], initial_states), drms, dW, dWb, None, None)  # fmt: skip


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
    tensors = (zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, initial_states, rmsnorm_weight,
               outproj_weight, outproj_bias)  # fmt: skip
    if (batch and seqlen and not torch.compiler.is_compiling() and needs_autograd(*tensors)
            and choose(zxbcdt.device)[0] == "kernel"):  # fmt: skip
        cfg = SimpleNamespace(  # the block's non-tensor arguments
            sizes=(nheads, headdim, dim, dstate, ngroups), chunk_size=kernel_chunk_size(chunk_size),
            dt_limit=(float(dt_limit[0]), float(dt_limit[1])), silu=activation is not None,
            eps=float(rmsnorm_eps), norm_before_gate=bool(norm_before_gate),
            return_final_states=return_final_states,
        )  # fmt: skip
        out, final = _FusedBlock.apply(*tensors, seq_idx, cfg)
        return (out, final) if return_final_states else out
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
