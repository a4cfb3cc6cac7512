"""``Mamba2Simple``: the minimal Mamba2 mixer of mamba_ssm's ``modules.mamba2_simple`` (no
decode cache; optional learnable initial states), on mamba2-rocm's ops."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mamba2_rocm.models._init import a_log_init, dt_bias_init, no_weight_decay
from mamba2_rocm.ops.conv1d import causal_conv1d_fn
from mamba2_rocm.ops.mamba2 import mamba_split_conv1d_scan_combined
from mamba2_rocm.ops.rmsnorm import RMSNorm as RMSNormGated
from mamba2_rocm.ops.ssd import mamba_chunk_scan_combined

__all__ = ["Mamba2Simple"]


class Mamba2Simple(nn.Module):
    """mamba_ssm's ``Mamba2Simple`` constructor and ``forward(u, seq_idx=None)``."""

    def __init__(
        self, d_model: int, d_state: int = 64, d_conv: int = 4, conv_init: float | None = None,
        expand: int = 2, headdim: int = 128, ngroups: int = 1,
        A_init_range: tuple[float, float] = (1, 16), dt_min: float = 0.001, dt_max: float = 0.1,
        dt_init_floor: float = 1e-4, dt_limit: tuple[float, float] = (0.0, float("inf")),
        learnable_init_states: bool = False, activation: str = "swish", bias: bool = False,
        conv_bias: bool = True, chunk_size: int = 256, use_mem_eff_path: bool = True,
        layer_idx: int | None = None, device=None, dtype=None,
    ) -> None:  # fmt: skip
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        if activation not in ("silu", "swish"):
            raise ValueError(f"activation must be 'silu' or 'swish', got {activation!r}")
        self.d_model, self.d_state, self.d_conv = d_model, d_state, d_conv
        self.conv_init, self.expand = conv_init, expand
        self.d_inner = expand * d_model
        self.headdim, self.ngroups = headdim, ngroups
        if self.d_inner % headdim:
            raise ValueError(f"expand * d_model = {self.d_inner} must be a multiple of "
                             f"headdim={headdim}")  # fmt: skip
        self.nheads = self.d_inner // headdim
        self.dt_limit, self.learnable_init_states = dt_limit, learnable_init_states
        self.activation, self.chunk_size = activation, chunk_size
        self.use_mem_eff_path, self.layer_idx = use_mem_eff_path, layer_idx
        d_in_proj = 2 * self.d_inner + 2 * ngroups * d_state + self.nheads
        self.in_proj = nn.Linear(d_model, d_in_proj, bias=bias, **factory)
        conv_dim = self.d_inner + 2 * ngroups * d_state
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, d_conv, groups=conv_dim, padding=d_conv - 1,
                                bias=conv_bias, **factory)  # fmt: skip
        if conv_init is not None:
            nn.init.uniform_(self.conv1d.weight, -conv_init, conv_init)
        if learnable_init_states:
            self.init_states = nn.Parameter(torch.zeros(self.nheads, headdim, d_state, **factory))
            no_weight_decay(self.init_states)
        self.act = nn.SiLU()
        self.dt_bias = nn.Parameter(dt_bias_init(self.nheads, dt_min, dt_max, dt_init_floor,
                                                 **factory))  # fmt: skip
        self.A_log = nn.Parameter(a_log_init(self.nheads, A_init_range, device, dtype))
        self.D = nn.Parameter(torch.ones(self.nheads, device=device))
        no_weight_decay(self.dt_bias, self.A_log, self.D)
        self.norm = RMSNormGated(self.d_inner, eps=1e-5, norm_before_gate=False, **factory)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias, **factory)

    def forward(self, u: Tensor, seq_idx: Tensor | None = None) -> Tensor:
        """u (batch, seqlen, d_model) -> the same shape."""
        batch = u.shape[0]
        zxbcdt = self.in_proj(u)
        A = -torch.exp(self.A_log)
        init = None
        if self.learnable_init_states:
            init = self.init_states.unsqueeze(0).expand(batch, *self.init_states.shape)
        limit = {} if tuple(self.dt_limit) == (0.0, math.inf) else {"dt_limit": self.dt_limit}
        weight = self.conv1d.weight.squeeze(1)
        if self.use_mem_eff_path:
            return mamba_split_conv1d_scan_combined(
                zxbcdt, weight, self.conv1d.bias, self.dt_bias, A, D=self.D,
                chunk_size=self.chunk_size, seq_idx=seq_idx, activation=self.activation,
                rmsnorm_weight=self.norm.weight, rmsnorm_eps=self.norm.eps,
                outproj_weight=self.out_proj.weight, outproj_bias=self.out_proj.bias,
                headdim=self.headdim, ngroups=self.ngroups, norm_before_gate=False,
                initial_states=init, **limit,
            )  # fmt: skip
        gn = self.ngroups * self.d_state
        z, xbc, dt = torch.split(zxbcdt, [self.d_inner, self.d_inner + 2 * gn, self.nheads], -1)
        dt = F.softplus(dt + self.dt_bias)
        xbc = causal_conv1d_fn(xbc.transpose(1, 2), weight, bias=self.conv1d.bias,
                               activation=self.activation).transpose(1, 2)  # fmt: skip
        x, B, C = torch.split(xbc, [self.d_inner, gn, gn], dim=-1)
        y = mamba_chunk_scan_combined(
            x.unflatten(-1, (self.nheads, self.headdim)), dt, A,
            B.unflatten(-1, (self.ngroups, self.d_state)),
            C.unflatten(-1, (self.ngroups, self.d_state)), chunk_size=self.chunk_size, D=self.D,
            seq_idx=seq_idx, initial_states=init, **limit,
        )  # fmt: skip
        return self.out_proj(self.norm(y.flatten(-2), z))
