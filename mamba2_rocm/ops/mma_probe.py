"""The matrix-core self-test kernel (csrc/mma_probe.hip) from Python.

One 16x16x16 step ``D = C + A B^T`` on one wave through ``mma.h`` exactly as the kernels use it.
``tests/gpu/test_mma_probe_gpu.py`` runs it on every build it meets (the NVIDIA build, each
``build --emulate`` variant, an AMD runner's GPU) with operands that name the source of every
value, so a wrong fragment or accumulator layout fails by name rather than as a tolerance miss
somewhere in the SSD.
"""

from __future__ import annotations

from dataclasses import dataclass

from mamba2_rocm._torch import require_torch
from mamba2_rocm.arch import MMA_PATHS, expected_mma_path
from mamba2_rocm.ops._launch import KERNEL_DTYPE, launch
from mamba2_rocm.runtime.loader import kernels_for_device

torch = require_torch()
_THREADS = 64  # csrc/mma_probe.hip: kThreads

__all__ = ["MMA_PATHS", "ProbeResult", "expected_mma_path", "run_mma_probe"]


@dataclass(frozen=True)
class ProbeResult:
    path: int  # the M2R_MMA the code object was compiled with
    wavefront: int
    emulated: bool  # the matrix instruction is csrc/mma_emu.h's emulation
    d: object  # (16, 16) float32 C + A B^T, or None on a build without matrix cores
    hits: object  # (16, 16) int32: accumulator registers written per cell, or None


def run_mma_probe(
    a, b, c, *, a_k_major: bool = False, b_k_major: bool = False, a_in_registers: bool = False
) -> ProbeResult:
    """``C + A B^T`` for A, B (16, 16) float16/bfloat16 (rows of K) and C (16, 16) float32 on
    their GPU's kernels. ``a_k_major`` stages A k-major in LDS (read by ``load_lane_t``), as the
    kernels do for an operand whose reduction dim is the slow one; likewise ``b_k_major``.
    ``a_in_registers``: each lane builds its A fragment from the elements ``mma::a_row`` /
    ``mma::a_k`` name (``mma::make_a``): a kernel's A operand worked out in registers."""
    if a_in_registers and a_k_major:
        raise ValueError("a_in_registers builds A without LDS: a_k_major does not apply")
    for name, t in (("a", a), ("b", b), ("c", c)):
        if not isinstance(t, torch.Tensor) or t.shape != (16, 16):
            raise ValueError(
                f"{name} must be a (16, 16) tensor, got {getattr(t, 'shape', type(t))}"
            )
        if t.device.type != "cuda":
            raise ValueError(f"{name} must be on a GPU, got {t.device}")
    if a.dtype not in (torch.float16, torch.bfloat16) or b.dtype != a.dtype:
        raise ValueError(f"a and b must both be float16 or bfloat16, got {a.dtype} and {b.dtype}")
    if c.dtype != torch.float32:
        raise ValueError(f"c must be float32, got {c.dtype}")
    if not (a.device == b.device == c.device):
        raise ValueError(
            f"a, b and c must be on one device, got {a.device}, {b.device}, {c.device}"
        )
    kset = kernels_for_device(a.device.index or 0)
    if kset is None:
        raise RuntimeError(f"no kernels serve {a.device}: the self-test needs the kernel tier")
    a, b, c = (t.contiguous() for t in (a, b, c))
    d = torch.full((16, 16), float("nan"), dtype=torch.float32, device=a.device)  # poisoned
    hits = torch.zeros((16, 16), dtype=torch.int32, device=a.device)
    info = torch.full((3,), -1, dtype=torch.int32, device=a.device)
    mode = int(a_k_major) | 2 * int(b_k_major) | 4 * int(a_in_registers)
    params = (
        a.data_ptr(),
        b.data_ptr(),
        c.data_ptr(),
        d.data_ptr(),
        hits.data_ptr(),
        info.data_ptr(),
        mode,
        0,
    )  # fmt: skip  (MmaProbeParams, field order)
    kernel = f"m2r_mma_probe_{KERNEL_DTYPE[a.dtype]}"
    launch(kset.launcher(kernel), a, params, (1, 1, 1), _THREADS)
    path, wavefront, emulated = (int(v) for v in info.tolist())
    if path == 0:
        return ProbeResult(path, wavefront, bool(emulated), None, None)
    return ProbeResult(path, wavefront, bool(emulated), d, hits)
