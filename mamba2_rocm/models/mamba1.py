"""``Mamba``: the Mamba1 mixer (mamba_ssm's ``modules.mamba_simple``) on mamba2-rocm's ops.

The input projection gives x and the gate z as (batch, channels, seqlen); x runs through the
causal depthwise conv, a projection gives each token's dt (low rank), B and C, and the
selective scan (S4D-real A per channel and state) is gated by silu(z) before the output
projection. Training without a cache is one call of ``mamba_inner_fn`` (``use_fast_path``);
prefill into an ``InferenceParams`` cache and the one-token ``step`` run the ops one by one.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mamba2_rocm.models._init import decay_rates, dt_bias_init, layer_states, no_weight_decay
from mamba2_rocm.ops.conv1d import causal_conv1d_fn, causal_conv1d_update
from mamba2_rocm.ops.linear import (
    decode_linear,
    join_prefetch,
    plain_linear,
    prefetch_beside,
    step_linear,
)
from mamba2_rocm.ops.mamba1 import mamba_inner_fn
from mamba2_rocm.ops.selective_scan import selective_scan_fn
from mamba2_rocm.ops.state_update import selective_state_update

__all__ = ["Mamba"]


class Mamba(nn.Module):
    """mamba_ssm's ``Mamba`` constructor, attributes, ``forward(hidden_states,
    inference_params=None)``, ``step``, ``allocate_inference_cache``."""

    def __init__(
        self, d_model: int, d_state: int = 16, d_conv: int = 4, expand: int = 2,
        dt_rank: int | str = "auto", dt_min: float = 0.001, dt_max: float = 0.1,
        dt_init: str = "random", dt_scale: float = 1.0, dt_init_floor: float = 1e-4,
        conv_bias: bool = True, bias: bool = False, use_fast_path: bool = True,
        layer_idx: int | None = None, device=None, dtype=None,
    ) -> None:  # fmt: skip
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        self.d_model, self.d_state, self.d_conv, self.expand = d_model, d_state, d_conv, expand
        self.d_inner = int(expand * d_model)
        self.dt_rank = math.ceil(d_model / 16) if dt_rank == "auto" else dt_rank
        self.use_fast_path, self.layer_idx = use_fast_path, layer_idx
        self.in_proj = nn.Linear(d_model, self.d_inner * 2, bias=bias, **factory)
        self.conv1d = nn.Conv1d(self.d_inner, self.d_inner, d_conv, groups=self.d_inner,
                                padding=d_conv - 1, bias=conv_bias, **factory)  # fmt: skip
        self.activation = "silu"
        self.act = nn.SiLU()
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + 2 * d_state, bias=False, **factory)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True, **factory)
        std = self.dt_rank**-0.5 * dt_scale  # keeps dt's variance at initialization
        if dt_init == "constant":
            nn.init.constant_(self.dt_proj.weight, std)
        elif dt_init == "random":
            nn.init.uniform_(self.dt_proj.weight, -std, std)
        else:
            raise ValueError(f"dt_init must be 'random' or 'constant', got {dt_init!r}")
        with torch.no_grad():
            self.dt_proj.bias.copy_(dt_bias_init(self.d_inner, dt_min, dt_max, dt_init_floor,
                                                 **factory))  # fmt: skip
        self.dt_proj.bias._no_reinit = True  # _init_weights zeroes every other Linear bias
        # S4D-real: A = -(1..d_state) on every channel, kept as log in fp32
        a = torch.arange(1, d_state + 1, dtype=torch.float32, device=device)
        self.A_log = nn.Parameter(torch.log(a).expand(self.d_inner, d_state).contiguous())
        self.D = nn.Parameter(torch.ones(self.d_inner, device=device))  # fp32
        no_weight_decay(self.A_log, self.D)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias, **factory)

    def _conv_weight(self) -> Tensor:
        return self.conv1d.weight.squeeze(1)

    def forward(self, hidden_states: Tensor, inference_params=None) -> Tensor:
        """hidden_states (batch, seqlen, d_model) -> the same shape."""
        batch, seqlen, _ = hidden_states.shape
        conv_state = ssm_state = None
        if inference_params is not None:
            conv_state, ssm_state = self._get_states_from_cache(inference_params, batch)
            if inference_params.seqlen_offset > 0:
                return self.step(hidden_states, conv_state, ssm_state)[0]
        # (batch, 2 * d_inner, seqlen) with seqlen the fastest dim, as the scan reads it
        w = self.in_proj.weight
        xz = (w @ hidden_states.reshape(-1, hidden_states.shape[-1]).t()).view(
            w.shape[0], batch, seqlen).permute(1, 0, 2)  # fmt: skip
        if self.in_proj.bias is not None:
            xz = xz + self.in_proj.bias.to(dtype=xz.dtype)[:, None]
        A = -torch.exp(self.A_log.float())
        if self.use_fast_path and inference_params is None:
            return mamba_inner_fn(
                xz, self.conv1d.weight, self.conv1d.bias, self.x_proj.weight,
                self.dt_proj.weight, self.out_proj.weight, self.out_proj.bias, A, None, None,
                self.D.float(), delta_bias=self.dt_proj.bias.float(), delta_softplus=True,
            )  # fmt: skip
        x, z = xz.chunk(2, dim=1)
        if conv_state is not None:  # the last d_conv inputs, zeros in front of a short prompt
            conv_state.copy_(F.pad(x, (self.d_conv - x.shape[-1], 0)))
        x = causal_conv1d_fn(x, self._conv_weight(), self.conv1d.bias, activation=self.activation)
        x_dbl = self.x_proj(x.transpose(1, 2).reshape(batch * seqlen, -1))
        dt, B, C = torch.split(x_dbl, [self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = (self.dt_proj.weight @ dt.t()).view(self.d_inner, batch, seqlen).permute(1, 0, 2)
        B = B.view(batch, seqlen, -1).transpose(1, 2).contiguous()
        C = C.view(batch, seqlen, -1).transpose(1, 2).contiguous()
        res = selective_scan_fn(x, dt, A, B, C, self.D.float(), z=z,
                                delta_bias=self.dt_proj.bias.float(), delta_softplus=True,
                                return_last_state=ssm_state is not None)  # fmt: skip
        if ssm_state is not None:
            y, last = res
            ssm_state.copy_(last)
        else:
            y = res
        return self.out_proj(y.transpose(1, 2))

    def step(self, hidden_states: Tensor, conv_state: Tensor, ssm_state: Tensor):
        """One token (batch, 1, d_model): ``(out, conv_state, ssm_state)``, states in place."""
        if hidden_states.shape[1] != 1:
            raise ValueError(f"step decodes one token at a time, got {hidden_states.shape[1]}")
        x, z = step_linear(self.in_proj, hidden_states.squeeze(1)).chunk(2, dim=-1)
        # in a graph: out_proj's weight read into the cache beside the small steps below
        side = (prefetch_beside(self.out_proj.weight, rows=x.shape[0])
                if plain_linear(self.out_proj) else None)  # fmt: skip
        x = causal_conv1d_update(x, conv_state, self._conv_weight(), self.conv1d.bias,
                                 self.activation)  # fmt: skip
        dt, B, C = torch.split(step_linear(self.x_proj, x), [self.dt_rank, self.d_state, self.d_state],
                               dim=-1)  # fmt: skip
        dt = decode_linear(dt, self.dt_proj.weight)  # the bias goes in as dt_bias
        A = decay_rates(self)
        y = selective_state_update(ssm_state, x, dt, A, B, C, self.D, z=z,
                                   dt_bias=self.dt_proj.bias, dt_softplus=True)  # fmt: skip
        out = step_linear(self.out_proj, y).unsqueeze(1)
        join_prefetch(side)
        return out, conv_state, ssm_state

    def _new_states(self, batch_size: int, conv_dtype, ssm_dtype, device):
        conv_state = torch.zeros(batch_size, self.d_inner, self.d_conv, device=device,
                                 dtype=conv_dtype)  # fmt: skip
        ssm_state = torch.zeros(batch_size, self.d_inner, self.d_state, device=device,
                                dtype=ssm_dtype)  # fmt: skip
        return conv_state, ssm_state

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype=None, **kwargs):
        conv_dtype = self.conv1d.weight.dtype if dtype is None else dtype
        ssm_dtype = self.dt_proj.weight.dtype if dtype is None else dtype
        return self._new_states(batch_size, conv_dtype, ssm_dtype, self.out_proj.weight.device)

    def _get_states_from_cache(self, inference_params, batch_size: int,
                               initialize_states: bool = False):  # fmt: skip
        w = self.conv1d.weight
        return layer_states(self, inference_params, initialize_states=initialize_states,
                            make=lambda: self._new_states(batch_size, w.dtype, self.dt_proj.weight.dtype,
                                                          w.device))  # fmt: skip
