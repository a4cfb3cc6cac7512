"""``nox -s publish``: refuse anything the pipeline did not verify, then twine to an index.

What is checked, per target directory ``wheels/<target>/`` (all of it before anything is sent):

- ``build-manifest.json`` is there, of this target, with ``verification.static`` and
  ``verification.smoke_test`` both ``"passed"``;
- the recipe is the one the wheels were built from (its sha256 and ``gpu_gate`` match the
  manifest's): a gate decision is never taken from a recipe edited after the build;
- every wheel named in the manifest exists with that sha256, and no other wheel is there: one
  each of the host (``mamba2_rocm``), the drop-in (``mamba2_rocm_dropin``) and the target's
  kernels;
- the wheels' contents: every code object in the kernel wheel is built for one of the recipe's
  archs (the ISA read from the code object) and lies in that arch's folder, every arch has code
  objects, the host wheel holds none; the kernel wheel's ``Summary`` is exactly the one
  ``package.kernel_summary`` writes (a compile-only target's says so);
- the GPU gate: a recipe with ``gpu_gate = "required"`` needs a passing ``gpu-gate.json``
  (written by ``nox -s gpu-tests-<target>``, see :mod:`mamba2_rocm.pipeline.gputest`) for
  exactly these wheel bytes, the commit they were built from and, in CI, this workflow run
  (``GITHUB_RUN_ID``: release.yml takes the gates from the GPU jobs it called, in the same
  run); a ``"compile-only"`` recipe needs no test;
- the drop-in wheel holds only the pipeline's ``.pth`` line (it runs at every interpreter start);
- across targets: one version, one host wheel and one drop-in wheel (same name, same sha256
  everywhere).

Then ``twine check --strict`` and ``twine upload`` (host wheel first, then the drop-in, then the
kernel wheels),
with credentials from the environment: ``TWINE_USERNAME``/``TWINE_PASSWORD``, or trusted
publishing (twine exchanges the CI's OIDC token itself when no password is set and the job may
request one). ``--skip-existing`` is never used: a version on the index is never replaced or
silently passed over, and a refusal by the index is reported as such.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mamba2_rocm.build.codeobject import CodeObjectError, code_object_arch
from mamba2_rocm.pipeline.package import DROPIN_PTH, DROPIN_PTH_FILE, kernel_summary
from mamba2_rocm.pipeline.recipes import Recipe

__all__ = [
    "GATE_FILE",
    "PublishError",
    "TargetRelease",
    "check_release",
    "check_target",
    "gate_record_problems",
    "publish",
    "twine_check",
    "twine_upload",
]

MANIFEST = "build-manifest.json"
GATE_FILE = "gpu-gate.json"
GATE_FORMAT = 2  # 2: the gate names the commit and the workflow run it tested


class PublishError(RuntimeError):
    """Something must not be published; the message names the target, file and reason."""


@dataclass(frozen=True)
class TargetRelease:
    target: str
    version: str
    host_wheel: Path
    dropin_wheel: Path
    target_wheel: Path
    gpu_gate: str  # the recipe's gate
    gate_result: dict[str, Any] | None  # the passing gpu-gate.json, None for compile-only


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise PublishError(f"{path}: no {what}") from None
    except (OSError, ValueError) as exc:
        raise PublishError(f"{path}: unreadable {what}: {exc}") from None
    if not isinstance(data, dict):
        raise PublishError(f"{path}: {what} is not a JSON object")
    return data


def _wheel_summary(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as zf:
        meta = next(
            (n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")),
            None,
        )
        if meta is None:
            raise PublishError(f"{wheel.name}: no .dist-info/METADATA")
        text = zf.read(meta).decode("utf-8", "replace")
    match = re.search(r"^Summary: (.*)$", text, re.MULTILINE)
    return match.group(1) if match else ""


def check_wheel_contents(target: str, host: Path, kernels: Path, recipe: Recipe) -> None:
    """The wheels hold what the recipe says: every code object in the kernel wheel is built
    for one of the recipe's archs (read from the code object itself) and lies under
    ``<module>/kernels/<that arch>/``, every arch has code objects, and the host wheel has none."""
    suffixes = (".hsaco", ".cubin", ".co")
    with zipfile.ZipFile(host) as zf:
        stray = [n for n in zf.namelist() if n.endswith(suffixes)]
    if stray:
        raise PublishError(f"{target}: the host wheel {host.name} holds code objects: {stray}")
    seen: set[str] = set()
    problems = []
    with zipfile.ZipFile(kernels) as zf:
        for name in zf.namelist():
            if not name.endswith(suffixes):
                continue
            parts = name.split("/")
            folder = parts[2] if len(parts) == 4 and parts[1] == "kernels" else None
            try:
                arch = code_object_arch(zf.read(name))
            except CodeObjectError as exc:
                problems.append(f"{name}: not a code object ({exc})")
                continue
            if arch not in recipe.archs:
                problems.append(f"{name} is built for {arch}, not one of {list(recipe.archs)}")
            elif folder != arch:
                problems.append(f"{name} is built for {arch} but lies in {folder!r}")
            seen.add(arch)
    missing = sorted(set(recipe.archs) - seen)
    if missing:
        problems.append(f"no code objects for {missing}")
    if problems:
        raise PublishError(f"{target}: {kernels.name} does not match recipes/{recipe.path.name}: "
                           + "; ".join(problems))  # fmt: skip


def check_dropin_contents(target: str, wheel: Path) -> None:
    """The drop-in wheel is what ``package.build_dropin_wheel`` writes: the one ``.pth`` line
    (code that runs at every interpreter start: nothing else may be in it) and its metadata."""
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        other = [n for n in names if n != DROPIN_PTH_FILE and ".dist-info/" not in n]
        pth = (
            zf.read(DROPIN_PTH_FILE).decode("utf-8", "replace")
            if DROPIN_PTH_FILE in names
            else None
        )
    if other or pth != DROPIN_PTH:
        what = f"files other than {DROPIN_PTH_FILE}: {other}" if other else (
            f"no {DROPIN_PTH_FILE}" if pth is None else f"{DROPIN_PTH_FILE} is not the pipeline's"
        )  # fmt: skip
        raise PublishError(f"{target}: the drop-in wheel {wheel.name} holds {what}; rebuild it "
                           "with this pipeline")  # fmt: skip


def gate_record_problems(gate: dict[str, Any], target: str) -> list[str]:
    """What makes a GPU gate record not a pass for ``target`` on its own terms (format, target,
    an emulation run, result, counts); ``check_gate`` adds what binds it to the wheels."""
    problems = []
    if gate.get("format") != GATE_FORMAT:
        problems.append(f"format {gate.get('format')!r}, expected {GATE_FORMAT}")
    if gate.get("target") != target:
        problems.append(f"it is for target {gate.get('target')!r}")
    if "emulates" in gate or "variant" in gate:
        problems.append("it records an emulation run, which never stands for the AMD GPU")
    if gate.get("result") != "passed":
        problems.append(f"result is {gate.get('result')!r}, not 'passed'")
    tests = gate.get("tests") if isinstance(gate.get("tests"), dict) else {}
    if not tests.get("passed"):
        problems.append("no GPU test passed (a run of skips is not a pass)")
    if tests.get("failed") or tests.get("errors"):
        claim = "a pass with " if gate.get("result") == "passed" else ""
        problems.append(f"{claim}{tests.get('failed')} failed, {tests.get('errors')} errors")
    return problems


def check_gate(gate: dict[str, Any], manifest: dict[str, Any], path: Path) -> None:
    """A gate result counts only if it passed, for this target and for these exact wheels."""
    target = manifest["target"]
    problems = gate_record_problems(gate, target)
    # bound to what was tested: the commit the wheels were built from and, in CI, this
    # workflow run (the release calls the GPU workflow; its jobs share the run id)
    if not manifest.get("source_commit") or gate.get("commit") != manifest.get("source_commit"):
        problems.append(
            f"it tested commit {gate.get('commit')!r}, the wheels are from "
            f"{manifest.get('source_commit')!r}"
        )
    run_id = os.environ.get("GITHUB_RUN_ID")
    if run_id and str(gate.get("run_id")) != run_id:
        problems.append(f"it is from workflow run {gate.get('run_id')!r}, this is run {run_id}")
    if gate.get("wheels") != manifest["wheels"]:
        problems.append(
            "it tested other wheel bytes than the manifest lists "
            f"(tested {gate.get('wheels')}, manifest {manifest['wheels']})"
        )
    if problems:
        raise PublishError(
            f"{target}: the GPU gate in {path} does not pass: " + "; ".join(problems)
        )


def check_target(
    directory: Path, recipe: Recipe, gates: dict[str, Path] | None = None
) -> TargetRelease:
    """Every per-target check above; returns what to upload or raises :class:`PublishError`."""
    manifest = _read_json(directory / MANIFEST, "build manifest (build the target first)")
    target = recipe.target
    where = directory / MANIFEST
    if manifest.get("target") != target:
        raise PublishError(f"{where}: manifest is for {manifest.get('target')!r}, not {target}")
    verification = manifest.get("verification") or {}
    for step in ("static", "smoke_test"):
        if verification.get(step) != "passed":
            raise PublishError(
                f"{target}: build verification {step!r} is {verification.get(step)!r} in {where}; "
                "only a build whose verification passed is published"
            )
    recorded = (manifest.get("recipe") or {}).get("sha256")
    if recorded != recipe.sha256:
        raise PublishError(
            f"{target}: recipes/{recipe.path.name} changed since the build (sha256 {recorded} in "
            f"the manifest, {recipe.sha256} now); rebuild before publishing"
        )
    if manifest.get("gpu_gate") != recipe.gpu_gate:
        raise PublishError(
            f"{target}: manifest says gpu_gate {manifest.get('gpu_gate')!r}, recipe says "
            f"{recipe.gpu_gate!r}"
        )
    listed: dict[str, str] = manifest.get("wheels") or {}
    present = {p.name for p in directory.glob("*.whl")}
    extra = sorted(present - set(listed))
    if extra:
        raise PublishError(
            f"{target}: {directory} holds wheels the manifest does not list: {', '.join(extra)}"
        )
    for name, digest in sorted(listed.items()):
        path = directory / name
        if not path.is_file():
            raise PublishError(f"{target}: {path} is listed in the manifest but missing")
        actual = sha256_file(path)
        if actual != digest:
            raise PublishError(
                f"{target}: {name} has sha256 {actual}, the build manifest says {digest}: the "
                "wheel changed after it was built and verified; refusing to publish it"
            )
    version = manifest.get("version")
    found = {
        dist: [n for n in listed if n.startswith(f"{dist}-{version}-")]
        for dist in ("mamba2_rocm", "mamba2_rocm_dropin", recipe.module_name)
    }
    if any(len(names) != 1 for names in found.values()) or len(listed) != len(found):
        raise PublishError(
            f"{target}: expected one wheel each of {', '.join(f'{d}-{version}' for d in found)} "
            f"in the manifest, found {sorted(listed)}"
        )
    host, dropin, kern = found.values()
    target_wheel = directory / kern[0]
    check_wheel_contents(target, directory / host[0], target_wheel, recipe)
    check_dropin_contents(target, directory / dropin[0])
    summary, expected = _wheel_summary(target_wheel), kernel_summary(recipe)
    if summary != expected:
        raise PublishError(
            f"{target}: {target_wheel.name}'s Summary is {summary!r}, expected exactly "
            f"{expected!r} (gpu_gate {recipe.gpu_gate!r}); rebuild it with this pipeline"
        )
    gate_result = None
    if recipe.gpu_gate == "required":
        gate_path = (gates or {}).get(target) or directory / GATE_FILE
        if not gate_path.is_file():
            raise PublishError(
                f"{target}: recipe requires a GPU gate, and there is no {GATE_FILE} for it "
                f"(looked at {gate_path}); run `nox -s gpu-tests-{target}` on a runner with the "
                "GPU, or mark the recipe compile-only"
            )
        gate_result = _read_json(gate_path, "GPU gate result")
        check_gate(gate_result, manifest, gate_path)
    return TargetRelease(target, version, directory / host[0], directory / dropin[0],
                         target_wheel, recipe.gpu_gate, gate_result)  # fmt: skip


def find_gates(roots: list[Path]) -> dict[str, Path]:
    """``gpu-gate.json`` files under ``roots`` by the target they name (CI downloads each
    runner's gate as its own artifact folder)."""
    found: dict[str, Path] = {}
    for root in roots:
        for path in sorted(root.rglob(GATE_FILE)):
            target = _read_json(path, "GPU gate result").get("target")
            if not isinstance(target, str):
                raise PublishError(f"{path}: GPU gate result names no target")
            if target in found and found[target] != path:
                raise PublishError(f"two GPU gate results for {target}: {found[target]} and {path}")
            found[target] = path
    return found


def check_release(
    recipes: list[Recipe], wheels_root: Path, gate_roots: list[Path] | None = None
) -> tuple[list[Path], list[TargetRelease]]:
    """All targets checked; returns the files to upload in order (the host wheel first)."""
    if not recipes:
        raise PublishError("no targets to publish")
    gates = find_gates(gate_roots or [])
    releases = [check_target(wheels_root / r.target, r, gates) for r in recipes]
    versions = {r.version for r in releases}
    if len(versions) != 1:
        raise PublishError(
            "targets were built at different versions: "
            + ", ".join(f"{r.target} {r.version}" for r in releases)
        )
    for what, wheel_of in (("host", lambda r: r.host_wheel), ("drop-in", lambda r: r.dropin_wheel)):
        if len({(wheel_of(r).name, sha256_file(wheel_of(r))) for r in releases}) != 1:
            raise PublishError(
                f"the {what} wheel differs between targets (one release has one {what} package): "
                + ", ".join(
                    f"{r.target}: {wheel_of(r).name} {sha256_file(wheel_of(r))[:12]}"
                    for r in releases
                )
            )
    first = releases[0]
    return [first.host_wheel, first.dropin_wheel, *(r.target_wheel for r in releases)], releases


def _twine(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "twine", "--no-color", *args],
        capture_output=True,
        text=True,
        env=env,
    )


