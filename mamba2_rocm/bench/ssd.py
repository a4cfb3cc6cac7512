"""SSD chunked-scan benchmark: ``mamba_chunk_scan_combined`` kernels vs the vectorized torch tier
(and mamba_ssm's Triton kernels when ``mamba_ssm`` is importable).

Shapes (the issue's): (b 2, l 4096, h 32, p 64, g 1, n 128) and (b 1, l 16384, h 64, p 64,
g 8, n 128), chunk 256, D per head, dt_bias with softplus, no z: the call a Mamba2 layer makes.
Reports the median per-call device-event time (launch included), the per-call time inside a
CUDA graph, the bytes that must move at least (inputs read once, out and the final states
written once) with the fraction of the measured copy bandwidth, and the arithmetic rate over
the scan's essential FLOPs (state in and out, 4 l h p n per row, plus the causal C·Bᵀ·x
block, l chunk h p per row).
"""

from __future__ import annotations

from mamba2_rocm._torch import require_torch
from mamba2_rocm.bench.timing import compare, copy_bandwidth_gbs, format_rows

SHAPES = ((2, 4096, 32, 64, 1, 128), (1, 16384, 64, 64, 8, 128))


def _triton_scan():
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception:  # not installed, or no Triton for this GPU
        return None
    return mamba_chunk_scan_combined


def run(shapes=SHAPES, chunk_size=256, dtype="bfloat16") -> list[dict]:
    torch = require_torch()
    from mamba2_rocm import mamba_chunk_scan_combined

    dt_ = getattr(torch, dtype)
    copy = copy_bandwidth_gbs()
    triton = _triton_scan()
    rows = []
    for b, L, h, p, groups, n in shapes:
        g = torch.Generator(device="cuda").manual_seed(L + h)
        r = lambda *s, g=g: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
        x, dt = r(b, L, h, p).to(dt_), (r(b, L, h) - 2).to(dt_)
        B, C = r(b, L, groups, n).to(dt_), r(b, L, groups, n).to(dt_)
        A, D, dt_bias = -torch.rand(h, device="cuda", generator=g) - 0.05, r(h), r(h) * 0.5
        elt = x.element_size()
        nbytes = (2 * x.numel() + dt.numel() + B.numel() + C.numel()) * elt + b * h * p * n * 4
        flops = 4 * b * L * h * p * n + b * L * chunk_size * h * p
        kw = dict(D=D, dt_bias=dt_bias, dt_softplus=True, return_final_states=True)
        case = f"ssd b{b} l{L} h{h} p{p} g{groups} n{n} c{chunk_size} {dtype}"
        for row in compare(
            case, mamba_chunk_scan_combined, triton, (x, dt, A, B, C, chunk_size), kw, nbytes, copy,
            calls={"kernel": dict(warmup=3, iters=50), "torch": dict(warmup=3, iters=20),
                   "mamba_ssm triton": dict(warmup=3, iters=50)},
            graphs={"kernel": dict(replays=5, per_graph=5)},
        ):  # fmt: skip
            row["tflops"] = flops / (row["best_us"] * 1e-6) / 1e12
            rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    return format_rows(rows, 42, 17, extra=[("TFLOP/s", "tflops", ".1f")])
