"""Code-object selection per device, module cache, and prepared kernel launchers.

Selection for a device (ARCHITECTURE.md, "Distribution scheme"):
  1. a kernel dir for the exact ISA (``gcnArchName`` without feature suffixes);
  2. one for its generic family (gfx1031 -> gfx10-3-generic);
  3. a just-in-time build from the packaged sources into the user cache dir, when a compiler
     (hipcc / nvcc) is found and ``MAMBA2_ROCM_JIT`` is not ``0``;
  4. none: the ops fall back to PyTorch, with one warning naming the arch and the pip line.

Modules are loaded once per (device, source), on first use, and unloaded at interpreter exit.
Launches go to torch's current stream on the tensor's device, so they are captured by
``torch.cuda.graph`` like any torch kernel (load the module before capture: warm up first, as
graph capture requires anyway).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import os
import shutil
import struct
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path

from mamba2_rocm.kernels import SOURCES, source_of
from mamba2_rocm.params import explain_pack_error, packer
from mamba2_rocm.runtime.discovery import (
    KernelDir,
    find_kernel_dir,
    jit_cache_root,
    kernel_path_error,
    pip_install_hint,
)
from mamba2_rocm.runtime.driver import DriverError, GpuDriver, get_driver

__all__ = ["KernelSet", "Launcher", "LoaderError", "kernels_for_device", "release_all", "reset"]

JIT_ENV = "MAMBA2_ROCM_JIT"


class LoaderError(RuntimeError):
    """A kernel dir that cannot be used safely (tampered file, struct mismatch, wrong vendor)."""


class Launcher:
    """A kernel ready to launch: its function handle and the packer of its parameter struct.

    ``launcher(values, grid, block, stream)`` packs ``values`` (the struct's fields in order,
    pointers as ints) and launches. The runtime copies the parameter bytes at launch time, also
    during graph capture, so each thread packs into one buffer of its own, which its next launch
    of this kernel reuses: a new buffer and pointer array per call were 0.8 of the 1.7 us the
    packing took (CPU, SsuParams). Per thread, because the driver call releases the GIL while
    it reads the bytes.
    """

    __slots__ = ("_launch", "_local", "_occupancy", "_packer", "_resident", "func", "name",
                 "params_type")  # fmt: skip

    def __init__(self, name: str, func: ctypes.c_void_p, params_type: type[ctypes.Structure],
                 driver: GpuDriver) -> None:  # fmt: skip
        self.name, self.func, self.params_type = name, func, params_type
        self._packer = packer(params_type)
        self._launch = driver.launch
        self._local = threading.local()
        self._occupancy = getattr(driver, "max_active_blocks", None)  # (a duck-typed driver)
        self._resident: dict[int, int | None] = {}

    def resident_blocks(self, threads: int) -> int | None:
        """Blocks of ``threads`` threads of this kernel a multiprocessor holds at once (the
        runtime's occupancy calculator; asked once per block size), or None if it cannot tell.
        For kernels whose blocks walk a share of the rows: a grid of exactly this many blocks
        per multiprocessor leaves no second, partial wave."""
        if threads not in self._resident:
            ask = self._occupancy
            self._resident[threads] = None if ask is None else ask(self.func, threads)
        return self._resident[threads]

    def __call__(self, values: tuple, grid: tuple[int, int, int], block: tuple[int, int, int],
                 stream: int, shared_bytes: int = 0) -> None:  # fmt: skip
        try:
            buf, args = self._local.slot
        except AttributeError:  # this thread's first launch of the kernel
            buf, args = self._local.slot = self._slot()
        self._pack_into(buf, values)
        self._launch(self.func, grid, block, shared_bytes, stream, args)

    def _slot(self):
        """A parameter buffer and the one-entry kernelParams array pointing at it (the array
        holds an address: whoever holds the array keeps ``buf`` alive too)."""
        buf = ctypes.create_string_buffer(self._packer.size)
        return buf, (ctypes.c_void_p * 1)(ctypes.addressof(buf))

    def _pack_into(self, buf, values: tuple) -> None:
        try:
            self._packer.pack_into(buf, 0, *values)
        except struct.error:  # name the field instead of struct's format message
            raise explain_pack_error(self.params_type, values) from None

    def driver_only(self, values: tuple, grid: tuple[int, int, int], block: tuple[int, int, int],
                    stream: int):  # fmt: skip
        """A callable that repeats this launch with ``values`` packed once: the driver call
        alone, what ``bench host`` reports as the floor of any launch from Python."""
        buf, args = self._slot()
        self._pack_into(buf, values)
        launch, func = self._launch, self.func

        def again() -> None:
            launch(func, grid, block, 0, stream, args)

        again.keep = buf  # (the packed bytes live as long as the callable)
        return again


class KernelSet:
    """The kernels of one kernel dir, loaded on one device (modules loaded lazily, per source)."""

    def __init__(self, kdir: KernelDir, device_index: int, driver: GpuDriver) -> None:
        self.kdir = kdir
        self.device_index = device_index
        self.driver = driver
        self._modules: dict[str, ctypes.c_void_p] = {}
        self._launchers: dict[str, Launcher] = {}
        self._lock = threading.Lock()
        self._objects = {co["source"]: co for co in kdir.manifest["code_objects"]}
        self._check_manifest()
        #: whether the 16-bit kernels run on matrix cores (read once: ops pick forms by it)
        self.matrix_cores = kdir.matrix_cores

    def _check_manifest(self) -> None:
        m = self.kdir.manifest
        expected_vendor = "amd" if self.driver.name == "hip" else "nvidia"
        if m.get("vendor") != expected_vendor:
            raise LoaderError(
                f"{self.kdir.path}: built for {m.get('vendor')}, this torch runs {self.driver.name}"
            )
        for co in m["code_objects"]:
            src = SOURCES.get(co["source"])
            if src is None:
                continue  # a newer kernel package may carry sources we do not use
            want = ctypes.sizeof(src.params)
            for k in co["kernels"]:
                if k["arg_size"] != want:
                    raise LoaderError(
                        f"{self.kdir.path / co['file']}: {k['name']} takes {k['arg_size']} argument "
                        f"bytes, this mamba2-rocm passes {want} ({src.params.__name__}); "
                        f"the kernel package does not match the installed mamba2-rocm version"
                    )

    @property
    def target(self) -> str:
        return self.kdir.target

    def has(self, kernel: str) -> bool:
        """Whether this kernel dir provides ``kernel`` (False for names we do not know)."""
        try:
            co = self._objects.get(source_of(kernel).name)
        except KeyError:
            return False
        return co is not None and any(k["name"] == kernel for k in co["kernels"])

    def _module(self, source: str) -> ctypes.c_void_p:
        module = self._modules.get(source)
        if module is not None:
            return module
        co = self._objects.get(source)
        if co is None:
            raise LoaderError(
                f"{self.kdir.path}: no code object for {source} (kernel dir from {self.kdir.origin})"
            )
        path = self.kdir.path / co["file"]
        image = path.read_bytes()
        if hashlib.sha256(image).hexdigest() != co["sha256"]:
            raise LoaderError(
                f"{path}: sha256 differs from its manifest; reinstall the kernel package"
            )
        self._check_arch(path, image)
        from mamba2_rocm._torch import require_torch

        with require_torch().cuda.device(self.device_index):
            module = self.driver.load_module(image)
        self._modules[source] = module
        return module

    def _check_arch(self, path: Path, image: bytes) -> None:
        """The ISA in the code object itself must be the kernel dir's: a manifest whose hashes
        match can still describe a code object of another GPU (the driver would fail later,
        or load it on a device it does not fit)."""
        from mamba2_rocm.build.codeobject import CodeObjectError

        try:
            arch = _code_object_arch(image)
        except CodeObjectError as exc:
            raise LoaderError(f"{path}: not a code object mamba2-rocm can read: {exc}") from None
        want = self.kdir.target
        same = arch == want or (arch.startswith("sm_") and arch.rstrip("af") == want.rstrip("af"))
        if not same:
            raise LoaderError(
                f"{path}: the code object is built for {arch}, its kernel dir says {want} "
                f"(from {self.kdir.origin}); reinstall or rebuild the kernel package"
            )

    def launcher(self, kernel: str) -> Launcher:
        """The prepared launcher for ``kernel`` (cached; first call loads its module)."""
        launcher = self._launchers.get(kernel)
        if launcher is not None:
            return launcher
        with self._lock:
            src = source_of(kernel)
            module = self._module(src.name)
            func = self.driver.get_function(module, kernel)
            actual = self.driver.param_size(func)
            if actual is not None and actual != ctypes.sizeof(src.params):
                raise LoaderError(
                    f"{kernel} on device {self.device_index}: the runtime reports a "
                    f"{actual}-byte parameter, {src.params.__name__} is {ctypes.sizeof(src.params)}"
                )
            launcher = Launcher(kernel, func, src.params, self.driver)
            self._launchers[kernel] = launcher
            return launcher

    def release(self) -> None:
        with self._lock:
            self._launchers.clear()
            modules, self._modules = self._modules, {}
        for module in modules.values():
            with contextlib.suppress(DriverError):  # the context may be gone at interpreter exit
                self.driver.unload_module(module)


def _code_object_arch(image: bytes) -> str:
    """``build.codeobject.code_object_arch``, imported on first use (pyelftools and msgpack
    stay out of ``import mamba2_rocm``)."""
    from mamba2_rocm.build.codeobject import code_object_arch

    return code_object_arch(image)


_SETS: dict[int, KernelSet | None] = {}
_WARNED: set[str] = set()
_LOCK = threading.Lock()


def jit_compiler(vendor: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The compiler a just-in-time build for ``vendor`` would use, or None (no compiler, or
    ``MAMBA2_ROCM_JIT=0``). ``doctor`` asks the same question."""
    env = os.environ if environ is None else environ
    if env.get(JIT_ENV, "1") == "0":
        return None
    from mamba2_rocm.build.driver import BuildError, find_toolchain

    try:
        return find_toolchain(vendor).compiler
    except BuildError:
        return None


def _jit_build(arch: str) -> KernelDir | None:
    from mamba2_rocm.arch import arch_info
    from mamba2_rocm.build.driver import BuildError, build

    try:
        info = arch_info(arch)
    except ValueError:
        return None
    if jit_compiler(info.vendor) is None:
        return None
    from filelock import FileLock

    root = jit_cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{info.name}.lock")):  # (held: no other process builds it now)
        kdir = find_kernel_dir(arch, _cache_dirs(root))
        if kdir is not None:  # (root/<arch>: what the build below writes)
            damage = cache_entry_damage(kdir)
            if damage is None:
                return kdir
            warnings.warn(
                f"mamba2-rocm: the just-in-time cache entry {kdir.path} is damaged ({damage}; "
                "an interrupted write?): removing it and building again", stacklevel=4,
            )  # fmt: skip
            shutil.rmtree(kdir.path, ignore_errors=True)
        for stale in root.glob(f".{info.name}.building-*"):  # a killed build's (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        warnings.warn(
            f"mamba2-rocm: building kernels for {info.name} into {root} (once)", stacklevel=4
        )
        # built beside the cache entry and renamed into place when complete: an interrupted
        # build never leaves a half-written entry where the next process looks
        staging = root / f".{info.name}.building-{os.getpid()}"
        try:
            build([info.name], staging)
            shutil.rmtree(root / info.name, ignore_errors=True)  # (an older build's remains)
            os.rename(staging / info.name, root / info.name)
        except BuildError as exc:
            warnings.warn(
                f"mamba2-rocm: just-in-time build for {info.name} failed: {exc}", stacklevel=4
            )
            return None
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return find_kernel_dir(arch, _cache_dirs(root))


