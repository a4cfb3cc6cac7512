"""Decode-step benchmark: ``selective_state_update`` kernel vs the vectorized torch tier (at the
issue's shape) and mamba_ssm's Triton kernel (when ``mamba_ssm`` is importable: the best of
several processes).

Mamba2 decode (bf16 state, tied-head A/dt/dt_bias/D as HF transformers passes them) for the
issue's shape (nheads 64, headdim 64, dstate 128, ngroups 8) at batch 1/16/64, and over batch
1/4/16/64/256 for mamba2-1.3b (h64 g1), the grouped hybrids' layers (Codestral-Mamba-7B /
Nemotron-H-8B: h128 g8) and Falcon-H1-7B's (h24, headdim 128, dstate 256). Reports the median
per-call device-event time (launch included), the per-call time inside a CUDA graph (kernel
only), bandwidth over the bytes that must move (the state read and written once, inputs,
output), and per case the ratio to Triton's best with the worst over the grid (issue #17: ahead
at every batch). The state-pool cases (:data:`POOL_GRID`: ``state_batch_indices`` into a pool,
as serving stacks call it) also time both ways of checking the indices (:data:`INDEX_CHECKS`).
"""

from __future__ import annotations

from mamba2_rocm._torch import require_torch
from mamba2_rocm.bench.timing import (
    add_triton_best,
    compare,
    copy_bandwidth_gbs,
    format_rows,
    split_summary,
)

#: (label, batches, nheads, headdim, dstate, ngroups)
GRID = (
    ("issue", (1, 16, 64), 64, 64, 128, 8),
    ("mamba2-1.3b", (1, 4, 16, 64, 256), 64, 64, 128, 1),
    ("codestral-7b", (1, 4, 16, 64, 256), 128, 64, 128, 8),
    ("falcon-h1-7b", (1, 4, 16, 64, 256), 24, 128, 256, 1),  # bench ssd's Falcon-H1-7B layer
)
#: State-pool decode (serving: ``state_batch_indices`` into a pool of batch + 8 rows, in a
#: random order): (label, batches, nheads, headdim, dstate, ngroups). Besides the op as it
#: chooses, each case times both ways of checking the indices, whose crossover places
#: ``ops.state_update.SSU_CHECK_IN_KERNEL_MAX_BATCH``.
POOL_GRID = (("mamba2-1.3b pool", (1, 4, 16, 64, 256), 64, 64, 128, 1),)
POOL_EXTRA = 8
#: the two ways, as (impl label, SSU_CHECK_IN_KERNEL_MAX_BATCH pinned for the call)
INDEX_CHECKS = (("kernel, indices in kernel", 1 << 62), ("kernel, indices checked first", 0))
TARGET = 1.0  # ahead


def _triton_update():
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    except Exception:  # not installed, or no Triton for this GPU
        return None
    return selective_state_update


def decode_inputs(b: int, h: int, p: int, n: int, ngroups: int, dtype, seed: int,
                  device: str = "cuda", pool: int | None = None) -> dict:  # fmt: skip
    """One decode step's inputs as HF transformers passes them (A / dt / dt_bias / D as
    per-head values broadcast with stride 0), seeded: keyword arguments of
    ``selective_state_update`` without ``dt_softplus``. ``pool``: the state has that many rows
    (not ``b``), for ``state_batch_indices``."""
    torch = require_torch()
    g = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=device, generator=g)  # noqa: E731
    state = r(pool or b, h, p, n).to(dtype)
    x, z = r(b, h, p).to(dtype), r(b, h, p).to(dtype)
    dt = torch.rand(b, h, device=device, generator=g).to(dtype)[:, :, None].expand(b, h, p)
    A = (-torch.rand(h, device=device, generator=g))[:, None, None].expand(h, p, n)
    dt_bias, D = r(h)[:, None].expand(h, p), r(h)[:, None].expand(h, p)
    B, C = r(b, ngroups, n).to(dtype), r(b, ngroups, n).to(dtype)
    return dict(state=state, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias)


