"""``python -m mamba2_rocm build``: compile the kernels for one or more targets."""

from __future__ import annotations

import argparse


def _run(args: argparse.Namespace) -> int:
    from mamba2_rocm.build.driver import build

    result = build(args.arch, args.out, sources=args.source or None, jobs=args.jobs,
                   code_object_version=args.code_object_version, extra_flags=args.extra_flag or (),
                   emulate=args.emulate)  # fmt: skip
    for target, path in result.targets.items():
        manifest = result.manifest(target)
        kernels = [k for co in manifest["code_objects"] for k in co["kernels"]]
        worst_regs = max(k["vgpr"] for k in kernels)
        worst_lds = max(k["lds_bytes"] for k in kernels)
        spilling = sum(1 for k in kernels if k["vgpr_spill"] or k["sgpr_spill"])
        spills = f"{spilling} kernels spill (allowed: emulation)" if spilling else "0 spills"
        print(
            f"{target}: {len(manifest['code_objects'])} code objects, {len(kernels)} kernels, "
            f"max {worst_regs} VGPRs, max {worst_lds} B LDS, {spills} -> {path}"
            + (f" (emulates {args.emulate}: never shipped)" if args.emulate else "")
        )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build", help="compile the kernels into verified code objects")
    p.add_argument("--arch", action="append", required=True,
                   help="target: gfx1030, gfx11-generic, sm_90, ... or 'native' (repeatable)")  # fmt: skip
    p.add_argument("--out", required=True, help="output directory (one subdirectory per target)")
    p.add_argument("--source", action="append", help="build only this csrc source (repeatable)")
    p.add_argument("--jobs", type=int, default=None, help="parallel compiles (default: CPU count)")
    p.add_argument("--code-object-version", type=int, choices=[5, 6], default=None,
                   help="AMD code-object version (default: 6 for generic targets, else 5)")  # fmt: skip
    p.add_argument("--extra-flag", action="append", metavar="FLAG",
                   help="extra compiler flag, e.g. --extra-flag=-O3 (repeatable)")  # fmt: skip
    p.add_argument("--emulate", metavar="TARGET", default=None,
                   help="NVIDIA archs only: build an AMD target's code paths to run them on the "
                        "NVIDIA GPU (gfx1030: the FMA path; gfx11 / gfx12: the WMMA layouts, "
                        "emulated, built with clang); never shipped")  # fmt: skip
    p.set_defaults(func=_run)
