"""torch.compile / Inductor settings that are safe on ROCm.

On ROCm, Inductor's autotuning (``TORCHINDUCTOR_MAX_AUTOTUNE`` or the ``max-autotune`` mode)
can hang even the "default" compile mode, and the CUDA-graph paths (``reduce-overhead``,
cudagraph trees) and Inductor's memory planning are kept off as the known-safe set.
:func:`configure_torch_compile` applies that set once per process; :func:`safe_compile_mode`
maps a requested mode to one that does not autotune or capture graphs.

On NVIDIA and CPU both are exact no-ops: they do not import ``torch._inductor``, touch the
environment or change any setting.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from mamba2_rocm.env.audit import MAX_AUTOTUNE_ENVS
from mamba2_rocm.env.detect import is_rocm

__all__ = [
    "INDUCTOR_SETTINGS",
    "UNSAFE_MODES",
    "CompileSafety",
    "configure_torch_compile",
    "safe_compile_mode",
    "shell_unset_lines",
]

#: Inductor config keys forced on ROCm, and their safe values.
INDUCTOR_SETTINGS: dict[str, Any] = {
    "max_autotune": False,
    "triton.cudagraphs": False,
    "triton.cudagraph_trees": False,
    "memory_planning": False,
}
#: Read by Inductor from the ``*_GEMM``/``*_POINTWISE`` variables when its config is imported;
#: reset only when such a variable had already switched them on.
_AUTOTUNE_VARIANT_SETTINGS = ("max_autotune_gemm", "max_autotune_pointwise")

#: torch.compile modes that autotune or capture CUDA graphs.
UNSAFE_MODES = ("reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class CompileSafety:
    """What :func:`configure_torch_compile` changed."""

    rocm: bool
    env_unset: dict[str, str] = field(default_factory=dict)  # name -> previous value
    inductor: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # key -> (old, new)

    @property
    def changed(self) -> bool:
        return bool(self.env_unset or self.inductor)

    def __str__(self) -> str:
        if not self.rocm:
            return "torch.compile safety: not a ROCm torch, nothing changed"
        if not self.changed:
            return "torch.compile safety: ROCm torch, settings were already safe"
        parts = [f"unset {k} (was {v!r})" for k, v in self.env_unset.items()]
        parts += [f"inductor {k}: {old!r} -> {new!r}" for k, (old, new) in self.inductor.items()]
        return "torch.compile safety: " + "; ".join(parts)


def _get(config: Any, dotted: str) -> Any:
    obj = config
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _set(config: Any, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    obj = config
    for part in parents:
        obj = getattr(obj, part)
    setattr(obj, last, value)


def configure_torch_compile() -> CompileSafety:
    """Make torch.compile safe on ROCm; a no-op (returning an empty record) anywhere else.

    Unsets the ``TORCHINDUCTOR_MAX_AUTOTUNE*`` variables and sets :data:`INDUCTOR_SETTINGS`
    (plus ``max_autotune_gemm``/``max_autotune_pointwise`` when a variable had already turned
    them on). Call it before the first ``torch.compile``; calling it again changes nothing.
    """
    record = CompileSafety(rocm=is_rocm())
    if not record.rocm:
        return record
    for name in MAX_AUTOTUNE_ENVS:
        if name in os.environ:
            record.env_unset[name] = os.environ.pop(name)
    import torch._inductor.config as config

    wanted = dict(INDUCTOR_SETTINGS)
    for key in _AUTOTUNE_VARIANT_SETTINGS:
        if hasattr(config, key) and _get(config, key):
            wanted[key] = False
    for key, value in wanted.items():
        old = _get(config, key)
        if old != value:
            _set(config, key, value)
            record.inductor[key] = (old, value)
    return record


def safe_compile_mode(mode: str | None) -> str | None:
    """``mode`` for ``torch.compile``; on ROCm, autotuning/cudagraph modes become "default"."""
    if mode in UNSAFE_MODES and is_rocm():
        return "default"
    return mode


def shell_unset_lines() -> list[str]:
    """``unset NAME`` lines for a shell entry step (``eval "$(... env compile-safety)"``).

    Empty off ROCm. Inductor's in-process settings still need :func:`configure_torch_compile`.
    """
    if not is_rocm():
        return []
    return [f"unset {name}" for name in MAX_AUTOTUNE_ENVS if name in os.environ]
