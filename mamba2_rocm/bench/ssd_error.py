"""The SSD forward's accuracy as users see it: ``mamba_chunk_scan_combined``'s output, in its own
dtype, against the plain recurrence in float64 (:func:`mamba2_rocm.reference.ssd.ssd_sequential`
on the same dtype-rounded inputs), ours (the kernel tier) vs mamba_ssm's Triton (when the real
mamba_ssm is importable), for float32, float16 and bfloat16 over a varied grid: odd lengths and
widths, headdim 32-128 and dstate 16-256, groups, seq_idx, packed variable-length sequences
(cu_seqlens), z, initial states.

Issue #72's rule for the SSD forward: wherever our numerics change (rounding once, as Triton
does, for speed), the output error must stay at or below Triton's, per dtype; this command is
how that is measured. Per case and dtype it reports the relative RMS error
(‖out − ref‖ / ‖ref‖) and the worst element's error over the largest magnitude, for each
implementation, next to the floor: the float64 result rounded once to the output dtype (no
implementation can be closer). The summary names, per dtype, the worst case of each and the
cases where ours is above Triton's.
"""

from __future__ import annotations

import math
import os

from mamba2_rocm._torch import require_torch
from mamba2_rocm.bench import ssd as ssd_bench
from mamba2_rocm.bench.timing import backend, python_json

DTYPES = ("float32", "float16", "bfloat16")
TRITON = "mamba_ssm triton"

#: name -> (batch, seqlen, nheads, headdim, ngroups, dstate, chunk_size, extras), extras from
#: "seq_idx" (three sequences a row), "varlen" (four packed sequences: cu_seqlens + seq_idx),
#: "z" (the gate), "init" (initial states)
GRID = {
    "odd b2 l259 h6 p40 n32 g2": (2, 259, 6, 40, 2, 32, 64, ()),
    "mamba2-130m b1 l1000": (1, 1000, 24, 64, 1, 128, 256, ()),
    "p32 n16 b2 l777": (2, 777, 8, 32, 1, 16, 128, ()),
    "falcon-h1 p128 n256 b1 l513": (1, 513, 4, 128, 1, 256, 128, ()),
    "codestral g8 b1 l1100": (1, 1100, 16, 64, 8, 128, 256, ()),
    "seq_idx b2 l900": (2, 900, 8, 64, 1, 64, 256, ("seq_idx",)),
    "varlen 4 seqs l1234": (1, 1234, 8, 64, 2, 128, 256, ("varlen",)),
    "z + initial states b2 l301": (2, 301, 8, 64, 1, 64, 128, ("z", "init")),
}


