"""The language model: ``create_block``, ``MixerModel`` (embedding, blocks, final norm) and
``MambaLMHeadModel`` (plus the head, generation, and upstream's ``config.json`` +
``pytorch_model.bin`` checkpoint format) — mamba_ssm's ``models.mixer_seq_simple``, with its
module tree, so upstream checkpoints load with ``strict=True``."""

from __future__ import annotations

import copy
import json
import math
import os
from collections import namedtuple
from functools import partial

import torch
from torch import Tensor, nn

from mamba2_rocm.models._init import step_decay_rates
from mamba2_rocm.models.block import Block
from mamba2_rocm.models.config import MambaConfig
from mamba2_rocm.models.generation import GenerationMixin
from mamba2_rocm.models.hf import load_config_hf, load_state_dict_hf
from mamba2_rocm.models.mamba1 import Mamba
from mamba2_rocm.models.mamba2 import Mamba2
from mamba2_rocm.models.mha import MHA
from mamba2_rocm.models.mlp import GatedMLP
from mamba2_rocm.ops.add_norm import RMSNorm, layer_norm_fn
from mamba2_rocm.ops.linear import step_linear

__all__ = [
    "MIXERS",
    "CausalLMOutput",
    "MambaLMHeadModel",
    "MixerModel",
    "_init_weights",
    "create_block",
]  # fmt: skip

#: ``ssm_cfg["layer"]`` -> the mixer class
MIXERS = {"Mamba1": Mamba, "Mamba2": Mamba2}
#: layers upstream names that mamba2-rocm does not provide, with the reason
NOT_PROVIDED = {"Mamba3": "mamba2-rocm has no Mamba3 kernels (upstream runs it on CUDA-only "
                          "TileLang / CuTe kernels)"}  # fmt: skip

CausalLMOutput = namedtuple("CausalLMOutput", ["logits"])


def create_block(
    d_model: int, d_intermediate: int, ssm_cfg: dict | None = None,
    attn_layer_idx: list | None = None, attn_cfg: dict | None = None,
    norm_epsilon: float = 1e-5, rms_norm: bool = False, residual_in_fp32: bool = False,
    fused_add_norm: bool = False, layer_idx: int | None = None, device=None, dtype=None,
) -> Block:  # fmt: skip
    """One layer: an SSM mixer (``ssm_cfg["layer"]``, default "Mamba1") or, at the indices in
    ``attn_layer_idx``, attention (``MHA(**attn_cfg)``); a gated MLP when ``d_intermediate``."""
    factory = {"device": device, "dtype": dtype}
    if layer_idx not in (attn_layer_idx or []):
        cfg = copy.deepcopy(ssm_cfg or {})
        layer = cfg.pop("layer", "Mamba1")
        if layer in NOT_PROVIDED:
            raise NotImplementedError(f"ssm_cfg layer {layer!r}: {NOT_PROVIDED[layer]}")
        if layer not in MIXERS:
            raise ValueError(f"unknown ssm_cfg layer {layer!r}: expected one of "
                             f"{sorted(MIXERS)}")  # fmt: skip
        mixer_cls = partial(MIXERS[layer], layer_idx=layer_idx, **cfg, **factory)
    else:
        mixer_cls = partial(MHA, layer_idx=layer_idx, **(attn_cfg or {}), **factory)
    norm_cls = partial(RMSNorm if rms_norm else nn.LayerNorm, eps=norm_epsilon, **factory)
    if d_intermediate == 0:
        mlp_cls = nn.Identity
    else:
        mlp_cls = partial(GatedMLP, hidden_features=d_intermediate, out_features=d_model,
                          **factory)  # fmt: skip
    block = Block(d_model, mixer_cls, mlp_cls, norm_cls=norm_cls, fused_add_norm=fused_add_norm,
                  residual_in_fp32=residual_in_fp32)  # fmt: skip
    block.layer_idx = layer_idx
    return block


def _init_weights(module: nn.Module, n_layer: int, initializer_range: float = 0.02,
                  rescale_prenorm_residual: bool = True,
                  n_residuals_per_layer: int = 1) -> None:  # fmt: skip
    """GPT-2's initialization, as mamba_ssm applies it: Linear biases zeroed (except those
    marked ``_no_reinit``), embeddings N(0, initializer_range), and the projections that write
    into the residual stream (``out_proj`` / ``fc2``) drawn as PyTorch does and scaled down by
    sqrt(n_residuals_per_layer * n_layer)."""
    if isinstance(module, nn.Linear):
        if module.bias is not None and not getattr(module.bias, "_no_reinit", False):
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=initializer_range)
    if rescale_prenorm_residual:
        for name, p in module.named_parameters():
            if name in ("out_proj.weight", "fc2.weight"):
                nn.init.kaiming_uniform_(p, a=math.sqrt(5))
                with torch.no_grad():
                    p /= math.sqrt(n_residuals_per_layer * n_layer)


def _final_norm(norm: nn.Module, hidden: Tensor, residual: Tensor | None, fused: bool,
                residual_in_fp32: bool) -> Tensor:  # fmt: skip
    if fused:
        return layer_norm_fn(hidden, norm.weight, norm.bias, residual=residual, eps=norm.eps,
                             prenorm=False, residual_in_fp32=residual_in_fp32,
                             is_rms_norm=isinstance(norm, RMSNorm))  # fmt: skip
    stream = hidden if residual is None else hidden + residual
    return norm(stream.to(dtype=norm.weight.dtype))


