"""``nox -s pull-<target>``: install a published target the way a user does, and check it.

In a fresh venv: optionally a pre-installed torch first (``--torch``, as a user has their ROCm
torch), then ``pip install "mamba2-rocm[<target>]==<version>" --index-url URL`` through the
torch protection (the torch stack must come out unchanged; the requirement is
``mamba2-rocm[<target>,dropin]``, so the drop-in extra resolves too), then the checks against the
build manifest of that release:

- our three wheels (host, drop-in, kernels) are installed in pip's hash-checking mode
  (``--require-hashes --no-deps``
  with the manifest's sha256s), so a file from the index that is not the built one is refused
  before anything is installed; their third-party dependencies follow in a second step; pip's
  ``--report`` hashes are compared with the manifest as well;
- the manifest itself is validated first (a version, non-empty ``wheels`` and ``code_objects``
  tables of sha256s, one wheel per distribution, code objects only of the recipe's archs);
- every installed code object (``mamba2_rocm_<target>/kernels/<arch>/...``) has the manifest's
  sha256, none is missing and none is extra;
- ``python -m mamba2_rocm info --json`` in that venv finds each arch in the installed package,
  and ``import mamba_ssm`` / ``import causal_conv1d`` are served by the drop-in at this version
  (run only once every file check passed: nothing unverified runs).

Which manifest: ``build-manifest.json`` is not on the index (an index holds wheels only; the
manifest names the wheels' own hashes, so it cannot be inside them). The release workflow
attaches each target's manifest to the GitHub release, with a build-provenance attestation;
a user downloads it from there. ``--manifest`` takes that file; the default is
``wheels/<target>/build-manifest.json`` of this checkout, i.e. checking an index against the
build that was just published.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from mamba2_rocm.env.protect import TorchStackChanged, fingerprint, protected_install
from mamba2_rocm.pipeline.package import DROPIN_REPORT_SCRIPT, dropin_problems
from mamba2_rocm.pipeline.recipes import Recipe

__all__ = ["PullError", "hashed_requirements", "manifest_problems", "pull", "verify_install"]


class PullError(RuntimeError):
    pass


# Runs in the fresh venv: the installed distributions and the code objects' sha256s.
_INSTALLED_SCRIPT = r"""
import hashlib, json, sys
import importlib.metadata as md
out = {}
for name in sys.argv[1:]:
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        out[name] = None
        continue
    files = {}
    for f in dist.files or []:
        parts = f.parts
        if len(parts) >= 4 and parts[1] == "kernels" and not f.name.endswith((".json", ".py", ".pyc")):
            files["/".join(parts[2:])] = hashlib.sha256(f.locate().read_bytes()).hexdigest()
    out[name] = {"version": dist.version, "code_objects": files}
