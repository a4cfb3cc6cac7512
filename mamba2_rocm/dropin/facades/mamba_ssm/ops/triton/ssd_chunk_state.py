"""``mamba_ssm.ops.triton.ssd_chunk_state`` (mamba2-rocm drop-in facade): the SSD scan's cumsum
and chunk-state stages in mamba_ssm's layouts, as PyTorch (``mamba2_rocm.reference.ssd_stages``;
the whole scan, ``mamba_chunk_scan_combined``, runs on the kernels)."""

from mamba2_rocm.reference.ssd_stages import chunk_cumsum as _chunk_cumsum_fwd
from mamba2_rocm.reference.ssd_stages import chunk_state as _chunk_state
from mamba2_rocm.reference.ssd_stages import chunk_state_varlen

__all__ = ["_chunk_cumsum_fwd", "_chunk_state_fwd", "chunk_state", "chunk_state_ref",
           "chunk_state_varlen"]  # fmt: skip


def _chunk_state_fwd(B, x, dt, dA_cumsum, seq_idx=None, states=None, states_in_fp32=True):
    out = _chunk_state(B, x, dt, dA_cumsum, seq_idx, states_in_fp32)
    if states is not None:  # mamba_ssm's preallocated output
        states.copy_(out)
        return states
    return out


def chunk_state(B, x, dt, dA_cumsum, states_in_fp32=True):
    return _chunk_state(B, x, dt, dA_cumsum, None, states_in_fp32)


def chunk_state_ref(B, x, dt, dA_cumsum):
    return _chunk_state(B, x, dt, dA_cumsum).to(x.dtype)
