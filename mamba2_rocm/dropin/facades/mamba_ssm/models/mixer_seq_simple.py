"""``mamba_ssm.models.mixer_seq_simple`` (mamba2-rocm drop-in facade: re-exports only)."""

from mamba2_rocm.models.lm import MambaLMHeadModel, MixerModel, _init_weights, create_block

__all__ = ["MambaLMHeadModel", "MixerModel", "_init_weights", "create_block"]
