"""Device-event timing and the copy-bandwidth ceiling the results are compared with."""

from __future__ import annotations

import functools
import os
import statistics
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

from mamba2_rocm._torch import require_torch


@dataclass
class Timing:
    median_us: float
    iqr_us: float  # spread: interquartile range of the per-call times
    calls: int


def kernel_build_note(device_index: int | None = None) -> str:
    """Which kernel build the timings are of: an emulation build (``build --emulate``) runs an
    AMD target's code paths on this GPU, and its timings must never be read as that AMD GPU's."""
    from mamba2_rocm.runtime.loader import LoaderError, kernels_for_device

    torch = require_torch()
    if not torch.cuda.is_available():
        return "kernels: none (no GPU)"
    try:
        kset = kernels_for_device(
            torch.cuda.current_device() if device_index is None else device_index
        )
    except LoaderError as exc:
        return f"kernels: none ({exc})"
    if kset is None:
        return "kernels: none (torch fallback)"
    note = f"kernels: {kset.target} from {kset.kdir.path} ({kset.kdir.origin})"
    emulates = kset.kdir.manifest.get("emulates")
    if emulates:
        note += (f"; EMULATION build of {emulates}'s code paths: these are timings of that code "
                 f"on this GPU, not of an AMD GPU")  # fmt: skip
    return note


def env_items(name: str, default: tuple, item: Callable[[str], object]) -> tuple:
    """The environment's ``name`` read as space-separated items, each through ``item``, or
    ``default`` where it is unset or empty: the sweep scripts' ``SHAPES="b,d,L,n b,d,L,n"``,
    ``SEGMENTS="auto 1 8"``."""
    text = os.environ.get(name, "").strip()
    return tuple(item(s) for s in text.split()) if text else default


def time_calls(fn: Callable[[], object], warmup: int = 10, iters: int = 100) -> Timing:
    """Median of per-call device-event timings; each call is timed alone, launch included."""
    torch = require_torch()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends, strict=False):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends, strict=False))
    q = statistics.quantiles(times, n=4)
    return Timing(statistics.median(times), q[2] - q[0], iters)


