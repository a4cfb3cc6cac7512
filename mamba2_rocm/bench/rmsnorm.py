"""Gated RMSNorm benchmark: ``rmsnorm_fn`` kernel vs the vectorized torch tier (and mamba_ssm's
Triton ``layernorm_gated.rmsnorm_fn`` when ``mamba_ssm`` is importable).

Shapes: the norm of a Mamba2 block (z gate, norm_before_gate=False, weight in the activation
dtype) over 16384 tokens at every Mamba2 checkpoint's width (d_inner 1536 / 2048 / 3072 / 4096
/ 5120 for 130m / 370m / 780m / 1.3b / 2.7b, ngroups 1: one group per row) and at a grouped
hybrid's (d_inner 8192 in 8 groups of 1024, Codestral-Mamba-like), plus a decode step (64
rows, d_inner 8192, 8 groups). Reports the median per-call
device-event time (launch included), the per-call time inside a CUDA graph, and the bandwidth
over the bytes that must move (x and z read once, out written once, the weight once) as a
fraction of the measured copy bandwidth.
"""

from __future__ import annotations

from mamba2_rocm._torch import require_torch
from mamba2_rocm.bench.timing import compare, copy_bandwidth_gbs, format_rows

CASES = (
    *((16384, d, d) for d in (1536, 2048, 3072, 4096, 5120)),
    (16384, 8192, 1024),
    (64, 8192, 1024),
)  # (rows, hidden, group)


def _triton_norm():
    try:
        from mamba_ssm.ops.triton.layernorm_gated import rmsnorm_fn
    except Exception:  # not installed, or no Triton for this GPU
        return None
    return rmsnorm_fn


def run(cases=CASES, dtype="bfloat16") -> list[dict]:
    torch = require_torch()
    from mamba2_rocm import rmsnorm_fn

    dt_ = getattr(torch, dtype)
    copy = copy_bandwidth_gbs()
    triton = _triton_norm()
    out = []
    for rows, hidden, group in cases:
        g = torch.Generator(device="cuda").manual_seed(rows + hidden)
        x = torch.randn(rows, hidden, device="cuda", generator=g).to(dt_)
        z = torch.randn(rows, hidden, device="cuda", generator=g).to(dt_)
        w = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).to(dt_)
        nbytes = (3 * x.numel() + w.numel()) * x.element_size()
        kw = dict(z=z, eps=1e-5, group_size=group, norm_before_gate=False)
        case = f"rmsnorm rows{rows} d{hidden} group{group} {dtype}"
        out += compare(case, rmsnorm_fn, triton, (x, w, None), kw, nbytes, copy)
    return out


def format_table(rows: list[dict]) -> str:
    return format_rows(rows, 40, 17)