def twine_check(files: list[Path]) -> None:
    proc = _twine(["check", "--strict", *map(str, files)])
    if proc.returncode != 0:
        raise PublishError(f"twine check --strict failed:\n{(proc.stdout + proc.stderr).strip()}")


def _explain_upload_failure(output: str, url: str) -> str:
    status = re.search(r"HTTPError: (\d{3})", output) or re.search(r"\b(40[0-9]|50[0-9])\b", output)
    code = status.group(1) if status else None
    if code in ("401", "403"):
        return (
            f"the index at {url} refused the credentials (HTTP {code}): check TWINE_USERNAME and "
            "TWINE_PASSWORD (or the trusted publisher configured for this workflow)"
        )
    if code in ("400", "409") and re.search(r"exist|conflict|already", output, re.IGNORECASE):
        return (
            f"the index at {url} already has this version (HTTP {code}) and refused to replace "
            "it; a published version is never overwritten: bump the version (a new tag) instead"
        )
    return f"twine upload to {url} failed" + (f" (HTTP {code})" if code else "")


def twine_upload(files: list[Path], repository_url: str, env: dict[str, str] | None = None) -> str:
    """Upload in order; never ``--skip-existing``. Returns twine's output."""
    env = dict(os.environ if env is None else env)
    trusted = "ACTIONS_ID_TOKEN_REQUEST_URL" in env and not env.get("TWINE_PASSWORD")
    if not env.get("TWINE_PASSWORD") and not trusted:
        raise PublishError(
            "no upload credentials: set TWINE_USERNAME and TWINE_PASSWORD, or run in a GitHub "
            "Actions job with `id-token: write` for trusted publishing"
        )
    # --verbose: the index's own reason for a refusal (e.g. "already exists") is in the body.
    args = ["upload", "--non-interactive", "--disable-progress-bar", "--verbose",
            "--repository-url", repository_url, *map(str, files)]  # fmt: skip
    proc = _twine(args, env)
    output = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        uploaded = re.findall(r"Uploading (\S+\.whl)", output)
        done = uploaded[:-1] if uploaded else []
        raise PublishError(
            _explain_upload_failure(output, repository_url)
            + (f"\nuploaded before the failure: {', '.join(done)}" if done else "")
            + f"\ntwine said:\n{output[-3000:]}"
        )
    return output


def publish(
    recipes: list[Recipe],
    wheels_root: Path,
    repository_url: str | None,
    gate_roots: list[Path] | None = None,
    log=print,
) -> list[Path]:
    """Check everything, ``twine check --strict``, then upload (unless ``repository_url`` is
    None: the check-only mode the release workflow runs before it asks for an OIDC token)."""
    files, releases = check_release(recipes, wheels_root, gate_roots)
    for r in releases:
        how = (
            f"GPU gate passed ({r.gate_result['tests']['passed']} tests on "
            f"{', '.join(r.gate_result.get('device_archs', []))})"
            if r.gate_result
            else "compile-only (no GPU test; marked in its metadata)"
        )
        log(f"{r.target} {r.version}: verified build, sha256 match, {how}")
    twine_check(files)
    log(f"twine check --strict: {len(files)} wheel(s) passed")
    if repository_url is None:
        return files
    output = twine_upload(files, repository_url)
    log(output)
    log(f"uploaded to {repository_url}: " + ", ".join(f.name for f in files))
    return files
