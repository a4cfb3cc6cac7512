"""Launching a prepared kernel on torch's current stream of a tensor's device, cheaply."""

from __future__ import annotations

from mamba2_rocm._torch import require_torch

torch = require_torch()


def _current_stream(index: int) -> int:
    return torch.cuda.current_stream(index).cuda_stream


#: torch's current stream on a device as the raw handle the driver API takes (same value as
#: ``current_stream(i).cuda_stream``, without building a Stream object: ~40x cheaper).
raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", _current_stream)


def launch(launcher, x, params: tuple, grid: tuple[int, int, int], threads: int) -> None:
    """Launch on x's device and torch's current stream there; switch devices only if needed."""
    index = x.get_device()
    if torch.cuda.current_device() == index:  # the common case: no guard object, no switch
        launcher(params, grid, (threads, 1, 1), raw_stream(index))
        return
    with torch.cuda.device(index):
        launcher(params, grid, (threads, 1, 1), raw_stream(index))
