"""``Mamba2``: the Mamba2 mixer (mamba_ssm's ``modules.mamba2``) on mamba2-rocm's ops.

One input projection gives [z0 | x0 | z | xBC | dt] (z0 / x0 only with ``d_ssm`` < d_inner: a
gated MLP beside the SSM); xBC runs through the causal depthwise conv, then the SSD scan over
heads of ``headdim`` channels, the gated RMSNorm and the output projection. The whole
training path is one call of ``mamba_split_conv1d_scan_combined`` (``use_mem_eff_path``);
the unfused path, prefill into an ``InferenceParams`` cache (varlen with ``cu_seqlens``) and
the one-token ``step`` run the ops one by one. Parameter names and shapes are upstream's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mamba2_rocm.models._init import (
    a_log_init,
    decay_rates,
    dt_bias_init,
    layer_states,
    no_weight_decay,
)
from mamba2_rocm.ops.conv1d import (
    causal_conv1d_fn,
    causal_conv1d_update,
    causal_conv1d_varlen_states,
)
from mamba2_rocm.ops.linear import (
    in_proj_conv_step,
    join_prefetch,
    plain_linear,
    prefetch_beside,
    step_linear,
)
from mamba2_rocm.ops.mamba2 import mamba_split_conv1d_scan_combined
from mamba2_rocm.ops.rmsnorm import RMSNorm as RMSNormGated
from mamba2_rocm.ops.ssd import mamba_chunk_scan_combined
from mamba2_rocm.ops.state_update import selective_state_update

__all__ = ["Mamba2"]

_NO_LIMIT = (0.0, math.inf)


class Mamba2(nn.Module):
    """mamba_ssm's ``Mamba2`` constructor, attributes, ``forward(u, seqlen=None, seq_idx=None,
    cu_seqlens=None, inference_params=None)``, ``step``, ``allocate_inference_cache``."""

    def __init__(
        self, d_model: int, d_state: int = 128, d_conv: int = 4, conv_init: float | None = None,
        expand: int = 2, headdim: int = 64, d_ssm: int | None = None, ngroups: int = 1,
        A_init_range: tuple[float, float] = (1, 16), D_has_hdim: bool = False,
        rmsnorm: bool = True, norm_before_gate: bool = False, dt_min: float = 0.001,
        dt_max: float = 0.1, dt_init_floor: float = 1e-4,
        dt_limit: tuple[float, float] = (0.0, float("inf")), bias: bool = False,
        conv_bias: bool = True, chunk_size: int = 256, use_mem_eff_path: bool = True,
        layer_idx: int | None = None, process_group=None, sequence_parallel: bool = True,
        device=None, dtype=None,
    ) -> None:  # fmt: skip
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        self.d_model, self.d_state, self.d_conv = d_model, d_state, d_conv
        self.conv_init, self.expand = conv_init, expand
        self.process_group, self.sequence_parallel = process_group, sequence_parallel
        self.world_size = 1 if process_group is None else process_group.size()
        self.local_rank = 0 if process_group is None else process_group.rank()
        if (expand * d_model) % self.world_size:
            raise ValueError(f"expand * d_model = {expand * d_model} must divide among "
                             f"{self.world_size} ranks")  # fmt: skip
        self.d_inner = expand * d_model // self.world_size
        self.headdim = headdim
        self.d_ssm = self.d_inner if d_ssm is None else d_ssm // self.world_size
        if ngroups % self.world_size:
            raise ValueError(f"ngroups={ngroups} must divide among {self.world_size} ranks")
        self.ngroups = ngroups // self.world_size
        if self.d_ssm % headdim:
            raise ValueError(f"d_ssm={self.d_ssm} must be a multiple of headdim={headdim}")
        self.nheads = self.d_ssm // headdim
        self.D_has_hdim, self.rmsnorm = D_has_hdim, rmsnorm
        self.norm_before_gate, self.dt_limit = norm_before_gate, dt_limit
        self.activation = "silu"
        self.chunk_size, self.use_mem_eff_path, self.layer_idx = (
            chunk_size,
            use_mem_eff_path,
            layer_idx,
        )

        # [z0 | x0 | z | x | B | C | dt]
        d_in_proj = 2 * self.d_inner + 2 * self.ngroups * d_state + self.nheads
        if process_group is None:
            self.in_proj = nn.Linear(d_model, d_in_proj, bias=bias, **factory)
        else:
            from mamba2_rocm.models.parallel import ColumnParallelLinear

            self.in_proj = ColumnParallelLinear(d_model, d_in_proj * self.world_size, bias=bias,
                                                process_group=process_group,
                                                sequence_parallel=sequence_parallel, **factory)  # fmt: skip
        conv_dim = self.d_ssm + 2 * self.ngroups * d_state
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, d_conv, groups=conv_dim, padding=d_conv - 1,
                                bias=conv_bias, **factory)  # fmt: skip
        if conv_init is not None:
            nn.init.uniform_(self.conv1d.weight, -conv_init, conv_init)
        self.act = nn.SiLU()
        self.dt_bias = nn.Parameter(dt_bias_init(self.nheads, dt_min, dt_max, dt_init_floor,
                                                 **factory))  # fmt: skip
        self.A_log = nn.Parameter(a_log_init(self.nheads, A_init_range, device, dtype))
        self.D = nn.Parameter(torch.ones(self.d_ssm if D_has_hdim else self.nheads, device=device))
        no_weight_decay(self.dt_bias, self.A_log, self.D)
        if rmsnorm:
            self.norm = RMSNormGated(self.d_ssm, eps=1e-5, norm_before_gate=norm_before_gate,
                                     group_size=self.d_ssm // ngroups, **factory)  # fmt: skip
        if process_group is None:
            self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias, **factory)
        else:
            from mamba2_rocm.models.parallel import RowParallelLinear

            self.out_proj = RowParallelLinear(self.d_inner * self.world_size, d_model, bias=bias,
                                              process_group=process_group,
                                              sequence_parallel=sequence_parallel, **factory)  # fmt: skip

    # ---- pieces ------------------------------------------------------------------------------

    def _conv_weight(self) -> Tensor:
        return self.conv1d.weight.squeeze(1)  # (channels, width)

    def _D(self) -> Tensor:
        return self.D.view(self.nheads, self.headdim) if self.D_has_hdim else self.D

    def _dt_limit_kwargs(self) -> dict:
        return {} if tuple(self.dt_limit) == _NO_LIMIT else {"dt_limit": self.dt_limit}

    def _d_mlp(self, zxbcdt: Tensor) -> int:
        """The width of the gated-MLP half (z0, x0 each) in front of the SSM's columns."""
        return (zxbcdt.shape[-1] - 2 * self.d_ssm - 2 * self.ngroups * self.d_state
                - self.nheads) // 2  # fmt: skip

    def _split(self, zxbcdt: Tensor):
        """(z0, x0, z, xBC, dt) along the last dim."""
        d_mlp = self._d_mlp(zxbcdt)
        xbc = self.d_ssm + 2 * self.ngroups * self.d_state
        return torch.split(zxbcdt, [d_mlp, d_mlp, self.d_ssm, xbc, self.nheads], dim=-1)

    def _xbc_split(self, xbc: Tensor):
        gn = self.ngroups * self.d_state
        return torch.split(xbc, [self.d_ssm, gn, gn], dim=-1)

    def _finish(self, y: Tensor, z: Tensor, z0: Tensor, x0: Tensor) -> Tensor:
        """The gated norm, the MLP half joined in front, and the output projection's input."""
        if self.rmsnorm:
            y = self.norm(y, z)
        if z0.shape[-1] > 0:
            y = torch.cat([F.silu(z0) * x0, y], dim=-1)
        return y

    # ---- forward -----------------------------------------------------------------------------

    def forward(self, u: Tensor, seqlen: int | None = None, seq_idx: Tensor | None = None,
                cu_seqlens: Tensor | None = None, inference_params=None) -> Tensor:  # fmt: skip
        """u (batch, seqlen, d_model), or (batch * seqlen, d_model) with ``seqlen`` given (the
        sequence-parallel layout); returns u's shape."""
        flat = seqlen is not None
        if flat:
            batch = u.shape[0] // seqlen
        else:
            batch, seqlen, _ = u.shape
        conv_state = ssm_state = None
        if inference_params is not None:
            rows = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else batch
            conv_state, ssm_state = self._get_states_from_cache(inference_params, rows)
            if inference_params.seqlen_offset > 0:  # decoding: the states advance in place
                return self.step(u, conv_state, ssm_state)[0]
        zxbcdt = self.in_proj(u)
        if flat:
            zxbcdt = zxbcdt.view(batch, seqlen, -1)
        A = -torch.exp(self.A_log.float())  # fp32: an fp16 A_log would overflow to -inf here
        if self.use_mem_eff_path and inference_params is None:
            # the op fuses conv, scan, gated norm and (without an MLP half) the output projection
            d_mlp = self._d_mlp(zxbcdt)
            ssm_in = zxbcdt[..., 2 * d_mlp :] if d_mlp else zxbcdt
            out = mamba_split_conv1d_scan_combined(
                ssm_in, self._conv_weight(), self.conv1d.bias, self.dt_bias, A, D=self._D(),
                chunk_size=self.chunk_size, seq_idx=seq_idx, activation=self.activation,
                rmsnorm_weight=self.norm.weight if self.rmsnorm else None,
                rmsnorm_eps=self.norm.eps if self.rmsnorm else 1e-6,
                outproj_weight=None if d_mlp else self.out_proj.weight,
                outproj_bias=None if d_mlp else self.out_proj.bias,
                headdim=None if self.D_has_hdim else self.headdim, ngroups=self.ngroups,
                norm_before_gate=self.norm_before_gate, **self._dt_limit_kwargs(),
            )  # fmt: skip
            if d_mlp:
                z0, x0 = zxbcdt[..., :d_mlp], zxbcdt[..., d_mlp : 2 * d_mlp]
                out = self.out_proj(torch.cat([F.silu(z0) * x0, out], dim=-1))
            if flat:
                out = out.reshape(batch * seqlen, -1)
            if self.process_group is not None:
                from mamba2_rocm.models.parallel import all_reduce, reduce_scatter

                reduce = reduce_scatter if self.sequence_parallel else all_reduce
                out = reduce(out, self.process_group)
            return out
        z0, x0, z, xbc, dt = self._split(zxbcdt)
        if conv_state is not None:
            if cu_seqlens is None:  # the last d_conv tokens, zeros in front of a short prompt
                xt = xbc.transpose(1, 2)
                conv_state.copy_(F.pad(xt, (self.d_conv - xt.shape[-1], 0)))
            else:
                if batch != 1:
                    raise ValueError(f"varlen prefill (cu_seqlens) takes batch 1, got {batch}")
                conv_state.copy_(causal_conv1d_varlen_states(xbc.squeeze(0), cu_seqlens,
                                                             state_len=conv_state.shape[-1]))  # fmt: skip
        xbc = causal_conv1d_fn(xbc.transpose(1, 2), self._conv_weight(), bias=self.conv1d.bias,
                               activation=self.activation, seq_idx=seq_idx).transpose(1, 2)  # fmt: skip
        x, B, C = self._xbc_split(xbc)
        want_varlen = cu_seqlens is not None and inference_params is not None
        res = mamba_chunk_scan_combined(
            x.unflatten(-1, (self.nheads, self.headdim)), dt, A,
            B.unflatten(-1, (self.ngroups, self.d_state)),
            C.unflatten(-1, (self.ngroups, self.d_state)), chunk_size=self.chunk_size,
            D=self._D(), z=None if self.rmsnorm else z.unflatten(-1, (self.nheads, self.headdim)),
            dt_bias=self.dt_bias, dt_softplus=True, seq_idx=seq_idx, cu_seqlens=cu_seqlens,
            return_final_states=ssm_state is not None, return_varlen_states=want_varlen,
            **self._dt_limit_kwargs(),
        )  # fmt: skip
        if ssm_state is not None:
            y, last, *varlen = res
            ssm_state.copy_(varlen[0] if cu_seqlens is not None else last)
        else:
            y = res
        y = self._finish(y.flatten(-2), z, z0, x0)
        if flat:
            y = y.reshape(batch * seqlen, -1)
        return self.out_proj(y)

    def step(self, hidden_states: Tensor, conv_state: Tensor, ssm_state: Tensor):
        """One token (batch, 1, d_model): ``(out (batch, 1, d_model), conv_state, ssm_state)``,
        the states advanced in place."""
        if hidden_states.shape[1] != 1:
            raise ValueError(f"step decodes one token at a time, got {hidden_states.shape[1]}")
        h_in = hidden_states.squeeze(1)
        if plain_linear(self.in_proj):  # the projection and the conv in one launch where it can
            channels = self.d_ssm + 2 * self.ngroups * self.d_state
            start = self.in_proj.out_features - channels - self.nheads
            zxbcdt, xbc = in_proj_conv_step(h_in, self.in_proj.weight, self.in_proj.bias,
                                            conv_state, self._conv_weight(), self.conv1d.bias,
                                            start, channels, self.activation)  # fmt: skip
            z0, x0, z, _, dt = self._split(zxbcdt)  # (xBC's columns: use xbc)
        else:
            z0, x0, z, xbc, dt = self._split(self.in_proj(h_in))
            xbc = causal_conv1d_update(xbc, conv_state, self._conv_weight(), self.conv1d.bias,
                                       self.activation)  # fmt: skip
        # in a graph: out_proj's weight read into the cache beside the scan step and the norm,
        # which leave the memory bus idle (ops.linear.prefetch_beside)
        side = (prefetch_beside(self.out_proj.weight, rows=xbc.shape[0])
                if plain_linear(self.out_proj) else None)  # fmt: skip
        x, B, C = self._xbc_split(xbc)
        h, p, n = self.nheads, self.headdim, self.d_state
        A = decay_rates(self)[:, None, None].expand(h, p, n)
        D = self.D.view(h, p) if self.D_has_hdim else self.D[:, None].expand(h, p)
        y = selective_state_update(
            ssm_state, x.view(-1, h, p), dt[:, :, None].expand(-1, h, p), A,
            B.view(-1, self.ngroups, n), C.view(-1, self.ngroups, n), D,
            z=None if self.rmsnorm else z.view(-1, h, p),
            dt_bias=self.dt_bias[:, None].expand(h, p), dt_softplus=True,
        )  # fmt: skip
        y = self._finish(y.reshape(y.shape[0], -1), z, z0, x0)
        out = step_linear(self.out_proj, y).unsqueeze(1)
        join_prefetch(side)
        return out, conv_state, ssm_state

    # ---- decode state ------------------------------------------------------------------------

    def _new_states(self, batch_size: int, conv_dtype, ssm_dtype, device):
        channels = self.conv1d.weight.shape[0]
        # the conv state is channel-last in memory: (batch, channels, d_conv) with stride 1 on
        # channels, the layout the conv update reads fastest
        conv_state = torch.zeros(batch_size, self.d_conv, channels, device=device,
                                 dtype=conv_dtype).transpose(1, 2)  # fmt: skip
        ssm_state = torch.zeros(batch_size, self.nheads, self.headdim, self.d_state,
                                device=device, dtype=ssm_dtype)  # fmt: skip
        return conv_state, ssm_state

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype=None, **kwargs):
        conv_dtype = self.conv1d.weight.dtype if dtype is None else dtype
        ssm_dtype = self.in_proj.weight.dtype if dtype is None else dtype
        return self._new_states(batch_size, conv_dtype, ssm_dtype, self.out_proj.weight.device)

    def _get_states_from_cache(self, inference_params, batch_size: int,
                               initialize_states: bool = False):  # fmt: skip
        w = self.conv1d.weight
        return layer_states(self, inference_params, initialize_states=initialize_states,
                            make=lambda: self._new_states(batch_size, w.dtype, self.in_proj.weight.dtype,
                                                          w.device))  # fmt: skip