def cache_entry_damage(kdir: KernelDir) -> str | None:
    """What is wrong with a cache entry's files (a code object its manifest names that is
    missing, or whose sha256 differs: a truncated write), or None."""
    for co in kdir.manifest.get("code_objects", []):
        path = kdir.path / co["file"]
        if not path.is_file():
            return f"{co['file']} is missing"
        if hashlib.sha256(path.read_bytes()).hexdigest() != co["sha256"]:
            return f"{co['file']}'s sha256 differs from its manifest"
    return None


def _cache_dirs(root: Path) -> list[KernelDir]:
    from mamba2_rocm.runtime.discovery import _dirs_below

    return _dirs_below(root, "jit cache")


def kernels_for_device(device_index: int) -> KernelSet | None:
    """The kernel set serving this device, or None (then the caller uses the torch fallback)."""
    try:
        return _SETS[device_index]
    except KeyError:
        pass
    with _LOCK:
        if device_index in _SETS:
            return _SETS[device_index]
        from mamba2_rocm.runtime.device import device_arch

        arch = device_arch(device_index)
        path_error = kernel_path_error(arch)
        if path_error is not None:  # not cached: fixing the path takes effect on the next call
            raise LoaderError(f"mamba2-rocm (device {device_index}, {arch}): {path_error}")
        kdir = find_kernel_dir(arch) or _jit_build(arch)
        kset = KernelSet(kdir, device_index, get_driver()) if kdir is not None else None
        if kset is None and arch not in _WARNED:
            _WARNED.add(arch)
            warnings.warn(
                f"mamba2-rocm: no kernels for {arch} (device {device_index}); using the slower "
                f"PyTorch fallback. To get kernels: {pip_install_hint(arch)}",
                stacklevel=3,
            )
        _SETS[device_index] = kset
        return kset


def release_all() -> None:
    """Unload every module (also run at interpreter exit)."""
    with _LOCK:
        sets = [s for s in _SETS.values() if s is not None]
        _SETS.clear()
    for kset in sets:
        kset.release()


def reset() -> None:
    """Forget selections and warnings (tests, or after installing a kernel package)."""
    release_all()
    _WARNED.clear()


atexit.register(release_all)
