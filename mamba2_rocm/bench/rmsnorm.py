"""Gated RMSNorm benchmark: ``rmsnorm_fn`` kernel vs the vectorized torch tier (and mamba_ssm's
Triton ``layernorm_gated.rmsnorm_fn`` when ``mamba_ssm`` is importable).

Shapes: the norm of a Mamba2 block (z gate, norm_before_gate=False, weight in the activation
dtype) over 16384 tokens at every Mamba2 checkpoint's width (d_inner 1536 / 2048 / 3072 / 4096
/ 5120 for 130m / 370m / 780m / 1.3b / 2.7b, ngroups 1: one group per row) and at a grouped
hybrid's (d_inner 8192 in 8 groups of 1024, Codestral-Mamba-like), plus a decode step (64
rows, d_inner 8192, 8 groups). Reports the median per-call
device-event time (launch included), the per-call time inside a CUDA graph, and the bandwidth
over the bytes that must move (x and z read once, out written once, the weight once) as a
fraction of the measured copy bandwidth. ``--backward``: the training step of the same norms
(forward and ``autograd.grad``), against Triton's, with the worst speed-up over it.
"""

from __future__ import annotations

from mamba2_rocm._torch import require_torch
from mamba2_rocm.bench.timing import TRITON, compare, copy_bandwidth_gbs, format_rows

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


def _inputs(torch, rows: int, hidden: int, dt_, seed: int):
    """x, z and a weight near 1 in ``dt_`` on the GPU, and the generator that made them."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, hidden, device="cuda", generator=g).to(dt_)
    z = torch.randn(rows, hidden, device="cuda", generator=g).to(dt_)
    w = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).to(dt_)
    return x, z, w, g


def _backward_rows(torch, ours, triton, copy, rows, hidden, group, dt_, dtype) -> list[dict]:
    """Training rows of one case: the block's norm forward and ``autograd.grad`` of x, z and
    the weight, our op on the kernel and torch tiers and mamba_ssm's Triton ``rmsnorm_fn``
    (whose backward reads the mean / rstd its forward saved). Bytes: x and z read and out
    written forward; x, z and dout read and dx and dz written backward (the weight's reads and
    dweight's partial sums left out)."""
    x, z, w, g = _inputs(torch, rows, hidden, dt_, rows + hidden + 1)
    x, z, w = (t.requires_grad_() for t in (x, z, w))
    dout = torch.randn(rows, hidden, device="cuda", generator=g).to(dt_)

    def step(fn):
        y = fn(x, w, None, z=z, eps=1e-5, group_size=group, norm_before_gate=False)
        return torch.autograd.grad(y, (x, w, z), dout)

    case = f"rmsnorm fwd+bwd rows{rows} d{hidden} group{group} {dtype}"
    peer = None if triton is None else lambda: step(triton)
    return compare(case, lambda: step(ours), peer, (), {}, 8 * x.numel() * x.element_size(),
                   copy, calls={"torch": dict(warmup=1, iters=5)})  # fmt: skip


def backward_summary(rows: list[dict]) -> list[str]:
    """The worst ratio of Triton's time to ours (the better of per-call and graph) over the
    training cases, or nothing when Triton was not timed (or the rows are forward ones)."""
    ours = {
        r["case"]: r["best_us"] for r in rows if r["impl"] == "kernel" and "fwd+bwd" in r["case"]
    }
    ratios = [(r["best_us"] / ours[r["case"]], r["case"]) for r in rows
              if r["impl"] == TRITON and r["case"] in ours]  # fmt: skip
    if not ratios:
        return []
    worst, case = min(ratios)
    return [f"worst speed-up over mamba_ssm's Triton norm (training step): {worst:.2f}x ({case})"]


def run(cases=CASES, dtype="bfloat16", backward=False) -> list[dict]:
    """Forward rows, or with ``backward`` the training rows (:func:`_backward_rows`) of every
    case but the decode step."""
    torch = require_torch()
    from mamba2_rocm import rmsnorm_fn

    dt_ = getattr(torch, dtype)
    copy = copy_bandwidth_gbs()
    triton = _triton_norm()
    out = []
    for rows, hidden, group in cases:
        if backward:
            if rows >= 1024:  # (a decode step has no backward)
                out += _backward_rows(torch, rmsnorm_fn, triton, copy, rows, hidden, group, dt_,
                                      dtype)  # fmt: skip
            continue
        x, z, w, _ = _inputs(torch, rows, hidden, dt_, rows + hidden)
        nbytes = (3 * x.numel() + w.numel()) * x.element_size()
        kw = dict(z=z, eps=1e-5, group_size=group, norm_before_gate=False)
        case = f"rmsnorm rows{rows} d{hidden} group{group} {dtype}"
        out += compare(case, rmsnorm_fn, triton, (x, w, None), kw, nbytes, copy)
    return out


def format_table(rows: list[dict]) -> str:
    return "\n".join([format_rows(rows, 48, 17), *backward_summary(rows)])
