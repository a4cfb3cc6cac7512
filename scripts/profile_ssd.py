"""Per-kernel device time of mamba_chunk_scan_combined at the benchmark shapes (torch.profiler).

Usage (on the GPU machine, kernels built): python scripts/profile_ssd.py
"""

import torch
from torch.profiler import ProfilerActivity, profile

from mamba2_rocm import mamba_chunk_scan_combined
from mamba2_rocm.bench.ssd import SHAPES


def profile_shape(b, L, h, p, groups, n):
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    x, dt = r(b, L, h, p).bfloat16(), (r(b, L, h) - 2).bfloat16()
    B, C = r(b, L, groups, n).bfloat16(), r(b, L, groups, n).bfloat16()
    A, D, bias = -torch.rand(h, device="cuda") - 0.05, r(h), r(h)

    def call():
        return mamba_chunk_scan_combined(x, dt, A, B, C, 256, D=D, dt_bias=bias, dt_softplus=True)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            call()
        torch.cuda.synchronize()
    print(f"--- b{b} l{L} h{h} p{p} g{groups} n{n} (10 calls)")
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=40)
    )


for shape in SHAPES:
    profile_shape(*shape)