class MixerModel(nn.Module):
    """Embedding, ``n_layer`` blocks and the final norm ``norm_f``."""

    def __init__(
        self, d_model: int, n_layer: int, d_intermediate: int, vocab_size: int,
        ssm_cfg: dict | None = None, attn_layer_idx: list | None = None,
        attn_cfg: dict | None = None, norm_epsilon: float = 1e-5, rms_norm: bool = False,
        initializer_cfg: dict | None = None, fused_add_norm: bool = False,
        residual_in_fp32: bool = False, device=None, dtype=None,
    ) -> None:  # fmt: skip
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        self.residual_in_fp32, self.fused_add_norm = residual_in_fp32, fused_add_norm
        self.embedding = nn.Embedding(vocab_size, d_model, **factory)
        self.layers = nn.ModuleList(
            create_block(d_model, d_intermediate=d_intermediate, ssm_cfg=ssm_cfg,
                         attn_layer_idx=attn_layer_idx, attn_cfg=attn_cfg,
                         norm_epsilon=norm_epsilon, rms_norm=rms_norm,
                         residual_in_fp32=residual_in_fp32, fused_add_norm=fused_add_norm,
                         layer_idx=i, **factory)
            for i in range(n_layer)
        )  # fmt: skip
        self.norm_f = (RMSNorm if rms_norm else nn.LayerNorm)(d_model, eps=norm_epsilon, **factory)
        self.apply(partial(_init_weights, n_layer=n_layer, **(initializer_cfg or {}),
                           n_residuals_per_layer=1 if d_intermediate == 0 else 2))  # fmt: skip

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype=None, **kwargs):
        return {i: layer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)
                for i, layer in enumerate(self.layers)}  # fmt: skip

    def forward(self, input_ids: Tensor, inference_params=None, **mixer_kwargs) -> Tensor:
        hidden, residual = self.embedding(input_ids), None
        with step_decay_rates(self.layers, inference_params):
            for layer in self.layers:
                hidden, residual = layer(hidden, residual, inference_params=inference_params,
                                         **mixer_kwargs)  # fmt: skip
        return _final_norm(self.norm_f, hidden, residual, self.fused_add_norm,
                           self.residual_in_fp32)  # fmt: skip


class MambaLMHeadModel(nn.Module, GenerationMixin):
    """``MambaLMHeadModel(config, initializer_cfg=None, device=None, dtype=None)``:
    ``backbone`` (MixerModel) and ``lm_head`` (tied to the embedding with
    ``config.tie_embeddings``); the vocabulary padded to ``pad_vocab_size_multiple``."""

    def __init__(self, config: MambaConfig, initializer_cfg: dict | None = None, device=None,
                 dtype=None) -> None:  # fmt: skip
        self.config = config
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        vocab = config.vocab_size
        pad = config.pad_vocab_size_multiple
        if vocab % pad:
            vocab += pad - vocab % pad
        self.backbone = MixerModel(
            d_model=config.d_model, n_layer=config.n_layer, d_intermediate=config.d_intermediate,
            vocab_size=vocab, ssm_cfg=config.ssm_cfg, attn_layer_idx=config.attn_layer_idx,
            attn_cfg=config.attn_cfg, rms_norm=config.rms_norm, initializer_cfg=initializer_cfg,
            fused_add_norm=config.fused_add_norm, residual_in_fp32=config.residual_in_fp32,
            **factory,
        )  # fmt: skip
        self.lm_head = nn.Linear(config.d_model, vocab, bias=False, **factory)
        self.apply(partial(_init_weights, n_layer=config.n_layer, **(initializer_cfg or {})))
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_embeddings:
            self.lm_head.weight = self.backbone.embedding.weight

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype=None, **kwargs):
        return self.backbone.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype,
                                                      **kwargs)  # fmt: skip

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None,
                inference_params=None, num_last_tokens: int = 0,
                **mixer_kwargs) -> CausalLMOutput:  # fmt: skip
        """Logits (batch, seqlen or ``num_last_tokens``, padded vocab). ``position_ids`` is
        accepted for generation code written for transformers and not used."""
        hidden = self.backbone(input_ids, inference_params=inference_params, **mixer_kwargs)
        if num_last_tokens > 0:
            hidden = hidden[:, -num_last_tokens:]
        return CausalLMOutput(logits=step_linear(self.lm_head, hidden))

    @classmethod
    def from_pretrained(cls, pretrained_model_name: str, device=None, dtype=None, **kwargs):
        """A local directory (``config.json`` + ``pytorch_model.bin``) or a Hugging Face Hub
        name; the weights are loaded strictly."""
        config = MambaConfig(**load_config_hf(pretrained_model_name))
        model = cls(config, device=device, dtype=dtype, **kwargs)
        state = load_state_dict_hf(pretrained_model_name, device=device, dtype=dtype)
        model.load_state_dict(state, strict=True)
        return model

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """``config.json`` and ``pytorch_model.bin`` in upstream's format."""
        os.makedirs(save_directory, exist_ok=True)
        torch.save(self.state_dict(), os.path.join(save_directory, "pytorch_model.bin"))
        with open(os.path.join(save_directory, "config.json"), "w") as f:
            json.dump(self.config.__dict__, f, indent=4)
