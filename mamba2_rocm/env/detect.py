"""What GPU stack this process runs on: ROCm or not, and the arch of each visible device.

Sources, in order of trust:

1. torch (``torch.cuda.get_device_properties(i).gcnArchName`` on ROCm, ``sm_XY`` on CUDA): the
   devices this process will actually launch on, after ``HIP_VISIBLE_DEVICES`` and friends.
2. ``rocminfo``, then ``rocm_agent_enumerator``: when torch is missing, is a CPU or CUDA build,
   or sees no GPU (a machine check before installing the ROCm torch).
3. The KFD topology in sysfs (``/sys/class/kfd/kfd/topology/nodes/*/properties``): the
   hardware's *real* ISA. ``HSA_OVERRIDE_GFX_VERSION`` changes what torch and rocminfo report,
   never this file, so it is how the real arch under an override is known.

Nothing here imports torch at module import time: the audit must run where torch is missing
or broken.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from mamba2_rocm.arch import generic_family, split_arch_name

__all__ = [
    "HSA_OVERRIDE_ENV",
    "GpuDevice",
    "HsaOverride",
    "amd_gpus_present",
    "detect_devices",
    "fp8_dtype",
    "fp8_dtype_name",
    "hsa_override",
    "import_torch",
    "is_rocm",
    "kfd_archs",
    "parse_rocm_agent_enumerator",
    "parse_rocminfo",
]

HSA_OVERRIDE_ENV = "HSA_OVERRIDE_GFX_VERSION"

#: Where the KFD driver publishes its topology and where PCI devices live (tests point these
#: at fake trees).
KFD_TOPOLOGY = Path("/sys/class/kfd/kfd/topology/nodes")
PCI_DEVICES = Path("/sys/bus/pci/devices")
AMD_PCI_VENDOR = "0x1002"

_TOOL_TIMEOUT_S = 30


def import_torch() -> tuple[ModuleType | None, str | None]:
    """``(torch, None)``, or ``(None, why)`` when torch is missing or fails to import.

    A torch that is installed but broken (a missing ``libamdhip64.so``, an ABI mismatch) is not
    the same as no torch: the reason is returned so the audit can show it.
    """
    try:
        import torch
    except ModuleNotFoundError as exc:
        if exc.name == "torch":
            return None, "not installed"
        return None, f"import failed: {type(exc).__name__}: {exc}"
    except Exception as exc:  # any failure while importing torch is something to report
        return None, f"import failed: {type(exc).__name__}: {exc}"
    return torch, None


def is_rocm(torch: ModuleType | None = None) -> bool:
    """True when the torch in this process is a ROCm (HIP) build; False without torch."""
    if torch is None:
        torch, _ = import_torch()
        if torch is None:
            return False
    return getattr(getattr(torch, "version", None), "hip", None) is not None


# --------------------------------------------------------------------------- HSA override


@dataclass(frozen=True)
class HsaOverride:
    """``HSA_OVERRIDE_GFX_VERSION`` as set, and the ISA it makes the runtime report."""

    value: str
    arch: str | None  # None when the value is malformed
    error: str | None = None


def override_to_arch(value: str) -> str:
    """``"10.3.0"`` -> ``"gfx1030"``; ``"9.0.10"`` -> ``"gfx90a"`` (stepping is one hex digit).

    Raises ValueError naming the value when it is not ``MAJOR.MINOR.STEPPING``.
    """
    parts = value.strip().split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(
            f"{HSA_OVERRIDE_ENV}={value!r} is not MAJOR.MINOR.STEPPING (e.g. 10.3.0 for gfx1030, "
            f"11.0.0 for gfx1100)"
        )
    major, minor, stepping = (int(p) for p in parts)
    if major < 7 or minor > 15 or stepping > 15:
        raise ValueError(
            f"{HSA_OVERRIDE_ENV}={value!r} names no gfx ISA (major >= 7, minor and stepping "
            f"0..15 expected, e.g. 10.3.0 for gfx1030)"
        )
    return f"gfx{major}{minor:x}{stepping:x}"


def hsa_override(environ: dict[str, str] | None = None) -> HsaOverride | None:
    """The active ``HSA_OVERRIDE_GFX_VERSION``, or None when it is unset or empty."""
    environ = os.environ if environ is None else environ
    value = environ.get(HSA_OVERRIDE_ENV, "")
    if not value.strip():
        return None
    try:
        return HsaOverride(value, override_to_arch(value))
    except ValueError as exc:
        return HsaOverride(value, None, str(exc))


# --------------------------------------------------------------------------- sysfs


def _gfx_from_target_version(version: int) -> str:
    """KFD's ``gfx_target_version`` (major*10000 + minor*100 + stepping) as a gfx name."""
    major, minor, stepping = version // 10000, (version // 100) % 100, version % 100
    return f"gfx{major}{minor:x}{stepping:x}"


