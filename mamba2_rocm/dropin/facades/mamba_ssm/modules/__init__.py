"""``mamba_ssm.modules`` (mamba2-rocm drop-in facade)."""
