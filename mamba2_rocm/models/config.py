"""``MambaConfig``: the configuration ``MambaLMHeadModel`` is built from and saved as
``config.json`` — mamba_ssm's fields and defaults, so upstream configs load as they are."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["MambaConfig"]


@dataclass
class MambaConfig:
    """A Mamba language model: sizes, the mixer of each layer (``ssm_cfg["layer"]``: "Mamba1"
    or "Mamba2"; attention at ``attn_layer_idx`` with ``attn_cfg``), an optional gated MLP
    (``d_intermediate`` > 0), the norms and how the vocabulary is padded."""

    d_model: int = 2560
    d_intermediate: int = 0
    n_layer: int = 64
    vocab_size: int = 50277
    ssm_cfg: dict = field(default_factory=dict)
    attn_layer_idx: list = field(default_factory=list)
    attn_cfg: dict = field(default_factory=dict)
    rms_norm: bool = True
    residual_in_fp32: bool = True
    fused_add_norm: bool = True
    pad_vocab_size_multiple: int = 8
    tie_embeddings: bool = True