def time_graph(fn: Callable[[], object], replays: int = 20, per_graph: int = 20) -> Timing:
    """Per-call time from CUDA-graph replays of ``per_graph`` calls: kernel time, no launch gaps."""
    torch = require_torch()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    timing = time_calls(graph.replay, warmup=3, iters=replays)
    return Timing(timing.median_us / per_graph, timing.iqr_us / per_graph, replays * per_graph)


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy rate, counting bytes read plus bytes written."""
    torch = require_torch()
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t = time_calls(lambda: dst.copy_(src), warmup=5, iters=30)
    return 2 * nbytes / (t.median_us * 1e-6) / 1e9


def bandwidth_row(case: str, impl: str, timing: Timing, graph: Timing | None, nbytes: int,
                  copy_gbs: float, **extra) -> dict:  # fmt: skip
    """One benchmark result: the per-call median, the graph-timed median, and the bandwidth
    over ``nbytes`` at the better of the two, as a fraction of the copy bandwidth."""
    best = min(timing.median_us, graph.median_us) if graph else timing.median_us
    gbs = nbytes / (best * 1e-6) / 1e9
    return {
        "case": case, "impl": impl, "us": timing.median_us,
        "graph_us": graph.median_us if graph else None, "gbs": gbs, "copy_frac": gbs / copy_gbs,
        "copy_gbs": copy_gbs, "mbytes": nbytes / 1e6, "best_us": best, **extra,
    }  # fmt: skip


def format_rows(rows: list[dict], case_width: int, impl_width: int, extra=()) -> str:
    """The table of :func:`bandwidth_row` rows; ``extra`` = (header, key, format) columns ("-"
    in a row without that key)."""
    torch = require_torch()
    head = (f"{'case':{case_width}} {'impl':{impl_width}} {'MB':>6} {'median us':>10} "
            f"{'graph us':>9} {'GB/s':>7} {'% copy':>7}")  # fmt: skip
    head += "".join(f" {h:>8}" for h, _, _ in extra)
    lines = [
        f"device: {torch.cuda.get_device_name()}  copy bandwidth {rows[0]['copy_gbs']:.0f} GB/s "
        "(read+write)",
        head,
    ]
    for r in rows:
        graph = f"{r['graph_us']:.1f}" if r["graph_us"] is not None else "-"
        line = (f"{r['case']:{case_width}} {r['impl']:{impl_width}} {r['mbytes']:6.1f} "
                f"{r['us']:10.1f} {graph:>9} {r['gbs']:7.0f} {100 * r['copy_frac']:6.1f}%")  # fmt: skip
        lines.append(
            line + "".join(f" {r[k]:8{fmt}}" if k in r else f" {'-':>8}" for _, k, fmt in extra)
        )
    return "\n".join(lines)


@contextmanager
def backend(name: str):
    """``MAMBA2_ROCM_BACKEND=name`` inside the block (the ops read it on every call)."""
    old = os.environ.get("MAMBA2_ROCM_BACKEND")
    os.environ["MAMBA2_ROCM_BACKEND"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MAMBA2_ROCM_BACKEND", None)
        else:
            os.environ["MAMBA2_ROCM_BACKEND"] = old


TRITON = "mamba_ssm triton"


def compare(case: str, ours: Callable, triton: Callable | None, args: tuple, kwargs: dict,
            nbytes: int, copy_gbs: float, calls: dict | None = None,
            graphs: dict | None = None,
            impls: tuple[str, ...] = ("kernel", "torch", TRITON)) -> list[dict]:  # fmt: skip
    """:func:`bandwidth_row` rows of one case for our op on the kernel tier, on the torch tier,
    and mamba_ssm's op (``triton``, when importable), each called as ``fn(*args, **kwargs)``
    (mamba_ssm's op ignores the backend setting); ``calls`` / ``graphs`` map an implementation to
    :func:`time_calls` / :func:`time_graph` keyword arguments (only those in ``graphs`` are also
    graph-timed; default: the kernel and Triton); ``impls`` those to run."""
    graphs = {"kernel": {}, TRITON: {}} if graphs is None else graphs
    fns = {"kernel": ours, "torch": ours, TRITON: triton}
    rows = []
    for impl in impls:
        fn = fns[impl]
        if fn is None:
            continue
        call = functools.partial(fn, *args, **kwargs)
        with backend("kernel" if impl == TRITON else impl):
            t = time_calls(call, **(calls or {}).get(impl, {}))
            gr = time_graph(call, **graphs[impl]) if impl in graphs else None
        rows.append(bandwidth_row(case, impl, t, gr, nbytes, copy_gbs))
    return rows


def python_json(code: str, failure: str, env: dict[str, str] | None = None):
    """What ``python -c code`` (this interpreter, in a fresh process) prints as JSON on its last
    line; a nonzero exit raises RuntimeError with ``failure`` and the end of its stderr."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{failure}:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def triton_best_of(op: str, processes: int, dtype: str, env: dict[str, str] | None = None,
                   label: str = TRITON, **run_kwargs) -> dict[str, dict]:  # fmt: skip
    """mamba_ssm's Triton row per case, the fastest of ``processes`` fresh processes (its
    autotuner picks a configuration per process, and the pick changes the time): each runs
    ``mamba2_rocm.bench.<op>.run(dtype, impls=(TRITON,), **run_kwargs)``; empty where
    mamba_ssm is absent. ``env``: variables set in those processes (e.g. ``DISABLE_MMA_V3``),
    which then get a Triton cache folder of their own, so that no kernel compiled without the
    variable is reused; the rows are labelled ``label``."""
    import tempfile

    extra = "".join(f", {k}={v!r}" for k, v in run_kwargs.items())
    code = (f"import json; from mamba2_rocm.bench import {op} as m; "
            f"print(json.dumps(m.run(dtype={dtype!r}, impls=({TRITON!r},){extra})))")  # fmt: skip
    best: dict[str, dict] = {}
    cache_dir = (
        nullcontext() if env is None else tempfile.TemporaryDirectory(prefix="m2r-triton-cache-")
    )
    with cache_dir as cache:
        proc_env = None if env is None else {**os.environ, **env, "TRITON_CACHE_DIR": cache}
        for _ in range(processes):
            for row in python_json(code, f"bench {op}: a Triton process failed", proc_env):
                if row["case"] not in best or row["best_us"] < best[row["case"]]["best_us"]:
                    best[row["case"]] = {**row, "impl": f"{label} (best of {processes})"}
    return best


