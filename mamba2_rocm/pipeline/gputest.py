"""``nox -s gpu-tests-<target>``: the built wheels on a real AMD GPU, in the GPU test image.

Order, each step failing with a message that says what it found:

1. the host has ``/dev/kfd`` and ``/dev/dri`` (else fail at once: no GPU, nothing to test; this
   never turns into a skip that reads as a pass);
2. the wheels in ``wheels/<target>/`` still match their build manifest;
3. ``docker/gpu-test.Dockerfile`` is built on a ROCm PyTorch image (``--base-image``), installing
   exactly those wheels through ``env protect-torch`` (see the Dockerfile);
4. health check: ``rocminfo`` in the container must list an arch the recipe's code objects run on;
5. the test run (``docker/gpu-test-run.sh``): audit, torch.compile safety, torch unchanged,
   ``pytest -m gpu`` with a JUnit report, benchmarks;
6. the gate: at least one test passed and none failed, errored or skipped. Only then is
   ``wheels/<target>/gpu-gate.json`` written: target, the tested wheels' sha256s, the devices,
   the counts, the base image, the benchmark reports' sha256s. ``nox -s publish`` requires it
   for ``gpu_gate = "required"``;
7. the benchmark reports (``bench-<op>.json``: ``bench conv1d / decode / ssd`` and ``bench
   ssd-paths``, the SSD forward's host choices timed against their alternatives) are kept in
   ``wheels/<target>/gpu-bench/<op>.json`` (gpu.yml uploads them as ``gpu-bench-<target>``): the
   only measurements of the kernels on AMD hardware, and what the choices calibrated on NVIDIA
   (``mamba2_rocm.ops.ssd``'s chaining tables, the 128-column chunk_scan form) wait on there.

The container gets the GPU the way ROCm documents it for Docker: ``--device /dev/kfd
--device /dev/dri``, the ``video`` group and the host's render group (by id: the name may not
exist in the image), ``--security-opt seccomp=unconfined`` and ``--ipc host``.
"""

from __future__ import annotations

import grp
import json
import os
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mamba2_rocm.arch import generic_family
from mamba2_rocm.pipeline import guard, publish
from mamba2_rocm.pipeline.recipes import Recipe

__all__ = [
    "BENCH_DIR",
    "DEFAULT_BASE_IMAGE",
    "GpuTestError",
    "check_devices",
    "docker_gpu_args",
    "health_check",
    "junit_counts",
    "keep_benchmarks",
    "render_gid",
    "run_gpu_tests",
    "write_gate",
]

REPO = Path(__file__).resolve().parents[2]
#: An official ROCm PyTorch image (ROCm 6.4.1, Python 3.12, torch 2.7.1); override per runner.
DEFAULT_BASE_IMAGE = "rocm/pytorch:rocm6.4.1_ubuntu24.04_py3.12_pytorch_release_2.7.1"


#: where a passed run's benchmark reports are kept, under wheels/<target>/
BENCH_DIR = "gpu-bench"


class GpuTestError(RuntimeError):
    pass


def check_devices(target: str, dev: Path = Path("/dev")) -> None:
    """Fail fast, before any image is built, when this machine has no AMD GPU to test on."""
    if not (dev / "kfd").exists():
        raise GpuTestError(
            f"gpu-tests-{target}: no {dev / 'kfd'} on this machine, so there is no AMD GPU to "
            "test on (amdgpu/KFD driver not loaded, or not a GPU runner). The GPU tests cannot "
            "run here; this is a failure, not a skip: run them on a runner with the GPU."
        )
    if not (dev / "dri").is_dir():
        raise GpuTestError(
            f"gpu-tests-{target}: {dev / 'kfd'} exists but {dev / 'dri'} does not: the "
            "amdgpu render nodes are missing"
        )


def render_gid(dev: Path = Path("/dev")) -> int:
    """The group id owning the host's render nodes (``/dev/dri/renderD*``); the ``render``
    group's id when there are none to look at."""
    nodes = sorted((dev / "dri").glob("renderD*"))
    if nodes:
        return nodes[0].stat().st_gid
    try:
        return grp.getgrnam("render").gr_gid
    except KeyError:
        raise GpuTestError(
            f"no render node in {dev / 'dri'} and no 'render' group on this host: cannot give "
            "the container access to the GPU"
        ) from None


def docker_gpu_args(gid: int) -> list[str]:
    """The ``docker run`` options that hand the AMD GPU to the container."""
    return [
        "--device", "/dev/kfd", "--device", "/dev/dri",
        "--group-add", "video", "--group-add", str(gid),
        "--security-opt", "seccomp=unconfined", "--ipc", "host",
    ]  # fmt: skip


