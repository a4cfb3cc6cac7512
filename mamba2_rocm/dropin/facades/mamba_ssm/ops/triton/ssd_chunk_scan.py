"""``mamba_ssm.ops.triton.ssd_chunk_scan`` (mamba2-rocm drop-in facade): the SSD scan's output
stage in mamba_ssm's layouts, as PyTorch (``mamba2_rocm.reference.ssd_stages``)."""

from mamba2_rocm.reference.ssd_stages import chunk_scan as _chunk_scan

__all__ = ["chunk_scan", "chunk_scan_ref"]


def chunk_scan(B, C, x, dt, dA_cumsum, prev_states, D=None, z=None):
    return _chunk_scan(B, C, x, dt, dA_cumsum, prev_states, D, z)


chunk_scan_ref = chunk_scan
