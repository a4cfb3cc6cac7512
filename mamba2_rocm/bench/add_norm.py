"""The fused residual add + RMSNorm of a pre-norm block (``ops.add_norm.rms_norm_fn`` with
``prenorm=True, residual_in_fp32=True``, as every mamba_ssm block calls it): kernel vs the
torch tier, and mamba_ssm's Triton ``ops.triton.layer_norm.rms_norm_fn`` when the real
mamba_ssm is importable (never our drop-in's facade of it).

Shapes: 16384 tokens at the widths of Mamba / Mamba2 checkpoints (d_model 768 for 130m, 1024
for 370m, 1536 for 780m, 2048 for 1.3b, 2560 for 2.7b, and 4096), and for the forward also a
decode step's 1 and 16 rows (latency, not bandwidth, bounds these), bf16 activations, the fp32
residual stream, an fp32 weight. Bytes that must move: forward, x (2 B) and the residual (4 B)
read, y (2 B) and the stream (4 B) written; ``--backward`` (the training step: forward and
``autograd.grad`` of x, the residual and the weight), the forward's and then the stream, dy and
the stream's gradient read, dx and the residual's gradient written (the weight's reads and
dweight's partial sums left out). Each row reports the fraction of the measured copy bandwidth.
"""

from __future__ import annotations

from mamba2_rocm._torch import require_torch
from mamba2_rocm.bench.timing import compare, copy_bandwidth_gbs, format_rows

CASES = tuple((16384, d) for d in (768, 1024, 1536, 2048, 2560, 4096))  # (rows, d_model)
#: the forward at a decode step's rows (batch 1 and 16; latency-bound, graph time is the figure)
DECODE_CASES = ((1, 768), (1, 2048), (1, 2560), (1, 4096), (16, 2048))


def _triton_norm():
    """mamba_ssm's Triton ``rms_norm_fn``, or None (absent, no Triton, or our own facade)."""
    try:
        from mamba_ssm.ops.triton.layer_norm import rms_norm_fn
    except Exception:
        return None
    return None if rms_norm_fn.__module__.startswith("mamba2_rocm") else rms_norm_fn


def run(cases=None, dtype="bfloat16", backward=False) -> list[dict]:
    torch = require_torch()
    if cases is None:
        cases = CASES if backward else CASES + DECODE_CASES
    from mamba2_rocm.ops.add_norm import rms_norm_fn

    dt_ = getattr(torch, dtype)
    copy = copy_bandwidth_gbs()
    triton = _triton_norm()
    out = []
    for rows, d in cases:
        g = torch.Generator(device="cuda").manual_seed(rows + d)
        x = torch.randn(rows, d, device="cuda", generator=g).to(dt_)
        res = torch.randn(rows, d, device="cuda", generator=g)
        w = 1 + 0.1 * torch.randn(d, device="cuda", generator=g)
        elems = rows * d
        fwd_bytes = elems * (2 * x.element_size() + 8)
        if not backward:
            kw = dict(residual=res, eps=1e-5, prenorm=True, residual_in_fp32=True)
            case = f"add+rmsnorm rows{rows} d{d} {dtype}"
            out += compare(case, rms_norm_fn, triton, (x, w, None), kw, fwd_bytes, copy)
            continue
        x, res, w = (t.requires_grad_() for t in (x, res, w))
        dy = torch.randn(rows, d, device="cuda", generator=g).to(dt_)
        ds = torch.randn(rows, d, device="cuda", generator=g)

        def step(fn, x=x, res=res, w=w, dy=dy, ds=ds):
            y, s = fn(x, w, None, residual=res, eps=1e-5, prenorm=True, residual_in_fp32=True)
            return torch.autograd.grad((y, s), (x, res, w), (dy, ds))

        bwd_bytes = elems * (2 * x.element_size() + 12)
        case = f"add+rmsnorm fwd+bwd rows{rows} d{d} {dtype}"
        peer = None if triton is None else (lambda s=step: s(triton))
        out += compare(case, lambda s=step: s(rms_norm_fn), peer, (), {}, fwd_bytes + bwd_bytes,
                       copy, calls={"torch": dict(warmup=1, iters=5)})  # fmt: skip
    return out


def format_table(rows: list[dict]) -> str:
    return format_rows(rows, 44, 17)
