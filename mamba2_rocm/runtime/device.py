"""The architecture of a torch device, as our code objects are named."""

from __future__ import annotations

import functools

from mamba2_rocm._torch import require_torch
from mamba2_rocm.arch import split_arch_name

__all__ = ["device_arch", "device_arch_full", "device_multiprocessors"]


@functools.cache
def device_arch_full(index: int) -> str:
    """``gcnArchName`` with its feature suffixes (``gfx90a:sramecc+:xnack-``) or ``sm_90``."""
    torch = require_torch()
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip is not None:
        return props.gcnArchName
    return f"sm_{props.major}{props.minor}"


def device_arch(index: int) -> str:
    """The ISA we select code objects by: ``gfx90a``, ``gfx1100``, ``sm_90``."""
    return split_arch_name(device_arch_full(index))[0]


@functools.cache
def device_multiprocessors(index: int) -> int:
    """Multiprocessors (SMs; CUs on ROCm) of the device: launch heuristics size grids by it."""
    return require_torch().cuda.get_device_properties(index).multi_processor_count
