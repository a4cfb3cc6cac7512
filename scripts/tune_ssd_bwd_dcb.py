"""Sweep of the SSD backward's dcb head parts (``mamba2_rocm.ops.ssd.DCB_PARTS``), graph-timed.

Usage (on the GPU machine, kernels built): python scripts/tune_ssd_bwd_dcb.py

The dcb stage (csrc/ssd_bwd_dcb.hip) gives a block one (chunk, group, tile pair) and walks the
group's heads; the host may split them into parts, each a group of its own for the kernel,
and sum the parts' gradients (mamba2_rocm.ops.ssd: DCB_PARTS, dcb_parts). This
times the whole backward (``mamba_chunk_scan_combined_bwd``, the op the scan's autograd formula
calls; bf16, z, D, dt_bias) for each part count of ``PARTS="1 auto 2 4 8"`` ("auto":
:func:`~mamba2_rocm.ops.ssd.dcb_parts`' choice) over ``SHAPES="b,L,h,p,g,n,cs ..."``, and each
setting's largest gradient difference from the one-part run's (the parts sum in another
order: rounding only). The first shape is the 1.3b training step's layer (bench generate).
"""

import functools
import math
import os

import torch

from mamba2_rocm.bench.timing import env_items, time_graph
from mamba2_rocm.ops import ssd as ssd_ops

SHAPES = ((4, 2048, 64, 64, 1, 128, 256), (2, 4096, 32, 64, 1, 128, 256),
          (1, 16384, 64, 64, 8, 128, 256), (8, 512, 24, 64, 1, 128, 256))  # fmt: skip
PARTS = (1, None, 2, 4, 8)  # None: the rule


def _inputs(b: int, L: int, h: int, p: int, g: int, n: int):
    gen = torch.Generator(device="cuda").manual_seed(L + h)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    bf = torch.bfloat16
    return (r(b, L, h, p).to(bf), (r(b, L, h) * 0.5).to(bf),
            -torch.rand(h, device="cuda", generator=gen) - 0.1, r(b, L, g, n).to(bf),
            r(b, L, g, n).to(bf), r(h), r(b, L, h, p).to(bf), r(h) * 0.3, r(b, L, h, p).to(bf))  # fmt: skip


def main() -> None:
    os.environ.setdefault("MAMBA2_ROCM_BACKEND", "kernel")
    print(f"kernels {os.environ.get('MAMBA2_ROCM_KERNEL_PATH')}")
    saved, rule = ssd_ops.DCB_PARTS, ssd_ops.dcb_parts
    shape = lambda s: tuple(int(v) for v in s.split(","))  # noqa: E731
    for b, L, h, p, g, n, cs in env_items("SHAPES", SHAPES, shape):
        x, dt, A, B, C, D, z, bias, dout = _inputs(b, L, h, p, g, n)
        call = functools.partial(
            ssd_ops.mamba_chunk_scan_combined_bwd, x, dt, A, B, C, cs, D, z, bias, None, None,
            True, [0.0, math.inf], dout, None,
        )  # fmt: skip
        ref, cells = None, []
        for parts in env_items("PARTS", PARTS, lambda s: None if s == "auto" else int(s)):
            ssd_ops.DCB_PARTS = parts
            chosen = []  # the part count the backward ran with (the rule's, for "auto")
            ssd_ops.dcb_parts = lambda *a, chosen=chosen: chosen.append(rule(*a)) or chosen[-1]
            grads = call()
            ref = grads if ref is None else ref
            diff = max((a.float() - r.float()).abs().max().item()
                       for a, r in zip(grads, ref, strict=True) if a.numel())  # fmt: skip
            us = time_graph(call, replays=5, per_graph=5).median_us
            label = parts if parts is not None else f"auto({chosen[0]})"
            cells.append(f"{label}={us:.0f}us(diff {diff:.2g})")
        ssd_ops.DCB_PARTS, ssd_ops.dcb_parts = saved, rule
        print(f"b{b} l{L} h{h} p{p} g{g} n{n} cs{cs}: " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
