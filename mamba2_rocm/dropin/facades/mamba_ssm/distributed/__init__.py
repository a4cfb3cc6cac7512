"""``mamba_ssm.distributed`` (mamba2-rocm drop-in facade)."""