def make_case(shape: tuple, dtype: str, device, seed: int = 0) -> tuple[tuple, dict]:
    """(args, kwargs) of ``mamba_chunk_scan_combined`` for ``shape`` (a :data:`GRID` value):
    x, dt, B, C (and z) in ``dtype`` as a model passes them; A, D, dt_bias and initial states in
    float32; softplus on dt. Seeded by ``seed``."""
    torch = require_torch()
    b, L, h, p, g, n, cs, extras = shape
    dt_ = getattr(torch, dtype)
    gen = torch.Generator(device=device).manual_seed(seed + L + 7 * h)

    def r(*s, scale=1.0):
        return torch.randn(*s, device=device, generator=gen) * scale

    x, dt = r(b, L, h, p).to(dt_), (r(b, L, h) - 2).to(dt_)
    B, C = r(b, L, g, n).to(dt_), r(b, L, g, n).to(dt_)
    A = -torch.rand(h, device=device, generator=gen) - 0.05
    kw = dict(D=r(h), dt_bias=r(h, scale=0.5), dt_softplus=True)
    if "z" in extras:
        kw["z"] = r(b, L, h, p).to(dt_)
    if "init" in extras:
        kw["initial_states"] = r(b, h, p, n, scale=0.5)
    if "seq_idx" in extras or "varlen" in extras:
        parts = 4 if "varlen" in extras else 3
        cut_gen = torch.Generator().manual_seed(seed + L)  # (on the host: randperm's cuts)
        cuts = sorted(torch.randperm(L - 2, generator=cut_gen)[: parts - 1] + 1)
        bounds = [0, *(int(c) for c in cuts), L]
        seq_idx = torch.zeros(b, L, dtype=torch.int32, device=device)
        for i in range(parts):
            seq_idx[:, bounds[i] : bounds[i + 1]] = i
        kw["seq_idx"] = seq_idx
        if "varlen" in extras:  # (batch 1: the packed form; the varlen states are computed too)
            kw["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32, device=device)
            kw["return_varlen_states"] = True
    return (x, dt, A, B, C, cs), kw


def errors(out, ref) -> tuple[float, float]:
    """(relative RMS error, worst element's error over the largest |ref|) of ``out`` vs ``ref``."""
    diff = out.double() - ref
    scale = ref.abs().max().item()
    rms = diff.norm().item() / max(ref.norm().item(), 1e-300)
    worst = diff.abs().max().item() / max(scale, 1e-300)
    return (rms if math.isfinite(rms) else math.inf), (worst if math.isfinite(worst) else math.inf)


def reference(args: tuple, kw: dict):
    """The float64 recurrence on the (already dtype-rounded) inputs: the output, in float64."""
    torch = require_torch()
    from mamba2_rocm.reference.ssd import ssd_sequential

    wide = lambda t: t.double() if t.is_floating_point() else t  # noqa: E731
    x, dt, A, B, C, _cs = args
    kw64 = {k: wide(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    for k in ("cu_seqlens", "return_varlen_states"):  # (the output only: the recurrence
        kw64.pop(k, None)  # restarts where seq_idx says, the same cuts)
    return ssd_sequential(wide(x), wide(dt), wide(A), wide(B), wide(C), **kw64)


def run(dtype: str | None = None, dtypes=DTYPES, cases=None, device="cuda", seed: int = 0,
        ours_tier: str = "kernel", procs: int | None = None) -> list[dict]:  # fmt: skip
    """Rows (case, dtype, impl, rel_rms, max_rel, floor_rel_rms) for every case of ``cases``
    (default :data:`GRID`) and dtype of ``dtypes`` (every one: ``dtype``, the bench command's
    option, is not this bench's subject), then the summary row. ``ours_tier``: the backend ours
    runs on, and its rows' impl (``torch`` for a CPU run of the harness).

    ``procs``: processes the cases are spread over (default: one per case, up to the CPU count;
    1: all in this process). Triton compiles and autotunes its five kernels anew for every
    dtype and (headdim, dstate, chunk) of the grid, one compile at a time in a process: serially
    that took over 220 s on the H100 machine, while each case's own work is a second or two.
    Errors do not depend on what else runs on the GPU, so the cases run side by side."""
    torch = require_torch()
    cases = cases or GRID
    if device != "cpu" and not torch.cuda.is_available():
        raise RuntimeError("bench ssd-error needs a GPU (ROCm or CUDA): none is visible here")
    if procs is None:
        procs = min(len(cases), os.cpu_count() or 1)
    if procs > 1 and len(cases) > 1:
        rows = _run_spread(dtypes, cases, device, seed, ours_tier, procs)
    else:
        rows = _measure(dtypes, cases, device, seed, ours_tier)
    return [*rows, {"summary": summary(rows)}]


def _run_spread(dtypes, cases: dict, device: str, seed: int, ours_tier: str,
                procs: int) -> list[dict]:  # fmt: skip
    """:func:`_measure` of each case in a process of its own (``procs`` at a time: threads that
    each wait on one ``python -c``), rows in the grid's order."""
    from concurrent.futures import ThreadPoolExecutor

    def one(name: str) -> list[dict]:
        code = ("import json; from mamba2_rocm.bench import ssd_error as m; "
                f"print(json.dumps(m._measure({tuple(dtypes)!r}, {{{name!r}: {cases[name]!r}}}, "
                f"{device!r}, {seed!r}, {ours_tier!r})))")  # fmt: skip
        return python_json(code, f"bench ssd-error: case {name!r} failed")

    with ThreadPoolExecutor(max_workers=procs) as pool:
        return [row for rows in pool.map(one, list(cases)) for row in rows]


def _measure(dtypes, cases: dict, device: str, seed: int, ours_tier: str) -> list[dict]:
    """The rows of :func:`run` for ``cases``, in this process."""
    torch = require_torch()
    from mamba2_rocm import mamba_chunk_scan_combined

    triton = ssd_bench._triton_scan() if device != "cpu" else None
    rows = []
    for name, shape in cases.items():
        for dt_name in dtypes:
            args, kw = make_case(shape, dt_name, device, seed)
            ref = reference(args, kw)
            floor = errors(ref.to(getattr(torch, dt_name)), ref)[0]
            impls = [(ours_tier, mamba_chunk_scan_combined, ours_tier)]
            if triton is not None:
                impls.append((TRITON, triton, "kernel"))
            for impl, fn, tier in impls:
                with backend(tier):
                    out = fn(*args, **kw)
                if isinstance(out, tuple):  # (out, varlen_states): the output is compared
                    out = out[0]
                rms, worst = errors(out, ref)
                rows.append({"case": name, "dtype": dt_name, "impl": impl,
                             "rel_rms": float(f"{rms:.3g}"), "max_rel": float(f"{worst:.3g}"),
                             "floor_rel_rms": float(f"{floor:.3g}")})  # fmt: skip
    return rows


def summary(rows: list[dict]) -> list[str]:
    """Per dtype: the worst relative RMS error of each implementation (with its case), and the
    cases where ours is above Triton's (issue #72: at or below, per dtype)."""
    lines = []
    for dt_name in dict.fromkeys(r["dtype"] for r in rows):
        mine = [r for r in rows if r["dtype"] == dt_name]
        parts = []
        for impl in dict.fromkeys(r["impl"] for r in mine):
            w = max((r for r in mine if r["impl"] == impl), key=lambda r: r["rel_rms"])
            parts.append(f"{impl} worst {w['rel_rms']:.3g} ({w['case']})")
        by = {(r["case"], r["impl"]): r["rel_rms"] for r in mine}
        cases = list(dict.fromkeys(r["case"] for r in mine))
        compared = [c for c in cases if (c, TRITON) in by]
        ours = next(i for i in dict.fromkeys(r["impl"] for r in mine) if i != TRITON)
        above = [c for c in compared if by[(c, ours)] > by[(c, TRITON)]]
        line = f"{dt_name}: " + "; ".join(parts)
        if compared:
            line += (f"; ours at or below Triton in {len(compared) - len(above)} of "
                     f"{len(compared)} cases")  # fmt: skip
            if above:
                line += " (above in: " + ", ".join(above) + ")"
        lines.append(line)
    return lines


def format_table(rows: list[dict]) -> str:
    table = [r for r in rows if "summary" not in r]
    head = f"{'case':30} {'dtype':9} {'impl':17} {'rel RMS':>9} {'max rel':>9} {'floor':>9}"
    lines = [head, "-" * len(head)]
    lines += [f"{r['case']:30} {r['dtype']:9} {r['impl']:17} {r['rel_rms']:9.3g} "
              f"{r['max_rel']:9.3g} {r['floor_rel_rms']:9.3g}" for r in table]  # fmt: skip
    lines += [line for r in rows if "summary" in r for line in r["summary"]]
    return "\n".join(lines)
