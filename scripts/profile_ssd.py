"""Per-kernel device time of the SSD forward (torch.profiler), ours or mamba_ssm's Triton, at
the shapes where the two differ most, with the per-call graph time and the accuracy of the
output and final states against the float64 chunked reference. ``--backward``: a training step
instead (forward, then every input's gradient through autograd, the final states' included),
per kernel of the forward, the recomputation and the backward stages; no accuracy columns.

Usage (on the GPU machine, kernels built; mamba_ssm's Triton ops importable for --triton):
    python scripts/profile_ssd.py [--triton] [--backward] [--json FILE] [--scan-form FORM] [SHAPE ...]
SHAPE names a row of SHAPES (default: all). Each shape prints one line: graph µs per call, the
kernels' mean device µs per call, and (shapes up to 2^19 tokens x heads) the relative L2 error
of out and of the final states against ``ssd_chunked(..., compute_dtype=float64)``; --json
appends the rows to FILE. ``--once SHAPE`` makes one warm-up and one timed call, no profiler:
the target for ncu (scripts/device_profile.sh); the timed call is the NVTX range ``timed``, so
``ncu --nvtx --nvtx-include timed/`` skips Triton's autotuning launches. ``--triton --configs``
also prints, per shape, the config Triton's autotuner kept for each stage (its tile sizes, warps
and stages): where our tiles differ from those, docs/design.md's SSD entries say so.
"""

import argparse
import json
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from mamba2_rocm.kernels import SSD_SCAN_FORMS

#: name -> (batch, seqlen, nheads, headdim, ngroups, dstate, chunk_size): the issue's two
#: shapes, then bench ssd's grid points where ours is furthest behind Triton
SHAPES = {
    "issue-g1": (2, 4096, 32, 64, 1, 128, 256),
    "issue-g8": (1, 16384, 64, 64, 8, 128, 256),
    "mamba2-130m": (8, 512, 24, 64, 1, 128, 256),
    "mamba2-2.7b": (4, 2048, 80, 64, 1, 128, 256),
    "nemotron-h": (1, 8192, 128, 64, 8, 128, 128),
    "falcon-h1": (8, 512, 24, 128, 1, 256, 128),
    "falcon-h1-b4": (4, 2048, 24, 128, 1, 256, 128),
    "falcon-h1-l8192": (1, 8192, 24, 128, 1, 256, 128),
    "codestral-b8": (8, 512, 128, 64, 8, 128, 256),
    "mamba2-2.7b-b8": (8, 512, 80, 64, 1, 128, 256),
    # points the separate state-passing kernel runs (too few chains for the chained chunk_state)
    "mamba2-130m-b4": (4, 2048, 24, 64, 1, 128, 256),
    "mamba2-130m-l16384": (1, 16384, 24, 64, 1, 128, 256),
    "mamba2-370m-b4": (4, 2048, 32, 64, 1, 128, 256),
    "mamba2-780m-l8192": (1, 8192, 48, 64, 1, 128, 256),
}


def make_call(fn, b, L, h, p, groups, n, cs, backward=False):
    g = torch.Generator(device="cuda").manual_seed(L + h)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    x, dt = r(b, L, h, p).bfloat16(), (r(b, L, h) - 2).bfloat16()
    B, C = r(b, L, groups, n).bfloat16(), r(b, L, groups, n).bfloat16()
    A, D, bias = -torch.rand(h, device="cuda", generator=g) - 0.05, r(h), r(h) * 0.5
    args = (x, dt, A, B, C, cs)
    kw = dict(D=D, dt_bias=bias, dt_softplus=True, return_final_states=True)
    if not backward:
        return (lambda: fn(*args, **kw)), args, kw
    leaves = [t.requires_grad_() for t in (x, dt, A, B, C, D, bias)]
    cot = [r(b, L, h, p).bfloat16(), r(b, h, p, n)]

    def step():
        return torch.autograd.grad(list(fn(*args, **kw)), leaves, cot)

    return step, args, kw


def rel(a, ref):
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


def profile_shape(name, fn, label, iters=20, backward=False):
    from mamba2_rocm.bench.timing import time_calls, time_graph
    from mamba2_rocm.reference.ssd import ssd_chunked

    shape = SHAPES[name]
    call, args, kw = make_call(fn, *shape, backward=backward)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
    per = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name.split("(")[0]] += e.device_time / iters
    # autograd's backward runs on its own thread: no graph capture; device-event medians instead
    timed = time_calls(call, warmup=2, iters=iters) if backward else time_graph(call)
    row = {"impl": label, "shape": name, "backward": backward,
           "graph_us" if not backward else "step_us": round(timed.median_us, 1),
           "kernels_us": {k: round(v, 1) for k, v in sorted(per.items(), key=lambda kv: -kv[1])}}  # fmt: skip
    _, L, h = shape[:3]
    # the fp64 reference's memory grows with chunk_size x tokens x heads
    if not backward and L * h <= 2**19:
        out, fin = call()
        ref, ref_fin = ssd_chunked(*args, **kw, compute_dtype=torch.float64)
        row.update(out_rel=rel(out, ref), final_rel=rel(fin, ref_fin))
    return row