def run(dtype="bfloat16", impls=None, triton_procs: int = 3) -> list[dict]:
    torch = require_torch()
    from mamba2_rocm import selective_state_update

    dt_ = getattr(torch, dtype)
    copy = copy_bandwidth_gbs()
    triton = _triton_update()
    rows = []
    for label, batches, h, p, n, ngroups in GRID:
        for b in batches:
            t = decode_inputs(b, h, p, n, ngroups, dt_, seed=b)
            state, x, B = t["state"], t["x"], t["B"]
            elt = state.element_size()
            nbytes = (2 * state.numel() * elt + (3 * x.numel() + b * h + 2 * B.numel()) * elt
                      + 3 * h * 4)  # fmt: skip
            kw = dict(D=t["D"], z=t["z"], dt_bias=t["dt_bias"], dt_softplus=True)
            case = f"{label} decode b{b} h{h} p{p} n{n} g{ngroups} {dtype}"
            here = impls or (("kernel", "torch") if label == "issue" else ("kernel",))
            args = tuple(t[k] for k in ("state", "x", "dt", "A", "B", "C"))
            rows += compare(case, selective_state_update, triton, args, kw, nbytes, copy,
                            impls=here)  # fmt: skip
    rows += _pool_rows(dtype, impls, triton, copy)
    if impls is None and triton is not None and triton_procs > 0:
        rows = add_triton_best(rows, "decode", triton_procs, dtype, TARGET)
    return rows


def _pool_rows(dtype: str, impls, triton, copy: float, device: str = "cuda") -> list[dict]:
    """The :data:`POOL_GRID` cases: the op as it chooses (``kernel``), Triton (``impls``), and
    with no ``impls`` each of :data:`INDEX_CHECKS` pinned."""
    torch = require_torch()
    from mamba2_rocm import selective_state_update
    from mamba2_rocm.ops import state_update as ssu_ops

    dt_, rows = getattr(torch, dtype), []
    for label, batches, h, p, n, ngroups in POOL_GRID:
        for b in batches:
            pool = b + POOL_EXTRA
            t = decode_inputs(b, h, p, n, ngroups, dt_, seed=b, device=device, pool=pool)
            g = torch.Generator().manual_seed(b)
            idx = torch.randperm(pool, generator=g)[:b].to(device=device, dtype=torch.int32)
            elt = t["state"].element_size()
            nbytes = (2 * b * h * p * n * elt + (3 * b * h * p + b * h + 2 * b * ngroups * n) * elt
                      + 3 * h * 4 + 4 * b)  # fmt: skip
            kw = dict(D=t["D"], z=t["z"], dt_bias=t["dt_bias"], dt_softplus=True,
                      state_batch_indices=idx)  # fmt: skip
            case = f"{label} decode b{b} h{h} p{p} n{n} g{ngroups} {dtype}"
            args = tuple(t[k] for k in ("state", "x", "dt", "A", "B", "C"))
            rows += compare(case, selective_state_update, triton, args, kw, nbytes, copy,
                            impls=impls or ("kernel",))  # fmt: skip
            if impls:
                continue
            real = ssu_ops.SSU_CHECK_IN_KERNEL_MAX_BATCH
            for impl, limit in INDEX_CHECKS:
                ssu_ops.SSU_CHECK_IN_KERNEL_MAX_BATCH = limit
                try:
                    (row,) = compare(case, selective_state_update, None, args, kw, nbytes, copy,
                                     impls=("kernel",))  # fmt: skip
                finally:
                    ssu_ops.SSU_CHECK_IN_KERNEL_MAX_BATCH = real
                rows.append({**row, "impl": impl})
    return rows


def format_table(rows: list[dict]) -> str:
    table, summary = split_summary(rows)
    return "\n".join([format_rows(table, 50, 26), *summary])
