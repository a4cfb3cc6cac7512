"""Host cost of a selective-scan training step on the kernel tier, measured on the CPU.

Usage: python scripts/host_selective_scan.py [b,d,L,n ...]
       python scripts/host_selective_scan.py --block [b,L,d_model ...]

At mamba-130m width (b1 d1536 l2048 n16) an eager forward + backward on the H100 machine took
924 µs of host time against ~480 µs of kernels (docs/design.md): the step waits for the host.
What the host does there is Python and torch calls, which this script runs on the CPU with the
kernel tier's launches stood in for (``choose`` answers "kernel"; every ``launch`` is only
counted, by ``mamba2_rocm.bench.host.launches_disabled``), so the host path is exactly the
GPU's, minus the driver calls. Per shape it prints the forward alone (no autograd), the forward
with autograd and its backward, in µs of this machine's wall time (the fastest of 9 runs of 200
steps, one torch thread: this machine is a shared VM whose neighbours slow some runs), and what
one step launches: our kernels, and the torch ops that launch a kernel of their own on a GPU
(copies, fills, reductions; views and allocations launch nothing). B / C are variable bf16
(batch, dstate, L), as mamba_ssm's ``Mamba`` passes them; D and delta_bias float32, z given.

``--block``: a whole Mamba1 block (``mamba2_rocm.models.mamba1.Mamba``, bf16, d_state 16,
expand 2) forward + backward instead, counting its launches and the copies it makes (clones,
dtype conversions, copies into views: count and MiB), which at mamba widths are full
(batch, d_inner, seqlen) tensors wherever a layout does not match the next op's.

The torch ops compute on the CPU here, at the shape's size: use a narrow shape (the default
b1 d64 l256 n16) to see the host path alone. This machine runs Python about 2.6-4x faster
per call than the H100 machine's host.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mamba2_rocm.ops as ops_pkg
from mamba2_rocm import selective_scan_fn
from mamba2_rocm.bench.host import launches_disabled

#: aten ops that launch nothing on a GPU: views, metadata, allocations
_NO_LAUNCH = ("view", "slice", "select", "alias", "unbind", "expand", "as_strided", "empty",
              "squeeze", "unsqueeze", "transpose", "permute", "t.default", "detach",
              "promote_types", "split", "narrow", "_reshape_alias", "reshape")  # fmt: skip


class KernelNames:
    """A kernel set whose launchers are their names: ``launches_disabled`` (mamba2_rocm.bench.host)
    turns every launch into a count, so nothing is run."""

    def launcher(self, name):
        return name


def kernel_tier_on_cpu() -> None:
    """Every ops module's ``choose`` answers "kernel" on the CPU (its host path as on a GPU)."""
    kset = KernelNames()
    for info in pkgutil.iter_modules(ops_pkg.__path__):
        mod = importlib.import_module(f"mamba2_rocm.ops.{info.name}")
        if hasattr(mod, "choose"):
            mod.choose = lambda device: ("kernel", kset)


class TorchLaunches(TorchDispatchMode):
    """The aten ops of a region that would launch a kernel on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func).removeprefix("aten.")
        if not any(name.startswith(p) for p in _NO_LAUNCH):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def inputs(b: int, d: int, L: int, n: int):
    g = torch.Generator().manual_seed(0)
    r = lambda *s, dt=torch.bfloat16: torch.randn(*s, generator=g).to(dt).requires_grad_()  # noqa: E731
    A = (-torch.rand(d, n, generator=g)).requires_grad_()
    return (r(b, d, L), r(b, d, L), A, r(b, n, L), r(b, n, L), r(d, dt=torch.float32),
            r(b, d, L), r(d, dt=torch.float32))  # fmt: skip


def best_us(fn, steps: int = 200, runs: int = 9) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        for _ in range(steps):
            fn()
        times.append((time.perf_counter() - t) / steps * 1e6)
    return min(times)


def measure(b: int, d: int, L: int, n: int) -> dict:
    ins = inputs(b, d, L, n)
    dout = torch.randn(b, d, L).to(torch.bfloat16)

    def fwd():
        return selective_scan_fn(*ins, delta_softplus=True)

    def fwd_no_grad():
        with torch.no_grad():
            return fwd()

    def step():
        return torch.autograd.grad(fwd(), ins, dout)

    with launches_disabled() as ours:
        for _ in range(20):  # caches, lazy imports
            step()
        ours[0] = 0
        with TorchLaunches() as mode:
            step()
        launched = ours[0]
        return {"shape": f"b{b} d{d} l{L} n{n}", "fwd_no_grad_us": best_us(fwd_no_grad),
                "fwd_bwd_us": best_us(step), "our_launches": launched,
                "torch_launches": len(mode.ops), "torch_ops": sorted(set(mode.ops))}  # fmt: skip


class Copies(TorchDispatchMode):
    """The copies of a region: count and bytes written."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func).removeprefix("aten.").startswith(("clone", "_to_copy", "copy_")):
            self.count += 1
            self.nbytes += out.numel() * out.element_size()
        return out


def measure_block(b: int, L: int, d_model: int) -> dict:
    from mamba2_rocm.models.mamba1 import Mamba

    torch.manual_seed(0)
    block = Mamba(d_model=d_model, d_state=16, d_conv=4, expand=2).to(torch.bfloat16)
    x = torch.randn(b, L, d_model, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    wrt = [x, *block.parameters()]

    def step():
        return torch.autograd.grad(block(x), wrt, dy)

    with launches_disabled() as ours:
        step()
        ours[0] = 0
        with TorchLaunches() as launches, Copies() as copies:
            step()
    return {"shape": f"b{b} l{L} d_model{d_model}", "our_launches": ours[0],
            "torch_launches": len(launches.ops), "copies": copies.count,
            "copied_mib": copies.nbytes / 2**20}  # fmt: skip


kernel_tier_on_cpu()

if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1:2] == ["--block"]:
        shapes = [tuple(int(v) for v in a.split(",")) for a in sys.argv[2:]] or [(2, 512, 768)]
        print(f"{'block':24} {'ours':>5} {'torch':>5} {'copies':>6} {'copied MiB':>10}")
        for shape in shapes:
            r = measure_block(*shape)
            print(f"{r['shape']:24} {r['our_launches']:5d} {r['torch_launches']:5d} "
                  f"{r['copies']:6d} {r['copied_mib']:10.1f}")  # fmt: skip
        sys.exit()
    shapes = [tuple(int(v) for v in a.split(",")) for a in sys.argv[1:]] or [(1, 64, 256, 16)]
    print(f"{'shape':24} {'fwd no_grad us':>14} {'fwd+bwd us':>10} {'ours':>5} {'torch':>5}")
    for shape in shapes:
        r = measure(*shape)
        print(f"{r['shape']:24} {r['fwd_no_grad_us']:14.1f} {r['fwd_bwd_us']:10.1f} "
              f"{r['our_launches']:5d} {r['torch_launches']:5d}  {', '.join(r['torch_ops'])}")  # fmt: skip
