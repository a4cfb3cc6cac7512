"""Which tier runs an op: the GPU kernel, vectorized PyTorch, or the plain eager loop.

``MAMBA2_ROCM_BACKEND=auto|kernel|torch|eager`` (read on every call, so it can be switched at
run time). ``auto`` uses the kernel when the tensors are on a GPU that has code objects (see
``runtime.loader``) and vectorized PyTorch otherwise; ``kernel`` fails loudly when no kernel
can run instead of falling back.
"""

from __future__ import annotations

import os

from mamba2_rocm.runtime.loader import kernels_for_device

BACKEND_ENV = "MAMBA2_ROCM_BACKEND"
BACKENDS = ("auto", "kernel", "torch", "eager")


def _environ_reader():
    """The process environment's value of ``MAMBA2_ROCM_BACKEND`` as a cheap call: ``os.environ``
    keeps the encoded environment in a dict (``_data``, shared by ``os.environ`` and
    ``os.environb``; every ``os.environ[...] = ...`` or ``putenv`` through it updates it), and
    one lookup there with the key encoded once costs a tenth of ``os.environ.get``'s key
    encoding (~1 us of host time on every op call). Other Pythons: ``os.environ.get``."""
    env = os.environ
    data, encode, decode = (getattr(env, a, None) for a in ("_data", "encodekey", "decodevalue"))
    if not (isinstance(data, dict) and callable(encode) and callable(decode)):
        return lambda: env.get(BACKEND_ENV)
    key = encode(BACKEND_ENV)

    def read() -> str | None:
        raw = data.get(key)
        return None if raw is None else decode(raw)

    return read


_read_process_backend = _environ_reader()


def requested_backend(environ=None) -> str:
    """``MAMBA2_ROCM_BACKEND`` of ``environ`` (default: the process's), checked."""
    raw = _read_process_backend() if environ is None else environ.get(BACKEND_ENV)
    if raw is None:  # the common case, on every op call: skip the string work
        return "auto"
    value = raw.strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={value!r} is not one of {', '.join(BACKENDS)}")
    return value


def choose(device) -> tuple[str, object]:
    """``(tier, kernel_set)`` for tensors on ``device``; kernel_set is None off the kernel tier."""
    wanted = requested_backend()
    if wanted in ("torch", "eager"):
        return wanted, None
    if device.type != "cuda":
        if wanted == "kernel":
            raise ValueError(f"{BACKEND_ENV}=kernel needs GPU tensors, got tensors on {device}")
        return "torch", None
    kset = kernels_for_device(device.index if device.index is not None else 0)
    if kset is None:
        if wanted == "kernel":
            from mamba2_rocm.runtime.device import device_arch
            from mamba2_rocm.runtime.discovery import pip_install_hint

            arch = device_arch(device.index or 0)
            raise RuntimeError(
                f"{BACKEND_ENV}=kernel but no kernels serve {arch} (device {device}); {pip_install_hint(arch)}"
            )
        return "torch", None
    return "kernel", kset
