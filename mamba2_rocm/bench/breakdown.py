"""Where a model step's device time goes, by kernel family, and the ratio that bounds a goal.

``bench generate --breakdown`` profiles one prefill and one training step of each side
(``torch.profiler``, device activity only) and adds up every kernel's device time under one of
:data:`FAMILIES`, by its name:

- ``ours``: this project's kernels (``m2r_*``);
- ``gemm``: the BLAS library's matrix products (cuBLAS / cuBLASLt / CUTLASS on NVIDIA,
  rocBLAS / hipBLASLt / Tensile on AMD) -- the projections, the LM head and their gradients;
- ``triton``: Triton kernels (mamba_ssm's scan, norms and decode step on the upstream side);
- ``torch``: everything else PyTorch launches itself (elementwise ops, reductions, copies,
  embedding, softmax and cross-entropy, optimizer-free gradient accumulation).

The bound: with ``ours`` taken to zero, our side could at best take ``total - ours`` (the GEMMs
and PyTorch's own kernels run the same library code on both sides), so no kernel of ours can
make the step faster than ``upstream total / (our total - ours)`` times upstream's. Where a
goal's ratio is above that, the goal is out of the kernels' reach, and the table says so.
Device time, not wall time: host gaps are left out, as are overlaps (sums of kernel times).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

_GEMM = (
    r"gemm|gemv|cublas|cutlass|xmma|nvjet|^sm\d+_|Cijk_|rocblas|hipblaslt|splitKreduce|dot_kernel"
)
#: (family, pattern on the kernel's name), the first match wins; anything else is "torch"
FAMILIES: tuple[tuple[str, re.Pattern], ...] = (
    ("ours", re.compile(r"^m2r_")),
    ("gemm", re.compile(_GEMM, re.IGNORECASE)),
    ("triton", re.compile(r"^triton_|_kernel$|_kernel_\d+$|^_[a-z0-9_]+$")),
)
NAMES = ("ours", "gemm", "triton", "torch")


def family(name: str) -> str:
    """The family of a kernel name (see :data:`FAMILIES`)."""
    base = name.split("(")[0].strip()
    for fam, pattern in FAMILIES:
        if pattern.search(base):
            return fam
    return "torch"


def by_family(kernels: Iterable[tuple[str, float]]) -> dict[str, float]:
    """``{family: device µs}`` over ``(kernel name, device µs)`` pairs, every family present."""
    out = dict.fromkeys(NAMES, 0.0)
    for name, us in kernels:
        out[family(name)] += us
    return out


def top_kernels(kernels: Iterable[tuple[str, float]], n: int = 10) -> list[list]:
    """The ``n`` kernels of most device time over ``(kernel name, device µs)`` pairs, as
    ``[name, launches, device µs]`` (names without a leading ``void``, cut before their argument
    list and at 72 characters): what a family's sum is made of."""
    agg: dict[str, list] = {}
    for name, us in kernels:
        bare = name.replace("(anonymous namespace)::", "")  # (PyTorch's kernels: before the name)
        base = bare.split("(")[0].strip().removeprefix("void ")[:72] or name[:72]
        entry = agg.setdefault(base, [base, 0, 0.0])
        entry[1] += 1
        entry[2] += us
    return sorted(agg.values(), key=lambda e: (-e[2], e[0]))[:n]


def format_top(side: str, top: list[list]) -> list[str]:
    """Table lines for :func:`top_kernels`' list."""
    lines = [f"    top kernels, {side}: device ms, launches"]
    lines += [f"      {us / 1e3:>8.2f} {calls:>5}  {name}" for name, calls, us in top]
    return lines


def profile_kernels(torch, fn: Callable[[], object]) -> list[tuple[str, float]]:
    """``(name, device µs)`` of every kernel one call of ``fn`` ran (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA  # (also HIP's kernels under a ROCm torch)
    return [(e.name, e.device_time) for e in prof.events() if e.device_type == cuda]


def bound(ours: dict[str, float], upstream: dict[str, float]) -> float | None:
    """Upstream's total over ours without our kernels: the best ratio our kernels can reach."""
    rest = sum(ours.values()) - ours["ours"]
    return sum(upstream.values()) / rest if rest > 0 else None


def format_rows(label: str, ours: dict[str, float], upstream: dict[str, float],
                goal: float | None = None) -> list[str]:  # fmt: skip
    """Table lines: each family's ms on both sides, the totals' ratio, the bound, the goal."""
    lines = [f"  {label}: device ms by kernel family (sums of kernel times)",
             f"    {'family':<8}{'ours':>10}{'upstream':>10}"]  # fmt: skip
    for fam in NAMES:
        lines.append(f"    {fam:<8}{ours[fam] / 1e3:>10.2f}{upstream[fam] / 1e3:>10.2f}")
    t_ours, t_up = sum(ours.values()), sum(upstream.values())
    lines.append(f"    {'total':<8}{t_ours / 1e3:>10.2f}{t_up / 1e3:>10.2f}")
    best = bound(ours, upstream)
    ratio = f"{t_up / t_ours:.2f}x" if t_ours > 0 else "-"
    line = f"    upstream / ours {ratio}; with our kernels at zero at most "
    line += f"{best:.2f}x" if best is not None else "-"
    if goal is not None and best is not None:
        line += f" (goal {goal:.1f}x: {'within' if best >= goal else 'out of'} the kernels' reach)"
    lines.append(line)
    return lines
