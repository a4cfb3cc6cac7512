"""Host-side cost of one op call on a GPU: wall time per call and a cProfile of the hot path."""

import cProfile
import os
import pstats
import time

import torch

os.environ.setdefault("MAMBA2_ROCM_BACKEND", "kernel")
from mamba2_rocm import causal_conv1d_fn, causal_conv1d_update

dt = torch.bfloat16
xs = torch.randn(64, 8192, device="cuda", dtype=dt)
st = torch.randn(64, 8192, 3, device="cuda", dtype=dt)
wd = torch.randn(8192, 4, device="cuda", dtype=dt)
bd = torch.randn(8192, device="cuda", dtype=dt)
x = torch.randn(1, 64, 64, device="cuda", dtype=dt)
w = torch.randn(64, 4, device="cuda", dtype=dt)


def per_call(fn, n=3000):
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


upd = lambda: causal_conv1d_update(xs, st, wd, bd, activation="silu")  # noqa: E731
fwd = lambda: causal_conv1d_fn(x, w, None, activation="silu")  # noqa: E731
print(f"host us/call: update {per_call(upd):.1f}  fwd {per_call(fwd):.1f}")
print(f"host us/call: torch.empty_like {per_call(lambda: torch.empty_like(xs)):.1f}")
print(f"host us/call: current_stream {per_call(lambda: torch.cuda.current_stream()):.1f}")
print(f"host us/call: raw stream {per_call(lambda: torch._C._cuda_getCurrentRawStream(0)):.1f}")
print(f"host us/call: current_device {per_call(lambda: torch.cuda.current_device()):.1f}")
print(f"host us/call: xs.add_(0) {per_call(lambda: xs.add_(0)):.1f}")
prof = cProfile.Profile()
prof.enable()
for _ in range(3000):
    upd()
prof.disable()
torch.cuda.synchronize()
pstats.Stats(prof).sort_stats("tottime").print_stats(14)
