"""Wheels: the host package (this repository), one kernel package per recipe, and the
drop-in (``mamba2-rocm-dropin``: the ``mamba_ssm`` / ``causal_conv1d`` import names, opt-in
through the host's ``dropin`` extra).

All are built by hatchling through ``python -m build --no-isolation`` with
``SOURCE_DATE_EPOCH`` from the source commit, so the same commit gives the same bytes. A kernel
package holds only its target's code objects and manifests, depends on the exact host version,
and registers itself in the ``mamba2_rocm.kernels`` entry-point group.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from mamba2_rocm.dropin import FACADES, facade_version
from mamba2_rocm.pipeline.recipes import Recipe

__all__ = [
    "DROPIN_PTH", "DROPIN_PTH_FILE", "DROPIN_REPORT_SCRIPT", "PackageError", "build_dropin_wheel", "build_host_wheel",
    "build_target_wheel", "dropin_problems", "export_commit", "source_date_epoch",
    "work_tree_dirty",
]  # fmt: skip

REPO = Path(__file__).resolve().parents[2]


class PackageError(RuntimeError):
    pass


COMPILE_ONLY_SUMMARY = " [compile-only: not tested on a GPU before release]"


def kernel_summary(recipe: Recipe) -> str:
    """The kernel wheel's Summary; a compile-only target's ends with COMPILE_ONLY_SUMMARY
    (publish compares it exactly)."""
    archs = ", ".join(recipe.archs)
    tail = COMPILE_ONLY_SUMMARY if recipe.gpu_gate == "compile-only" else ""
    return f"mamba2-rocm kernels (code objects) for {recipe.target}: {archs}{tail}"


def source_date_epoch(repo: Path = REPO) -> str:
    """The source commit's time: every timestamp inside the wheels."""
    proc = subprocess.run(
        ["git", "-C", str(repo), "log", "-1", "--format=%ct"], capture_output=True, text=True
    )
    if proc.returncode != 0 or not proc.stdout.strip():
        raise PackageError(
            f"cannot read the commit time of {repo} (is it a git checkout?): {proc.stderr.strip()}"
        )
    return proc.stdout.strip()


