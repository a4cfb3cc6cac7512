"""Host time per call of the decode-path ops: how long Python keeps the CPU busy per call, the
part of a decode step's wall time that a GPU kernel of a few microseconds cannot hide.

For each op (``selective_state_update`` with pool indices, ``causal_conv1d_update``,
gated ``rmsnorm_fn``, at batch 1 with Mamba2-1.3b widths, bf16) on an idle GPU:

- **host us/call**: ``iters`` calls back to back, timed on the CPU (``time.perf_counter``)
  without synchronizing inside the loop, divided by ``iters``. While this exceeds the kernel
  time the GPU waits for the host, so this is the host cost of one call.
- **python us/call**: the same with the driver launch replaced by a no-op (every
  ``launch`` the ops call): our checks, plan lookup, argument packing and allocation, without
  the driver's own cost.
- **launch us**: the difference: the driver call (``cuLaunchKernel`` / ``hipModuleLaunchKernel``
  through ctypes) and the stream lookup.
- **kernel us**: the op's time per call inside a CUDA graph (no host in the loop).

The target of the performance issue is host us/call <= 10 per op; the summary line says
which ops meet it. Medians of ``repeats`` runs.

The same run measures this machine's floor for any op called from Python: the driver call
alone (one of the norm's launches repeated with its arguments packed once), torch's own
``y.add_(1)`` on a one-element tensor (a C++ op through torch's dispatcher, one launch), and
``torch.empty(1)`` (what allocating an output costs). On the H100 machine the driver call
alone took 6.5-10 us and torch's own one-launch op 7-14 us (run to run): an op that launches
from Python cannot be below them, whatever its Python does; under a CUDA/HIP graph (the ``kernel us`` column, how
serving stacks run decode) the host cost is gone.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from mamba2_rocm._torch import require_torch
from mamba2_rocm.bench.timing import backend, time_graph

TARGET_US = 10.0


@contextmanager
def launches_disabled() -> Iterator[list[int]]:
    """Every ``launch`` the ops modules hold becomes a no-op that counts its calls (the list
    yielded holds the count); restored on exit."""
    count = [0]

    def skip(*args, **kwargs) -> None:
        count[0] += 1

    patched = []
    for name, mod in list(sys.modules.items()):
        if name.startswith("mamba2_rocm.ops") and callable(getattr(mod, "launch", None)):
            patched.append((mod, mod.launch))
            mod.launch = skip
    try:
        yield count
    finally:
        for mod, fn in patched:
            mod.launch = fn


def _host_us(fn: Callable[[], object], iters: int, repeats: int) -> float:
    torch = require_torch()
    runs = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        runs.append((time.perf_counter() - t0) / iters * 1e6)
        torch.cuda.synchronize()
    return statistics.median(runs)


def _ops(torch):
    from mamba2_rocm import causal_conv1d_update, rmsnorm_fn, selective_state_update

    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s, dt=bf: torch.randn(*s, device=dev, generator=g).to(dt)  # noqa: E731
    h, p, n, groups, pool = 64, 64, 128, 1, 8
    state = r(pool, h, p, n)
    idx = torch.tensor([3], dtype=torch.int32, device=dev)
    x, z = r(1, h, p), r(1, h, p)
    dt = r(1, h)[:, :, None].expand(1, h, p)
    A = (-torch.rand(h, device=dev, generator=g))[:, None, None].expand(h, p, n)
    D, dt_bias = (
        r(h, dt=torch.float32)[:, None].expand(h, p),
        r(h, dt=torch.float32)[:, None].expand(h, p),
    )
    B, C = r(1, groups, n), r(1, groups, n)
    conv_dim, width = h * p + 2 * groups * n, 4
    xc, conv_state = r(1, conv_dim), r(pool, conv_dim, width - 1)
    w, wb = r(conv_dim, width), r(conv_dim)
    y, zz, nw = r(1, h * p), r(1, h * p), r(h * p)
    return {
        f"selective_state_update b1 h{h} p{p} n{n} pool": lambda: selective_state_update(
            state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True,
            state_batch_indices=idx),
        f"causal_conv1d_update b1 d{conv_dim} w{width} pool": lambda: causal_conv1d_update(
            xc, conv_state, w, wb, activation="silu", conv_state_indices=idx),
        f"rmsnorm_fn gated 1 x {h * p}": lambda: rmsnorm_fn(
            y, nw, None, z=zz, group_size=h * p, norm_before_gate=False),
    }  # fmt: skip


def run(iters: int = 2000, repeats: int = 5, dtype: str = "bfloat16") -> list[dict]:
    torch = require_torch()
    if not torch.cuda.is_available():
        raise RuntimeError("bench host needs a GPU")
    rows = []
    with backend("kernel"):
        ops = _ops(torch)
        for case, fn in ops.items():
            for _ in range(20):  # plan caches, lazy loads
                fn()
            host = _host_us(fn, iters, repeats)
            with launches_disabled() as count:
                python = _host_us(fn, iters, repeats)
            launches = count[0] / (iters * repeats)
            kernel = time_graph(fn, replays=10, per_graph=50).median_us
            rows.append({"case": case, "host_us": host, "python_us": python,
                         "launch_us": host - python, "launches_per_call": launches,
                         "kernel_us": kernel})  # fmt: skip
        for case, fn in _floors(torch, ops).items():
            rows.append({"case": case, "host_us": _host_us(fn, iters, repeats), "floor": True})
    return rows


def _floors(torch, ops) -> dict[str, Callable[[], object]]:
    """The machine's floor for an op called from Python (see the module docstring)."""
    import mamba2_rocm.ops.rmsnorm as norm
    from mamba2_rocm.ops._launch import raw_stream

    seen = []
    real = norm.launch
    norm.launch = lambda launcher, x, params, grid, threads: seen.append(
        (launcher, x, params, grid, threads)
    )
    try:
        next(fn for case, fn in ops.items() if case.startswith("rmsnorm_fn"))()
    finally:
        norm.launch = real
    launcher, x, params, grid, threads = seen[-1]
    y = torch.zeros(1, device=x.device)
    return {
        "floor: driver launch alone (ctypes)": launcher.driver_only(
            params, grid, (threads, 1, 1), raw_stream(x.get_device())
        ),
        "floor: torch y.add_(1), one launch": lambda: y.add_(1),
        "floor: torch.empty(1)": lambda: torch.empty(1, device=x.device),
    }


