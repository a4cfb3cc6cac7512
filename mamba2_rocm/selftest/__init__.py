"""``python -m mamba2_rocm selftest [--quick] [--report FILE]``: are the kernels right, and how
fast, on this GPU?

For every op family the kernel tier against the torch tier in float64 at odd shapes per dtype
(:mod:`mamba2_rocm.selftest.checks`), the non-finite containment rules, a graph capture of a
decode step, then a short timing of each op against the torch tier (and mamba_ssm's Triton
kernels when the real mamba_ssm is installed). Progress is printed as it runs, then a summary;
the exit status is 0 only when every check passed. ``--report FILE`` writes what the project
counts in its hardware-truth table (:mod:`mamba2_rocm.selftest.report`): please send it.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import time
from pathlib import Path
from typing import Any

from mamba2_rocm.selftest.report import REPORT_FORMAT, privacy_problems

__all__ = ["PEERS", "main", "peer_ops", "run_selftest"]


def _environment(device) -> dict[str, Any]:
    """The device and software, as a bench record names them (``bench.records.environment``),
    plus the ISA without features (what a recipe lists) and our version."""
    import torch

    from mamba2_rocm import __version__
    from mamba2_rocm.arch import split_arch_name
    from mamba2_rocm.bench.records import environment

    with torch.cuda.device(device):
        env = environment()
    return {
        "name": env["device"], "arch": split_arch_name(env["arch"])[0], "arch_full": env["arch"],
        "runtime": env["runtime"], "driver": env["driver"], "torch": env["torch"],
        "mamba2_rocm": __version__,
    }  # fmt: skip


def _kernels(device) -> dict[str, Any]:
    from mamba2_rocm.runtime.loader import kernels_for_device

    kset = kernels_for_device(device.index or 0)
    if kset is None:
        return {}
    kdir = kset.kdir
    out = {"target": kdir.target, "origin": kdir.origin, "source_commit": _source_commit(kdir),
           "code_objects": {co["file"]: co["sha256"] for co in kdir.manifest["code_objects"]}}  # fmt: skip
    if kdir.manifest.get("emulates"):  # an NVIDIA build of an AMD target's code paths
        out["emulates"] = kdir.manifest["emulates"]
    return out


def _source_commit(kdir) -> str | None:
    """The commit a kernel package was built from (its module's ``SOURCE_COMMIT``, written by
    the pipeline's package stage); None for kernel dirs that are not a package's."""
    import importlib

    if not kdir.origin.startswith("package "):
        return None
    try:  # <module>/kernels/<arch>
        module = importlib.import_module(kdir.path.parent.parent.name)
    except ImportError:
        return None
    return getattr(module, "SOURCE_COMMIT", None)


#: op -> (module, function, label) of the peers timed beside ours when the real packages are
#: importable (upstream's pure-Python mamba-ssm brings its Triton ops; causal-conv1d where it
#: built); the drop-in's facades under those names are ours and are skipped
PEERS = {
    "ssd": ("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined", "mamba_ssm Triton"),
    "gated norm": ("mamba_ssm.ops.triton.layernorm_gated", "rmsnorm_fn", "mamba_ssm Triton"),
    "decode": ("mamba_ssm.ops.triton.selective_state_update", "selective_state_update",
               "mamba_ssm Triton"),
    "conv1d": ("causal_conv1d", "causal_conv1d_fn", "causal-conv1d"),
}  # fmt: skip


def peer_ops() -> dict[str, tuple[str, Any]]:
    """op -> (label, function) for each peer in :data:`PEERS` that imports and is not ours."""
    import importlib

    out = {}
    for op, (module, name, label) in PEERS.items():
        try:
            fn = getattr(importlib.import_module(module), name)
        except Exception:  # not installed, or its compiled part missing: no column
            continue
        if not getattr(fn, "__module__", "mamba2_rocm").startswith("mamba2_rocm"):
            out[op] = (label, fn)
    return out


def _timings(device, quick: bool, log) -> list[dict]:
    """Each op at a model-like shape: the kernel tier against the torch tier, and against
    upstream's op where it is importable (:func:`peer_ops`); CUDA-graph-free per-call medians,
    enough to spot a kernel that runs far off its expected speed."""
    import torch

    import mamba2_rocm
    from mamba2_rocm.bench.timing import time_calls
    from mamba2_rocm.selftest.checks import backend

    def timed(fn, reps):
        return time_calls(fn, warmup=2, iters=reps).median_us

    g = torch.Generator(device=device).manual_seed(5)
    bf = torch.bfloat16

    def r(*shape, dtype=bf):
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    b, seqlen, h, p, n = 1, 2048, 24, 64, 128
    x, dt_ = r(b, seqlen, h, p), torch.rand(b, seqlen, h, device=device, generator=g)
    A, B, C = (
        -torch.rand(h, device=device, generator=g) - 0.1,
        r(b, seqlen, 1, n),
        r(b, seqlen, 1, n),
    )
    xc, wc = r(b, h * p, seqlen), r(h * p, 4)
    xn, wn, zn = (
        r(4 * seqlen, h * p),
        torch.ones(h * p, device=device, dtype=bf),
        r(4 * seqlen, h * p),
    )
    st = r(16, h, p, n)
    Ad = A[:, None, None].expand(h, p, n)
    xd, dtd, Bd = (
        r(16, h, p),
        torch.rand(16, h, device=device, generator=g)[:, :, None].expand(16, h, p),
        r(16, 1, n),
    )
    args = {
        "ssd b1 l2048 h24 p64 n128": ("ssd", (x, dt_, A, B, C, 256), {}),
        "conv1d b1 d1536 l2048": ("conv1d", (xc, wc), {"activation": "silu"}),
        "gated norm rows8192 d1536": ("gated norm", (xn, wn, None, zn), {}),
        "decode step b16 h24 p64 n128": ("decode", (st, xd, dtd, Ad, Bd, Bd), {}),
    }
    ours_fns = {"ssd": mamba2_rocm.mamba_chunk_scan_combined, "conv1d": mamba2_rocm.causal_conv1d_fn,
                "gated norm": mamba2_rocm.rmsnorm_fn, "decode": mamba2_rocm.selective_state_update}  # fmt: skip
    peers = peer_ops()
    reps = 5 if quick else 20
    rows = []
    for name, (op, a, kw) in args.items():
        fn = functools.partial(ours_fns[op], *a, **kw)
        with backend("kernel"):
            ours = timed(fn, reps)
        with backend("torch"):
            theirs = timed(fn, max(2, reps // 4))
        row = {"op": name, "kernel_us": round(ours, 1), "torch_us": round(theirs, 1)}
        line = f"  time {name}: kernel {ours:.1f} µs, torch tier {theirs:.1f} µs ({theirs / ours:.1f}x)"
        if op in peers:
            label, peer = peers[op]
            try:  # (a peer that fails says so; it fails none of our checks)
                peer_us = timed(functools.partial(peer, *a, **kw), reps)
            except Exception as exc:
                row.update(peer=label, peer_error=f"{type(exc).__name__}: {exc}"[:200])
                line += f"; {label} failed ({type(exc).__name__})"
            else:
                row.update(peer=label, peer_us=round(peer_us, 1))
                line += f"; {label} {peer_us:.1f} µs ({peer_us / ours:.2f}x)"
        rows.append(row)
        log(line)
    return rows


def run_selftest(quick: bool = False, report_path: Path | None = None, log=print,
                 device=None) -> tuple[bool, dict]:  # fmt: skip
    """Every check on ``device`` (default: the current GPU); returns (all passed, report)."""
    import torch

    from mamba2_rocm.selftest.checks import CheckResult, correctness_checks, special_checks

    if device is None:
        if not torch.cuda.is_available():
            raise RuntimeError("selftest needs a ROCm (or CUDA) GPU that torch can see; "
                               "`python -m mamba2_rocm doctor` says why it cannot")  # fmt: skip
        device = torch.device("cuda", torch.cuda.current_device())
    env = _environment(device)
    kernels = _kernels(device)
    log(f"selftest on {env['name']} ({env['arch']}, {env['runtime']}, torch {env['torch']}); "
        f"kernels: {kernels.get('target', 'none')} from {kernels.get('origin', '-')}")  # fmt: skip
    checks = [*correctness_checks(quick), *special_checks()]
    results: list[CheckResult] = []
    start = time.monotonic()
    for i, check in enumerate(checks, 1):
        t0 = time.monotonic()
        try:
            res = check.run(device)
        except Exception as exc:  # a crash is a failed check, named
            res = CheckResult(
                check.name, check.family, False, detail=f"{type(exc).__name__}: {exc}"[:300]
            )
        results.append(res)
        err = (
            f" error {res.error:.1e} (tolerance {res.tolerance:.0e})"
            if res.error is not None
            else ""
        )
        log(f"[{i:>2}/{len(checks)}] {'ok  ' if res.ok else 'FAIL'} {res.name}{err}"
            f" ({time.monotonic() - t0:.1f} s){'  -- ' + res.detail if res.detail else ''}")  # fmt: skip
    timings = []
    if all(r.ok for r in results):
        try:
            timings = _timings(device, quick, log)
        except Exception as exc:
            log(f"  timing skipped: {type(exc).__name__}: {exc}")
    failed = [r for r in results if not r.ok]
    log(f"\n{len(results) - len(failed)} of {len(results)} checks passed in "
        f"{time.monotonic() - start:.0f} s" + (": FAILED " + ", ".join(r.name for r in failed) if failed else ""))  # fmt: skip
    report = {
        "format": REPORT_FORMAT, "tool": "python -m mamba2_rocm selftest" + (" --quick" if quick else ""),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "mamba2_rocm": env.pop("mamba2_rocm"), "device": env, "tier": "kernel",
        "kernels": kernels, "checks": [r.as_dict() for r in results], "timings": timings,
        "summary": {"passed": len(results) - len(failed), "failed": len(failed)},
    }  # fmt: skip
    if report_path is not None:
        text = json.dumps(report, indent=1) + "\n"
        leaks = privacy_problems(text)
        if leaks:  # never written: the report must not identify the machine
            raise RuntimeError(f"the report would contain this machine's {', '.join(leaks)}")
        report_path.write_text(text)
        log(f"report: {report_path} (please attach it to an issue: it holds no host, user or path)")
    return not failed, report


def register(sub) -> None:
    p = sub.add_parser("selftest", help="check the kernels on this GPU against the float64 torch "
                       "tier, time them, and write a report to send back")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="bf16 only, one shape a family (< 2 min)")
    p.add_argument("--report", type=Path, help="write the report (JSON) here")
    p.set_defaults(func=lambda args: main(args.quick, args.report))


def main(quick: bool = False, report: Path | None = None) -> int:
    ok, _ = run_selftest(quick, report)
    return 0 if ok else 1