#: mamba_ssm's Triton with Hopper's wgmma turned off (``DISABLE_MMA_V3=1``: mma.sync only, the
#: instruction class of our NVIDIA build and the one AMD's per-wave MFMA / WMMA match)
TRITON_NO_WGMMA = f"{TRITON}, DISABLE_MMA_V3=1"
NO_WGMMA_ENV = {"DISABLE_MMA_V3": "1"}


def add_triton_best(rows: list[dict], op: str, processes: int, dtype: str, target: float,
                    no_wgmma_target: float | None = None, **run_kwargs) -> list[dict]:  # fmt: skip
    """``rows`` with Triton's best-of-``processes`` rows (:func:`triton_best_of`) and a summary
    row (:func:`ratio_summary` against ``target``) appended; :func:`split_summary` undoes it.
    With ``no_wgmma_target`` also Triton without wgmma (:data:`TRITON_NO_WGMMA`, processes of
    its own) and its ratios against that target."""
    best = triton_best_of(op, processes, dtype, **run_kwargs)
    summary = ratio_summary(rows, best, target)
    extra: dict[str, dict] = {}
    if no_wgmma_target is not None and best:
        extra = triton_best_of(op, processes, dtype, env=NO_WGMMA_ENV, label=TRITON_NO_WGMMA,
                               **run_kwargs)  # fmt: skip
        summary += ratio_summary(rows, extra, no_wgmma_target,
                                 peer="Triton's best with DISABLE_MMA_V3=1")  # fmt: skip
    return [*rows, *best.values(), *extra.values(), {"summary": summary}]


def split_summary(rows: list[dict]) -> tuple[list[dict], list[str]]:
    """The table rows and the summary lines of :func:`add_triton_best`'s rows."""
    table = [r for r in rows if "summary" not in r]
    return table, [line for r in rows if "summary" in r for line in r["summary"]]


def ratio_summary(rows: list[dict], triton_best: dict[str, dict], target: float,
                  peer: str = "Triton's best") -> list[str]:  # fmt: skip
    """Per case: our kernel's best time (the graph-timed one where there is one: device time)
    against Triton's best of processes (``triton_best``, named ``peer``) and against ``target``
    x faster, and the eager per-call medians' ratio (launch and host time included: what an
    eager caller sees); then the worst of each over the grid."""
    lines, worst, worst_eager = [], None, None
    for r in rows:
        if r["impl"] != "kernel" or r["case"] not in triton_best:
            continue
        t = triton_best[r["case"]]
        ratio, eager = t["best_us"] / r["best_us"], t["us"] / r["us"]
        mark = "" if ratio >= target else f"  (below {target:.1f}x)"
        lines.append(f"{r['case']}: {r['best_us']:.1f} us vs {peer} {t['best_us']:.1f} us: "
                     f"{ratio:.2f}x{mark}; eager per call {r['us']:.1f} vs {t['us']:.1f} us: "
                     f"{eager:.2f}x")  # fmt: skip
        worst = ratio if worst is None else min(worst, ratio)
        worst_eager = eager if worst_eager is None else min(worst_eager, eager)
    if worst is not None:
        name = "Triton best" if peer == "Triton's best" else peer
        lines.append(f"worst ratio over the grid ({name} / ours): {worst:.2f}x device time, "
                     f"{worst_eager:.2f}x eager per call")  # fmt: skip
    return lines


def peak_mb(fn: Callable[[], object]) -> float:
    """Peak memory one call of ``fn`` allocates above what was allocated before it, in MiB."""
    torch = require_torch()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20