def kfd_archs(root: Path | None = None) -> list[str]:
    """The real ISA of every GPU node in the KFD topology, in node order (empty without KFD)."""
    root = KFD_TOPOLOGY if root is None else root
    archs: list[tuple[int, str]] = []
    try:
        nodes = list(root.iterdir())
    except OSError:
        return []
    for node in nodes:
        try:
            text = (node / "properties").read_text()
        except OSError:
            continue
        props = dict(line.split(None, 1) for line in text.splitlines() if len(line.split()) == 2)
        version = int(props.get("gfx_target_version", "0") or 0)
        if version:  # CPU nodes report 0
            key = int(node.name) if node.name.isdigit() else 1 << 30
            archs.append((key, _gfx_from_target_version(version)))
    return [arch for _, arch in sorted(archs)]


def amd_gpus_present(kfd_root: Path | None = None, pci_root: Path | None = None) -> bool:
    """Whether this machine has an AMD GPU, whatever torch says (KFD nodes or PCI display)."""
    if kfd_archs(kfd_root):
        return True
    pci_root = PCI_DEVICES if pci_root is None else pci_root
    try:
        devices = list(pci_root.iterdir())
    except OSError:
        return False
    for dev in devices:
        try:
            vendor = (dev / "vendor").read_text().strip().lower()
            pci_class = (dev / "class").read_text().strip().lower()
        except OSError:
            continue
        # 0x03xxxx: display controllers (VGA 0x0300, 3D 0x0302, display 0x0380).
        if vendor == AMD_PCI_VENDOR and pci_class.startswith("0x03"):
            return True
    return False


# --------------------------------------------------------------------------- devices


@dataclass(frozen=True)
class GpuDevice:
    """One visible GPU. ``arch`` is the ISA the runtime reports (and loads code objects for)."""

    index: int
    arch: str  # effective ISA without features: "gfx90a", "gfx1030", "sm_90"
    arch_full: str  # as reported, with feature suffixes: "gfx90a:sramecc+:xnack-"
    features: dict[str, bool] = field(default_factory=dict)
    name: str = ""
    source: str = "torch"  # "torch", "rocminfo", "rocm_agent_enumerator", "kfd"
    real_arch: str | None = None  # the hardware ISA when an HSA override is active

    @property
    def vendor(self) -> str:
        return "nvidia" if self.arch.startswith("sm_") else "amd"

    @property
    def generic_family(self) -> str | None:
        return generic_family(self.arch) if self.vendor == "amd" else None

    @property
    def fp8_dtype(self) -> str | None:
        return fp8_dtype_name(self.arch)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(
            vendor=self.vendor, generic_family=self.generic_family, fp8_dtype=self.fp8_dtype
        )
        return data


def _device(index: int, arch_full: str, name: str, source: str) -> GpuDevice:
    base, features = split_arch_name(arch_full)
    return GpuDevice(index, base, arch_full.strip(), features, name.strip(), source)


def torch_devices(torch: ModuleType) -> list[GpuDevice]:
    """The devices torch sees (ROCm: ``gcnArchName``; CUDA: ``sm_<major><minor>``)."""
    cuda = torch.cuda
    if not cuda.is_available():
        return []
    hip = is_rocm(torch)
    found = []
    for i in range(cuda.device_count()):
        props = cuda.get_device_properties(i)
        if hip:
            arch = getattr(props, "gcnArchName", "") or ""
            if not arch:
                continue
        else:
            arch = f"sm_{props.major}{props.minor}"
        found.append(_device(i, arch, getattr(props, "name", ""), "torch"))
    return found


_AGENT_RE = re.compile(r"^\s*Agent\s+\d+\s*$")
_ISA_RE = re.compile(r"amdgcn-amd-amdhsa--(gfx[0-9a-z]+(?::[a-z0-9_]+[+-])*)")


def parse_rocminfo(text: str) -> list[tuple[str, str]]:
    """``[(arch_with_features, marketing_name), ...]`` for each GPU agent in rocminfo output."""
    agents: list[dict[str, str]] = []
    for line in text.splitlines():
        if _AGENT_RE.match(line):
            agents.append({})
            continue
        if not agents:
            continue
        agent = agents[-1]
        key, sep, value = line.strip().partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key in ("Name", "Marketing Name", "Device Type") and key not in agent:
            agent[key] = value
        isa = _ISA_RE.search(line)
        if isa and "isa" not in agent:
            agent["isa"] = isa.group(1)
    return [
        (agent.get("isa") or agent.get("Name", ""), agent.get("Marketing Name", ""))
        for agent in agents
        if agent.get("Device Type") == "GPU" and (agent.get("isa") or agent.get("Name"))
    ]


def parse_rocm_agent_enumerator(text: str) -> list[str]:
    """GPU ISAs from ``rocm_agent_enumerator`` (one per line; gfx000 is the CPU)."""
    return [
        w for w in (ln.strip() for ln in text.splitlines()) if w.startswith("gfx") and w != "gfx000"
    ]


