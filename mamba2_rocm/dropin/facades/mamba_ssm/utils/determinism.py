"""``mamba_ssm.utils.determinism`` (mamba2-rocm drop-in facade: re-exports only; upstream's
Triton autotune helpers have no counterpart: our kernels are not autotuned)."""

from mamba2_rocm.models.compat import set_deterministic_mode, use_deterministic_mode

__all__ = ["set_deterministic_mode", "use_deterministic_mode"]
