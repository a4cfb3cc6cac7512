"""Per-kernel device time of mamba_chunk_scan_combined at the benchmark shapes (torch.profiler).

Usage (on the GPU machine, kernels built): python scripts/profile_ssd.py [--once SHAPE]
``--once 1`` makes one warm-up and one timed call at shape 1 (index into the benchmark's issue
shapes, ISSUE_SHAPES, from 0), no
profiler: the target for ncu (scripts/device_profile.sh).
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from mamba2_rocm import mamba_chunk_scan_combined
from mamba2_rocm.bench.ssd import ISSUE_SHAPES as SHAPES


def make_call(b, L, h, p, groups, n, cs=256):
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    x, dt = r(b, L, h, p).bfloat16(), (r(b, L, h) - 2).bfloat16()
    B, C = r(b, L, groups, n).bfloat16(), r(b, L, groups, n).bfloat16()
    A, D, bias = -torch.rand(h, device="cuda") - 0.05, r(h), r(h)

    def call():
        return mamba_chunk_scan_combined(x, dt, A, B, C, cs, D=D, dt_bias=bias, dt_softplus=True)

    return call


def profile_shape(shape):
    call = make_call(*shape)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            call()
        torch.cuda.synchronize()
    print("--- b{} l{} h{} p{} g{} n{} c{} (10 calls)".format(*shape))
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=40)
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--once", type=int, default=None, help="one call at SHAPES[ONCE], for ncu")
    args = ap.parse_args()
    if args.once is not None:
        call = make_call(*SHAPES[args.once])
        call()
        call()
        torch.cuda.synchronize()
    else:
        for shape in SHAPES:
            profile_shape(shape)
