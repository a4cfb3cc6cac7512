"""The ROCm environment guard: detection, the audit, torch.compile safety, torch protection.

Importing this package never imports torch; each function that needs torch imports it when
called, so ``python -m mamba2_rocm doctor`` works where torch is missing or broken.
"""

from __future__ import annotations

from mamba2_rocm.arch import generic_family
from mamba2_rocm.env.audit import Finding, render_text, run_audit
from mamba2_rocm.env.compile_safety import (
    CompileSafety,
    configure_torch_compile,
    safe_compile_mode,
)
from mamba2_rocm.env.detect import (
    GpuDevice,
    HsaOverride,
    detect_devices,
    fp8_dtype,
    fp8_dtype_name,
    hsa_override,
    is_rocm,
)
from mamba2_rocm.env.protect import (
    Fingerprint,
    TorchStackChanged,
    fingerprint,
    protected_install,
    verify,
)

__all__ = [
    "CompileSafety",
    "Finding",
    "Fingerprint",
    "GpuDevice",
    "HsaOverride",
    "TorchStackChanged",
    "configure_torch_compile",
    "detect_devices",
    "fingerprint",
    "fp8_dtype",
    "fp8_dtype_name",
    "generic_family",
    "hsa_override",
    "is_rocm",
    "protected_install",
    "render_text",
    "run_audit",
    "safe_compile_mode",
    "verify",
]
