"""``mamba_ssm.utils.hf`` (mamba2-rocm drop-in facade: re-exports only)."""

from mamba2_rocm.models.hf import load_config_hf, load_state_dict_hf

__all__ = ["load_config_hf", "load_state_dict_hf"]
