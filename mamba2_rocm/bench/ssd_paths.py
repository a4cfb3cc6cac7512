"""``bench ssd-paths``: the SSD forward's two per-shape choices against their alternatives, on
this GPU, over ``bench ssd``'s grid.

The host picks, per call (:mod:`mamba2_rocm.ops.ssd`):

* chunk_scan's kernel form (``_scan_form``; a key of :data:`mamba2_rocm.kernels.SSD_SCAN_FORMS`),
* how the states pass along the chunks (``_state_path``: ``separate``, ``chained`` or
  ``chained_lds``, from the tables ``CHAIN_CHAINS_PER_SM`` / ``CHAIN_LDS_CHAINS_PER_SM``),
* the chunk size the kernels run (``scan_chunk_size``: 64, 128 or 256 by the call's work per
  multiprocessor, ``CHUNK_WORK_PER_SM``; whatever the caller asked for).

All three were measured on NVIDIA (H100, H200) only; the AMD targets take them untested (the 128-column
form is not picked on AMD, the LDS link neither, the chaining table is NVIDIA's). At every grid
point this times ``mamba_chunk_scan_combined`` (the call a Mamba2 layer makes, graph µs per call,
the better of ``rounds`` interleaved rounds) with each state path forced (chunk_scan's form the
host's) and with each chunk_scan form that can run the shape forced (the state path the host's),
and with each kernel chunk size forced (the other two choices the host's for that size), and
reports how much slower the host's pick is than the fastest option. The chunk size alone is also
timed at shorter calls (``CHUNK_CASES``: the grid's are all 512 tokens and more), where the rule
most often moves it. The GPU gate's run
(``docker/gpu-test-run.sh``) runs it on every AMD runner and keeps the JSON, so those numbers are
what settle the AMD side of the choices; on NVIDIA it is the calibration the tables came from.

Forms offered at a shape (:func:`scan_forms`): every form whose tile rows fit the chunk, the
16-bit-only forms for 16-bit inputs, and the 128-column form only where headdim is over 64 (at 64
half its columns would idle). On targets without matrix cores (gfx10.3) the 16-bit forms' kernels
take the FMA path, and are timed there as such.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

from mamba2_rocm._torch import require_torch
from mamba2_rocm.bench.ssd import MODELS, grid, make_inputs
from mamba2_rocm.bench.timing import time_graph
from mamba2_rocm.kernels import SSD_SCAN_16BIT_FORMS, SSD_SCAN_FORMS
from mamba2_rocm.ops.checks import KERNEL_CHUNK_SIZES as CHUNKS

#: a pick this much slower than the fastest option is reported as a miss
TOLERANCE = 0.005
#: (label, shape) of the shorter calls at which the chunk size alone is timed: two Mamba2
#: checkpoints and the two hybrids whose layers differ most (Nemotron-H's 128 heads in 8 groups,
#: Falcon-H1's headdim 128 / dstate 256) at a short prompt, a batch of them and a longer one
CHUNK_CASES = [
    (name, (b, L, *MODELS[name]))
    for name in ("mamba2-130m", "mamba2-2.7b", "nemotron-h-8b", "falcon-h1-7b")
    for b, L in ((1, 300), (8, 160), (4, 450), (1, 1500))
]
#: the choices: (row key, what the summary calls it)
CHOICES = (("path", "state path"), ("scan", "chunk_scan form"), ("chunk", "chunk size"))


def scan_forms(chunk_size: int, headdim: int, dtype: str) -> list[str]:
    """chunk_scan's forms that can run (chunk_size, headdim) for inputs of ``dtype`` (a torch
    dtype name), in :data:`SSD_SCAN_FORMS` order."""
    forms = []
    for form, (rows, _threads, cols) in SSD_SCAN_FORMS.items():
        if rows > chunk_size or (dtype == "float32" and form in SSD_SCAN_16BIT_FORMS):
            continue
        if cols > 64 and headdim <= 64:
            continue
        forms.append(form)
    return forms


@contextlib.contextmanager
def forced(
    scan: str | None = None, path: str | None = None, chunk: int | None = None
) -> Iterator[dict]:
    """Within the block the SSD forward takes chunk_scan form ``scan`` / state path ``path`` /
    kernel chunk size ``chunk`` (None: the host's own pick), whatever its rules say; yields a
    dict that records the picks the forward made (``scan``, ``path``, ``chunk``: the last
    call's). The rules are restored on exit."""
    from mamba2_rocm.ops import ssd as ssd_ops

    if path is not None and path not in ssd_ops._STATE_STAGES:
        raise ValueError(f"unknown state path {path!r}; one of {', '.join(ssd_ops._STATE_STAGES)}")
    if scan is not None and scan not in SSD_SCAN_FORMS:
        raise ValueError(f"unknown chunk_scan form {scan!r}; one of {', '.join(SSD_SCAN_FORMS)}")
    if chunk is not None and chunk not in CHUNKS:
        raise ValueError(f"unknown chunk size {chunk!r}; one of {', '.join(map(str, CHUNKS))}")
    rules = {
        name: getattr(ssd_ops, name) for name in ("_scan_form", "_state_path", "scan_chunk_size")
    }
    seen: dict = {}

    def recording(key, value, rule):  # the forced value, else the rule's; kept in seen[key]
        def pick(*args, **kwargs):
            seen[key] = value if value is not None else rule(*args, **kwargs)
            return seen[key]

        return pick

    path_pick = recording("path", path, rules["_state_path"])

    def state_path(chains, chunks, sms, x, B, chunk_size):
        if path == "chained_lds" and not ssd_ops._lds_offsets_fit(x, B):
            # (that kernel holds x's and B's offsets in 32 bits: forced there it would be wrong)
            raise ValueError("chained_lds takes x and B spans within 32-bit element offsets")
        return path_pick(chains, chunks, sms, x, B, chunk_size)

    ssd_ops._scan_form = recording("scan", scan, rules["_scan_form"])
    ssd_ops._state_path = state_path
    ssd_ops.scan_chunk_size = recording("chunk", chunk, rules["scan_chunk_size"])
    try:
        yield seen
    finally:
        for name, rule in rules.items():
            setattr(ssd_ops, name, rule)


def loss(us: dict[str, float], pick: str) -> float:
    """How much slower ``pick`` ran than the fastest of ``us`` (0 where it is the fastest)."""
    return us[pick] / min(us.values()) - 1


def run(dtype="bfloat16", rounds: int = 2, cases=None, chunk_cases=None) -> list[dict]:
    """One row per grid point (``cases``: (label, shape) pairs instead of ``bench ssd``'s grid):
    graph µs per call for each state path, each chunk_scan form and each chunk size, the host's
    picks and their losses; then one row per ``chunk_cases`` point (default ``CHUNK_CASES``)
    with the chunk sizes alone."""
    torch = require_torch()
    if not torch.cuda.is_available():
        raise RuntimeError("bench ssd-paths needs a GPU: it times the SSD forward's kernels")
    from mamba2_rocm import mamba_chunk_scan_combined
    from mamba2_rocm.ops import ssd as ssd_ops

    every = [(c, True) for c in (cases if cases is not None else grid())]
    every += [(c, False) for c in (chunk_cases if chunk_cases is not None else CHUNK_CASES)]
    rows = []
    for (label, shape), all_choices in every:
        b, L, h, p, groups, n, cs = shape
        args, kw = make_inputs(shape, dtype)
        call = lambda args=args, kw=kw: mamba_chunk_scan_combined(*args, **kw)  # noqa: E731
        with forced() as picks:
            call()
        options = [("chunk", v) for v in CHUNKS]
        if all_choices:
            options += [("path", v) for v in ssd_ops._STATE_STAGES]
            options += [("scan", v) for v in scan_forms(picks["chunk"], p, dtype)]
        us: dict[tuple[str, object], float] = {}
        for _ in range(rounds):
            for kind, value in options:
                with forced(**{kind: value}) as seen:
                    t = time_graph(call, replays=10, per_graph=10).median_us
                if seen.get(kind) != value:  # the forward must have run what it was told to
                    raise RuntimeError(f"{label} {shape}: forced {kind} {value}, ran {seen}")
                us[kind, value] = min(us.get((kind, value), math.inf), t)
        row = {
            "case": f"{label} b{b} l{L} h{h} p{p} g{groups} n{n} c{cs} {dtype}", "shape": list(shape),
            "chains": b * ssd_ops._state_tiles(p, n) * h, "chunks": math.ceil(L / picks["chunk"]),
        }  # fmt: skip
        for kind, _ in CHOICES:
            times = {str(v): round(t, 1) for (k, v), t in us.items() if k == kind}
            if times:
                pick = str(picks[kind])
                row.update({f"{kind}_us": times, f"{kind}_pick": pick,
                            f"{kind}_loss": round(loss(times, pick), 4)})  # fmt: skip
        rows.append(row)
        del args, kw, call
        torch.cuda.empty_cache()
    return rows


def summary(rows: list[dict]) -> list[str]:
    """Per choice: at how many points the host's pick is more than TOLERANCE slower than the
    fastest option, and those points."""
    lines = []
    for kind, what in CHOICES:
        timed = [r for r in rows if f"{kind}_loss" in r]
        if not timed:
            continue
        missed = [r for r in timed if r[f"{kind}_loss"] > TOLERANCE]
        lines.append(
            f"{what}: the host's pick is more than {100 * TOLERANCE:.1f}% slower than the fastest "
            f"at {len(missed)} of {len(timed)} points"
        )
        for r in missed:
            us = r[f"{kind}_us"]
            best = min(us, key=us.get)
            lines.append(
                f"  {r['case']}: {r[f'{kind}_pick']} {us[r[f'{kind}_pick']]:.1f} us, "
                f"{best} {us[best]:.1f} us ({100 * r[f'{kind}_loss']:.1f}% slower)"
            )
    return lines


def format_table(rows: list[dict]) -> str:
    def cells(r: dict, kind: str) -> str:
        us, pick = r.get(f"{kind}_us"), r.get(f"{kind}_pick")
        if us is None:
            return "-"
        return "  ".join(f"{v}{'*' if v == pick else ''} {t:.1f}" for v, t in us.items())

    lines = [
        f"{'case':52} {'chains':>6} {'chunks':>6}  state path (graph us; * the host's pick)"
        "  |  chunk_scan form  |  chunk size"
    ]
    for r in rows:
        lines.append(
            f"{r['case']:52} {r['chains']:6} {r['chunks']:6}  "
            + "  |  ".join(cells(r, kind) for kind, _ in CHOICES)
        )
    return "\n".join(lines + summary(rows))
