"""``python -m mamba2_rocm.pipeline <command>``: what the Nox sessions call.

Commands: ``targets`` | ``toolchain [--refresh] [TARGET...]`` | ``build TARGET... [--out wheels]``
| ``reproducibility TARGET`` | ``matrix [--github-output FILE]`` | ``publish [TARGET...]
(--repository-url URL | --check-only)`` | ``pull TARGET --index-url URL`` | ``gpu-tests TARGET``
| ``truth [--gates DIR]`` | ``emulation-record --variant V [--suite S] --junit FILE --commit SHA``
| ``emulation-kernels --variant V DIR`` | ``resources [--target T]... [--source S]... --out DIR
[--against DIR]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

from mamba2_rocm.pipeline import images
from mamba2_rocm.pipeline.recipes import get_recipe, load_recipes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mamba2_rocm.pipeline")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("targets", help="list the recipes")
    p = sub.add_parser("toolchain", help="build or refresh the toolchain images")
    p.add_argument("targets", nargs="*")
    p.add_argument("--refresh", action="store_true", help="rebuild without Docker's cache")
    p.add_argument("--print-tag", action="store_true", help="print only the image tag(s)")
    p = sub.add_parser("build", help="build wheels/<target>/ for each target")
    p.add_argument("targets", nargs="+", help="targets, or 'all'")
    p.add_argument("--out", default="wheels")
    p.add_argument("--jobs", type=int, default=None)
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="wait this long for another build holding a target's output folder "
                   "(default: refuse at once; 'inf' waits for good)")  # fmt: skip
    p = sub.add_parser("reproducibility", help="build twice from scratch and compare the wheels")
    p.add_argument("target")
    p = sub.add_parser("matrix", help="print the CI matrices (JSON) generated from recipes/")
    p.add_argument("--github-output", help="also append them to this $GITHUB_OUTPUT file")
    p = sub.add_parser("publish", help="check wheels/ and upload with twine")
    p.add_argument("targets", nargs="*", help="targets (default: every recipe)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--repository-url", help="the index's upload URL")
    where.add_argument("--check-only", action="store_true", help="every check, no upload")
    p.add_argument("--wheels", default="wheels", help="folder of <target>/ build outputs")
    p.add_argument("--gates", action="append", default=[],
                   help="also look for gpu-gate.json files under this folder (repeatable)")  # fmt: skip
    p = sub.add_parser("pull", help="install a target from an index and check it")
    p.add_argument("target")
    p.add_argument("--index-url", required=True)
    p.add_argument("--manifest", help="the release's build-manifest.json "
                   "(default: wheels/<target>/build-manifest.json)")  # fmt: skip
    p.add_argument("--torch", help="install this torch first (requirement or wheel), as a user has")
    p.add_argument("--torch-index-url", help="index for --torch (default: --index-url)")
    p.add_argument("--venv", help="create the venv here and keep it (default: a temporary one)")
    p = sub.add_parser("gpu-tests", help="test wheels/<target>/ on this machine's AMD GPU")
    p.add_argument("target")
    p.add_argument("--base-image", default=None, help="ROCm PyTorch image to test on")
    p.add_argument("--wheels", default="wheels")
    p = sub.add_parser("truth", help="the hardware-truth table: each target's deepest verification")
    p.add_argument("--records", default="records/emulation", help="emulation records folder")
    p.add_argument("--gates", action="append", default=[],
                   help="folder of GPU gate records from the runners (repeatable)")  # fmt: skip
    p.add_argument("--wheels", default="wheels", help="folder of <target>/ build outputs")
    p.add_argument("--reports", action="append", default=[],
                   help="folder of users' selftest reports (repeatable): adds their column")  # fmt: skip
    p = sub.add_parser("emulation-record",
                       help="write the record of a GPU-suite run on an emulation build")  # fmt: skip
    p.add_argument("--variant", required=True)
    p.add_argument("--suite", default="gpu", help="which suite ran (truth.EMULATION_SUITES)")
    p.add_argument("--junit", required=True, help="pytest's --junitxml report of the run")
    p.add_argument("--commit", required=True, help="the git sha the build and tests came from")
    p.add_argument("--device", required=True, help="the GPU it ran on")
    p.add_argument("--date", required=True, help="when it ran (ISO 8601)")
    p.add_argument("--out", required=True)
    p = sub.add_parser("emulation-kernels",
                       help="check that a prebuilt kernel folder is the named emulation's build")  # fmt: skip
    p.add_argument("--variant", default="", help="the variant it must be ('' = no emulation)")
    p.add_argument("kernels", help="the folder build --out wrote (<arch>/manifest.json)")
    p = sub.add_parser("resources",
                       help="compile the work tree's kernels for the AMD targets and report "
                       "their registers, LDS, spills and waves per SIMD")  # fmt: skip
    p.add_argument("--target", action="append", default=[],
                   help="a recipe (repeatable; default: every recipe)")  # fmt: skip
    p.add_argument("--source", action="append", default=[],
                   help="a csrc source without .hip (repeatable; default: every source)")  # fmt: skip
    p.add_argument("--out", required=True, help="folder for the code objects and resources.json")
    p.add_argument("--against", help="a folder an earlier run wrote: print what changed")
    p.add_argument("--jobs", type=int, default=None)
    args = parser.parse_args(argv)

    from mamba2_rocm.pipeline import guard
    from mamba2_rocm.pipeline.stages import PipelineError

    # the long commands stop cleanly on SIGINT / SIGTERM / SIGHUP: their containers are killed,
    # temporary folders removed, outputs left as they were; the exit says which stage it was
    long = args.cmd in ("build", "reproducibility", "toolchain", "gpu-tests", "resources")
    try:
        with guard.cancellable() if long else contextlib.nullcontext():
            return _run(args)
    except guard.Cancelled as exc:
        print(f"error: {exc.message('python -m mamba2_rocm.pipeline ' + ' '.join(argv or sys.argv[1:]))}; "
              "its containers are stopped, its temporary folders removed and the outputs "
              "left as they were", file=sys.stderr)  # fmt: skip
        return exc.exit_code
    except (PipelineError, images.DockerError, ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    from mamba2_rocm.pipeline.stages import build_targets

    if args.cmd == "targets":
        for recipe in load_recipes().values():
            print(recipe.target)
    elif args.cmd == "toolchain":
        recipes = [get_recipe(t) for t in args.targets] or list(load_recipes().values())
        log = (lambda *_: None) if args.print_tag else print
        from mamba2_rocm.pipeline.guard import enter_stage

        with enter_stage("toolchain image"):  # (what a cancellation's message names)
            tags = [images.ensure_toolchain(r, refresh=args.refresh, log=log) for r in recipes]
        for tag in dict.fromkeys(tags):
            print(tag)
    elif args.cmd == "build":
        names = list(load_recipes()) if args.targets == ["all"] else args.targets
        recipes = [get_recipe(t) for t in names]  # every name checked before any work
        start = time.monotonic()
        build_targets(recipes, Path(args.out), jobs=args.jobs, wait=args.wait)
        print(f"built {len(recipes)} target(s) in {time.monotonic() - start:.1f} s")
    elif args.cmd == "resources":
        from mamba2_rocm.pipeline.resources import run

        recipes = [get_recipe(t) for t in args.target] or list(load_recipes().values())
        against = Path(args.against) if args.against else None
        return run(recipes, args.source, Path(args.out), against, args.jobs)
    elif args.cmd == "reproducibility":
        from mamba2_rocm.pipeline.repro import check_reproducible

        diffs = check_reproducible(get_recipe(args.target))
        if diffs:
            print("NOT reproducible:\n  " + "\n  ".join(diffs), file=sys.stderr)
            return 1
        print(f"{args.target}: two builds from scratch gave byte-identical wheels")
    elif args.cmd == "matrix":
        from mamba2_rocm.pipeline.matrix import github_outputs, matrices

        recipes = list(load_recipes().values())
        print(json.dumps(matrices(recipes), indent=2))
        if args.github_output:
            github_outputs(recipes, Path(args.github_output))
    elif args.cmd == "publish":
        from mamba2_rocm.pipeline.publish import publish

        names = args.targets or list(load_recipes())
        publish([get_recipe(t) for t in names], Path(args.wheels),
                None if args.check_only else args.repository_url,
                [Path(g) for g in args.gates])  # fmt: skip
    elif args.cmd == "pull":
        from mamba2_rocm.pipeline.pull import pull

        manifest = Path(args.manifest or Path("wheels", args.target, "build-manifest.json"))
        pull(get_recipe(args.target), args.index_url, manifest, args.torch,
             args.torch_index_url, Path(args.venv) if args.venv else None)  # fmt: skip
    elif args.cmd == "truth":
        from mamba2_rocm.pipeline.truth import (
            format_table,
            read_reports,
            truth_table,
            unplaced_reports,
        )

        recipes, reports = (
            list(load_recipes().values()),
            read_reports([Path(r) for r in args.reports]),
        )
        rows = truth_table(recipes, Path(args.records), [Path(g) for g in args.gates],
                           Path(args.wheels), reports)  # fmt: skip
        print(format_table(rows, reports=bool(args.reports)))
        unplaced = unplaced_reports(recipes, reports)
        if unplaced:
            print(f"\n{len(unplaced)} report(s) counted for no target:")
            print("\n".join(f"- {line}" for line in unplaced))
    elif args.cmd == "emulation-record":
        from mamba2_rocm.pipeline.truth import emulation_record

        rec = emulation_record(Path(args.junit), args.variant, args.commit, args.device,
                               args.date, args.suite)  # fmt: skip
        Path(args.out).write_text(json.dumps(rec, indent=2, sort_keys=True) + "\n")
        print(f"{args.variant} {args.suite}: {rec['passed']} passed, {rec['failed']} failed "
              f"-> {args.out}")  # fmt: skip
    elif args.cmd == "emulation-kernels":
        from mamba2_rocm.pipeline.truth import check_emulation_kernels

        print(check_emulation_kernels(Path(args.kernels), args.variant))
    elif args.cmd == "gpu-tests":
        from mamba2_rocm.pipeline.gputest import DEFAULT_BASE_IMAGE, run_gpu_tests

        run_gpu_tests(get_recipe(args.target), Path(args.wheels),
                      args.base_image or DEFAULT_BASE_IMAGE)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
