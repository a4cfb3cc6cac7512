"""Fakes shared by the env tests: torch stand-ins, KFD trees, and minimal wheels."""

from __future__ import annotations

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


@pytest.fixture
def no_rocm_tools(monkeypatch):
    """Make rocminfo/rocm_agent_enumerator unfindable and the KFD/PCI trees empty."""
    from mamba2_rocm.env import detect

    monkeypatch.setattr(detect, "find_rocm_tool", lambda name: None)
    monkeypatch.setattr(detect, "KFD_TOPOLOGY", Path("/nonexistent/kfd"))
    monkeypatch.setattr(detect, "PCI_DEVICES", Path("/nonexistent/pci"))
