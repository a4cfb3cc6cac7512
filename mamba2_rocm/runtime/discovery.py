"""Where code objects come from: installed kernel packages, an env path, the JIT cache.

``MAMBA2_ROCM_KERNEL_PATH`` (directories, ``os.pathsep``-separated) comes first; an entry that
cannot be used, or that holds no kernels for the device's arch, is an error for ops on that
device (:func:`kernel_path_error`), never skipped silently.

A kernel directory holds one target's code objects and the ``manifest.json`` the build driver
wrote for them. Kernel packages (``mamba2-rocm-gfx1030``, ``mamba2-rocm-gfx11-generic``, ...)
register their directory through the entry-point group :data:`ENTRY_POINT_GROUP`, so several
can be installed side by side (an APU and a discrete card). The entry point names the target and
points at a module; the directory is that module's ``KERNEL_DIR`` attribute, or its folder.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mamba2_rocm.arch import EMULATION_PATHS, expected_mma_path, generic_family, split_arch_name

__all__ = [
    "ENTRY_POINT_GROUP",
    "KERNEL_PATH_ENV",
    "MANIFEST_NAME",
    "KernelDir",
    "find_kernel_dir",
    "jit_cache_root",
    "kernel_dirs",
    "kernel_path_error",
    "kernel_path_problems",
    "pip_install_hint",
]

ENTRY_POINT_GROUP = "mamba2_rocm.kernels"
KERNEL_PATH_ENV = "MAMBA2_ROCM_KERNEL_PATH"
MANIFEST_NAME = "manifest.json"


@dataclass(frozen=True)
class KernelDir:
    """One target's code objects on disk, and where we found them."""

    target: str
    path: Path
    origin: str  # e.g. "package mamba2-rocm-gfx1030 0.3.0", "env MAMBA2_ROCM_KERNEL_PATH"
    manifest: dict[str, Any] = field(repr=False, compare=False)

    @property
    def kernels(self) -> list[str]:
        return sorted(k["name"] for co in self.manifest["code_objects"] for k in co["kernels"])

    @property
    def matrix_cores(self) -> bool:
        """Whether the 16-bit kernels of this dir run on matrix cores (csrc/mma.h's M2R_MMA for
        its target, or for the AMD target an emulation build stands for)."""
        return expected_mma_path(self.target, self.manifest.get("emulates")) != 0


_SHA256 = re.compile(r"[0-9a-f]{64}")
_CODE_OBJECT_SUFFIXES = (".hsaco", ".cubin")


def manifest_problems(data: Any) -> list[str]:
    """What in a kernel dir's ``manifest.json`` does not follow the build driver's schema
    (``mamba2_rocm.build.driver``); empty when the loader can rely on it."""
    if not isinstance(data, dict):
        return [f"not a JSON object: {type(data).__name__}"]
    problems = []
    target = data.get("target")
    if not isinstance(target, str) or not target:
        problems.append(f"'target' must be a string, got {target!r}")
    if data.get("vendor") not in ("amd", "nvidia"):
        problems.append(f"'vendor' must be 'amd' or 'nvidia', got {data.get('vendor')!r}")
    if "emulates" in data and data["emulates"] not in EMULATION_PATHS:
        problems.append(
            f"'emulates' must be one of {', '.join(EMULATION_PATHS)}, got {data['emulates']!r}"
        )
    objects = data.get("code_objects")
    if not isinstance(objects, list) or not objects:
        return [*problems, f"'code_objects' must be a non-empty list, got {objects!r}"]
    for i, co in enumerate(objects):
        where = f"code_objects[{i}]"
        if not isinstance(co, dict):
            problems.append(f"{where} must be an object")
            continue
        for key in ("source", "file"):
            if not isinstance(co.get(key), str) or not co.get(key):
                problems.append(f"{where}.{key} must be a non-empty string, got {co.get(key)!r}")
        file = co.get("file")
        if isinstance(file, str) and (Path(file).name != file or file in (".", "..")):
            problems.append(f"{where}.file must be a file name in the kernel dir, got {file!r}")
        if not isinstance(co.get("sha256"), str) or not _SHA256.fullmatch(co["sha256"]):
            problems.append(f"{where}.sha256 must be a sha256, got {co.get('sha256')!r}")
        kernels = co.get("kernels")
        if not isinstance(kernels, list) or not all(
            isinstance(k, dict) and isinstance(k.get("name"), str)
            and isinstance(k.get("arg_size"), int) and not isinstance(k.get("arg_size"), bool)
            for k in kernels
        ):  # fmt: skip
            problems.append(f"{where}.kernels must be a list of {{name, arg_size}} objects")
    return problems


