"""A whole model's decay rates ``-exp(A_log)`` in one launch (csrc/decay.hip), for a decode step
captured in a graph.

A captured decode step must compute the rates inside the graph: a copy kept from an earlier
step would be replayed unchanged after ``A_log`` is updated in place (the graphs outlive
``generate`` calls). Computed per layer, that is two small kernels a layer and token, each
about a microsecond of a graph's time; :func:`decay_rates_of` computes every layer's in one
launch, each a float32 view of one buffer, bit for bit ``-torch.exp(a_log.float())``.

The launch reads the parameters through a table of their addresses on the device. The table is
built on an eager call (a decode graph's warm-up: a copy to the device may not run inside a
capture) and kept while the parameters stay where they are; a call that finds no table for its
parameters inside a capture returns None, and the caller computes the rates per layer.
"""

from __future__ import annotations

from mamba2_rocm._torch import require_torch
from mamba2_rocm.ops._backend import choose
from mamba2_rocm.ops._launch import DTYPE_CODE, KERNEL_DTYPE, launch, remember

torch = require_torch()
Tensor = torch.Tensor

THREADS = 256  # csrc/decay.hip: kThreads
TABLE_CACHE_SIZE = 8
#: parameters' (address, size, dtype, device) per layer -> the device table of the launch
_TABLES: dict = {}


def _key(a_logs) -> tuple | None:
    """The table's key, or None when the kernel does not take these tensors: plain contiguous
    tensors of one kernel dtype on one device (the caller asks ``choose`` whether it is a GPU
    with kernels)."""
    first = a_logs[0] if a_logs else None
    if first is None or first.dtype not in KERNEL_DTYPE:
        return None
    key = []
    for a in a_logs:
        if (type(a) is not Tensor and type(a) is not torch.nn.Parameter) or not a.is_contiguous():
            return None
        if a.dtype != first.dtype or a.device != first.device or a.numel() == 0:
            return None
        key.append((a.data_ptr(), a.numel()))
    return (first.dtype, first.device, tuple(key))


def prepare(a_logs) -> bool:
    """Build (or find) the launch's table for these parameters; call it outside a capture.
    False when the kernel does not take them (then :func:`decay_rates_of` returns None)."""
    key = _key(list(a_logs))
    if key is None or choose(key[1])[0] != "kernel":
        return False
    if key not in _TABLES:
        rows, first = [], 0
        for ptr, n in key[2]:
            rows.append((ptr, n, first))
            first += n
        table = torch.tensor(rows, dtype=torch.int64, device=key[1])
        remember(_TABLES, key, (table, first), TABLE_CACHE_SIZE)
    return True


def decay_rates_of(a_logs) -> list[Tensor] | None:
    """``[-exp(a.float()) for a in a_logs]`` from one launch (views of one float32 buffer), or
    None where the kernel does not take the call: off the kernel tier, traced, a gradient to
    record, tensors it does not read, or no table built yet (see :func:`prepare`)."""
    a_logs = list(a_logs)
    if torch.compiler.is_compiling() or (
        torch.is_grad_enabled() and any(a.requires_grad for a in a_logs)
    ):
        return None
    key = _key(a_logs)
    found = None if key is None else _TABLES.get(key)
    if found is None:
        return None
    tier, kset = choose(key[1])
    if tier != "kernel":
        return None
    table, total = found
    out = torch.empty(total, dtype=torch.float32, device=key[1])
    params = (table.data_ptr(), out.data_ptr(), len(a_logs), DTYPE_CODE[key[0]])
    launch(kset.launcher("m2r_decay_rates"), out, params, (len(a_logs), 1, 1), THREADS)
    views, first = [], 0
    for a in a_logs:
        views.append(out[first : first + a.numel()].view(a.shape))
        first += a.numel()
    return views


def clear_tables() -> None:
    """Forget every table (tests; the cache never needs it for correctness)."""
    _TABLES.clear()