def find_rocm_tool(name: str) -> str | None:
    """``name`` on PATH, else under ``$ROCM_PATH/bin`` or ``/opt/rocm/bin``."""
    found = shutil.which(name)
    if found:
        return found
    for root in (os.environ.get("ROCM_PATH"), "/opt/rocm"):
        if root and os.access(os.path.join(root, "bin", name), os.X_OK):
            return os.path.join(root, "bin", name)
    return None


def _run_tool(name: str) -> tuple[str | None, str]:
    """``(stdout, note)``: the tool's output, or None and why it could not be used."""
    path = find_rocm_tool(name)
    if path is None:
        return None, f"{name}: not found"
    try:
        proc = subprocess.run(
            [path], capture_output=True, text=True, timeout=_TOOL_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{name}: {exc}"
    if proc.returncode != 0:
        err = (proc.stderr or proc.stdout).strip().splitlines()
        return None, f"{name}: exit {proc.returncode}" + (f" ({err[-1]})" if err else "")
    return proc.stdout, f"{name}: ran"


ToolRunner = Callable[[str], tuple[str | None, str]]


def detect_devices(
    torch: ModuleType | None = None,
    *,
    use_torch: bool = True,
    run_tool: ToolRunner | None = None,
    kfd_root: Path | None = None,
    environ: dict[str, str] | None = None,
) -> tuple[list[GpuDevice], list[str]]:
    """The visible GPUs and a note per source tried (``"torch: 0 devices"``, ...).

    torch first; when it sees no GPU, rocminfo, then rocm_agent_enumerator, then the KFD
    topology. Each device's ``real_arch`` is filled from KFD when an HSA override is active.
    """
    run_tool = _run_tool if run_tool is None else run_tool
    notes: list[str] = []
    devices: list[GpuDevice] = []
    if use_torch:
        if torch is None:
            torch, why = import_torch()
        else:
            why = None
        if torch is None:
            notes.append(f"torch: {why}")
        else:
            try:
                devices = torch_devices(torch)
                notes.append(f"torch: {len(devices)} device(s)")
            except Exception as exc:  # a broken driver must not stop the audit
                notes.append(f"torch: device query failed: {type(exc).__name__}: {exc}")
    if not devices:
        out, note = run_tool("rocminfo")
        notes.append(note)
        if out is not None:
            devices = [
                _device(i, arch, name, "rocminfo")
                for i, (arch, name) in enumerate(parse_rocminfo(out))
            ]
    if not devices:
        out, note = run_tool("rocm_agent_enumerator")
        notes.append(note)
        if out is not None:
            devices = [
                _device(i, arch, "", "rocm_agent_enumerator")
                for i, arch in enumerate(parse_rocm_agent_enumerator(out))
            ]
    real = kfd_archs(kfd_root)
    override = hsa_override(environ)
    if not devices and real:
        notes.append(f"kfd: {len(real)} GPU node(s)")
        effective = override.arch if override and override.arch else None
        devices = [_device(i, effective or arch, "", "kfd") for i, arch in enumerate(real)]
    if override is not None and devices:
        devices = [_with_real_arch(dev, i, real) for i, dev in enumerate(devices)]
    return devices, notes


def _with_real_arch(dev: GpuDevice, i: int, real: list[str]) -> GpuDevice:
    """Attach the hardware ISA: by position when the counts match, else when all agree."""
    if dev.vendor != "amd" or not real:
        return dev
    if len(set(real)) == 1:
        arch = real[0]
    elif i < len(real):
        arch = real[i]
    else:
        return dev
    return GpuDevice(dev.index, dev.arch, dev.arch_full, dev.features, dev.name, dev.source, arch)


# --------------------------------------------------------------------------- fp8


_FNUZ_ISAS = ("gfx940", "gfx941", "gfx942")


def fp8_dtype_name(arch: str) -> str | None:
    """The name of the torch fp8 (e4m3) dtype to use on ``arch``.

    gfx940/941/942 (MI300) implement the "fnuz" encoding (no negative zero, exponent bias 8);
    gfx950, RDNA (gfx10-12) and NVIDIA implement or emulate the OCP ``float8_e4m3fn``. None for a generic target that spans both
    (gfx9-4-generic) and for unknown names.
    """
    base = split_arch_name(arch)[0]
    if base in _FNUZ_ISAS:
        return "float8_e4m3fnuz"
    if base.startswith("sm_") or re.fullmatch(r"gfx(9[0-9a-f]{2}|1[0-2][0-9a-f]{2})", base):
        return "float8_e4m3fn"
    if base in ("gfx10-1-generic", "gfx10-3-generic", "gfx11-generic", "gfx12-generic"):
        return "float8_e4m3fn"
    return None


def fp8_dtype(arch: str) -> Any:
    """The torch dtype named by :func:`fp8_dtype_name` (imports torch)."""
    name = fp8_dtype_name(arch)
    if name is None:
        raise ValueError(
            f"no single fp8 dtype for {arch!r}: pass a concrete ISA such as gfx942 "
            f"(float8_e4m3fnuz) or gfx950 (float8_e4m3fn)"
        )
    from mamba2_rocm._torch import require_torch

    return getattr(require_torch(), name)
