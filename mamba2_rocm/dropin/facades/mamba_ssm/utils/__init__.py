"""``mamba_ssm.utils`` (mamba2-rocm drop-in facade)."""
