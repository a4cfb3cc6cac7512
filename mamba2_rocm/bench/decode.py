"""Decode-step benchmark: ``selective_state_update`` kernel vs the vectorized torch tier (and
mamba_ssm's Triton kernel when ``mamba_ssm`` is importable).

Mamba2 decode shapes (nheads 64, headdim 64, dstate 128, ngroups 8, bf16 state, tied-head
A/dt/dt_bias/D as HF transformers passes them) at batch 1/16/64. Reports the median per-call
device-event time (launch included), the per-call time inside a CUDA graph (kernel only), and
bandwidth over the bytes that must move (the state read and written once, inputs, output).
"""

from __future__ import annotations

from mamba2_rocm._torch import require_torch
from mamba2_rocm.bench.timing import compare, copy_bandwidth_gbs, format_rows


def _triton_update():
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    except Exception:  # not installed, or no Triton for this GPU
        return None
    return selective_state_update


def run(
    batches=(1, 16, 64), nheads=64, headdim=64, dstate=128, ngroups=8, dtype="bfloat16"
) -> list[dict]:
    torch = require_torch()
    from mamba2_rocm import selective_state_update

    dt_ = getattr(torch, dtype)
    copy = copy_bandwidth_gbs()
    triton = _triton_update()
    rows = []
    for b in batches:
        h, p, n = nheads, headdim, dstate
        g = torch.Generator(device="cuda").manual_seed(b)
        r = lambda *s, g=g: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
        state = r(b, h, p, n).to(dt_)
        x, z = r(b, h, p).to(dt_), r(b, h, p).to(dt_)
        dt = torch.rand(b, h, device="cuda", generator=g).to(dt_)[:, :, None].expand(b, h, p)
        A = (-torch.rand(h, device="cuda", generator=g))[:, None, None].expand(h, p, n)
        dt_bias, D = r(h)[:, None].expand(h, p), r(h)[:, None].expand(h, p)
        B, C = r(b, ngroups, n).to(dt_), r(b, ngroups, n).to(dt_)
        elt = state.element_size()
        nbytes = 2 * state.numel() * elt + (3 * x.numel() + b * h + 2 * B.numel()) * elt + 3 * h * 4

        kw = dict(D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
        case = f"decode b{b} h{h} p{p} n{n} g{ngroups} {dtype}"
        args = (state, x, dt, A, B, C)
        rows += compare(case, selective_state_update, triton, args, kw, nbytes, copy)
    return rows


def format_table(rows: list[dict]) -> str:
    return format_rows(rows, 38, 17)
