"""``build-<target>``: audit → compile → verify → package → smoke-test → publish to wheels/.

Every stage is logged with its duration; any failure stops the build with a message that names
the stage, the target and the cause. The result is ``wheels/<target>/``: the host wheel, the
target wheel and ``build-manifest.json`` (deterministic: no timestamps, no absolute paths).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mamba2_rocm.arch import arch_info
from mamba2_rocm.build.codeobject import CodeObjectError, amd_code_object_version, amd_kernels
from mamba2_rocm.kernels import SOURCES
from mamba2_rocm.pipeline import guard, images, package
from mamba2_rocm.pipeline.recipes import Recipe

__all__ = [
    "ENV_AUDIT_PATTERN",
    "PipelineError",
    "build_target",
    "estimate_waves_per_simd",
    "verify_kernel_dir",
]

ENV_AUDIT_PATTERN = "TORCH|INDUCTOR|AUTOTUNE|TRITON|HIP|ROCM|HSA|GPU|AMD|CUDA"
MANIFEST_FORMAT = 2  # 2: the drop-in wheel is part of every target's release


class PipelineError(RuntimeError):
    pass


@dataclass
class StageLog:
    timings: dict[str, float] = field(default_factory=dict)
    log: Any = print

    @contextlib.contextmanager
    def stage(self, name: str, target: str) -> Iterator[None]:
        self.log(f"[{target}] {name} ...")
        start = time.monotonic()
        try:
            with guard.enter_stage(name):
                yield
        except guard.Cancelled:
            self.log(f"[{target}] {name} cancelled after {time.monotonic() - start:.1f} s")
            raise
        except Exception as exc:
            self.log(f"[{target}] {name} FAILED after {time.monotonic() - start:.1f} s")
            if isinstance(exc, PipelineError):
                raise
            raise PipelineError(f"[{target}] stage {name!r} failed: {exc}") from exc
        self.timings[name] = time.monotonic() - start
        self.log(f"[{target}] {name} done in {self.timings[name]:.1f} s")


# ---- occupancy estimate ---------------------------------------------------------------------

# (VGPRs per lane per SIMD, allocation granule, max waves per SIMD, SIMDs per CU, LDS per CU)
_FAMILY_LIMITS = {
    "gfx9": (512, 8, 8, 4, 64 * 1024),  # CDNA: unified VGPR/AGPR file
    "gfx10": (1024, 8, 16, 2, 64 * 1024),  # RDNA2, wave32
    "gfx11": (1536, 12, 16, 2, 64 * 1024),  # RDNA3/3.5 (gfx1102/1103/115x: 1024 in hardware)
    "gfx12": (1536, 12, 16, 2, 64 * 1024),  # RDNA4
}
_SMALL_VGPR_FILE = {"gfx1102", "gfx1103", "gfx1150", "gfx1151", "gfx1152", "gfx1153"}


def estimate_waves_per_simd(
    arch: str, vgpr: int, agpr: int, lds_bytes: int, workgroup: int = 128
) -> int:
    """Waves one SIMD can hold for a kernel, from its registers and LDS (an estimate: SGPRs and
    scratch are ignored)."""
    family = "gfx9" if arch.startswith("gfx9") else arch.split("-")[0][:5]
    vgprs, granule, max_waves, simds, lds_cu = _FAMILY_LIMITS.get(family, _FAMILY_LIMITS["gfx11"])
    if arch in _SMALL_VGPR_FILE:
        vgprs = 1024
    used = max(1, vgpr + (agpr if family == "gfx9" else 0))
    used = -(-used // granule) * granule
    waves = min(max_waves, vgprs // used)
    if lds_bytes:
        wave_size = arch_info(arch).wavefront_size
        waves_per_group = -(-workgroup // wave_size)
        groups_per_cu = lds_cu // lds_bytes
        waves = min(waves, groups_per_cu * waves_per_group // simds)
    return waves


# ---- verification -----------------------------------------------------------------------------


def resource_row(arch: str, k) -> dict[str, Any]:
    """A code object's kernel (``codeobject.KernelInfo``) as the resource tables list it: its
    registers, LDS, spills, scratch and the waves per SIMD they leave on ``arch``."""
    return {"vgpr": k.vgpr, "sgpr": k.sgpr, "agpr": k.agpr, "lds_bytes": k.lds_bytes,
            "spills": k.spills, "scratch_bytes": k.scratch_bytes,
            "waves_per_simd": estimate_waves_per_simd(arch, k.vgpr, k.agpr, k.lds_bytes)}  # fmt: skip


def compile_groups(recipes: list[Recipe], image_of: dict[str, str]) -> dict[tuple, list[Recipe]]:
    """The recipes that one container run compiles together: same toolchain image (``image_of``
    maps a target to it), code-object version and flags."""
    groups: dict[tuple, list[Recipe]] = {}
    for r in recipes:
        key = (image_of[r.target], r.code_object_version, r.compile_flags)
        groups.setdefault(key, []).append(r)
    return groups


def verify_kernel_dir(recipe: Recipe, kernels: Path) -> dict[str, Any]:
    """Re-read every code object on the host and check it against the recipe and our structs.

    Independent of the checks the driver made inside the container: the files are parsed again
    here, so a tampered or mislabeled file cannot slip through. Returns the resource table.
    """
    problems: list[str] = []
    table: dict[str, Any] = {}
    for arch in recipe.archs:
        info = arch_info(arch)
        kdir = kernels / arch
        manifest_path = kdir / "manifest.json"
        if not manifest_path.is_file():
            raise PipelineError(
                f"{arch}: no manifest.json in {kdir}: the compile stage did not verify"
            )
        manifest = json.loads(manifest_path.read_text())
        objects = {co["source"]: co for co in manifest["code_objects"]}
        rows = []
        for src in SOURCES.values():
            co = objects.get(src.name)
            if co is None:
                problems.append(f"{arch}: no code object for {src.name}")
                continue
            data = (kdir / co["file"]).read_bytes()
            if hashlib.sha256(data).hexdigest() != co["sha256"]:
                problems.append(f"{arch}/{co['file']}: sha256 differs from the manifest")
            try:
                target, kinfos = amd_kernels(data)
                cov = amd_code_object_version(data)
            except CodeObjectError as exc:
                problems.append(f"{arch}/{co['file']}: {exc}")
                continue
            if target != arch:
                problems.append(
                    f"{arch}/{co['file']}: code-object target is {target}, recipe says {arch}"
                )
            if cov != recipe.code_object_version:
                problems.append(
                    f"{arch}/{co['file']}: code-object v{cov}, recipe says v{recipe.code_object_version}"
                )
            by_name = {k.name: k for k in kinfos}
            want = ctypes.sizeof(src.params)
            for name in src.kernels:
                k = by_name.get(name)
                if k is None:
                    problems.append(f"{arch}/{co['file']}: kernel {name} missing")
                    continue
                if k.wavefront_size != recipe.wavefront_size:
                    problems.append(
                        f"{arch}: {name} is wave{k.wavefront_size}, recipe says {recipe.wavefront_size}"
                    )
                if k.spills:
                    problems.append(
                        f"{arch}: {name} spills ({k.vgpr_spill} vgpr, {k.sgpr_spill} sgpr)"
                    )
                if k.lds_bytes > info.lds_limit_bytes:
                    problems.append(
                        f"{arch}: {name} uses {k.lds_bytes} B LDS > {info.lds_limit_bytes}"
                    )
                if k.arg_size != want:
                    problems.append(
                        f"{arch}: {name} takes {k.arg_size} B of arguments, {src.params.__name__} is {want}"
                    )
                rows.append({"kernel": name, **resource_row(arch, k)})
        table[arch] = sorted(rows, key=lambda r: r["kernel"])
    if problems:
        raise PipelineError(
            f"static verification of {recipe.target} failed:\n  " + "\n  ".join(problems)
        )
    return table


# ---- the stages -------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _audit(image: str, export: Path, scratch: Path) -> dict[str, Any]:
    script = (
        "set -u; unset TORCHINDUCTOR_MAX_AUTOTUNE TORCHINDUCTOR_MAX_AUTOTUNE_GEMM TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE; "
        "hipcc --version | head -2; python3 --version; "
        f"echo '--- env'; env | grep -E '{ENV_AUDIT_PATTERN}' | sort; "
        "echo '--- doctor'; python3 -m mamba2_rocm doctor --json > /out/doctor.json; echo \"doctor exit $?\""
    )
    proc = images.run_in_image(image, ["sh", "-c", script], export, scratch)
    if proc.returncode != 0:
        raise PipelineError(f"audit in {image} failed:\n{proc.stdout}\n{proc.stderr}")
    doctor = json.loads((scratch / "doctor.json").read_text())
    env_lines = proc.stdout.split("--- env\n", 1)[1].split("--- doctor", 1)[0].strip().splitlines()
    if any(line.startswith("TORCHINDUCTOR_MAX_AUTOTUNE=") for line in env_lines):
        raise PipelineError("TORCHINDUCTOR_MAX_AUTOTUNE is still set inside the build container")
    return {
        "tools": proc.stdout.split("--- env", 1)[0].strip().splitlines(),
        "env": env_lines,
        "findings": [{k: f[k] for k in ("id", "severity")} for f in doctor.get("findings", [])],
    }


def _compile(recipes: list[Recipe], image: str, export: Path, kernels: Path, jobs: int,
             sources: tuple[str, ...] = ()) -> None:  # fmt: skip
    """One container run compiles every arch of ``recipes`` (same image, version and flags):
    the sources of ``export`` (only ``sources`` when given) into ``kernels/<arch>/``."""
    first = recipes[0]
    images.require_image(image, first)
    cmd = ["python3", "-m", "mamba2_rocm", "build", "--out", "/out", "--jobs", str(jobs),
           "--code-object-version", str(first.code_object_version)]  # fmt: skip
    for arch in dict.fromkeys(a for r in recipes for a in r.archs):
        cmd += ["--arch", arch]
    for flag in first.compile_flags:
        cmd.append(f"--extra-flag={flag}")
    for source in sources:
        cmd += ["--source", source]
    proc = images.run_in_image(image, cmd, export, kernels)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-40:])
        names = ", ".join(r.target for r in recipes)
        raise PipelineError(f"compile for {names} failed in {image}:\n{tail}")


# Run inside the smoke venv: every requirement of the named distributions is installed.
_REQUIREMENTS_CHECK = """
import sys, importlib.metadata as md
from packaging.requirements import Requirement
bad = []
for name in sys.argv[1:]:
    for req in map(Requirement, md.requires(name) or []):
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            version = md.version(req.name)
        except md.PackageNotFoundError:
            bad.append(f"{name}: {req} (missing)")
            continue
        if not req.specifier.contains(version, prereleases=True):
            bad.append(f"{name}: {req} (found {version})")
