"""A kernel directory whose code objects for some sources come from another build: a variant
built with a measurement knob (``build --source ssd_chunk_scan --extra-flag=-DM2R_SSD_SPLIT_SCAN=1``)
laid over the full build, so that one GPU can time both in the same run without rebuilding
every source twice (a full build on the device machine costs a minute of its time; one source
about ten seconds). Never shipped: the overlaid manifest names each replaced source and the
flags it was built with under ``overlays``, which the wheel packager does not read.

    python -m mamba2_rocm.build.overlay BASE VARIANT OUT

BASE and VARIANT are ``build --out`` folders (one ``<target>/manifest.json`` per target); OUT
must not exist. Every target of BASE that VARIANT also built gets VARIANT's code objects for
the sources VARIANT holds; the rest of BASE is copied as it is.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from mamba2_rocm.runtime.discovery import MANIFEST_NAME as MANIFEST


def _targets(root: Path) -> dict[str, Path]:
    return {d.name: d for d in sorted(root.iterdir()) if (d / MANIFEST).is_file()}


def overlay(base: Path, variant: Path, out: Path) -> list[str]:
    """Write BASE with VARIANT's code objects laid over it to OUT; returns one line per
    replaced (target, source). Refuses targets whose vendor or emulation differ (their code
    objects would not load together) and a VARIANT sharing no target with BASE."""
    base, variant, out = Path(base), Path(variant), Path(out)
    if out.exists():
        raise ValueError(f"{out} exists: the overlay is written to a new folder")
    btargets, vtargets = _targets(base), _targets(variant)
    if not btargets:
        raise ValueError(f"{base} holds no <target>/{MANIFEST}: not a build --out folder")
    common = sorted(set(btargets) & set(vtargets))
    if not common:
        raise ValueError(
            f"{variant} built none of {base}'s targets ({', '.join(btargets)}); "
            f"it has {', '.join(vtargets) or 'none'}"
        )
    plans = []
    for target in common:
        bm = json.loads((btargets[target] / MANIFEST).read_text())
        vm = json.loads((vtargets[target] / MANIFEST).read_text())
        for key in ("vendor", "emulates", "wavefront_size"):
            if bm.get(key) != vm.get(key):
                raise ValueError(
                    f"{target}: {key} {vm.get(key)!r} in {variant} but {bm.get(key)!r} in {base}"
                )
        plans.append((target, bm, vm))
    shutil.copytree(base, out)
    done = []
    for target, bm, vm in plans:
        tdir = out / target
        replaced = {co["source"]: co for co in vm["code_objects"]}
        for co in bm["code_objects"]:
            if co["source"] in replaced:
                (tdir / co["file"]).unlink()
        bm["code_objects"] = [co for co in bm["code_objects"] if co["source"] not in replaced]
        for source, co in sorted(replaced.items()):
            shutil.copy2(vtargets[target] / co["file"], tdir / co["file"])
            bm["code_objects"].append(co)
            done.append(
                f"{target}: {source} from {variant} ({' '.join(vm.get('compile_flags', []))})"
            )
        bm["overlays"] = bm.get("overlays", []) + [
            {"source": s, "compile_flags": list(vm.get("compile_flags", []))}
            for s in sorted(replaced)
        ]
        (tdir / MANIFEST).write_text(json.dumps(bm, indent=2, sort_keys=True) + "\n")
    return done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m mamba2_rocm.build.overlay", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("base", type=Path)
    p.add_argument("variant", type=Path)
    p.add_argument("out", type=Path)
    args = p.parse_args(argv)
    try:
        for line in overlay(args.base, args.variant, args.out):
            print(line)
    except ValueError as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
