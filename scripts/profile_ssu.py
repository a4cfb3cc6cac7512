"""One selective_state_update call at the decode benchmark's batch-64 shape, for ncu."""

import os

import torch

os.environ.setdefault("MAMBA2_ROCM_BACKEND", "kernel")
from mamba2_rocm import selective_state_update

b, h, p, n, g = 64, 64, 64, 128, 8
dt_ = torch.bfloat16
state = torch.randn(b, h, p, n, device="cuda", dtype=dt_)
x = torch.randn(b, h, p, device="cuda", dtype=dt_)
z = torch.randn(b, h, p, device="cuda", dtype=dt_)
dt = torch.rand(b, h, device="cuda", dtype=dt_)[:, :, None].expand(b, h, p)
A = (-torch.rand(h, device="cuda"))[:, None, None].expand(h, p, n)
dt_bias = torch.randn(h, device="cuda")[:, None].expand(h, p)
D = torch.randn(h, device="cuda")[:, None].expand(h, p)
B = torch.randn(b, g, n, device="cuda", dtype=dt_)
C = torch.randn(b, g, n, device="cuda", dtype=dt_)
for _ in range(3):
    selective_state_update(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
torch.cuda.synchronize()
