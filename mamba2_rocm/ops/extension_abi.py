"""The calling conventions of the compiled extensions that the real, pure-Python mamba-ssm
imports and cannot build on ROCm, served by mamba2-rocm's ops.

``pip install mamba-ssm`` (2.3.x) installs Triton code and no CUDA extension; its ``Mamba2``
reaches the conv through ``causal_conv1d.cpp_functions`` and its ``Mamba`` the scan through
``selective_scan_cuda``. Beside it the drop-in serves those two names from here, so the real
modules run with our conv and scan kernels. These are adapters only: argument order, in-place
outputs and return values as the C++ extensions have them; checks and math are the ops'.

- ``causal_conv1d_fwd_function`` / ``_bwd_function`` / ``_update_function``: causal-conv1d
  1.6's ``cpp_functions``. The backward writes dx into a caller's buffer when one is given
  (mamba_ssm passes a view into the packed input gradient).
- ``selective_scan_fwd`` / ``selective_scan_bwd``: ``selective_scan_cuda.fwd`` / ``.bwd``. The
  extension's intermediate ``x`` is (batch, dim, chunks, 2 * dstate) with the running decay at
  even and the state at odd positions, one entry per chunk of 2048 tokens. Our backward
  recomputes from the inputs and needs none of it, so ``x`` here is the sequence as one chunk:
  ``x[..., 0::2]`` the decay over the whole sequence, ``x[..., 1::2]`` the final state (what
  mamba_ssm reads of it: ``x[:, :, -1, 1::2]``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mamba2_rocm.ops import conv1d as _conv
from mamba2_rocm.ops import selective_scan as _scan

__all__ = [
    "causal_conv1d_bwd_function",
    "causal_conv1d_fwd_function",
    "causal_conv1d_update_function",
    "selective_scan_bwd",
    "selective_scan_fwd",
]


# ---- causal_conv1d.cpp_functions ---------------------------------------------------------------


def causal_conv1d_fwd_function(
    x: Tensor, weight: Tensor, bias: Tensor | None, seq_idx: Tensor | None,
    initial_states: Tensor | None, final_states_out: Tensor | None, silu_activation: bool,
) -> Tensor:  # fmt: skip
    """out (x's shape and layout); ``final_states_out`` (batch, dim, width - 1), if given, is
    written in place."""
    op = _conv.causal_conv1d_fwd if torch.compiler.is_compiling() else _conv._fwd_impl
    return op(x, weight, bias, seq_idx, initial_states, final_states_out, bool(silu_activation))


def causal_conv1d_bwd_function(
    x: Tensor, weight: Tensor, bias: Tensor | None, dout: Tensor, seq_idx: Tensor | None,
    initial_states: Tensor | None, dfinal_states: Tensor | None, dx: Tensor | None,
    return_dinitial_states: bool, silu_activation: bool,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:  # fmt: skip
    """``(dx, dweight, dbias, dinitial_states)``: dx written into ``dx`` when given; dweight /
    dbias in the parameters' dtypes; dinitial_states (batch, dim, width - 1) only with
    ``return_dinitial_states`` (the gradient of zero entering states when none were given)."""
    if return_dinitial_states and initial_states is None:
        width = weight.shape[-1]
        initial_states = x.new_zeros(x.shape[0], x.shape[1], width - 1)
    op = _conv.causal_conv1d_bwd if torch.compiler.is_compiling() else _conv._bwd_impl
    gx, gw, gb, ginit = op(x, weight, bias, seq_idx, initial_states, dout, dfinal_states,
                           bool(silu_activation))  # fmt: skip
    if dx is not None:
        if dx.shape != x.shape:
            raise ValueError(f"dx must have x's shape {tuple(x.shape)}, got {tuple(dx.shape)}")
        dx.copy_(gx)
        gx = dx
    return (gx, gw, gb if bias is not None else None,
            ginit if return_dinitial_states else None)  # fmt: skip


def causal_conv1d_update_function(
    x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None, silu_activation: bool,
    cache_seqlens: Tensor | None, conv_state_indices: Tensor | None,
) -> Tensor:  # fmt: skip
    """out (x's shape); ``conv_state`` advanced in place."""
    return _conv.causal_conv1d_update(x, conv_state, weight, bias,
                                      "silu" if silu_activation else None, cache_seqlens,
                                      conv_state_indices)  # fmt: skip


# ---- selective_scan_cuda -----------------------------------------------------------------------


def _scan_state(u, delta, A, delta_bias, delta_softplus, last: Tensor) -> Tensor:
    """The extension's ``x`` for one chunk: (batch, dim, 1, 2 * dstate), decay and state
    interleaved."""
    dt = delta.float()
    if delta_bias is not None:
        dt = dt + delta_bias.float()[:, None]
    if delta_softplus:
        dt = F.softplus(dt)
    decay = torch.exp(A[None] * dt.sum(-1)[..., None])  # (batch, dim, dstate)
    pairs = torch.stack([decay.to(last.dtype), last], dim=-1)
    return pairs.reshape(last.shape[0], last.shape[1], 1, 2 * last.shape[2])


def selective_scan_fwd(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
    z: Tensor | None, delta_bias: Tensor | None, delta_softplus: bool,
) -> list[Tensor]:  # fmt: skip
    """``[out, x]``, or ``[out, x, out_z]`` with z: out is the scan's output before the gate,
    out_z = out * silu(z)."""
    out, last = _scan._impl(u, delta, A, B, C, D, None, delta_bias, bool(delta_softplus), True)
    res = [out, _scan_state(u, delta, A, delta_bias, delta_softplus, last)]
    if z is not None:
        res.append(out * F.silu(z.to(out.dtype)))
    return res


def selective_scan_bwd(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
    z: Tensor | None, delta_bias: Tensor | None, dout: Tensor, x: Tensor | None,
    out: Tensor | None, dz: Tensor | None, delta_softplus: bool, recompute_out_z: bool,
) -> list[Tensor | None]:  # fmt: skip
    """``[du, ddelta, dA, dB, dC, dD, ddelta_bias]``, then ``dz`` with z, then ``out_z`` with
    ``recompute_out_z``. ``dout`` is the gradient of out_z when z is given (of out otherwise);
    dz is written into ``dz`` when given. ``x`` is not read (the states are recomputed)."""
    if z is not None and recompute_out_z and out is None:
        raise ValueError("recompute_out_z needs the forward's out")
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    g = _scan._bwd_impl(u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus), dout, None)
    du, ddelta, dA, dB, dC, dD, gz, ddb = g
    res = [du, ddelta, dA, dB, dC, dD if D is not None else None,
           ddb if delta_bias is not None else None]  # fmt: skip
    if z is not None:
        if dz is not None:
            dz.copy_(gz)
            gz = dz
        res.append(gz)
        if recompute_out_z:
            res.append(out * F.silu(z.to(out.dtype)))
    return res
