"""The real pipeline in Docker: build-gfx1030 end to end, twice, byte for byte the same."""

import json
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from mamba2_rocm.kernels import SOURCES
from mamba2_rocm.pipeline import stages
from mamba2_rocm.pipeline.package import DROPIN_PTH, DROPIN_PTH_FILE
from mamba2_rocm.pipeline.recipes import get_recipe
from mamba2_rocm.pipeline.repro import compare_wheel_dirs

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.docker, pytest.mark.slow]


@pytest.fixture(scope="module")
def two_builds(toolchain_image, tmp_path_factory):
    root = tmp_path_factory.mktemp("wheels")
    recipe = get_recipe("gfx1030")
    first = stages.build_target(recipe, root / "first")
    second = stages.build_target(recipe, root / "second")
    return first, second


def test_build_gfx1030_outputs(two_builds):
    out, _ = two_builds
    wheels = sorted(p.name for p in out.glob("*.whl"))
    assert len(wheels) == 3
    host, dropin, target = (
        (w for w in wheels if w.startswith("mamba2_rocm-")),
        (w for w in wheels if w.startswith("mamba2_rocm_dropin-")),
        (w for w in wheels if w.startswith("mamba2_rocm_gfx1030-")),
    )
    host, dropin, target = next(host), next(dropin), next(target)
    assert host.endswith("-py3-none-any.whl") and target.endswith("-py3-none-any.whl")
    manifest = json.loads((out / "build-manifest.json").read_text())
    assert manifest["target"] == "gfx1030" and manifest["verification"]["static"] == "passed"
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    assert manifest["source_commit"] == head
    assert (
        manifest["toolchain"]["packages"]["hipcc"]
        == get_recipe("gfx1030").toolchain_packages["hipcc"]
    )
    for name, digest in manifest["wheels"].items():
        import hashlib

        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
    rows = manifest["resources"]["gfx1030"]
    assert rows and all(r["spills"] == 0 and r["waves_per_simd"] >= 1 for r in rows)
    assert not any(
        line.startswith("TORCHINDUCTOR_MAX_AUTOTUNE") for line in manifest["audit"]["env"]
    )
    # the target wheel: only its code objects, pinned to the host version, registered as a kernel package
    version = host.split("-")[1]
    with zipfile.ZipFile(out / target) as zf:
        names = zf.namelist()
        assert {n for n in names if n.endswith(".hsaco")} == {
            f"mamba2_rocm_gfx1030/kernels/gfx1030/{src}.hsaco" for src in SOURCES
        }
        meta = zf.read(f"mamba2_rocm_gfx1030-{version}.dist-info/METADATA").decode()
        eps = zf.read(f"mamba2_rocm_gfx1030-{version}.dist-info/entry_points.txt").decode()
    assert f"Requires-Dist: mamba2-rocm=={version}" in meta
    assert "[mamba2_rocm.kernels]" in eps and "gfx1030 = mamba2_rocm_gfx1030" in eps
    with zipfile.ZipFile(out / host) as zf:
        meta = zf.read(f"mamba2_rocm-{version}.dist-info/METADATA").decode()
        assert not any(n.endswith((".hsaco", ".cubin")) for n in zf.namelist())
    assert f"Requires-Dist: mamba2-rocm-gfx1030=={version}; extra == 'gfx1030'" in meta
    assert f"Requires-Dist: mamba2-rocm-dropin=={version}; extra == 'dropin'" in meta
    assert "Requires-Dist: torch" not in meta
    # the drop-in: its .pth line only, pinned to the host version; the smoke test imported the
    # names through it in the fresh venv
    with zipfile.ZipFile(out / dropin) as zf:
        assert [n for n in zf.namelist() if ".dist-info/" not in n] == [DROPIN_PTH_FILE]
        assert zf.read(DROPIN_PTH_FILE).decode() == DROPIN_PTH
        meta = zf.read(f"mamba2_rocm_dropin-{version}.dist-info/METADATA").decode()
    assert f"Requires-Dist: mamba2-rocm=={version}" in meta
    assert manifest["smoke_test"]["import_names"] == [
        f"causal_conv1d 1.6.1+mamba2rocm.{version} <- mamba2-rocm",
        f"mamba_ssm 2.3.2+mamba2rocm.{version} <- mamba2-rocm",
        "selective_scan_cuda - <- mamba2-rocm",  # an extension module: no distribution version
    ]


def test_reproducible(two_builds):
    first, second = two_builds
    assert compare_wheel_dirs(first, second) == []
    a = json.loads((first / "build-manifest.json").read_text())
    b = json.loads((second / "build-manifest.json").read_text())
    assert a == b


def test_compiler_failure_reports_its_stderr(toolchain_image, tmp_path):
    export = tmp_path / "src"
    shutil.copytree(REPO / "mamba2_rocm", export / "mamba2_rocm")
    shutil.copytree(REPO / "csrc", export / "csrc")
    bad = export / "csrc" / "conv1d_update.hip"
    bad.write_text(bad.read_text() + "\nthis is not C++;\n")
    with pytest.raises(stages.PipelineError) as err:
        stages._compile([get_recipe("gfx1030")], toolchain_image, export, tmp_path / "out", 2)
    msg = str(err.value)
    assert "compile for gfx1030 failed" in msg and "conv1d_update.hip" in msg and "error:" in msg
