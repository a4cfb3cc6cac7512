"""The one place that imports torch for the ops, with an error that says how to get it."""

from __future__ import annotations

import importlib
from types import ModuleType

INSTALL_HINT = (
    "mamba2-rocm needs PyTorch, and deliberately does not install it (pip would pick a CUDA "
    "build). Install the ROCm build that matches your system first, for example:\n"
    "    pip install torch --index-url https://download.pytorch.org/whl/rocm6.4\n"
    "then run `python -m mamba2_rocm doctor` to check the result."
)


def require_torch() -> ModuleType:
    """Return the torch module, or raise ImportError with installation instructions."""
    try:
        return importlib.import_module("torch")
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