def run_args(image: str, gid: int, out: Path | None, command: Sequence[str] = ()) -> list[str]:
    """The whole ``docker run`` command line; the environment is explicit (nothing of the
    host's, so no max-autotune variable reaches the container)."""
    args = ["docker", "run", "--rm", *docker_gpu_args(gid), "-e", "PYTHONUNBUFFERED=1"]
    if out is not None:
        args += ["-v", f"{out}:/out", "-e", "OUT=/out"]
    return [*args, image, *command]


def health_check(recipe: Recipe, rocminfo: str) -> list[str]:
    """The device archs in ``rocminfo``'s output that the recipe's code objects run on (an exact
    arch, or one of a generic target's family); raises naming what was found otherwise."""
    found = sorted(set(re.findall(r"^\s*Name:\s+(gfx[0-9a-z]+)\b", rocminfo, re.MULTILINE)))
    wanted = set(recipe.archs)
    usable = [a for a in found if a in wanted or generic_family(a) in wanted]
    if not usable:
        raise GpuTestError(
            f"health check for {recipe.target}: rocminfo lists "
            + (f"the GPU arch(s) {', '.join(found)}" if found else "no GPU agent at all")
            + f", but the recipe's code objects are for {', '.join(recipe.archs)}: wrong runner "
            "(check its labels) or the GPU is not visible in the container"
        )
    return usable