def format_table(rows: list[dict]) -> str:
    lines = [f"{'op':46} {'host us/call':>12} {'python us':>10} {'launch us':>10} "
             f"{'launches':>8} {'kernel us':>10}"]  # fmt: skip
    ops = [r for r in rows if not r.get("floor")]
    floors = [r for r in rows if r.get("floor")]
    for r in ops:
        lines.append(f"{r['case']:46} {r['host_us']:12.1f} {r['python_us']:10.1f} "
                     f"{r['launch_us']:10.1f} {r['launches_per_call']:8.1f} {r['kernel_us']:10.1f}")  # fmt: skip
    for r in floors:
        lines.append(f"{r['case']:46} {r['host_us']:12.1f}")
    over = [r["case"].split()[0] for r in ops if r["host_us"] > TARGET_US]
    worst = max(ops, key=lambda r: r["host_us"])
    lines.append(
        f"worst host time per call: {worst['host_us']:.1f} us ({worst['case'].split()[0]}); "
        + (f"over the {TARGET_US:.0f} us target: {', '.join(over)}" if over
           else f"every op within the {TARGET_US:.0f} us target")
    )  # fmt: skip
    launch_floor = max((r["host_us"] for r in floors if r["case"].startswith("floor: driver")),
                       default=None)  # fmt: skip
    if launch_floor is not None and launch_floor > TARGET_US:
        lines.append(f"this machine's floor for one launch from Python is {launch_floor:.1f} us "
                     f"(the driver call alone): the {TARGET_US:.0f} us target is below it")  # fmt: skip
    return "\n".join(lines)
