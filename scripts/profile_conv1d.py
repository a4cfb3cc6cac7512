"""One call of each conv1d kernel at the benchmark shapes, for ncu: `ncu -k regex:m2r_ python ...`."""

import os

import torch

os.environ.setdefault("MAMBA2_ROCM_BACKEND", "kernel")
from mamba2_rocm import causal_conv1d_fn, causal_conv1d_update

dt = torch.bfloat16
x = torch.randn(4, 4096, 4096, device="cuda", dtype=dt)
x_cl = torch.randn(4, 4096, 4096, device="cuda", dtype=dt).transpose(1, 2)
w = torch.randn(4096, 4, device="cuda", dtype=dt)
b = torch.randn(4096, device="cuda", dtype=dt)
xs = torch.randn(64, 8192, device="cuda", dtype=dt)
st = torch.randn(64, 8192, 3, device="cuda", dtype=dt)
wd = torch.randn(8192, 4, device="cuda", dtype=dt)
for _ in range(2):
    causal_conv1d_fn(x, w, b, activation="silu")
    causal_conv1d_fn(x_cl, w, b, activation="silu")
    causal_conv1d_update(xs, st, wd, None, activation="silu")
torch.cuda.synchronize()
