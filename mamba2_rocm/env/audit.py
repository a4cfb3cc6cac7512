"""The environment audit behind ``python -m mamba2_rocm doctor``.

:func:`gather` collects facts (environment, torch, devices, kernel packages, a few ``/proc`` and
``/dev`` files), :func:`check` turns them into findings, each with a severity and a fix, and
:func:`render_text` prints them. Checks are plain functions of the facts, so tests fake the
facts rather than the machine. The process exits non-zero when a finding is an error.

``doctor --json`` prints one object with these keys (stable; a change that removes or renames a
key bumps ``schema_version``, a change that adds one does not):

- ``schema_version`` (int, now 1), ``mamba2_rocm_version`` (str), ``ok`` (bool: no error finding)
- ``python``: ``{"version", "executable", "platform"}``
- ``environment``: ``{NAME: value}`` for every variable whose name matches
  :data:`ENV_PATTERN`; values of names that look secret (TOKEN, SECRET, PASSWORD, KEY, AUTH,
  CREDENTIAL) read ``"<redacted>"``
- ``torch``: ``{"installed", "version", "hip", "cuda", "location", "error"}`` (``error`` is
  why torch could not be imported, else null)
- ``rocm``: bool, torch is a ROCm build (``torch.version.hip`` is not None)
- ``amd_gpus_present``: bool, the machine has an AMD GPU (KFD topology or PCI), torch or not
- ``hsa_override``: null, or ``{"value", "arch", "error"}``
- ``devices``: list of ``{"index", "arch", "arch_full", "features", "name", "source",
  "real_arch", "vendor", "generic_family", "fp8_dtype", "kernel_dir", "install_hint"}``;
  ``kernel_dir`` is null or ``{"target", "path", "origin"}``, ``install_hint`` is the pip line
  when no kernel dir serves the device, else null; ``op_tier`` is ``{"tier", "why"}``: which
  tier ops on the device take (``"kernel"``, ``"jit"``, ``"torch"``, ``"eager"``, ``"error"``:
  they raise, ``"none"``: no torch) and why
- ``cpu_op_tier``: ``{"tier", "why"}`` for CPU tensors
- ``device_sources``: list of str, what each detection source said
- ``kernel_packages``: list of ``{"name", "version"}`` (installed ``mamba2-rocm-*``)
- ``import_names``: ``mamba2_rocm.dropin.report()``: who owns ``mamba_ssm`` / ``causal_conv1d``
- ``kernel_dirs``: list of ``{"target", "path", "origin"}``
- ``numa_balancing``: str or null (content of ``/proc/sys/kernel/numa_balancing``)
- ``kfd``: ``"ok"``, ``"missing"``, ``"no-access"`` or ``"n/a"`` (not Linux)
- ``findings``: list of ``{"id", "severity", "message", "fix"}``, errors first; severity is
  ``"error"``, ``"warning"`` or ``"info"``
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mamba2_rocm import dropin
from mamba2_rocm.env.detect import (
    GpuDevice,
    HsaOverride,
    amd_gpus_present,
    detect_devices,
    hsa_override,
    import_torch,
)

__all__ = [
    "ENV_PATTERN",
    "SCHEMA_VERSION",
    "Facts",
    "Finding",
    "TorchInfo",
    "check",
    "exit_code",
    "gather",
    "render_text",
    "run_audit",
]

SCHEMA_VERSION = 1
ENV_PATTERN = re.compile(r"TORCH|INDUCTOR|AUTOTUNE|TRITON|HIP|ROCM|HSA|GPU|AMD|CUDA")
_SECRET_RE = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|KEY|AUTH|CREDENTIAL", re.IGNORECASE)

NUMA_BALANCING = Path("/proc/sys/kernel/numa_balancing")
DEV_KFD = Path("/dev/kfd")

#: Inductor reads these at import; "1" turns autotuning on for every compile mode.
MAX_AUTOTUNE_ENVS = (
    "TORCHINDUCTOR_MAX_AUTOTUNE",
    "TORCHINDUCTOR_MAX_AUTOTUNE_GEMM",
    "TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE",
)
#: The allocator settings torch reads (the HIP and device-generic names alias the CUDA one).
ALLOC_CONF_ENVS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

SEVERITIES = ("error", "warning", "info")


#: PyTorch's wheel indexes (download.pytorch.org/whl/...): the CPU build, and the ROCm build
#: the project's own ROCm images use (PyTorch publishes one per supported ROCm release)
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TORCH_ROCM_INDEX = "https://download.pytorch.org/whl/rocm6.4"


_ROCM_TORCH_HINT = (
    f"pip install torch --index-url {TORCH_ROCM_INDEX} "
    "(pick the rocmX.Y matching your driver), then re-run `python -m mamba2_rocm doctor`"
)


def torch_install_line(amd_gpus: bool, nvidia_gpus: bool) -> str:
    """The pip line that installs the torch this machine needs: ROCm's on a machine with AMD
    GPUs, PyPI's default (CUDA) build where only NVIDIA GPUs are, the CPU build otherwise.
    Never the bare `pip install torch` on an AMD machine: on Linux it is the CUDA build."""
    if amd_gpus:
        return (
            f"pip install torch --index-url {TORCH_ROCM_INDEX} "
            "(or the rocmX.Y index that matches your ROCm driver)"
        )
    if nvidia_gpus:
        return "pip install torch"
    return f"pip install torch --index-url {TORCH_CPU_INDEX}"


@dataclass(frozen=True)
class Finding:
    """One problem (or notable fact) with what to do about it."""

    id: str
    severity: str  # "error" | "warning" | "info"
    message: str
    fix: str

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")


@dataclass(frozen=True)
class TorchInfo:
    installed: bool
    version: str | None = None
    hip: str | None = None
    cuda: str | None = None
    location: str | None = None
    error: str | None = None  # why import failed (installed but broken, or not installed)

    @property
    def importable(self) -> bool:
        return self.version is not None


@dataclass
class Facts:
    """Everything the checks look at. :func:`gather` reads the machine; tests build one."""

    environ: dict[str, str]
    torch: TorchInfo
    devices: list[GpuDevice] = field(default_factory=list)
    device_sources: list[str] = field(default_factory=list)
    amd_gpus: bool = False
    numa_balancing: str | None = None
    kfd: str = "n/a"
    kernel_packages: list[dict[str, str]] = field(default_factory=list)
    kernel_dirs: list[Any] = field(default_factory=list)  # runtime.discovery.KernelDir
    kernel_warnings: list[str] = field(default_factory=list)
    #: who owns the drop-in import names (mamba2_rocm.dropin.report())
    import_names: list[dict[str, Any]] = field(default_factory=list)
    #: why MAMBA2_ROCM_KERNEL_PATH cannot be used: entries that serve nothing, and per device
    #: arch (runtime.discovery.kernel_path_error), {arch: message}
    kernel_path_problems: list[str] = field(default_factory=list)
    kernel_path_errors: dict[str, str] = field(default_factory=dict)
    #: compilers a just-in-time build would use, by vendor (empty with MAMBA2_ROCM_JIT=0)
    jit_compilers: dict[str, str] = field(default_factory=dict)

    @property
    def rocm(self) -> bool:
        return self.torch.hip is not None

    @property
    def rocm_context(self) -> bool:
        """ROCm matters here: a ROCm torch, or AMD hardware."""
        return self.rocm or self.amd_gpus

    @property
    def override(self) -> HsaOverride | None:
        return hsa_override(self.environ)


# --------------------------------------------------------------------------- gathering


def torch_info(torch: Any = None, error: str | None = None) -> TorchInfo:
    if torch is None:
        return TorchInfo(installed=error != "not installed", error=error)
    version = getattr(torch, "version", None)
    location = getattr(torch, "__file__", None)
    return TorchInfo(
        installed=True,
        version=str(getattr(torch, "__version__", "?")),
        hip=getattr(version, "hip", None),
        cuda=getattr(version, "cuda", None),
        location=str(Path(location).parent) if location else None,
    )


def kfd_status(path: Path | None = None) -> str:
    if not sys.platform.startswith("linux"):
        return "n/a"
    path = DEV_KFD if path is None else path
    if not path.exists():
        return "missing"
    return "ok" if os.access(path, os.R_OK | os.W_OK) else "no-access"


def read_numa_balancing(path: Path | None = None) -> str | None:
    try:
        return (NUMA_BALANCING if path is None else path).read_text().strip()
    except OSError:
        return None


def _kernel_packages() -> list[dict[str, str]]:
    found = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith("mamba2-rocm-") and name != "mamba2-rocm-dropin":
            found[name] = dist.version
    return [{"name": n, "version": v} for n, v in sorted(found.items())]


def _kernel_dirs() -> tuple[list[Any], list[str]]:
    from mamba2_rocm.runtime.discovery import kernel_dirs

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            dirs = kernel_dirs()
        except Exception as exc:  # a broken cache dir or package must not stop the audit
            return [], [f"kernel discovery failed: {type(exc).__name__}: {exc}"]
    return dirs, [str(w.message) for w in caught]


def gather(environ: Mapping[str, str] | None = None, *, use_torch: bool = True) -> Facts:
    """Read the machine. ``use_torch=False`` skips importing torch (as if it were missing)."""
    environ = dict(os.environ if environ is None else environ)
    torch, error = import_torch() if use_torch else (None, "not installed")
    devices, sources = detect_devices(torch, use_torch=torch is not None, environ=environ)
    if torch is None:
        sources.insert(0, f"torch: {error}")
    dirs, kernel_warnings = _kernel_dirs()
    from mamba2_rocm.runtime.discovery import kernel_path_error, kernel_path_problems

    path_problems = kernel_path_problems(environ)
    path_errors = {}
    if not path_problems:
        for d in devices:
            err = kernel_path_error(d.arch, environ)
            if err is not None:
                path_errors[d.arch] = err
    return Facts(
        environ=environ,
        torch=torch_info(torch, error),
        devices=devices,
        device_sources=sources,
        amd_gpus=amd_gpus_present() or any(d.vendor == "amd" for d in devices),
        numa_balancing=read_numa_balancing(),
        kfd=kfd_status(),
        kernel_packages=_kernel_packages(),
        import_names=[dict(r) for r in dropin.report()],
        kernel_dirs=dirs,
        kernel_warnings=kernel_warnings,
        kernel_path_problems=path_problems,
        kernel_path_errors=path_errors,
        jit_compilers=_jit_compilers(environ),
    )


def _jit_compilers(environ: Mapping[str, str]) -> dict[str, str]:
    """The compilers a just-in-time build would find (runtime.loader's rule), by vendor."""
    from mamba2_rocm.runtime.loader import jit_compiler

    found = {v: jit_compiler(v, environ) for v in ("amd", "nvidia")}
    return {v: c for v, c in found.items() if c}


# --------------------------------------------------------------------------- checks


def _check_torch(f: Facts) -> list[Finding]:
    t = f.torch
    if not t.importable:
        if t.installed:
            return [
                Finding(
                    "torch-import-failed",
                    "error",
                    f"torch is installed but `import torch` fails: {t.error}",
                    "reinstall the ROCm torch build that matches your ROCm driver: "
                    + _ROCM_TORCH_HINT,
                )
            ]
        nvidia = any(d.vendor == "nvidia" for d in f.devices)
        gpu = "AMD GPU" if f.amd_gpus else "NVIDIA GPU" if nvidia else "no GPU"
        return [
            Finding(
                "torch-missing",
                "warning",
                "torch is not installed: the mamba2-rocm ops cannot run at all, on any tier "
                "(the build driver and this audit can)",
                f"for this machine ({gpu}): {torch_install_line(f.amd_gpus, nvidia)}, then "
                "re-run `python -m mamba2_rocm doctor` (mamba2-rocm never installs torch itself)",
            )
        ]
    if t.cuda is not None and f.amd_gpus:
        return [
            Finding(
                "torch-cuda-on-amd",
                "error",
                f"torch {t.version} is a CUDA build (torch.version.cuda={t.cuda!r}) but this "
                f"machine has AMD GPUs: it cannot use them",
                "replace it with a ROCm build: pip uninstall torch && " + _ROCM_TORCH_HINT,
            )
        ]
    if t.hip is None and t.cuda is None and f.amd_gpus:
        return [
            Finding(
                "torch-cpu-on-amd",
                "warning",
                f"torch {t.version} is a CPU-only build but this machine has AMD GPUs",
                "replace it with a ROCm build: pip uninstall torch && " + _ROCM_TORCH_HINT,
            )
        ]
    return []


def _check_max_autotune(f: Facts) -> list[Finding]:
    # read as Inductor reads them: on exactly for "1" ("true", " 1", "yes" leave it off)
    active = [n for n in MAX_AUTOTUNE_ENVS if f.environ.get(n) == "1"]
    if not active:
        return []
    shown = ", ".join(f"{n}={f.environ[n]}" for n in active)
    if f.rocm:
        severity, where = "error", "this ROCm torch"
    elif f.rocm_context:
        severity, where = "warning", "a ROCm torch (this machine has AMD GPUs)"
    else:
        severity, where = "info", "a ROCm torch (harmless with this torch)"
    return [
        Finding(
            "inductor-max-autotune",
            severity,
            f"{shown} is set: under {where} it turns on Inductor autotuning for every "
            f"torch.compile mode, which hangs the 'default' mode",
            f"unset {' '.join(active)}, or call mamba2_rocm.env.configure_torch_compile() "
            f"before the first torch.compile",
        )
    ]


def _without_max_split(conf: str) -> str:
    items = [
        i for i in conf.split(",") if i.strip() and i.split(":")[0].strip() != "max_split_size_mb"
    ]
    return ",".join(items)


def _check_alloc_conf(f: Facts) -> list[Finding]:
    if not f.rocm_context and f.torch.importable:
        return []  # a CUDA or CPU torch on a machine without AMD GPUs accepts it
    found = []
    for name in ALLOC_CONF_ENVS:
        value = f.environ.get(name, "")
        keys = [i.split(":")[0].strip() for i in value.split(",")]
        if "max_split_size_mb" not in keys:
            continue
        rest = _without_max_split(value)
        fix = f"export {name}={rest}" if rest else f"unset {name}"
        severity = "error" if f.rocm else "warning"
        found.append(
            Finding(
                "alloc-conf-max-split-size",
                severity,
                f"{name}={value!r} sets max_split_size_mb, which the HIP caching allocator "
                f"rejects: a ROCm torch fails at its first GPU allocation",
                f"{fix} (expandable_segments:True is the ROCm-supported way to limit "
                f"fragmentation)",
            )
        )
    return found


def _check_numa(f: Facts) -> list[Finding]:
    if f.numa_balancing is None or f.numa_balancing.strip() in ("", "0"):
        return []
    return [
        Finding(
            "numa-balancing",
            "warning" if f.rocm_context else "info",
            f"automatic NUMA balancing is on (/proc/sys/kernel/numa_balancing="
            f"{f.numa_balancing}): its page migrations stall GPU memory access and can hang "
            f"ROCm workloads",
            "sudo sysctl -w kernel.numa_balancing=0 (persist it in /etc/sysctl.d/)",
        )
    ]


def _check_kfd(f: Facts) -> list[Finding]:
    if not f.rocm_context or f.kfd in ("ok", "n/a"):
        return []
    if f.kfd == "missing":
        return [
            Finding(
                "kfd-missing",
                "error",
                f"{DEV_KFD} does not exist: no ROCm GPU can be used (the amdgpu kernel driver "
                f"is not loaded, or this container was started without the device)",
                "on the host: load amdgpu (sudo modprobe amdgpu); in Docker: run with "
                "--device=/dev/kfd --device=/dev/dri --group-add video --group-add render",
            )
        ]
    return [
        Finding(
            "kfd-no-access",
            "error",
            f"{DEV_KFD} exists but this user cannot read and write it: ROCm sees no GPU",
            'add the user to the render and video groups (sudo usermod -aG render,video "$USER", '
            "then log in again); in Docker: --group-add video --group-add render",
        )
    ]


def _check_override(f: Facts) -> list[Finding]:
    ov = f.override
    if ov is None:
        return []
    if ov.arch is None:
        return [
            Finding(
                "hsa-override-malformed",
                "error",
                f"{ov.error}; the ROCm runtime will ignore it or fail to start",
                "unset HSA_OVERRIDE_GFX_VERSION, or set MAJOR.MINOR.STEPPING of a supported "
                "ISA (e.g. 10.3.0 for RDNA2, 11.0.0 for RDNA3)",
            )
        ]
    from mamba2_rocm.arch import generic_family

    pairs = sorted({(d.real_arch, d.arch) for d in f.devices if d.real_arch})
    if not pairs:
        return [
            Finding(
                "hsa-override",
                "info",
                f"HSA_OVERRIDE_GFX_VERSION={ov.value} makes ROCm report {ov.arch}; the real "
                f"arch is unknown (no GPU node in the KFD topology)",
                "nothing to do if intended; kernels are selected for the reported arch",
            )
        ]
    found = []
    for real, effective in pairs:
        fam_real, fam_eff = generic_family(real), generic_family(effective)
        if real == effective or (fam_real is not None and fam_real == fam_eff):
            found.append(
                Finding(
                    "hsa-override",
                    "info",
                    f"HSA_OVERRIDE_GFX_VERSION={ov.value}: real arch {real}, effective "
                    f"{effective}" + (f" (same ISA family {fam_eff})" if fam_eff else ""),
                    "nothing to do; kernels are selected for the effective arch",
                )
            )
        else:
            found.append(
                Finding(
                    "hsa-override-cross-family",
                    "warning",
                    f"HSA_OVERRIDE_GFX_VERSION={ov.value} makes a {_arch_fam(real)} run code "
                    f"built for {_arch_fam(effective)}: a different ISA family, so kernels may "
                    f"fault or compute wrong results",
                    f"unset HSA_OVERRIDE_GFX_VERSION and use kernels built for {real} "
                    f"({_hint_for(real)})"
                    + (f", or override to an ISA of the {fam_real} family" if fam_real else ""),
                )
            )
    return found


def _arch_fam(arch: str) -> str:
    from mamba2_rocm.arch import generic_family

    fam = generic_family(arch)
    return f"{arch} ({fam})" if fam else arch


def _hint_for(arch: str) -> str:
    from mamba2_rocm.runtime.discovery import pip_install_hint

    return pip_install_hint(arch)


def _check_devices(f: Facts) -> list[Finding]:
    if not f.devices:
        if f.rocm and f.amd_gpus:
            return [
                Finding(
                    "rocm-torch-no-device",
                    "warning",
                    "this ROCm torch sees no GPU although the machine has AMD GPUs",
                    "check HIP_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES "
                    "and /dev/kfd access; `rocminfo` must list the GPU",
                )
            ]
        return [
            Finding(
                "no-gpu",
                "info",
                "no GPU is visible (" + "; ".join(f.device_sources) + ")",
                "nothing to do on a CPU-only machine: ops use the PyTorch reference fallback"
                if f.torch.importable
                else "without torch no op runs here (see torch-missing); with it they would "
                "use the PyTorch reference fallback",
            )
        ]
    found = []
    if f.rocm and not any(d.source == "torch" for d in f.devices):
        found.append(
            Finding(
                "rocm-torch-no-device",
                "warning",
                "this ROCm torch sees no GPU, but "
                + ", ".join(sorted({d.source for d in f.devices}))
                + " lists "
                + ", ".join(d.arch for d in f.devices),
                "check HIP_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES, "
                "/dev/kfd access, and that torch's ROCm version supports this arch",
            )
        )
    for dev in f.devices:
        kdir = _served_by(dev, f.kernel_dirs)
        if kdir is None:
            found.append(
                Finding(
                    "kernels-missing",
                    "warning" if dev.vendor == "amd" else "info",
                    f"device {dev.index} ({dev.arch}) has no mamba2-rocm kernels installed: "
                    f"ops fall back to PyTorch",
                    _hint_for(dev.arch),
                )
            )
    return found


def _check_kernel_path(f: Facts) -> list[Finding]:
    """MAMBA2_ROCM_KERNEL_PATH set to something that cannot be used: ops on a GPU raise."""
    fix = (
        "point MAMBA2_ROCM_KERNEL_PATH at a `python -m mamba2_rocm build --out DIR` directory, "
        "or unset it to use the installed kernel packages"
    )
    found = [Finding("kernel-path-unusable", "error", p, fix) for p in f.kernel_path_problems]
    for dev in f.devices:
        if dev.arch in f.kernel_path_errors:
            found.append(
                Finding(
                    "kernel-path-no-arch",
                    "error",
                    f"device {dev.index}: {f.kernel_path_errors[dev.arch]}",
                    "ops on this device raise until the path serves it",
                )
            )
    return found


def op_tier(f: Facts, dev: GpuDevice | None) -> tuple[str, str]:
    """``(tier, why)`` for ops on ``dev`` (None: CPU tensors), by the rules of
    ``ops._backend.choose`` and ``runtime.loader``: "kernel", "jit" (built on first use),
    "torch" / "eager" (the PyTorch implementations), "error" (ops raise) or "none" (no torch)."""
    if not f.torch.importable:
        return "none", "torch is not installed: no op can run"
    from mamba2_rocm.ops._backend import requested_backend

    try:
        wanted = requested_backend(f.environ)
    except ValueError as exc:
        return "error", str(exc)
    if wanted in ("torch", "eager"):
        return wanted, f"MAMBA2_ROCM_BACKEND={wanted}"
    if dev is None:
        if wanted == "kernel":
            return "error", "MAMBA2_ROCM_BACKEND=kernel needs GPU tensors"
        return "torch", "CPU tensors take the PyTorch implementation"
    if dev.arch in f.kernel_path_errors or f.kernel_path_problems:
        return "error", f.kernel_path_errors.get(dev.arch) or "; ".join(f.kernel_path_problems)
    kdir = _served_by(dev, f.kernel_dirs)
    if kdir is not None:
        return "kernel", f"{kdir.target} kernels from {kdir.origin} ({kdir.path})"
    compiler = f.jit_compilers.get(dev.vendor)
    if compiler:
        return "jit", f"no installed kernels: the first op builds them with {compiler} (once)"
    if wanted == "kernel":
        return "error", f"MAMBA2_ROCM_BACKEND=kernel and no kernels: {_hint_for(dev.arch)}"
    return "torch", f"no kernels for {dev.arch} (the slower PyTorch fallback): " + _hint_for(
        dev.arch
    )


def _check_import_names(f: Facts) -> list[Finding]:
    """The drop-in names: a real mamba_ssm / causal_conv1d beside the drop-in takes the name,
    so code importing it gets the real package, not our kernels."""
    return [
        Finding(
            f"import-name-shadowed-{r['name']}",
            "warning",
            f"{r['name']} {r['version'] or ''} at {r['path']} is a real install: it takes the "
            f"name, and mamba2-rocm's drop-in gives way (code importing {r['name']} does not "
            "reach mamba2-rocm's kernels)",
            f"pip uninstall {r['name'].replace('_', '-')} to use mamba2-rocm's kernels through "
            "the name, or pip uninstall mamba2-rocm-dropin to keep the real one",
        )
        for r in f.import_names
        if r.get("shadowed") and not _beside_upstream(f, r)
    ]


def _beside_upstream(f: Facts, row: dict) -> bool:
    """A real mamba_ssm beside the drop-in is a supported setup (ours serves the conv and the
    scan under it), not a collision."""
    return row["name"] == "mamba_ssm" and dropin.setup(f.import_names)["setup"] == "beside"


def _check_kernel_warnings(f: Facts) -> list[Finding]:
    found = []
    for msg in f.kernel_warnings:
        if "skipped kernel dir" in msg:  # runtime.discovery: a dir that cannot be used, and why
            found.append(Finding("kernel-dir-skipped", "warning", msg,
                                 "rebuild it (`python -m mamba2_rocm build --out DIR`), reinstall "
                                 "its package, or remove it"))  # fmt: skip
        else:
            found.append(Finding("kernel-package-broken", "warning", msg,
                                 "reinstall or uninstall that package"))  # fmt: skip
    return found


def _served_by(dev: GpuDevice, dirs: list[Any]) -> Any:
    from mamba2_rocm.runtime.discovery import find_kernel_dir

    return find_kernel_dir(dev.arch, dirs)


CHECKS: tuple[Callable[[Facts], list[Finding]], ...] = (
    _check_torch,
    _check_max_autotune,
    _check_alloc_conf,
    _check_numa,
    _check_kfd,
    _check_override,
    _check_devices,
    _check_kernel_warnings,
    _check_kernel_path,
    _check_import_names,
)


def check(facts: Facts) -> list[Finding]:
    """All findings for ``facts``, errors first."""
    found = [finding for chk in CHECKS for finding in chk(facts)]
    return sorted(found, key=lambda x: SEVERITIES.index(x.severity))


def exit_code(findings: list[Finding]) -> int:
    return 1 if any(x.severity == "error" for x in findings) else 0


# --------------------------------------------------------------------------- report


def _env_report(environ: Mapping[str, str]) -> dict[str, str]:
    return {
        name: "<redacted>" if _SECRET_RE.search(name) else environ[name]
        for name in sorted(environ)
        if ENV_PATTERN.search(name)
    }


def _kdir_dict(kdir: Any) -> dict[str, str]:
    return {"target": kdir.target, "path": str(kdir.path), "origin": kdir.origin}


def report(facts: Facts, findings: list[Finding] | None = None) -> dict[str, Any]:
    """The ``doctor --json`` object (keys documented in this module's docstring)."""
    from mamba2_rocm import __version__

    findings = check(facts) if findings is None else findings
    devices = []
    for dev in facts.devices:
        kdir = _served_by(dev, facts.kernel_dirs)
        tier, why = op_tier(facts, dev)
        devices.append(
            {
                **dev.as_dict(),
                "kernel_dir": _kdir_dict(kdir) if kdir else None,
                "install_hint": None if kdir else _hint_for(dev.arch),
                "op_tier": {"tier": tier, "why": why},
            }
        )
    cpu_tier, cpu_why = op_tier(facts, None)
    ov = facts.override
    return {
        "schema_version": SCHEMA_VERSION,
        "mamba2_rocm_version": __version__,
        "ok": exit_code(findings) == 0,
        "python": {
            "version": platform.python_version(),
            "executable": sys.executable,
            "platform": platform.platform(),
        },
        "environment": _env_report(facts.environ),
        "torch": asdict(facts.torch),
        "rocm": facts.rocm,
        "amd_gpus_present": facts.amd_gpus,
        "hsa_override": asdict(ov) if ov else None,
        "devices": devices,
        "device_sources": list(facts.device_sources),
        "kernel_packages": list(facts.kernel_packages),
        "import_names": list(facts.import_names),
        "kernel_dirs": [_kdir_dict(k) for k in facts.kernel_dirs],
        "cpu_op_tier": {"tier": cpu_tier, "why": cpu_why},
        "numa_balancing": facts.numa_balancing,
        "kfd": facts.kfd,
        "findings": [asdict(x) for x in findings],
    }


def run_audit(*, use_torch: bool = True) -> tuple[dict[str, Any], int]:
    """Gather, check and report: ``(report, exit_code)``."""
    facts = gather(use_torch=use_torch)
    findings = check(facts)
    return report(facts, findings), exit_code(findings)


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    ]


