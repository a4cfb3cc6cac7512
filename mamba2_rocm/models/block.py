"""``Block``: one pre-norm residual layer (mamba_ssm's ``modules.block``).

The residual stream is carried beside the hidden states: a block adds its input to the stream,
normalizes the sum and runs the mixer (then, with an MLP, the same again), returning
``(hidden_states, residual)``. The add and the norm are one call of ``layer_norm_fn`` with
``fused_add_norm``, or two steps through the norm module otherwise.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mamba2_rocm.ops import linear as linear_ops
from mamba2_rocm.ops.add_norm import RMSNorm, layer_norm_fn

__all__ = ["Block"]


def add_then_norm(norm: nn.Module, hidden: Tensor, residual: Tensor | None, fused: bool,
                  residual_in_fp32: bool) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(norm(hidden + residual), hidden + residual)``; the stream in fp32 with
    ``residual_in_fp32``."""
    if fused:
        return layer_norm_fn(hidden, norm.weight, norm.bias, residual=residual, eps=norm.eps,
                             prenorm=True, residual_in_fp32=residual_in_fp32,
                             is_rms_norm=isinstance(norm, RMSNorm))  # fmt: skip
    stream = hidden if residual is None else hidden + residual
    out = norm(stream.to(dtype=norm.weight.dtype))
    return out, stream.to(torch.float32) if residual_in_fp32 else stream


class Block(nn.Module):
    """``Block(dim, mixer_cls, mlp_cls, norm_cls=nn.LayerNorm, fused_add_norm=False,
    residual_in_fp32=False)``; ``mlp_cls`` ``nn.Identity`` means no MLP (no ``norm2``)."""

    def __init__(self, dim: int, mixer_cls, mlp_cls, norm_cls=nn.LayerNorm,
                 fused_add_norm: bool = False, residual_in_fp32: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.residual_in_fp32 = residual_in_fp32
        self.fused_add_norm = fused_add_norm
        self.norm = norm_cls(dim)
        self.mixer = mixer_cls(dim)
        if mlp_cls is not nn.Identity:
            self.norm2 = norm_cls(dim)
            self.mlp = mlp_cls(dim)
        else:
            self.mlp = None
        if fused_add_norm and not isinstance(self.norm, (nn.LayerNorm, RMSNorm)):
            raise TypeError(f"fused_add_norm takes nn.LayerNorm or RMSNorm, got "
                            f"{type(self.norm).__name__}")  # fmt: skip

    def forward(self, hidden_states: Tensor, residual: Tensor | None = None,
                inference_params=None, **mixer_kwargs) -> tuple[Tensor, Tensor]:  # fmt: skip
        side = None
        if inference_params is not None and inference_params.seqlen_offset > 0:
            # a decode step in a graph: the tail of the mixer's in_proj weight read into the
            # cache beside the add + norm, which leaves the memory bus idle
            in_proj = getattr(self.mixer, "in_proj", None)
            if isinstance(in_proj, nn.Linear) and linear_ops.plain_linear(in_proj):
                w, nbytes = in_proj.weight, linear_ops.IN_PROJ_PREFETCH_BYTES
                side = linear_ops.prefetch_beside(w, w.numel() * w.element_size() - nbytes, nbytes,
                                                  rows=hidden_states.shape[0])  # fmt: skip
        hidden_states, residual = add_then_norm(self.norm, hidden_states, residual,
                                                self.fused_add_norm, self.residual_in_fp32)  # fmt: skip
        hidden_states = self.mixer(hidden_states, inference_params=inference_params,
                                   **mixer_kwargs)  # fmt: skip
        linear_ops.join_prefetch(side)
        if self.mlp is not None:
            hidden_states, residual = add_then_norm(self.norm2, hidden_states, residual,
                                                    self.fused_add_norm, self.residual_in_fp32)  # fmt: skip
            hidden_states = self.mlp(hidden_states)
        return hidden_states, residual

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype=None, **kwargs):
        return self.mixer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)
