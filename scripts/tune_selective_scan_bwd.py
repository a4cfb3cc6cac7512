"""Sweep of the selective-scan backward's grid over its host knobs, per shape.

Usage (on the GPU machine, kernels built): python scripts/tune_selective_scan_bwd.py

The backward (csrc/selective_scan_bwd.hip) gives each block of its gradients' kernel a slice of
a group's channels and a range of chunks (their carries come from the carries' kernel before
it); the host (``ops.bwd_grid``) takes a range per 256 tokens, sizes the slices from
``BWD_BLOCKS_PER_SM`` (or, where the runtime tells how many blocks a multiprocessor holds,
fits them to whole waves: ``ops.wave_fit_tiles``) and caps them so that the variable dB / dC
partials (one per slice, summed by the host) stay under ``BWD_PARTIAL_FACTOR`` times u's bytes
or ``BWD_PARTIAL_MIN_BYTES``. This times forward + backward (autograd, every input's gradient,
device events around each call) and the forward alone (graph replays), so the backward is their
difference, for every combination of ``RANGES`` (tokens a chunk range; default the host's
``_BWD_RANGE``), ``BLOCKS="8 16"``, ``PARTIAL_MB="64 1024"`` and ``WAVE_FIT="1 0"`` (0: the
runtime's occupancy is not asked, the slices come from ``BLOCKS`` alone) over
``SHAPES="b,d,L,n ..."``. Builds with the
kernel's knobs run from ``MAMBA2_ROCM_KERNEL_PATH``; ``BWD_LD=512`` pads B / C rows for a build
with ``-DM2R_SSCAN_BWD_TOK=16`` (512-token chunks; with ``-DM2R_SSCAN_BWD_MIN_BLOCKS=2`` it
builds without spills on sm_90: 255 registers, 45 KB LDS; slower, see docs/design.md).
The times are device events around whole autograd calls: at the narrow widths they carry the
host's share and its jitter (a 16-token build read 671 vs 1019 µs at b1 d1536 in one run, its
kernel 581 vs 514 µs under torch.profiler in the next). So each setting also prints the
backward kernel's own device time (``kernel``: torch.profiler, the mean of 3 calls), which is
what settles a kernel change.
"""

import functools
import itertools
import os

import torch

from mamba2_rocm import selective_scan_fn
from mamba2_rocm.bench.breakdown import profile_kernels
from mamba2_rocm.bench.timing import env_items, time_calls, time_graph
from mamba2_rocm.ops import selective_scan as ops

SHAPES = ((1, 768, 2048, 16), (1, 1536, 2048, 16), (8, 2048, 2048, 16), (8, 4096, 2048, 16),
          (1, 5120, 8192, 16))  # fmt: skip
BLOCKS = (8, 16)
PARTIAL_MB = (64, 1024)
WAVE_FIT = (1, 0)


def _inputs(b: int, d: int, L: int, n: int):
    g = torch.Generator(device="cuda").manual_seed(d + L)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    u, z, dout = (r(b, d, L).bfloat16() for _ in range(3))
    delta = (torch.rand(b, d, L, device="cuda", generator=g) * 0.5).bfloat16()
    A = -torch.rand(d, n, device="cuda", generator=g) - 0.1
    B, C = r(b, n, L), r(b, n, L)
    D, db = r(d), torch.rand(d, device="cuda", generator=g) * 0.5
    return [u, delta, A, B, C, D, z, db], dout


def kernel_us(step, calls: int = 3) -> float:
    """The backward kernels' device µs a call (the carries and the gradients; torch.profiler over
    ``calls`` calls of step)."""

    def run():
        for _ in range(calls):
            step()

    return sum(t for name, t in profile_kernels(torch, run) if "selective_scan_bwd" in name) / calls


def _no_fit(grid, *args):
    """``ops.bwd_grid`` without the runtime's occupancy (its last argument)."""
    return grid(*args[:-1], None)


def main() -> None:
    os.environ.setdefault("MAMBA2_ROCM_BACKEND", "kernel")  # read on every call
    # a build with M2R_SSCAN_BWD_TOK=16 walks chunks of 512 tokens: B / C rows padded to 512
    ops._BWD_LD = int(os.environ.get("BWD_LD") or ops._BWD_LD)
    print(
        f"kernels {os.environ.get('MAMBA2_ROCM_KERNEL_PATH')} (B / C rows padded to {ops._BWD_LD})"
    )
    saved = ops.BWD_BLOCKS_PER_SM, ops.BWD_PARTIAL_MIN_BYTES, ops._BWD_RANGE
    grid = ops.bwd_grid
    for b, d, L, n in env_items("SHAPES", SHAPES, lambda s: tuple(int(v) for v in s.split(","))):
        inputs, dout = _inputs(b, d, L, n)
        fwd = time_graph(functools.partial(selective_scan_fn, *inputs, True), 5, 5).median_us
        leaves = [t.requires_grad_() for t in inputs]
        ref = None
        cells = []
        for rng, blocks, mb, fit in itertools.product(
            env_items("RANGES", (saved[2],), int),
            env_items("BLOCKS", BLOCKS, int),
            env_items("PARTIAL_MB", PARTIAL_MB, int),
            env_items("WAVE_FIT", WAVE_FIT, int),
        ):
            ops._BWD_RANGE = rng
            ops.bwd_grid = grid if fit else functools.partial(_no_fit, grid)
            ops.BWD_BLOCKS_PER_SM, ops.BWD_PARTIAL_MIN_BYTES = blocks, mb << 20

            def step(leaves=leaves, dout=dout):
                return torch.autograd.grad(selective_scan_fn(*leaves, True), leaves, dout)

            grads = step()
            if ref is None:
                ref = grads
            same = all(torch.equal(a, r) for a, r in zip(grads, ref, strict=True))
            us = time_calls(step, warmup=2, iters=10).median_us
            kernel = kernel_us(step)
            cells.append(f"r{rng}/{blocks}/{mb}MB{'' if fit else '/nofit'}={us:.0f}us"
                         f"(bwd {us - fwd:.0f}, kernel {kernel:.0f}){'' if same else '!'}")  # fmt: skip
        ops.BWD_BLOCKS_PER_SM, ops.BWD_PARTIAL_MIN_BYTES, ops._BWD_RANGE = saved
        ops.bwd_grid = grid
        print(f"b{b} d{d} l{L} n{n}: fwd {fwd:.0f}us " + " ".join(cells), flush=True)
    print("('!': gradients differ in bits from the first setting's: slices sum in another order)")


if __name__ == "__main__":
    main()
