"""``mamba_ssm.ops.triton.ssd_combined`` (mamba2-rocm drop-in facade): the combined ops on the
kernels; mamba_ssm's references beside them from ``mamba2_rocm.reference``."""

import math

from mamba2_rocm.ops.mamba2 import mamba_split_conv1d_scan_combined
from mamba2_rocm.ops.ssd import mamba_chunk_scan_combined
from mamba2_rocm.reference.ssd_stages import split_conv1d_scan_ref as mamba_split_conv1d_scan_ref

__all__ = ["mamba_chunk_scan", "mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined",
           "mamba_split_conv1d_scan_ref", "ssd_chunk_scan_combined_ref", "ssd_selective_scan"]  # fmt: skip


def mamba_chunk_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False):
    """mamba_ssm's stage-by-stage scan: the same result as the combined one (kernels)."""
    return mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
                                     dt_softplus=dt_softplus)  # fmt: skip


def ssd_chunk_scan_combined_ref(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                                dt_softplus=False):  # fmt: skip
    """The chunked scan in PyTorch (float32)."""
    from mamba2_rocm.reference.ssd import ssd_chunked

    return ssd_chunked(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
                       dt_softplus=dt_softplus)  # fmt: skip


def ssd_selective_scan(x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                       dt_limit=(0.0, math.inf)):  # fmt: skip
    """The scan as the plain recurrence (float32), per-head dt and A."""
    from mamba2_rocm.reference.ssd import ssd_sequential

    if dt.dim() != 3 or A.dim() != 1:
        raise ValueError("ssd_selective_scan takes per-head dt (batch, seqlen, nheads) and A "
                         f"(nheads,) here, got dt {tuple(dt.shape)} and A {tuple(A.shape)}")  # fmt: skip
    import torch

    return ssd_sequential(x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                          dt_limit=dt_limit, compute_dtype=torch.float32)  # fmt: skip