def render_text(rep: dict[str, Any]) -> str:
    """The human-readable report."""
    t = rep["torch"]
    if t["version"]:
        torch_line = (
            f"{t['version']} (hip: {t['hip'] or '-'}, cuda: {t['cuda'] or '-'}) at {t['location']}"
        )
    else:
        torch_line = f"unavailable ({t['error']})"
    ov = rep["hsa_override"]
    lines = [
        f"mamba2-rocm {rep['mamba2_rocm_version']} doctor",
        "",
        f"python        {rep['python']['version']} at {rep['python']['executable']}",
        f"platform      {rep['python']['platform']}",
        f"torch         {torch_line}",
        f"ROCm torch    {'yes' if rep['rocm'] else 'no'}",
        f"AMD GPUs      {'present' if rep['amd_gpus_present'] else 'none found'}",
        f"HSA override  {(ov['value'] + ' -> ' + (ov['arch'] or 'invalid')) if ov else 'not set'}",
        f"/dev/kfd      {rep['kfd']}",
        f"NUMA balance  {rep['numa_balancing'] if rep['numa_balancing'] is not None else 'unknown'}",
        "",
        "devices (" + "; ".join(rep["device_sources"]) + ")",
    ]
    if rep["devices"]:
        rows = [["#", "arch", "real", "features", "family", "fp8", "source", "kernels", "name"]]
        for d in rep["devices"]:
            feats = ",".join(f"{k}{'+' if v else '-'}" for k, v in d["features"].items())
            kd = d["kernel_dir"]
            rows.append(
                [
                    str(d["index"]),
                    d["arch"],
                    d["real_arch"] or "-",
                    feats or "-",
                    d["generic_family"] or "-",
                    (d["fp8_dtype"] or "-").replace("float8_", ""),
                    d["source"],
                    f"{kd['target']} ({kd['origin']})" if kd else "none",
                    d["name"] or "-",
                ]
            )
        lines += _table(rows)
    else:
        lines.append("  none")
    lines += ["", "op tiers (float64 inputs always take the torch tier)"]
    tiers = [[f"device {d['index']} ({d['arch']})", d["op_tier"]["tier"], d["op_tier"]["why"]]
             for d in rep["devices"]]  # fmt: skip
    cpu = rep["cpu_op_tier"]
    lines += _table([*tiers, ["CPU tensors", cpu["tier"], cpu["why"]]])
    lines += ["", "kernel packages"]
    pkgs = rep["kernel_packages"]
    lines += [f"  {p['name']} {p['version']}" for p in pkgs] or ["  none installed"]
    if rep["kernel_dirs"]:
        lines += ["", "kernel dirs"]
        lines += _table([[k["target"], k["origin"], k["path"]] for k in rep["kernel_dirs"]])
    lines += ["", "import names (mamba2-rocm-dropin)"]
    names = [
        [r["name"], r["owner"], r["version"] or "-", r["path"] or "-",
         "shadowed: the real package wins" if r["shadowed"] else ""]
        for r in rep.get("import_names", [])
    ]  # fmt: skip
    lines += _table(names) if names else ["  none"]
    if names:
        found = dropin.setup(rep["import_names"])
        lines += ["", f"setup: {found['setup']}: {found['summary']}"]
        lines += _table(found["ops"])
    lines += ["", "environment"]
    env = rep["environment"]
    lines += [f"  {k}={v}" for k, v in env.items()] or ["  (no matching variables)"]
    lines += ["", "findings"]
    if not rep["findings"]:
        lines.append("  none")
    for x in rep["findings"]:
        lines.append(f"  [{x['severity']}] {x['id']}: {x['message']}")
        lines.append(f"      fix: {x['fix']}")
    if rep["rocm"] and any(d["arch"].startswith("gfx") for d in rep["devices"]):
        lines += ["", "next: check this card's kernels (1-2 minutes): `python -m mamba2_rocm selftest "
                  "--quick --report selftest.json`; please send the report (an issue on the "
                  "project): it holds no host, user or path, and it is how AMD cards get verified"]  # fmt: skip
    errors = sum(x["severity"] == "error" for x in rep["findings"])
    lines += ["", f"{errors} error(s); " + ("OK" if rep["ok"] else "NOT OK: fix the errors above")]
    return "\n".join(lines) + "\n"