def junit_counts(path: Path) -> dict[str, int]:
    """tests/passed/failed/errors/skipped from pytest's JUnit XML."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        raise GpuTestError(f"no readable JUnit report at {path}: {exc}") from None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {
        k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")
    }
    return {
        "tests": counts["tests"],
        "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
        "failed": counts["failures"],
        "errors": counts["errors"],
        "skipped": counts["skipped"],
    }


def gate_verdict(counts: dict[str, int]) -> str | None:
    """None when the run passes the gate, else why not. Skips fail the gate: a GPU test that
    skipped did not run, and must not read as a pass."""
    if counts["failed"] or counts["errors"]:
        return f"{counts['failed']} failed, {counts['errors']} errors"
    if counts["skipped"]:
        return f"{counts['skipped']} GPU test(s) skipped (the GPU was not usable from the tests)"
    if counts["passed"] <= 0:
        return "no GPU test ran"
    return None


def _docker(args: list[str], log) -> subprocess.CompletedProcess:
    log("+ " + " ".join(args))
    if args[:2] != ["docker", "run"]:
        return subprocess.run(args, capture_output=True, text=True)
    # a named, labelled container, stopped if this call is interrupted (guard)
    name = guard.container_name("gpu")
    try:
        return subprocess.run([*args[:2], *guard.container_args(name), *args[2:]],
                              capture_output=True, text=True)  # fmt: skip
    except BaseException:
        guard.stop_container(name)
        raise


def _build_image(
    recipe: Recipe, wheels: dict[str, Path], version: str, base_image: str, log
) -> str:
    tag = f"mamba2-rocm-gpu-test:{recipe.target}-{version}"
    with guard.temporary_folder("gpu") as ctx:
        (ctx / "wheels").mkdir()
        for name, path in wheels.items():
            shutil.copy2(path, ctx / "wheels" / name)
        shutil.copytree(REPO / "tests", ctx / "tests", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(REPO / "pyproject.toml", ctx / "pyproject.toml")  # pytest's markers
        shutil.copy2(REPO / "docker" / "gpu-test-run.sh", ctx / "gpu-test-run.sh")
        cmd = ["docker", "build", "-f", str(REPO / "docker" / "gpu-test.Dockerfile"),
               "--build-arg", f"BASE_IMAGE={base_image}", "--build-arg", f"TARGET={recipe.target}",
               "--build-arg", f"VERSION={version}", "-t", tag, str(ctx)]  # fmt: skip
        proc = _docker(cmd, log)
    if proc.returncode != 0:
        raise GpuTestError(
            f"building the GPU test image on {base_image} failed:\n{(proc.stdout + proc.stderr)[-4000:]}"
        )
    return tag


def run_gpu_tests(recipe: Recipe, wheels_root: Path, base_image: str = DEFAULT_BASE_IMAGE,
                  dev: Path = Path("/dev"), log=print) -> Path:  # fmt: skip
    """Every step above; returns the written ``gpu-gate.json``."""
    check_devices(recipe.target, dev)
    directory = wheels_root / recipe.target
    # The same checks publish makes, gate aside: test exactly the verified bytes.
    manifest = (
        json.loads((directory / publish.MANIFEST).read_text())
        if (directory / publish.MANIFEST).is_file()
        else None
    )
    if manifest is None:
        raise GpuTestError(
            f"no {directory / publish.MANIFEST}: run `nox -s build-{recipe.target}` first"
        )
    wheels = {}
    for name, digest in manifest["wheels"].items():
        path = directory / name
        if not path.is_file() or publish.sha256_file(path) != digest:
            raise GpuTestError(f"{path} is missing or differs from {publish.MANIFEST}")
        wheels[name] = path
    gid = render_gid(dev)
    image = _build_image(recipe, wheels, manifest["version"], base_image, log)
    proc = _docker(run_args(image, gid, None, ["rocminfo"]), log)
    if proc.returncode != 0:
        raise GpuTestError(
            f"rocminfo failed in the container (exit {proc.returncode}):\n{proc.stderr[-2000:]}"
        )
    archs = health_check(recipe, proc.stdout)
    log(f"health check: {', '.join(archs)} can run {recipe.target}")
    with guard.temporary_folder("gpu") as out:
        out.chmod(0o777)  # the image's non-root user writes the reports
        proc = _docker(run_args(image, gid, out), log)
        log(proc.stdout[-8000:])
        counts = junit_counts(out / "junit.xml") if (out / "junit.xml").is_file() else None
        if proc.returncode != 0 or counts is None:
            raise GpuTestError(
                f"the GPU test run for {recipe.target} failed (exit {proc.returncode})"
                + (f": {gate_verdict(counts)}" if counts and gate_verdict(counts) else "")
                + f"\n{proc.stderr[-4000:]}"
            )
        verdict = gate_verdict(counts)
        if verdict:
            raise GpuTestError(f"the GPU gate for {recipe.target} is not passed: {verdict}")
        bench = keep_benchmarks(out, directory / BENCH_DIR)
    path = write_gate(directory, manifest, archs, counts, base_image, bench)
    log(f"{recipe.target}: GPU gate passed ({counts['passed']} tests) -> {path}")
    return path


def keep_benchmarks(out: Path, keep: Path) -> dict[str, str]:
    """The run's ``bench-<op>.json`` reports in ``out`` copied to ``keep/<op>.json`` (``keep``
    emptied of an earlier run's first); returns {op: sha256 of the kept file}. A report that is
    not JSON, or holds no rows, fails: the run script writes one per benchmark it ran, so an
    empty or broken one means that benchmark did not run as it says."""
    reports = sorted(out.glob("bench-*.json"))
    kept = {}
    for path in reports:
        op = path.stem.removeprefix("bench-")
        try:
            rows = json.loads(path.read_text())
        except ValueError as exc:
            raise GpuTestError(f"the benchmark report {path.name} is not JSON: {exc}") from None
        if not isinstance(rows, list) or not rows:
            raise GpuTestError(f"the benchmark report {path.name} holds no rows")
        kept[op] = path
    if keep.exists():
        shutil.rmtree(keep)
    keep.mkdir(parents=True)
    digests = {}
    for op, path in kept.items():
        shutil.copyfile(path, keep / f"{op}.json")
        digests[op] = publish.sha256_file(keep / f"{op}.json")
    return digests


def write_gate(directory: Path, manifest: dict[str, Any], archs: list[str], counts: dict[str, int],
               base_image: str, benchmarks: dict[str, str]) -> Path:  # fmt: skip
    """``<directory>/gpu-gate.json``: a passed gate for exactly the manifest's wheels;
    ``benchmarks``: {op: sha256} of the kept reports (:func:`keep_benchmarks`)."""
    verdict = gate_verdict(counts)
    if verdict:
        raise GpuTestError(f"not writing a GPU gate for {manifest['target']}: {verdict}")
    gate: dict[str, Any] = {
        "format": publish.GATE_FORMAT, "target": manifest["target"], "version": manifest["version"],
        "result": "passed", "wheels": manifest["wheels"], "device_archs": archs,
        "base_image": base_image, "tests": counts, "benchmarks": benchmarks,
        "runner": os.environ.get("RUNNER_NAME", ""),
        # what publish binds the gate to: the built commit and this workflow run
        "commit": manifest.get("source_commit", ""), "run_id": os.environ.get("GITHUB_RUN_ID", ""),
    }  # fmt: skip
    path = directory / publish.GATE_FILE
    path.write_text(json.dumps(gate, indent=2, sort_keys=True) + "\n")
    return path