print("\\n".join(bad))
sys.exit(1 if bad else 0)
"""


def _smoke_test(
    recipes: list[Recipe], host_wheel: Path, target_wheels: dict[str, Path], scratch: Path,
    dropin_wheel: Path, version: str,
) -> dict[str, Any]:  # fmt: skip
    """Install the host, drop-in and target wheels into one fresh venv (no torch) and check, via
    ``python -m mamba2_rocm info --json``, that each target's kernels come from its own package,
    and that ``mamba_ssm`` / ``causal_conv1d`` are served by the drop-in at its version."""
    venv = scratch / "smoke-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    py = venv / ("Scripts" if os.name == "nt" else "bin") / "python"
    # Offline: the wheels without their dependencies, which then come from the interpreter that
    # runs the pipeline (appended to sys.path, after the venv's own site-packages, so the
    # installed wheels win). Whether the declared requirements are met is checked below.
    pip = [
        str(py),
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
        "--no-index",
        "--no-deps",
    ]
    proc = subprocess.run(
        [*pip, str(host_wheel), str(dropin_wheel), *map(str, target_wheels.values())],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise PipelineError(
            f"installing the wheels into a fresh venv failed:\n{proc.stderr[-2000:]}"
        )
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    Path(site, "_m2r_pipeline_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    names = ["mamba2-rocm", "mamba2-rocm-dropin", *(r.package_name for r in recipes)]
    proc = subprocess.run(
        [str(py), "-c", _REQUIREMENTS_CHECK, *names], capture_output=True, text=True, cwd=scratch
    )
    if proc.returncode != 0:
        raise PipelineError(
            f"requirements of the installed wheels are not met:\n{proc.stdout}{proc.stderr[-1000:]}"
        )
    clean_env = {
        k: v for k, v in os.environ.items() if not k.startswith(("MAMBA2_ROCM_", "PYTHON"))
    }
    clean_env["MAMBA2_ROCM_CACHE"] = str(
        scratch / "empty-cache"
    )  # no JIT dirs may answer for a package
    proc = subprocess.run([str(py), "-m", "mamba2_rocm", "info", "--json"], capture_output=True, text=True,
                          cwd=scratch, env=clean_env)  # fmt: skip
    if proc.returncode != 0:
        raise PipelineError(
            f"`python -m mamba2_rocm info --json` failed in the smoke venv:\n{proc.stderr[-2000:]}"
        )
    info = json.loads(proc.stdout)
    expected = {k for src in SOURCES.values() for k in src.kernels}
    for recipe in recipes:
        for arch in recipe.archs:
            dirs = [
                d
                for d in info["kernel_dirs"]
                if d["target"] == arch and d["origin"].startswith(f"package {recipe.package_name} ")
            ]
            if not dirs:
                raise PipelineError(
                    f"the installed {recipe.package_name} does not expose {arch} (info: {info['kernel_dirs']})"
                )
            missing = expected - set(dirs[0]["kernels"])
            if missing:
                raise PipelineError(
                    f"{arch}: installed {recipe.package_name} lacks kernels {sorted(missing)[:5]}"
                )
    # the drop-in's .pth ran at interpreter start: the import names are ours, at our version
    proc = subprocess.run([str(py), "-c", package.DROPIN_REPORT_SCRIPT], capture_output=True,
                          text=True, cwd=scratch, env=clean_env)  # fmt: skip
    if proc.returncode != 0:
        raise PipelineError(f"the drop-in's import-name report failed:\n{proc.stderr[-2000:]}")
    rows = json.loads(proc.stdout)
    problems = package.dropin_problems(rows, version)
    if problems:
        raise PipelineError("the installed drop-in does not serve the import names: "
                            + "; ".join(problems))  # fmt: skip
    return {
        "kernel_dirs": sorted(f"{d['target']} <- {d['origin']}" for d in info["kernel_dirs"]),
        "import_names": sorted(f"{r['name']} {r['version'] or '-'} <- {r['owner']}" for r in rows),
    }


def build_targets(recipes: list[Recipe], out_root: Path, jobs: int | None = None, log=print,
                  mirror: str | None = None, wait: float = 0.0) -> list[Path]:  # fmt: skip
    """Run every stage for ``recipes``; returns ``out_root/<target>`` for each.

    Shared work is done once: the source export, the host wheel, one audit per toolchain image
    and one compile per group of recipes with the same image, code-object version and flags
    (the driver spreads all of that group's (arch, source) compiles over ``jobs`` cores).
    One build per output folder: the targets' locks are held throughout (``wait`` seconds for
    a held one, see :func:`guard.output_lock`); what killed runs left is removed first; the
    outputs change only at the end, each target's set at once (:func:`guard.replace_dir`).
    """
    stages = StageLog(log=log)
    jobs = jobs or os.cpu_count() or 1
    t = ",".join(r.target for r in recipes) if len(recipes) <= 3 else f"{len(recipes)} targets"
    results = []
    with guard.output_lock(out_root, [r.target for r in recipes], wait, log), \
            guard.temporary_folder("build") as tmp:  # fmt: skip
        guard.clean_stale(out_root, log)
        with stages.stage("toolchain image", t):
            images.docker_check()
            image_of = {
                r.target: images.ensure_toolchain(r, mirror=mirror, log=log) for r in recipes
            }
        with stages.stage("export source", t):
            if package.work_tree_dirty():
                log(
                    f"[{t}] note: uncommitted changes are not part of the build (it builds the commit)"
                )
            export = tmp / "src"
            commit = package.export_commit(export)
            epoch = package.source_date_epoch(export)
        with stages.stage("audit", t):
            audits = {
                img: _audit(img, export, tmp / f"audit-{i}")
                for i, img in enumerate(dict.fromkeys(image_of.values()))
            }
        groups = compile_groups(recipes, image_of)
        kernels_of: dict[str, Path] = {}
        with stages.stage("compile", t):
            for gi, ((image, _cov, _flags), members) in enumerate(groups.items()):
                out = tmp / "kernels" / f"group{gi}"
                _compile(members, image, export, out, jobs)
                kernels_of.update({r.target: out for r in members})
        with stages.stage("verify", t):
            resources = {r.target: verify_kernel_dir(r, kernels_of[r.target]) for r in recipes}
        with stages.stage("package", t):
            dist = tmp / "dist"
            host = package.build_host_wheel(export, dist, epoch)
            version = host.name.split("-")[1]
            dropin = package.build_dropin_wheel(version, dist / "dropin", epoch)
            target_wheels = {
                r.target: package.build_target_wheel(
                    r, kernels_of[r.target], version, dist / r.target, epoch, commit
                )
                for r in recipes
            }
        with stages.stage("smoke test", t):
            smoke = _smoke_test(recipes, host, target_wheels, tmp / "smoke", dropin, version)
        with stages.stage("write", t):
            for r in recipes:
                wheels = (host, dropin, target_wheels[r.target])
                results.append(_write(r, out_root, wheels, kernels_of[r.target], version, commit,
                                      image_of[r.target], audits[image_of[r.target]],
                                      resources[r.target], smoke))  # fmt: skip
    log(f"[{t}] built in {sum(stages.timings.values()):.1f} s: "
        + ", ".join(f"{k} {v:.1f}s" for k, v in stages.timings.items()))  # fmt: skip
    return results


def _write(recipe: Recipe, out_root: Path, wheels: tuple[Path, ...], kernels: Path, version: str,
           commit: str, image: str, audit: dict, resources: dict, smoke: dict) -> Path:  # fmt: skip
    """``out_root/<target>/``: the release's wheels (host, drop-in, the target's kernels) and the
    build manifest naming their sha256s. Written beside the old set (``.<target>.new-<pid>``)
    and swapped in at once; a failure on the way (a full disk) leaves the old set as it was."""
    dest = out_root / recipe.target
    staged = out_root / f".{recipe.target}.new-{os.getpid()}"
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    try:
        _write_set(staged, recipe, wheels, kernels, version, commit, image, audit, resources, smoke)
        guard.replace_dir(staged, dest)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return dest


def _write_set(dest: Path, recipe: Recipe, wheels: tuple[Path, ...], kernels: Path, version: str,
               commit: str, image: str, audit: dict, resources: dict, smoke: dict) -> None:  # fmt: skip
    for whl in wheels:
        shutil.copy2(whl, dest / whl.name)
    code_objects = {
        f"{arch}/{co['file']}": co["sha256"]
        for arch in recipe.archs
        for co in json.loads((kernels / arch / "manifest.json").read_text())["code_objects"]
    }
    manifest = {
        "format": MANIFEST_FORMAT,
        "target": recipe.target,
        "package": recipe.package_name,
        "version": version,
        "source_commit": commit,
        "recipe": {"file": f"recipes/{recipe.path.name}", "sha256": recipe.sha256},
        "gpu_gate": recipe.gpu_gate,
        "min_rocm": recipe.min_rocm,
        "toolchain": {
            "image": image,
            "image_id": images.image_id(image),
            "packages": images.dpkg_versions(image, list(recipe.toolchain_packages)),
        },
        "audit": audit,
        "verification": {"static": "passed", "smoke_test": "passed", "gpu_test": "not run"},
        "code_objects": code_objects,
        "wheels": {w.name: _sha256(w) for w in wheels},
        "resources": resources,
        "smoke_test": smoke,
    }
    (dest / "build-manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def build_target(
    recipe: Recipe,
    out_root: Path,
    jobs: int | None = None,
    log=print,
    mirror: str | None = None,
    wait: float = 0.0,
) -> Path:
    """All stages for one recipe; returns ``out_root/<target>``."""
    return build_targets([recipe], out_root, jobs, log, mirror, wait)[0]
