"""``MHA``: multi-head (grouped-query) self-attention for hybrid Mamba models (mamba_ssm's
``modules.mha``), on PyTorch alone: ``scaled_dot_product_attention``, rotary embeddings
computed here, a key/value cache in ``InferenceParams``. flash-attn is not needed.

Decoding reads the cache through a mask built from the per-sequence lengths
(``InferenceParams.lengths_per_sample``) when they are given, so a captured decode graph
replays for any length; otherwise through the Python offset. One deliberate difference from
upstream: with ``d_conv`` > 0 the conv state after prefill holds the conv's *inputs* (what
the update step convolves with), not its outputs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mamba2_rocm.ops.conv1d import causal_conv1d_fn, causal_conv1d_update

__all__ = ["MHA", "RotaryEmbedding", "apply_rotary"]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` channels of x (batch, seqlen, heads, dim) by the
    angles whose cos / sin (batch or 1, seqlen, rotary_dim / 2) are given; fp32 arithmetic."""
    rd = 2 * cos.shape[-1]
    rot, rest = x[..., :rd].float(), x[..., rd:]
    c, s = cos.float().unsqueeze(2), sin.float().unsqueeze(2)
    if interleaved:  # pairs (0, 1), (2, 3), ...
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)
    else:  # halves (GPT-NeoX)
        a, b = rot[..., : rd // 2], rot[..., rd // 2 :]
        out = torch.cat([a * c - b * s, a * s + b * c], dim=-1)
    return torch.cat([out.to(x.dtype), rest], dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding of the first ``dim`` channels of each head (``base``; halves
    or ``interleaved`` pairs). The angles are computed in fp32 and rounded to the activations'
    dtype, as flash-attn's module does; ``inv_freq`` is not saved with the weights."""

    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False,
                 device=None) -> None:  # fmt: skip
        super().__init__()
        if dim <= 0 or dim % 2:
            raise ValueError(f"rotary dim must be a positive even number, got {dim}")
        self.dim, self.base, self.interleaved = dim, float(base), interleaved
        inv = 1.0 / (
            self.base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
        )
        self.register_buffer("inv_freq", inv, persistent=False)

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions (batch or 1, seqlen) -> cos, sin (batch or 1, seqlen, dim / 2)."""
        angles = positions.float().unsqueeze(-1) * self.inv_freq.to(positions.device)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, q: Tensor, kv: Tensor, seqlen_offset: int | Tensor = 0,
                max_seqlen: int | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
        """q (batch, seqlen, heads, hd), kv (batch, seqlen, 2, heads_kv, hd): q and the keys
        rotated at positions ``seqlen_offset + t`` (an int, or a (batch,) tensor)."""
        steps = torch.arange(q.shape[1], device=q.device)
        if isinstance(seqlen_offset, Tensor):
            positions = seqlen_offset.to(q.device, torch.long)[:, None] + steps
        else:
            positions = (steps + int(seqlen_offset))[None]
        cos, sin = self.cos_sin(positions, q.dtype)
        q = apply_rotary(q, cos, sin, self.interleaved)
        k = apply_rotary(kv[:, :, 0], cos, sin, self.interleaved)
        return q, torch.stack([k, kv[:, :, 1]], dim=2)


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool,
            scale: float | None) -> Tensor:  # fmt: skip
    """q (b, sq, h, d), k / v (b, sk, h_kv, d) -> (b, sq, h, d); grouped keys repeated."""
    reps = q.shape[2] // k.shape[2]
    if reps > 1:
        k, v = k.repeat_interleave(reps, dim=2), v.repeat_interleave(reps, dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
        is_causal=causal and mask is None, scale=scale,
    )  # fmt: skip
    return out.transpose(1, 2)


class MHA(nn.Module):
    """mamba_ssm's ``MHA`` constructor and attributes; ``forward(x, inference_params=None)``."""

    def __init__(
        self, embed_dim: int, num_heads: int, num_heads_kv: int | None = None,
        head_dim: int | None = None, mlp_dim: int = 0, qkv_proj_bias: bool = True,
        out_proj_bias: bool = True, softmax_scale: float | None = None, causal: bool = False,
        layer_idx: int | None = None, d_conv: int = 0, rotary_emb_dim: int = 0,
        rotary_emb_base: float = 10000.0, rotary_emb_interleaved: bool = False,
        device=None, dtype=None,
    ) -> None:  # fmt: skip
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        self.embed_dim, self.layer_idx, self.d_conv = embed_dim, layer_idx, d_conv
        self.rotary_emb_dim, self.softmax_scale, self.causal = rotary_emb_dim, softmax_scale, causal
        self.num_heads = num_heads
        self.num_heads_kv = num_heads if num_heads_kv is None else num_heads_kv
        if num_heads % self.num_heads_kv:
            raise ValueError(f"num_heads={num_heads} must be a multiple of "
                             f"num_heads_kv={self.num_heads_kv}")  # fmt: skip
        if head_dim is None and embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} must be a multiple of num_heads={num_heads}")
        self.head_dim = embed_dim // num_heads if head_dim is None else head_dim
        self.mlp_dim = math.ceil(mlp_dim / 256) * 256
        qkv_dim = self.head_dim * (num_heads + 2 * self.num_heads_kv)
        out_dim = self.head_dim * num_heads
        if rotary_emb_dim > 0:
            self.rotary_emb = RotaryEmbedding(rotary_emb_dim, base=rotary_emb_base,
                                              interleaved=rotary_emb_interleaved, device=device)  # fmt: skip
        self.in_proj = nn.Linear(embed_dim, qkv_dim + self.mlp_dim, bias=qkv_proj_bias, **factory)
        if d_conv > 0:
            self.conv1d = nn.Conv1d(qkv_dim, qkv_dim, kernel_size=d_conv, padding=d_conv - 1,
                                    groups=qkv_dim, **factory)  # fmt: skip
        self.out_proj = nn.Linear(out_dim + self.mlp_dim // 2, embed_dim, bias=out_proj_bias,
                                  **factory)  # fmt: skip

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype=None, **kwargs):
        """(kv_cache (batch, max_seqlen, 2, heads_kv, head_dim), conv_state or None)."""
        dtype = self.out_proj.weight.dtype if dtype is None else dtype
        device = self.out_proj.weight.device
        conv_state = None
        if self.d_conv > 0:
            conv_state = torch.zeros(batch_size, self.conv1d.weight.shape[0], self.d_conv,
                                     device=device, dtype=dtype)  # fmt: skip
        # zeros, not empty: decoding attends over the whole cache with a mask, and a masked
        # position's value still meets its zero weight (0 * NaN from stale memory is NaN)
        kv_cache = torch.zeros(batch_size, max_seqlen, 2, self.num_heads_kv, self.head_dim,
                               dtype=dtype, device=device)  # fmt: skip
        return kv_cache, conv_state

    def _conv(self, qkv: Tensor, inference_params) -> Tensor:
        weight = self.conv1d.weight.squeeze(1)
        if inference_params is None or inference_params.seqlen_offset == 0:
            if inference_params is not None:
                _, conv_state = inference_params.key_value_memory_dict[self.layer_idx]
                xt = qkv.transpose(1, 2)
                conv_state.copy_(F.pad(xt, (self.d_conv - xt.shape[-1], 0)))
            return causal_conv1d_fn(qkv.transpose(1, 2), weight, self.conv1d.bias).transpose(1, 2)
        if qkv.shape[1] != 1:
            raise ValueError(f"decoding takes one token at a time, got {qkv.shape[1]}")
        _, conv_state = inference_params.key_value_memory_dict[self.layer_idx]
        return causal_conv1d_update(qkv.squeeze(1), conv_state, weight,
                                    self.conv1d.bias).unsqueeze(1)  # fmt: skip

    def _cached_attention(self, q: Tensor, kv: Tensor, inference_params) -> Tensor:
        """Write kv into the cache after each sequence's length, then attend over the cache."""
        if self.layer_idx is None:
            raise ValueError("MHA needs a layer_idx to keep its cache in InferenceParams")
        kv_cache, _ = inference_params.key_value_memory_dict[self.layer_idx]
        b0 = inference_params.batch_size_offset
        batch, sq = q.shape[:2]
        cache = kv_cache[b0 : b0 + batch]
        lengths = inference_params.lengths_per_sample
        if inference_params.seqlen_offset == 0 or lengths is None:
            start = inference_params.seqlen_offset
            if start + sq > cache.shape[1]:
                raise ValueError(f"the KV cache holds {cache.shape[1]} tokens, "
                                 f"{start + sq} were asked for")  # fmt: skip
            cache[:, start : start + sq] = kv
            if start == 0:
                return _attend(q, kv[:, :, 0], kv[:, :, 1], None, self.causal, self.softmax_scale)
            keys = cache[:, : start + sq]
            key_pos = torch.arange(start + sq, device=q.device)
            query_pos = start + torch.arange(sq, device=q.device)
            mask = key_pos[None, :] <= query_pos[:, None] if self.causal else None
            mask = None if mask is None else mask[None, None]
            return _attend(q, keys[:, :, 0], keys[:, :, 1], mask, False, self.softmax_scale)
        # per-sequence lengths on the device: no host value, so a graph replays for any length
        start = lengths[b0 : b0 + batch].to(torch.long)  # (batch,)
        slots = start[:, None] + torch.arange(sq, device=q.device)  # (batch, sq)
        index = slots[:, :, None, None, None].expand_as(kv)
        cache.scatter_(1, index, kv.to(cache.dtype))
        key_pos = torch.arange(cache.shape[1], device=q.device)
        last = slots if self.causal else (start + sq - 1)[:, None].expand(batch, sq)
        mask = key_pos[None, None, :] <= last[:, :, None]  # (batch, sq, max_seqlen)
        return _attend(q, cache[:, :, 0], cache[:, :, 1], mask[:, None], False, self.softmax_scale)

    def forward(self, x: Tensor, inference_params=None) -> Tensor:
        """x (batch, seqlen, embed_dim) -> the same shape."""
        if (
            inference_params is not None
            and self.layer_idx not in inference_params.key_value_memory_dict
        ):
            inference_params.key_value_memory_dict[self.layer_idx] = self.allocate_inference_cache(
                x.shape[0], inference_params.max_seqlen, dtype=x.dtype)  # fmt: skip
        qkv = self.in_proj(x)
        if self.mlp_dim > 0:
            qkv, x_mlp = qkv.split([qkv.shape[-1] - self.mlp_dim, self.mlp_dim], dim=-1)
            up, gate = x_mlp.chunk(2, dim=-1)
            x_mlp = up * F.silu(gate)
        if self.d_conv > 0:
            qkv = self._conv(qkv, inference_params)
        hd = self.head_dim
        q, kv = qkv.split([self.num_heads * hd, 2 * self.num_heads_kv * hd], dim=-1)
        q = q.unflatten(-1, (self.num_heads, hd))
        kv = kv.unflatten(-1, (2, self.num_heads_kv, hd))
        if self.rotary_emb_dim > 0:
            offset = 0
            if inference_params is not None:
                lengths = inference_params.lengths_per_sample
                offset = (
                    lengths[: x.shape[0]] if lengths is not None else inference_params.seqlen_offset
                )
            q, kv = self.rotary_emb(q, kv, seqlen_offset=offset)
        if inference_params is None:
            context = _attend(q, kv[:, :, 0], kv[:, :, 1], None, self.causal, self.softmax_scale)
        else:
            context = self._cached_attention(q, kv, inference_params)
        context = context.flatten(-2)
        if self.mlp_dim > 0:
            context = torch.cat([context, x_mlp], dim=-1)
        return self.out_proj(context)
