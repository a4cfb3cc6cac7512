"""``python -m mamba2_rocm.pipeline <command>``: what the Nox sessions call.

Commands: ``targets`` | ``toolchain [--refresh] [TARGET...]`` | ``build TARGET... [--out wheels]``
| ``reproducibility TARGET``.
"""

from __future__ import annotations

import argparse
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
    p = sub.add_parser("reproducibility", help="build twice from scratch and compare the wheels")
    p.add_argument("target")
    args = parser.parse_args(argv)

    from mamba2_rocm.pipeline.stages import PipelineError, build_targets

    try:
        if args.cmd == "targets":
            for recipe in load_recipes().values():
                print(recipe.target)
        elif args.cmd == "toolchain":
            recipes = [get_recipe(t) for t in args.targets] or list(load_recipes().values())
            log = (lambda *_: None) if args.print_tag else print
            for tag in dict.fromkeys(
                images.ensure_toolchain(r, refresh=args.refresh, log=log) for r in recipes
            ):
                print(tag)
        elif args.cmd == "build":
            names = list(load_recipes()) if args.targets == ["all"] else args.targets
            recipes = [get_recipe(t) for t in names]  # every name checked before any work
            start = time.monotonic()
            build_targets(recipes, Path(args.out), jobs=args.jobs)
            print(f"built {len(recipes)} target(s) in {time.monotonic() - start:.1f} s")
        elif args.cmd == "reproducibility":
            from mamba2_rocm.pipeline.repro import check_reproducible

            diffs = check_reproducible(get_recipe(args.target))
            if diffs:
                print("NOT reproducible:\n  " + "\n  ".join(diffs), file=sys.stderr)
                return 1
            print(f"{args.target}: two builds from scratch gave byte-identical wheels")
    except (PipelineError, images.DockerError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