def _build_wheel(project: Path, out: Path, epoch: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    before = set(out.glob("*.whl"))
    env = dict(os.environ, SOURCE_DATE_EPOCH=epoch)
    cmd = [
        sys.executable,
        "-m",
        "build",
        "--wheel",
        "--no-isolation",
        "--outdir",
        str(out),
        str(project),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
        raise PackageError(f"building a wheel from {project} failed:\n{tail}")
    new = sorted(set(out.glob("*.whl")) - before) or sorted(out.glob("*.whl"))
    return new[-1]


def export_commit(dest: Path, repo: Path = REPO) -> str:
    """Clone HEAD of ``repo`` into ``dest`` (committed files only, with git metadata for
    hatch-vcs); returns the commit. Every stage builds from this export, never the work tree."""
    proc = subprocess.run(
        ["git", "clone", "-q", "--no-local", str(repo), str(dest)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise PackageError(f"cannot export {repo}: {proc.stderr.strip()}")
    return subprocess.run(
        ["git", "-C", str(dest), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()


def work_tree_dirty(repo: Path = REPO) -> bool:
    proc = subprocess.run(
        ["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True
    )
    return bool(proc.stdout.strip())


def _build_project(project: Path, pyproject: str, readme: str, out: Path, epoch: str) -> Path:
    """Write a satellite project's pyproject.toml and README, normalize modes, build it."""
    (project / "pyproject.toml").write_text(pyproject)
    (project / "README.md").write_text(readme)
    for path in project.rglob("*"):  # the umask must not leak into the wheel
        path.chmod(0o755 if path.is_dir() else 0o644)
    return _build_wheel(project, out, epoch)


def build_host_wheel(export: Path, out: Path, epoch: str) -> Path:
    """``mamba2_rocm-<ver>-py3-none-any.whl`` from an export made by :func:`export_commit`."""
    return _build_wheel(export, out, epoch)


#: The [project] of every satellite distribution (kernel packages, the drop-in): pinned to
#: the exact host version.
_PROJECT = """\
[build-system]
requires = ["hatchling>=1.26"]
build-backend = "hatchling.build"

[project]
name = "{package}"
version = "{version}"
description = "{summary}"
readme = "README.md"
requires-python = ">=3.10"
license = "Apache-2.0"
dependencies = ["mamba2-rocm=={version}"]
classifiers = ["Programming Language :: Python :: 3", "Operating System :: POSIX :: Linux",
               "Operating System :: Microsoft :: Windows"]
"""

_PYPROJECT = (
    _PROJECT
    + """
[project.entry-points."mamba2_rocm.kernels"]
{target} = "{module}"

[tool.hatch.build.targets.wheel]
packages = ["{module}"]
"""
)

_INIT = '''"""Code objects of mamba2-rocm for {target} ({archs}); found by mamba2_rocm.runtime.discovery."""

from pathlib import Path

TARGET = "{target}"
ARCHS = {archs_tuple!r}
MIN_ROCM = "{min_rocm}"
GPU_GATE = "{gpu_gate}"
SOURCE_COMMIT = {commit!r}
KERNEL_DIR = Path(__file__).parent / "kernels"
'''


def build_target_wheel(recipe: Recipe, kernels: Path, version: str, out: Path, epoch: str,
                       commit: str | None = None) -> Path:  # fmt: skip
    """``mamba2_rocm_<target>-<ver>-py3-none-any.whl`` holding ``kernels/<arch>/`` for each arch;
    its module names the commit the code objects were built from (``SOURCE_COMMIT``: what a
    user's selftest report quotes)."""
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp) / recipe.package_name
        pkg = project / recipe.module_name
        for arch in recipe.archs:
            src = kernels / arch
            if not (src / "manifest.json").is_file():
                raise PackageError(
                    f"{src} has no manifest.json: the build of {arch} did not verify"
                )
            emulates = json.loads((src / "manifest.json").read_text()).get("emulates")
            if emulates is not None:
                raise PackageError(f"{src} is an emulation build (of {emulates}): never shipped")
            shutil.copytree(src, pkg / "kernels" / arch)
        fmt = {
            "package": recipe.package_name, "version": version, "target": recipe.target,
            "archs": ", ".join(recipe.archs), "archs_tuple": tuple(recipe.archs), "module": recipe.module_name,
            "min_rocm": recipe.min_rocm, "gpu_gate": recipe.gpu_gate, "commit": commit,
        }  # fmt: skip
        # A compile-only target is published without a GPU test: its metadata says so.
        fmt["summary"] = kernel_summary(recipe)
        (pkg / "__init__.py").write_text(_INIT.format(**fmt))
        readme = (
            f"Kernels of mamba2-rocm for {recipe.target}. Install `mamba2-rocm[{recipe.target}]`.\n"
        )
        return _build_project(project, _PYPROJECT.format(**fmt), readme, out, epoch)


#: The drop-in's whole content: one ``.pth`` line, run by ``site`` at interpreter start. It
#: activates ``mamba2_rocm.dropin`` (which imports neither torch nor the ops), and does nothing
#: when the host package is gone, so a half-uninstalled environment prints no error per start.
DROPIN_PTH_FILE = "mamba2_rocm_dropin.pth"
DROPIN_PTH = (
    "import importlib.util as _m2r; _m2r.find_spec('mamba2_rocm') is not None and "
    "__import__('mamba2_rocm.dropin').dropin.activate_from_pth()\n"
)

_DROPIN_PYPROJECT = (
    _PROJECT
    + """
[tool.hatch.build.targets.wheel]
bypass-selection = true

[tool.hatch.build.targets.wheel.force-include]
"{pth}" = "{pth}"
"""
)


def build_dropin_wheel(version: str, out: Path, epoch: str) -> Path:
    """``mamba2_rocm_dropin-<ver>-py3-none-any.whl``: the ``.pth`` that turns on the drop-in
    import names (``mamba2_rocm.dropin``), pinned to the exact host version."""
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp) / "mamba2-rocm-dropin"
        project.mkdir()
        (project / DROPIN_PTH_FILE).write_text(DROPIN_PTH)
        summary = (
            "The mamba_ssm and causal_conv1d import names, served by mamba2-rocm's kernels "
            "(opt-in; a real install of either always wins)"
        )
        pyproject = _DROPIN_PYPROJECT.format(
            package="mamba2-rocm-dropin", version=version, summary=summary, pth=DROPIN_PTH_FILE
        )
        readme = (
            "Installs the `mamba_ssm` and `causal_conv1d` import names, served by mamba2-rocm's "
            "kernels, for code written against those packages (transformers' Mamba2-family "
            "models). A real install of either package always takes precedence; "
            "`python -m mamba2_rocm doctor` says who owns each name. `MAMBA2_ROCM_DROPIN=0` "
            "turns it off without uninstalling.\n"
        )
        return _build_project(project, pyproject, readme, out, epoch)


#: Run by an environment's python after installing the drop-in: who answers ``import mamba_ssm``
#: / ``import causal_conv1d`` there, as JSON (``mamba2_rocm.dropin.report()`` imports neither
#: torch nor the ops, so it runs in the pipeline's torch-less venvs).
DROPIN_REPORT_SCRIPT = (
    "import json; from mamba2_rocm import dropin; print(json.dumps(dropin.report()))"
)


def dropin_problems(rows: list[dict], version: str) -> list[str]:
    """What is wrong with the import names of an environment that has ``mamba2-rocm-dropin``
    ``version`` installed (``rows``: :data:`DROPIN_REPORT_SCRIPT`'s output): each name must be
    served by our facade, with the version transformers' checks read (``<api>+mamba2rocm.<v>``)."""
    problems = []
    by_name = {r.get("name"): r for r in rows if isinstance(r, dict)}
    for name in FACADES:
        expected = facade_version(name, version)
        row = by_name.get(name)
        if row is None:
            problems.append(f"import {name}: not reported")
        elif row.get("owner") != "mamba2-rocm":
            problems.append(
                f"import {name} is {row.get('owner')} ({row.get('path')}), not mamba2-rocm's drop-in"
            )
        elif row.get("version") != expected:
            problems.append(f"{name}'s version reads {row.get('version')!r}, expected {expected}")
    return problems
