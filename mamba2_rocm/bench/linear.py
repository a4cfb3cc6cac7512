"""The linear layers of a decode step (``ops.linear.decode_linear``, the kernel the models'
``step`` calls for one or two rows) against ``torch.nn.functional.linear`` (the BLAS library:
cuBLAS / hipBLASLt) at the projections of the Mamba2 checkpoints.

A decode step reads every layer's weights once, from memory, never from the cache: so each
case cycles through copies of its weight that together exceed the GPU's L2 cache several times
(a weight timed alone would be cache-resident at 130m sizes and the timing would measure the
cache). Bytes that must move: the weight, x and y. Each row reports the fraction of the
measured copy bandwidth.
"""

from __future__ import annotations

import itertools

from mamba2_rocm._torch import require_torch
from mamba2_rocm.bench.timing import (
    backend,
    bandwidth_row,
    copy_bandwidth_gbs,
    format_rows,
    time_calls,
    time_graph,
)

#: (label, in_features, out_features): in_proj (d_model -> 2 d_inner + 2 ngroups d_state +
#: nheads) and out_proj (d_inner -> d_model) of mamba2-130m / 1.3b / 2.7b, and 1.3b's LM head
LAYERS = (
    ("mamba2-130m in_proj", 768, 3352), ("mamba2-130m out_proj", 1536, 768),
    ("mamba2-1.3b in_proj", 2048, 8512), ("mamba2-1.3b out_proj", 4096, 2048),
    ("mamba2-2.7b in_proj", 2560, 10576), ("mamba2-2.7b out_proj", 5120, 2560),
    ("mamba2-1.3b lm_head", 2048, 50288),
)  # fmt: skip
BLAS = "torch.nn.functional.linear (BLAS)"
#: the weights a case cycles through fill at least this many bytes (and 4x the L2 cache)
MIN_ROTATION_BYTES = 256 << 20


def rotation(weight_bytes: int, l2_bytes: int) -> int:
    """Copies of a weight that together exceed the L2 cache four times and
    :data:`MIN_ROTATION_BYTES`."""
    need = max(4 * l2_bytes, MIN_ROTATION_BYTES)
    return max(2, -(-need // weight_bytes))


def run(dtype: str = "bfloat16", layers=LAYERS, rows=None) -> list[dict]:
    torch = require_torch()
    from mamba2_rocm.ops.linear import MAX_ROWS, decode_linear

    dt_ = getattr(torch, dtype)
    copy = copy_bandwidth_gbs()
    l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0)
    out = []
    for m in rows or range(1, MAX_ROWS + 1):
        for label, k, n in layers:
            g = torch.Generator(device="cuda").manual_seed(m * 7 + k + n)
            x = torch.randn(m, k, device="cuda", generator=g).to(dt_)
            wbytes = n * k * x.element_size()
            copies = rotation(wbytes, l2)
            ws = [(torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(dt_)
                  for _ in range(copies)]  # fmt: skip
            nbytes = wbytes + (m * k + m * n) * x.element_size()
            case = f"{label} rows{m} {dtype}"
            for impl, fn in (("kernel", decode_linear), (BLAS, torch.nn.functional.linear)):
                cycle = itertools.cycle(ws)

                def call(fn=fn, cycle=cycle, x=x):
                    return fn(x, next(cycle))

                # (the kernel tier required: without kernels for this GPU decode_linear would be
                # F.linear, and its row would time the BLAS library under our name)
                with torch.no_grad(), backend("kernel"):
                    t = time_calls(call, warmup=copies, iters=max(100, copies))
                    gr = time_graph(call, replays=10, per_graph=copies * max(1, 20 // copies))
                out.append(bandwidth_row(case, impl, t, gr, nbytes, copy, weight_copies=copies))
            del ws
    return out


def ratios(rows: list[dict]) -> list[tuple[str, float]]:
    """``(case, BLAS time / ours)`` for each case with both rows (above 1: ours is faster)."""
    by: dict[str, dict] = {}
    for r in rows:
        by.setdefault(r["case"], {})[r["impl"]] = r["best_us"]
    return [(c, t[BLAS] / t["kernel"]) for c, t in by.items() if "kernel" in t and BLAS in t]


def format_table(rows: list[dict]) -> str:
    lines = [format_rows(rows, 34, 34, extra=(("copies", "weight_copies", "d"),))]
    got = ratios(rows)
    lines += [f"{case}: BLAS / ours {r:.2f}x" for case, r in got]
    if got:
        case, worst = min(got, key=lambda cr: cr[1])
        lines.append(f"worst: {worst:.2f}x ({case})")
    return "\n".join(lines)
