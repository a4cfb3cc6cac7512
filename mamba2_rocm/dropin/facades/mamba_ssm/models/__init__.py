"""``mamba_ssm.models`` (mamba2-rocm drop-in facade)."""
