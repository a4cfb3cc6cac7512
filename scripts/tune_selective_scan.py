"""Sweep of the selective scan's channel form over segment counts, graph-timed, per shape.

Usage (on the GPU machine, kernels built): python scripts/tune_selective_scan.py
To measure the build-time knobs of csrc/selective_scan.hip, build with them, e.g.
``build(['native'], DIR, sources=['selective_scan'], extra_flags=['-DM2R_SSCAN_PER=8'])``,
and run with ``MAMBA2_ROCM_KERNEL_PATH=DIR PER=8`` (the host's lanes per channel must follow
M2R_SSCAN_PER; ``CH_THREADS`` follows M2R_SSCAN_CH_THREADS). The defaults of ``CH_FULL_PER_SM`` / ``CH_SEG_PER_SM`` and the knobs came from
this sweep (H100; numbers in mamba2_rocm/ops/selective_scan.py and the commit messages).
"""

import functools
import os

import torch

from mamba2_rocm import selective_scan_fn
from mamba2_rocm.bench.timing import copy_bandwidth_gbs, env_items, time_graph
from mamba2_rocm.ops import selective_scan as ops

SHAPES = ((8, 4096, 2048, 16), (1, 5120, 8192, 16), (1, 1536, 2048, 16), (4, 2048, 2048, 16),
          (1, 4096, 16384, 16))  # fmt: skip
SEGMENTS = (None, 1, 8, 12, 16, 24)  # None: the heuristic


def main() -> None:
    os.environ.setdefault("MAMBA2_ROCM_BACKEND", "kernel")  # read on every call
    ops._CH_PER = int(os.environ.get("PER", "16"))
    ops._CH_THREADS = int(os.environ.get("CH_THREADS", "64"))  # M2R_SSCAN_CH_THREADS
    ops.kernel_form = "channels"
    # SPLIT=1 / 2 / 4 forces the whole-lane / _ch2 / _ch4 kernels (the state of a channel over
    # 1 / 2 / 4 times the lanes); unset: the rule (ops.channel_lane_split)
    ops.channel_split = int(os.environ["SPLIT"]) if os.environ.get("SPLIT") else None
    copy = copy_bandwidth_gbs()
    print(f"copy {copy:.0f} GB/s  kernels {os.environ.get('MAMBA2_ROCM_KERNEL_PATH')}")
    for b, d, L, n in env_items("SHAPES", SHAPES, lambda s: tuple(int(v) for v in s.split(","))):
        g = torch.Generator(device="cuda").manual_seed(d + L)
        r = lambda *s, g=g: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
        u, z = r(b, d, L).bfloat16(), r(b, d, L).bfloat16()
        delta = (torch.rand(b, d, L, device="cuda", generator=g) * 0.5).bfloat16()
        A = -torch.rand(d, n, device="cuda", generator=g) - 0.1
        B, C = r(b, n, L), r(b, n, L)
        D, db = r(d), torch.rand(d, device="cuda", generator=g) * 0.5
        nbytes = 4 * u.numel() * 2 + (B.numel() + C.numel()) * 4
        call = functools.partial(selective_scan_fn, u, delta, A, B, C, D, z, db, True)
        cells = []
        for segs in env_items("SEGMENTS", SEGMENTS, lambda s: None if s == "auto" else int(s)):
            ops.channel_segments = segs
            t = time_graph(call, replays=5, per_graph=5)
            us = t.median_us
            cells.append(f"seg{segs or 'auto'}={us:.0f}us({nbytes / us / 1e3 / copy * 100:.0f}%)")
        ops.channel_segments = None
        print(f"b{b} d{d} l{L} n{n}: " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
