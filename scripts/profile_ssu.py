"""selective_state_update on the NVIDIA machine: one call at the decode benchmark's batch-64
shape (for ncu), or ``--sweep``: both contiguous-layout kernels (``_rows``, one headdim row per
thread; ``_contig``, SSU_ROWS_PER_WIDE rows per thread) forced at every point of ``bench
decode``'s grid, graph-timed, each checked against the float32 torch tier on the same inputs
(state and output relative error). Run it once per kernel build (``MAMBA2_ROCM_KERNEL_PATH``);
``--rows-per-wide R`` tells the host the build's ``M2R_SSU_ROWS_PER_WIDE`` (the grid depends on
it). ``--json`` writes one row per case and kernel."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

os.environ.setdefault("MAMBA2_ROCM_BACKEND", "kernel")
from mamba2_rocm import selective_state_update
from mamba2_rocm.bench.decode import GRID, decode_inputs


def _force(ops, kernel: str) -> None:
    """Make the op take one kernel whatever the batch (this tree's threshold names, or an older
    tree's, so the sweep also times the build it replaced); "rows" is _rows_std where the inputs
    are a Mamba2 block's (bench decode's are)."""
    names = ("WIDE_KERNEL_MIN_BLOCKS", "STD_WIDE_KERNEL_MIN_BLOCKS", "HEAD_KERNEL_MIN_BLOCKS")
    for name in (n for n in names if hasattr(ops, n)):
        setattr(ops, name, 0 if kernel == "contig" else 1 << 40)
    ops.clear_plan_cache()


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def sweep(label: str, rows_per_wide: int | None) -> list[dict]:
    import mamba2_rocm.ops.state_update as ops
    from mamba2_rocm.bench.timing import time_graph
    from mamba2_rocm.reference.ssd import selective_state_update_ref

    if rows_per_wide is not None:
        ops.SSU_ROWS_PER_WIDE = rows_per_wide
    rows = []
    for case, batches, h, p, n, g in GRID:
        for b in batches:
            for kernel in ("rows", "contig"):
                _force(ops, kernel)
                kw = decode_inputs(b, h, p, n, g, torch.bfloat16, seed=b)  # bench decode's inputs
                ref_state = kw["state"].float()
                ref = selective_state_update_ref(**{**kw, "state": ref_state}, dt_softplus=True,
                                                 compute_dtype=torch.float32)  # fmt: skip
                out = selective_state_update(**kw, dt_softplus=True)
                err = max(_rel(out, ref), _rel(kw["state"], ref_state))
                t = time_graph(lambda kw=kw: selective_state_update(**kw, dt_softplus=True))
                rows.append({"build": label, "case": f"{case} b{b} h{h} g{g}", "kernel": kernel,
                             "graph_us": t.median_us, "rel_err": err})  # fmt: skip
                print(f"{label:8s} {rows[-1]['case']:28s} {kernel:6s} {t.median_us:8.2f} us  err {err:.1e}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sweep", action="store_true", help="time both contiguous kernels over the grid")
    ap.add_argument("--label", default="build", help="the build's name in the sweep's rows")
    ap.add_argument("--rows-per-wide", type=int, default=None, help="the build's M2R_SSU_ROWS_PER_WIDE")
    ap.add_argument("--json", default=None, help="append the sweep's rows to this file (JSON lines)")
    args = ap.parse_args(argv)
    if not args.sweep:  # one call at the batch-64 shape, for ncu
        kw = decode_inputs(64, 64, 64, 128, 8, torch.bfloat16, seed=64)
        for _ in range(3):
            selective_state_update(**kw, dt_softplus=True)
        torch.cuda.synchronize()
        return 0
    rows = sweep(args.label, args.rows_per_wide)
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
