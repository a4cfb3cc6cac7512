"""Fakes shared by the env tests: torch stand-ins, KFD trees, and minimal wheels."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest


def fake_torch(hip=None, cuda=None, archs=(), names=None, version="2.5.1+rocm6.2", caps=()):
    """A torch stand-in: ``archs`` are gcnArchNames (ROCm), ``caps`` (major, minor) (CUDA)."""
    devices = [SimpleNamespace(gcnArchName=a, name=f"AMD GPU {i}") for i, a in enumerate(archs)]
    devices += [SimpleNamespace(major=m, minor=n, name="NVIDIA GPU") for m, n in caps]
    if names:
        for dev, name in zip(devices, names, strict=True):
            dev.name = name
    return SimpleNamespace(
        __version__=version,
        __file__="/opt/venv/lib/python3.11/site-packages/torch/__init__.py",
        version=SimpleNamespace(hip=hip, cuda=cuda),
        cuda=SimpleNamespace(
            is_available=lambda: bool(devices),
            device_count=lambda: len(devices),
            get_device_properties=lambda i: devices[i],
        ),
    )


def make_kfd(root: Path, target_versions: list[int]) -> Path:
    """A fake ``/sys/class/kfd/kfd/topology/nodes`` with a CPU node 0, then GPU nodes."""
    for i, version in enumerate([0, *target_versions]):
        node = root / str(i)
        node.mkdir(parents=True)
        (node / "properties").write_text(
            f"cpu_cores_count {0 if version else 16}\nsimd_count {0 if not version else 120}\n"
            f"gfx_target_version {version}\nvendor_id {4098 if version else 0}\n"
        )
    return root


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def build_wheel(
    outdir: Path, name: str, version: str, files: dict[str, str], requires: tuple[str, ...] = ()
) -> Path:
    """Write a minimal valid pure-Python wheel (METADATA, WHEEL, RECORD) and return its path."""
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    contents = dict(files)
    contents[f"{info}/METADATA"] = "".join(
        [
            "Metadata-Version: 2.1\n",
            f"Name: {name}\n",
            f"Version: {version}\n",
            *(f"Requires-Dist: {r}\n" for r in requires),
        ]
    )
    contents[f"{info}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: mamba2-rocm-tests\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n"
    )
    outdir.mkdir(parents=True, exist_ok=True)
    path = outdir / f"{dist}-{version}-py3-none-any.whl"
    record = []
    with zipfile.ZipFile(path, "w") as zf:
        for arc, text in contents.items():
            data = text.encode()
            zf.writestr(arc, data)
            record.append(_record_line(arc, data))
        record.append(f"{info}/RECORD,,")
        zf.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


def build_torch_wheel(outdir: Path, version: str, hip=None, cuda=None, extra: str = "") -> Path:
    """A stand-in ``torch`` distribution: ``__version__`` and a ``torch.version`` module."""
    version_py = (
        "from typing import Optional\n\n"
        f"__version__ = {version!r}\n"
        f"hip: Optional[str] = {hip!r}\n"
        f"cuda: Optional[str] = {cuda!r}\n"
        f"git_version = 'standin'\n{extra}"
    )
    return build_wheel(
        outdir,
        "torch",
        version,
        {
            "torch/__init__.py": f"from torch import version\n__version__ = {version!r}\n",
            "torch/version.py": version_py,
        },
    )


@pytest.fixture
def no_rocm_tools(monkeypatch):
    """Make rocminfo/rocm_agent_enumerator unfindable and the KFD/PCI trees empty."""
    from mamba2_rocm.env import detect

    monkeypatch.setattr(detect, "find_rocm_tool", lambda name: None)
    monkeypatch.setattr(detect, "KFD_TOPOLOGY", Path("/nonexistent/kfd"))
    monkeypatch.setattr(detect, "PCI_DEVICES", Path("/nonexistent/pci"))