#: mamba_ssm's modules holding the SSD forward's autotuned Triton kernels
TRITON_STAGE_MODULES = ("ssd_chunk_state", "ssd_chunk_scan", "ssd_state_passing", "ssd_bmm")


def triton_configs(modules, seen: set) -> dict[str, list[tuple[str, str]]]:
    """The configs Triton's autotuner kept, per autotuned kernel of ``modules`` (an Autotuner:
    its ``configs`` to choose from and its ``cache`` of key -> the kept one; a plain jitted
    kernel's ``cache`` holds compiled code and is skipped): {name: [(key, config)]}, only the
    (name, key) pairs not in ``seen``, which it adds them to, so that each shape reports what its
    own calls tuned."""
    kept = {}
    for mod in modules:
        for name, obj in sorted(vars(mod).items()):
            cache = getattr(obj, "cache", None)
            if not isinstance(cache, dict) or not hasattr(obj, "configs"):
                continue
            for key, config in cache.items():
                if (name, key) not in seen:
                    seen.add((name, key))
                    kept.setdefault(name, []).append((str(key), str(config)))
    return kept


def format_row(r):
    acc = ""
    if "out_rel" in r:
        acc = f"  out {r['out_rel']:.2e} final {r['final_rel']:.2e}"
    top = 16 if r.get("backward") else 6
    kernels = " ".join(f"{k[-28:]}={v}" for k, v in list(r["kernels_us"].items())[:top])
    total = f"step {r['step_us']:8.1f}" if r.get("backward") else f"graph {r['graph_us']:8.1f}"
    summed = sum(r["kernels_us"].values())
    return f"{r['shape']:12} {r['impl']:7} {total} us (kernels {summed:.1f}){acc} | {kernels}"


def force_scan_form(form, shapes):
    """Make our SSD forward take chunk_scan's kernel form ``form`` (a key of
    mamba2_rocm.kernels.SSD_SCAN_FORMS) instead of the one mamba2_rocm.ops.ssd._scan_form picks
    for the GPU at hand. ``shapes``: name -> SHAPES row; ValueError naming those whose chunk size
    is under the form's rows."""
    rows = SSD_SCAN_FORMS[form][0]
    small = [name for name, shape in shapes.items() if shape[6] < rows]
    if small:
        raise ValueError(
            f"--scan-form {form} takes chunks of {rows} and more: not {', '.join(small)}"
        )
    import mamba2_rocm.ops.ssd as ssd_ops

    ssd_ops._scan_form = lambda chunk_size, dt_name, matrix_cores, headdim: form


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "shapes", nargs="*", metavar="SHAPE", help=f"of {', '.join(SHAPES)} (default: all)"
    )
    ap.add_argument("--triton", action="store_true", help="mamba_ssm's Triton kernels, not ours")
    ap.add_argument("--json", metavar="FILE", help="append the rows to FILE (JSON lines)")
    ap.add_argument("--backward", action="store_true", help="a training step: forward + backward")
    ap.add_argument("--once", choices=list(SHAPES), help="one call at this shape, for ncu")
    ap.add_argument(
        "--configs",
        action="store_true",
        help="with --triton: the config its autotuner kept per stage, after each shape",
    )
    ap.add_argument(
        "--scan-form",
        choices=list(SSD_SCAN_FORMS),
        help="ours: chunk_scan's kernel form (mamba2_rocm.kernels.SSD_SCAN_FORMS) instead of the "
        "one mamba2_rocm.ops.ssd._scan_form picks for this GPU, to time the forms against each "
        "other (bf16: every form; chunk sizes below the form's rows are refused)",
    )
    args = ap.parse_args()
    unknown = sorted(set(args.shapes) - set(SHAPES))
    if unknown:
        ap.error(f"unknown shape(s) {', '.join(unknown)}; choose from {', '.join(SHAPES)}")
    if args.scan_form:
        if args.triton:
            ap.error("--scan-form picks among our kernels: not with --triton")
        names = [args.once] if args.once else args.shapes or list(SHAPES)
        try:
            force_scan_form(args.scan_form, {name: SHAPES[name] for name in names})
        except ValueError as exc:
            ap.error(str(exc))
    if args.configs and not args.triton:
        ap.error("--configs reports Triton's autotuner: only with --triton")
    if args.triton:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as fn
    else:
        from mamba2_rocm import mamba_chunk_scan_combined as fn
    if args.configs:  # (their modules: imported only when asked for)
        import importlib

        stages = [importlib.import_module(f"mamba_ssm.ops.triton.{m}") for m in TRITON_STAGE_MODULES]
        seen = set()
    if args.once:
        call = make_call(fn, *SHAPES[args.once], backward=args.backward)[0]
        call()  # (Triton autotunes here)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("timed")  # ncu --nvtx --nvtx-include timed/ profiles this call
        call()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        return
    for name in args.shapes or SHAPES:
        row = profile_shape(name, fn, "triton" if args.triton else "ours", backward=args.backward)
        print(format_row(row), flush=True)
        if args.configs:
            row["triton_configs"] = triton_configs(stages, seen)
            for kernel, kept in row["triton_configs"].items():
                for key, config in kept:
                    print(f"    {kernel} {key} -> {config}", flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
