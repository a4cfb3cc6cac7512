"""``mamba_ssm.ops.triton.ssd_state_passing`` (mamba2-rocm drop-in facade): the SSD scan's
state-passing stage in mamba_ssm's layouts, as PyTorch (``mamba2_rocm.reference.ssd_stages``)."""

from mamba2_rocm.reference.ssd_stages import state_passing as _state_passing_fwd

__all__ = ["_state_passing_fwd", "state_passing", "state_passing_ref"]


def state_passing(states, dA_chunk_cumsum, initial_states=None):
    return _state_passing_fwd(states, dA_chunk_cumsum, initial_states)


state_passing_ref = state_passing