print(json.dumps(out))
"""


def _run(
    cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, cwd=cwd)


def read_manifest(path: Path, recipe: Recipe) -> dict[str, Any]:
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise PullError(
            f"no build manifest at {path}: pass --manifest with the build-manifest.json of the "
            f"release (attached to the GitHub release of that version)"
        ) from None
    except (OSError, ValueError) as exc:
        raise PullError(f"unreadable build manifest {path}: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("target") != recipe.target:
        got = manifest.get("target") if isinstance(manifest, dict) else manifest
        raise PullError(f"{path} is the manifest of {got!r}, not {recipe.target}")
    problems = manifest_problems(manifest, recipe)
    if problems:
        raise PullError(f"{path} is not a usable build manifest:\n  " + "\n  ".join(problems))
    return manifest


_SHA256 = re.compile(r"[0-9a-f]{64}")


def manifest_problems(manifest: dict[str, Any], recipe: Recipe) -> list[str]:
    """What makes a manifest unusable for checking an install (an empty table checks nothing:
    it is an error, not a pass)."""
    problems = []
    version = manifest.get("version")
    if not isinstance(version, str) or not version:
        problems.append(f"'version' must be a non-empty string, got {version!r}")
        version = None
    for table in ("wheels", "code_objects"):
        value = manifest.get(table)
        if not isinstance(value, dict) or not value:
            problems.append(f"'{table}' must be a non-empty table of sha256s, got {value!r}")
            continue
        for key, digest in value.items():
            if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
                problems.append(f"'{table}' entry {key!r}: {digest!r} is not a sha256")
    wheels = manifest.get("wheels") if isinstance(manifest.get("wheels"), dict) else {}
    ours = ("mamba2_rocm", "mamba2_rocm_dropin", recipe.module_name)
    for dist in ours:
        mine = [w for w in wheels if w.endswith(".whl") and w.split("-")[0] == dist]
        if len(mine) != 1:
            problems.append(f"'wheels' must list exactly one {dist} wheel, got {mine}")
        elif version and mine[0].split("-")[1] != version:
            problems.append(f"{mine[0]} is not version {version}")
    strangers = sorted(w for w in wheels if w.split("-")[0] not in ours)
    if strangers:
        problems.append(f"'wheels' lists files of other distributions: {strangers}")
    objects = manifest.get("code_objects") if isinstance(manifest.get("code_objects"), dict) else {}
    outside = sorted(k for k in objects if k.split("/", 1)[0] not in recipe.archs)
    if outside:
        problems.append(f"code objects outside the recipe's archs {list(recipe.archs)}: {outside}")
    return problems


def hashed_requirements(manifest: dict[str, Any]) -> str:
    """pip requirement lines pinning each wheel of the manifest to its version and sha256."""
    lines = []
    for wheel, digest in sorted(manifest["wheels"].items()):
        dist, version = wheel.split("-")[:2]
        lines.append(f"{dist.replace('_', '-')}=={version} --hash=sha256:{digest}")
    return "\n".join(lines) + "\n"


def downloaded_hashes(report: dict[str, Any]) -> dict[str, str]:
    """File name -> sha256 of every archive pip fetched, from ``pip install --report``."""
    found = {}
    for item in report.get("install", []):
        info = item.get("download_info") or {}
        url = info.get("url", "")
        archive = info.get("archive_info") or {}
        digest = (archive.get("hashes") or {}).get("sha256")
        if not digest and str(archive.get("hash", "")).startswith("sha256="):
            digest = archive["hash"].split("=", 1)[1]
        if url:
            found[url.rsplit("/", 1)[-1].split("#", 1)[0]] = digest or ""
    return found


def verify_install(
    recipe: Recipe, manifest: dict[str, Any], installed: dict[str, Any], downloaded: dict[str, str]
) -> list[str]:
    """Every difference between what was installed and the manifest; empty when they agree."""
    problems = []
    version = manifest["version"]
    for name in ("mamba2-rocm", "mamba2-rocm-dropin", recipe.package_name):
        dist = installed.get(name)
        if dist is None:
            problems.append(f"{name} is not installed")
        elif dist["version"] != version:
            problems.append(f"{name} {dist['version']} installed, the manifest is for {version}")
    for wheel, digest in sorted(manifest["wheels"].items()):
        got = downloaded.get(wheel)
        if got is None:
            problems.append(f"{wheel} was not downloaded from the index (pip took another file)")
        elif not got:
            problems.append(f"the index gave no sha256 for {wheel}: its bytes cannot be checked")
        elif got != digest:
            problems.append(f"{wheel} from the index has sha256 {got}, the manifest says {digest}")
    got_objects = (installed.get(recipe.package_name) or {}).get("code_objects", {})
    want_objects = manifest["code_objects"]
    for key in sorted(set(want_objects) | set(got_objects)):
        if key not in got_objects:
            problems.append(f"code object {key} is in the manifest but not installed")
        elif key not in want_objects:
            problems.append(f"installed code object {key} is not in the manifest")
        elif got_objects[key] != want_objects[key]:
            problems.append(
                f"installed code object {key} has sha256 {got_objects[key]}, the manifest says "
                f"{want_objects[key]}"
            )
    return problems


def pull(
    recipe: Recipe,
    index_url: str,
    manifest_path: Path,
    torch: str | None = None,
    torch_index_url: str | None = None,
    venv: Path | None = None,
    log=print,
) -> dict[str, Any]:
    """Fresh venv, optional torch, protected install from ``index_url``, then the checks."""
    manifest = read_manifest(manifest_path, recipe)
    version = manifest["version"]
    with tempfile.TemporaryDirectory(prefix="m2r-pull-") as tmp:
        tmp = Path(tmp)
        venv = venv or tmp / "venv"
        proc = _run([sys.executable, "-m", "venv", "--clear", venv])
        if proc.returncode != 0:
            raise PullError(f"cannot create a venv at {venv}: {proc.stderr.strip()}")
        py = (
            venv
            / ("Scripts" if os.name == "nt" else "bin")
            / ("python.exe" if os.name == "nt" else "python")
        )
        if torch:
            cmd = [
                py,
                "-m",
                "pip",
                "install",
                "-q",
                "--index-url",
                torch_index_url or index_url,
                torch,
            ]
            proc = _run(cmd)
            if proc.returncode != 0:
                raise PullError(
                    f"installing the pre-installed torch {torch!r} failed:\n{proc.stderr[-2000:]}"
                )
            log(f"torch in the fresh venv: {fingerprint(py).summary()}")
        report = tmp / "pip-report.json"
        requirement = f"mamba2-rocm[{recipe.target},dropin]=={version}"
        # 1. our wheels in pip's hash-checking mode: a file whose sha256 is not the manifest's
        #    is refused before anything is installed; 2. then their dependencies (third-party,
        #    not in the manifest), with both of ours already in place. Both torch protected.
        pinned = tmp / "manifest-requirements.txt"
        pinned.write_text(hashed_requirements(manifest))
        log(f"installing {requirement} from {index_url}: our wheels hash-checked against the "
            "manifest, torch protected")  # fmt: skip
        steps = (
            ["--require-hashes", "--no-deps", "--report", str(report), "-r", str(pinned)],
            [requirement],
        )
        for args in steps:
            try:
                # without --torch the venv has none: a torch pip pulls in is still a change
                rc = protected_install(
                    ["-q", "--index-url", index_url, *args], py, allow_no_torch=True
                )
            except TorchStackChanged as exc:
                raise PullError(
                    f"installing {requirement} changed the torch stack: {exc}"
                ) from None
            if rc != 0:
                what = "the manifest's wheels (hash-checked)" if "-r" in args else requirement
                raise PullError(f"pip could not install {what} from {index_url} (exit {rc})")
        downloaded = downloaded_hashes(json.loads(report.read_text()))
        proc = _run([py, "-c", _INSTALLED_SCRIPT, "mamba2-rocm", "mamba2-rocm-dropin",
                     recipe.package_name], cwd=tmp)  # fmt: skip
        if proc.returncode != 0:
            raise PullError(f"cannot list the installed distributions:\n{proc.stderr[-2000:]}")
        installed = json.loads(proc.stdout)
        problems = verify_install(recipe, manifest, installed, downloaded)
        if problems:  # nothing from the new environment runs before its files are verified
            raise PullError(
                f"{recipe.package_name} {version} from {index_url} does not match "
                f"{manifest_path}:\n  " + "\n  ".join(problems)
            )
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MAMBA2_ROCM_", "PYTHON"))}
        env["MAMBA2_ROCM_CACHE"] = str(tmp / "empty-cache")  # no just-in-time build may answer
        proc = _run([py, "-m", "mamba2_rocm", "info", "--json"], env=env, cwd=tmp)
        if proc.returncode != 0:
            problems.append(f"`python -m mamba2_rocm info --json` failed: {proc.stderr[-1000:]}")
        else:
            dirs = json.loads(proc.stdout)["kernel_dirs"]
            for arch in recipe.archs:
                if not any(d["target"] == arch and d["origin"].startswith(f"package {recipe.package_name} ")
                           for d in dirs):  # fmt: skip
                    problems.append(
                        f"mamba2_rocm does not find {arch} in the installed {recipe.package_name}"
                    )
        proc = _run([py, "-c", DROPIN_REPORT_SCRIPT], env=env, cwd=tmp)
        if proc.returncode != 0:
            problems.append(f"the drop-in's import-name report failed: {proc.stderr[-1000:]}")
        else:
            problems += dropin_problems(json.loads(proc.stdout), version)
    if problems:
        raise PullError(
            f"{recipe.package_name} {version} from {index_url} does not match {manifest_path}:\n  "
            + "\n  ".join(problems)
        )
    result = {"target": recipe.target, "version": version, "wheels": manifest["wheels"],
              "code_objects": len(manifest["code_objects"])}  # fmt: skip
    log(
        f"{recipe.package_name} {version} from {index_url}: wheel sha256s and "
        f"{result['code_objects']} code objects match {manifest_path}; import mamba_ssm / "
        "causal_conv1d served by the drop-in"
    )
    return result