def _read_manifest(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``(manifest, None)`` for a kernel dir, ``(None, why)`` for one that must be skipped,
    ``(None, None)`` for a directory that is not a kernel dir at all."""
    file = path / MANIFEST_NAME
    if not file.is_file():
        if path.is_dir() and any(p.suffix in _CODE_OBJECT_SUFFIXES for p in path.iterdir()):
            return None, f"code objects but no {MANIFEST_NAME}"
        return None, None
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        return None, f"unreadable {MANIFEST_NAME}: {exc}"
    problems = manifest_problems(data)
    if problems:
        return None, f"{MANIFEST_NAME} does not follow the schema: " + "; ".join(problems)
    return data, None


def _dirs_below(root: Path, origin: str) -> list[KernelDir]:
    """``root`` itself if it is a kernel dir, else its immediate kernel subdirs. A directory
    that looks like a kernel dir but cannot be used is skipped with a warning that says why
    (``doctor`` reports it)."""
    found = []
    candidates = [root] if (root / MANIFEST_NAME).exists() or not root.is_dir() else [
        root, *sorted(p for p in root.iterdir() if p.is_dir())]  # fmt: skip
    for path in candidates:
        manifest, why = _read_manifest(path)
        if manifest is not None:
            found.append(KernelDir(manifest["target"], path, origin, manifest))
            if path == root:
                break
        elif why is not None:
            import warnings

            where = f" ({origin})" if origin else ""
            warnings.warn(f"mamba2-rocm: skipped kernel dir {path}{where}: {why}", stacklevel=3)
    return found


def jit_cache_root() -> Path:
    """Per-user, per-version cache of just-in-time builds (``MAMBA2_ROCM_CACHE`` overrides)."""
    from mamba2_rocm import __version__

    env = os.environ.get("MAMBA2_ROCM_CACHE")
    if env:
        return Path(env) / __version__
    import platformdirs

    return Path(platformdirs.user_cache_dir("mamba2_rocm", appauthor=False)) / __version__


def _package_dirs() -> list[KernelDir]:
    found = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        origin = f"package {dist.name} {dist.version}" if dist else f"entry point {ep.value}"
        try:
            module = ep.load()
        except Exception as exc:  # a broken kernel package must not hide the others
            import warnings

            warnings.warn(f"mamba2-rocm: cannot load kernel {origin}: {exc}", stacklevel=3)
            continue
        path = getattr(module, "KERNEL_DIR", None)
        if path is None:
            # a data-only package may be a namespace package: no __init__.py, so no __file__
            file = getattr(module, "__file__", None)
            path = Path(file).parent if file else next(iter(getattr(module, "__path__", [])), None)
        if path is not None:
            found.extend(_dirs_below(Path(path), origin))
    return found


def kernel_dirs(include_cache: bool = True) -> list[KernelDir]:
    """All kernel dirs, in priority order: env path, installed packages, JIT cache."""
    found: list[KernelDir] = []
    found.extend(_scan_kernel_path()[0])
    found.extend(_package_dirs())
    if include_cache:
        found.extend(_dirs_below(jit_cache_root(), "jit cache"))
    return found


def kernel_path_entries(environ: Mapping[str, str] | None = None) -> list[str]:
    """The entries of ``MAMBA2_ROCM_KERNEL_PATH`` (os.pathsep-separated; empty ones dropped)."""
    env = os.environ if environ is None else environ
    return [e for e in env.get(KERNEL_PATH_ENV, "").split(os.pathsep) if e]


def _scan_kernel_path(
    environ: Mapping[str, str] | None = None,
) -> tuple[list[KernelDir], list[str]]:
    """The kernel dirs of ``MAMBA2_ROCM_KERNEL_PATH``, and every entry that cannot serve any
    GPU, saying what was looked for: one scan of each entry."""
    dirs, problems = [], []
    for entry in kernel_path_entries(environ):
        path = Path(entry)
        if not path.exists():
            problems.append(f"{KERNEL_PATH_ENV} entry {entry!r} does not exist")
        elif not path.is_dir():
            problems.append(f"{KERNEL_PATH_ENV} entry {entry!r} is not a directory")
        else:
            found = _dirs_below(path, f"env {KERNEL_PATH_ENV}")
            if not found:
                problems.append(
                    f"{KERNEL_PATH_ENV} entry {entry!r} holds no kernel dir (looked for "
                    f"{path / 'manifest.json'} and {path / '<target>' / 'manifest.json'}, as "
                    f"`python -m mamba2_rocm build --out DIR` writes them)"
                )
            dirs += found
    return dirs, problems


def kernel_path_problems(environ: Mapping[str, str] | None = None) -> list[str]:
    """Every ``MAMBA2_ROCM_KERNEL_PATH`` entry that cannot serve any GPU, saying what was
    looked for. A path the user set is a statement of intent: it is never skipped silently."""
    return _scan_kernel_path(environ)[1]


def kernel_path_error(arch: str, environ: Mapping[str, str] | None = None) -> str | None:
    """Why ``MAMBA2_ROCM_KERNEL_PATH`` cannot serve a device of ``arch``, or None when it is
    unset or serves it (its own kernel dir, or its generic family's)."""
    entries = kernel_path_entries(environ)
    if not entries:
        return None
    dirs, problems = _scan_kernel_path(environ)
    if problems:
        return "; ".join(problems)
    if find_kernel_dir(arch, dirs) is not None:
        return None
    base = split_arch_name(arch)[0]
    wanted = " or ".join(filter(None, (base, generic_family(base))))
    held = ", ".join(sorted({d.target for d in dirs}))
    return (
        f"{KERNEL_PATH_ENV}={os.pathsep.join(entries)} has kernels for {held} but none for "
        f"{arch} (looked for {wanted}): build them with `python -m mamba2_rocm build --arch "
        f"{base} --out DIR` and add DIR, or unset {KERNEL_PATH_ENV} to use installed packages"
    )


def find_kernel_dir(arch: str, dirs: list[KernelDir] | None = None) -> KernelDir | None:
    """The kernel dir for ``arch``: its exact ISA first, then its generic family."""
    base = split_arch_name(arch)[0]
    dirs = kernel_dirs() if dirs is None else dirs
    for wanted in (base, generic_family(base)):
        if wanted is None:
            continue
        for kdir in dirs:
            if kdir.target == wanted:
                return kdir
    return None


def pip_install_hint(arch: str) -> str:
    """The pip line that would give ``arch`` kernels: its own package, else its family's."""
    from mamba2_rocm.targets import release_targets

    base = split_arch_name(arch)[0]
    targets = release_targets()
    extra = base if base in targets else generic_family(base)
    if extra is None or extra not in targets:
        return (
            f"no mamba2-rocm kernel package is published for {base}; build one with "
            f"`python -m mamba2_rocm build --arch {base} --out DIR` and set {KERNEL_PATH_ENV}=DIR"
        )
    return f'pip install "mamba2-rocm[{extra}]"'
