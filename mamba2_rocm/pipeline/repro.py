"""Reproducibility: the same commit built twice from scratch must give byte-identical wheels."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

from mamba2_rocm.pipeline.recipes import Recipe

__all__ = ["check_reproducible", "compare_wheel_dirs"]


def _members(path: Path) -> dict[str, tuple[str, int, tuple]]:
    with zipfile.ZipFile(path) as zf:
        return {
            i.filename: (hashlib.sha256(zf.read(i)).hexdigest(), i.external_attr, i.date_time)
            for i in zf.infolist()
        }


def compare_wheel_dirs(a: Path, b: Path) -> list[str]:
    """Every difference between the wheels of two build dirs, down to the member inside a wheel."""
    diffs = []
    wa = {p.name: p for p in a.glob("*.whl")}
    wb = {p.name: p for p in b.glob("*.whl")}
    for name in sorted(set(wa) ^ set(wb)):
        diffs.append(f"{name}: only in {'first' if name in wa else 'second'} build")
    for name in sorted(set(wa) & set(wb)):
        if wa[name].read_bytes() == wb[name].read_bytes():
            continue
        ma, mb = _members(wa[name]), _members(wb[name])
        inner = [m for m in sorted(set(ma) | set(mb)) if ma.get(m) != mb.get(m)]
        what = []
        for m in inner:
            if m not in ma or m not in mb:
                what.append(f"{m} (only in one)")
            elif ma[m][0] != mb[m][0]:
                what.append(f"{m} (content)")
            else:
                what.append(f"{m} (mode or timestamp)")
        diffs.append(f"{name} differs: " + (", ".join(what) if what else "zip layout/order only"))
    return diffs


def check_reproducible(recipe: Recipe, log=print) -> list[str]:
    from mamba2_rocm.pipeline.guard import temporary_folder
    from mamba2_rocm.pipeline.stages import build_target

    with temporary_folder("repro") as tmp:
        first = build_target(recipe, tmp / "first", log=log)
        second = build_target(recipe, tmp / "second", log=log)
        return compare_wheel_dirs(first, second)
