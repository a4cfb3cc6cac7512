"""Pipeline logic that needs no Docker: occupancy estimates, wheel comparison, verification."""

import json
import shutil
import zipfile
from pathlib import Path

import pytest

from mamba2_rocm.pipeline import images
from mamba2_rocm.pipeline.recipes import get_recipe
from mamba2_rocm.pipeline.repro import compare_wheel_dirs
from mamba2_rocm.pipeline.stages import PipelineError, estimate_waves_per_simd, verify_kernel_dir


@pytest.mark.parametrize(
    ("arch", "vgpr", "agpr", "lds", "waves"),
    [
        ("gfx90a", 32, 0, 0, 8),  # capped by the 8 waves a CDNA SIMD holds
        ("gfx90a", 128, 0, 0, 4),  # 512 / 128
        ("gfx90a", 64, 64, 0, 4),  # AGPRs share the file on CDNA
        ("gfx1030", 64, 0, 0, 16),  # 1024 / 64
        ("gfx1030", 139, 0, 0, 7),  # rounded up to 144 -> 1024 // 144
        ("gfx1100", 96, 0, 0, 16),  # 1536 / 96
        ("gfx1151", 96, 0, 0, 10),  # smaller register file on the APU: 1024 // 96
        ("gfx1030", 32, 0, 32 * 1024, 4),  # LDS: 2 groups of 4 waves on 2 SIMDs
    ],
)
def test_occupancy_estimate(arch, vgpr, agpr, lds, waves):
    assert estimate_waves_per_simd(arch, vgpr, agpr, lds) == waves


def _wheel(path: Path, members: dict[str, bytes], date=(2020, 2, 2, 0, 0, 0), mode=0o644):
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            info = zipfile.ZipInfo(name, date_time=date)
            info.external_attr = mode << 16
            zf.writestr(info, data)


def test_compare_wheel_dirs_names_the_differing_members(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    _wheel(a / "x-1-py3-none-any.whl", {"x/k.hsaco": b"\x01", "x/__init__.py": b""})
    _wheel(b / "x-1-py3-none-any.whl", {"x/k.hsaco": b"\x02", "x/__init__.py": b""})
    _wheel(a / "y-1-py3-none-any.whl", {"y/a": b"1"})
    _wheel(b / "y-1-py3-none-any.whl", {"y/a": b"1"}, date=(2021, 1, 1, 0, 0, 0))
    _wheel(a / "z-1-py3-none-any.whl", {"z": b""})
    assert compare_wheel_dirs(a, b) == [
        "z-1-py3-none-any.whl: only in first build",
        "x-1-py3-none-any.whl differs: x/k.hsaco (content)",
        "y-1-py3-none-any.whl differs: y/a (mode or timestamp)",
    ]
    shutil.rmtree(b)
    shutil.copytree(a, b)
    assert compare_wheel_dirs(a, b) == []


def test_verify_requires_a_manifest(tmp_path):
    with pytest.raises(PipelineError, match="gfx1030: no manifest.json"):
        verify_kernel_dir(get_recipe("gfx1030"), tmp_path)


def test_docker_unreachable_says_how_to_start_it(monkeypatch, tmp_path):
    fake = tmp_path / "docker"
    fake.write_text("#!/bin/sh\necho 'Cannot connect to the Docker daemon' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    with pytest.raises(
        images.DockerError, match="Docker is not reachable .*dockerd --iptables=false"
    ):
        images.docker_check()


def test_docker_missing_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(
        images.DockerError, match="docker client is not installed; .*apt-get install docker.io"
    ):
        images.docker_check()


def test_tampered_code_object_fails_verification(built_gfx1030, tmp_path):
    """A code object changed after the build is caught by the host-side re-read."""
    kernels = tmp_path / "kernels"
    shutil.copytree(built_gfx1030, kernels / "gfx1030")
    co = json.loads((kernels / "gfx1030" / "manifest.json").read_text())["code_objects"][0]
    path = kernels / "gfx1030" / co["file"]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(
        PipelineError, match=f"gfx1030/{co['file']}: sha256 differs from the manifest"
    ):
        verify_kernel_dir(get_recipe("gfx1030"), kernels)


def test_wrong_wavefront_recipe_fails_verification(built_gfx1030, tmp_path):
    """Code objects that disagree with the recipe are stopped with a precise message."""
    import dataclasses

    kernels = tmp_path / "kernels"
    shutil.copytree(built_gfx1030, kernels / "gfx1030")
    recipe = dataclasses.replace(get_recipe("gfx1030"), wavefront_size=64, code_object_version=6)
    with pytest.raises(PipelineError) as err:
        verify_kernel_dir(recipe, kernels)
    assert "recipe says v6" in str(err.value) and "is wave32, recipe says 64" in str(err.value)
