"""``python -m mamba2_rocm.pipeline resources``: what a kernel change costs on the AMD targets,
before it is committed.

Compiles csrc sources of the *work tree* (uncommitted edits included: the release build compiles
the commit) for every recipe's archs (or those of ``--target``), in the recipes' toolchain
images with their code-object versions and flags, one container run per group, and reads every
code object back (:func:`mamba2_rocm.build.codeobject.amd_kernels`): per kernel its VGPRs,
SGPRs, AGPRs, LDS, spills, scratch and the waves per SIMD they leave (``stages.resource_row``).
It prints a line per arch (kernels, the largest VGPR and SGPR counts and whose, spills) and,
with ``--against`` a folder an earlier run wrote, every kernel whose counts changed. Exit 1 on
any spill: the release build's verification refuses spilling code objects, and issue #72 asks
for 0 on every target.

    python -m mamba2_rocm.pipeline resources --source state_update --out /tmp/after \\
        --against /tmp/before

Each run writes ``OUT/.group<N>/<arch>/`` (the code objects of each compile group) and
``OUT/resources.json`` (the table).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from mamba2_rocm.arch import arch_info
from mamba2_rocm.build.codeobject import amd_kernels
from mamba2_rocm.pipeline import images
from mamba2_rocm.pipeline.package import REPO
from mamba2_rocm.pipeline.recipes import Recipe
from mamba2_rocm.pipeline.stages import PipelineError, _compile, compile_groups, resource_row

FIELDS = ("vgpr", "sgpr", "agpr", "lds_bytes", "spills", "waves_per_simd")


def compile_work_tree(recipes: list[Recipe], sources: list[str], out: Path,
                      jobs: int | None = None, log=print) -> dict[str, Path]:  # fmt: skip
    """Compile ``sources`` (all when empty) of this work tree for the recipes' archs, one
    container run per :func:`stages.compile_groups` group; returns arch -> the folder of its
    code objects."""
    images.docker_check()
    image_of = {r.target: images.ensure_toolchain(r, log=log) for r in recipes}
    folders: dict[str, Path] = {}
    for gi, ((image, _cov, _flags), members) in enumerate(
        compile_groups(recipes, image_of).items()
    ):
        group_out = out / f".group{gi}"
        _compile(members, image, REPO, group_out, jobs or os.cpu_count() or 1, tuple(sources))
        folders.update({a: group_out / a for r in members for a in r.archs})
    return folders


def kernel_table(folders: dict[str, Path]) -> dict[str, dict[str, dict]]:
    """arch -> kernel -> its :func:`stages.resource_row` (:data:`FIELDS` and its scratch), from
    the code objects in each folder."""
    table: dict[str, dict[str, dict]] = {}
    for arch, folder in sorted(folders.items()):
        rows = table.setdefault(arch, {})
        for path in sorted(folder.glob("*.hsaco")):
            _target, kinfos = amd_kernels(path.read_bytes())
            rows.update({k.name: resource_row(arch, k) for k in kinfos})
    return table


def summary(table: dict[str, dict[str, dict]]) -> list[str]:
    """A line per arch: kernels, the largest VGPR / SGPR counts (and whose), spilling kernels."""
    lines = []
    for arch, rows in table.items():
        if not rows:
            lines.append(f"{arch}: no kernels")
            continue
        v = max(rows, key=lambda k: (rows[k]["vgpr"], k))
        s = max(rows, key=lambda k: (rows[k]["sgpr"], k))
        spilling = sorted(k for k, r in rows.items() if r["spills"])
        line = (f"{arch}: {len(rows)} kernels, max {rows[v]['vgpr']} VGPRs ({v}), "
                f"max {rows[s]['sgpr']} SGPRs ({s}), ")  # fmt: skip
        line += f"{len(spilling)} spilling: {', '.join(spilling[:4])}" if spilling else "0 spills"
        lines.append(line)
    return lines


def changes(before: dict[str, dict[str, dict]], after: dict[str, dict[str, dict]]) -> list[str]:
    """Every kernel of an arch in both tables whose fields differ, as ``before -> after``;
    kernels only one side has, named as such."""
    lines = []
    for arch in sorted(set(before) & set(after)):
        old, new = before[arch], after[arch]
        for name in sorted(set(old) | set(new)):
            if name not in old or name not in new:
                lines.append(f"{arch}: {name} {'added' if name in new else 'removed'}")
                continue
            moved = [f"{f} {old[name][f]} -> {new[name][f]}" for f in FIELDS
                     if old[name].get(f) != new[name].get(f)]  # fmt: skip
            if moved:
                lines.append(f"{arch}: {name}: " + ", ".join(moved))
    return lines


def run(recipes: list[Recipe], sources: list[str], out: Path, against: Path | None = None,
        jobs: int | None = None, log=print) -> int:  # fmt: skip
    """The command: compile, write ``out/resources.json``, print; 1 on any spill."""
    for s in sources:
        if not (REPO / "csrc" / f"{s}.hip").is_file():
            raise PipelineError(f"no csrc/{s}.hip in this work tree")
    for r in recipes:
        for arch in r.archs:
            arch_info(arch)  # (an unknown arch fails here, not in the container)
    table = kernel_table(compile_work_tree(recipes, sources, out, jobs, log))
    (out / "resources.json").write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    for line in summary(table):
        log(line)
    if against is not None:
        earlier = json.loads((against / "resources.json").read_text())
        moved = changes(earlier, table)
        log(f"against {against}: {len(moved)} kernels changed")
        for line in moved:
            log("  " + line)
    return 1 if any(r["spills"] for rows in table.values() for r in rows.values()) else 0
