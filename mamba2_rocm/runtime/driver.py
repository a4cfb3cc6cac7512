"""ctypes bindings to the GPU runtime that torch already loaded: HIP on ROCm, the CUDA driver.

One small interface (:class:`GpuDriver`) with two implementations. We never load a second copy
of the HIP runtime: the search prefers the copy mapped into this process, then torch's own.
The order, and every path tried, are in the error when none is found.
"""

from __future__ import annotations

import ctypes
import glob
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["CudaDriver", "DriverError", "GpuDriver", "HipDriver", "find_hip_library", "get_driver"]

HIP_LIBRARY_ENV = "MAMBA2_ROCM_HIP_LIBRARY"
_c_void_pp = ctypes.POINTER(ctypes.c_void_p)


class DriverError(RuntimeError):
    """A GPU runtime call failed; the message carries the call and the runtime's own words."""


def _mapped_libraries(stem: str) -> list[str]:
    """Paths of already-mapped shared objects whose name starts with ``stem`` (Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if stem in line and "/" in line}
    except OSError:
        return []
    return sorted(p for p in paths if Path(p).name.startswith(stem))


def _torch_lib_dir() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


def _ldconfig(stem: str) -> list[str]:
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [
        line.split("=>")[-1].strip() for line in out.splitlines() if stem in line and "=>" in line
    ]


def hip_library_candidates() -> list[str]:
    """Where we look for the HIP runtime, in order (see the module docstring)."""
    cands: list[str] = []
    env = os.environ.get(HIP_LIBRARY_ENV)
    if env:
        cands.append(env)
    torch_lib = _torch_lib_dir()
    if sys.platform == "win32":
        if torch_lib is not None:
            cands += sorted(glob.glob(str(torch_lib / "amdhip64*.dll")), reverse=True)
        hip_path = os.environ.get("HIP_PATH")
        if hip_path:
            cands += sorted(glob.glob(str(Path(hip_path) / "bin" / "amdhip64*.dll")), reverse=True)
        return cands
    cands += _mapped_libraries("libamdhip64.so")
    if torch_lib is not None:
        cands += sorted(glob.glob(str(torch_lib / "libamdhip64.so*")))
    cands += _ldconfig("libamdhip64.so")
    for prefix in (os.environ.get("ROCM_PATH"), "/opt/rocm"):
        if prefix:
            cands.append(str(Path(prefix) / "lib" / "libamdhip64.so"))
    seen: set[str] = set()
    return [c for c in cands if not (c in seen or seen.add(c))]


def find_hip_library() -> ctypes.CDLL:
    tried = []
    for cand in hip_library_candidates():
        try:
            return ctypes.CDLL(cand, mode=getattr(ctypes, "RTLD_GLOBAL", 0))
        except OSError as exc:
            tried.append(f"{cand} ({exc})")
    raise DriverError(
        "cannot find the HIP runtime (libamdhip64) that torch uses. Tried, in order: "
        f"${HIP_LIBRARY_ENV}, the copy mapped in this process, torch/lib, ldconfig, "
        f"$ROCM_PATH/lib, /opt/rocm/lib:\n  "
        + ("\n  ".join(tried) or "(no candidate existed)")
        + f"\nSet {HIP_LIBRARY_ENV}=/path/to/libamdhip64.so to choose one."
    )


class GpuDriver:
    """Module loading and kernel launch through a vendor's C API."""

    name = "abstract"

    def load_module(self, image: bytes) -> ctypes.c_void_p:
        raise NotImplementedError

    def get_function(self, module: ctypes.c_void_p, name: str) -> ctypes.c_void_p:
        raise NotImplementedError

    def unload_module(self, module: ctypes.c_void_p) -> None:
        raise NotImplementedError

    def launch(self, func: ctypes.c_void_p, grid: tuple[int, int, int], block: tuple[int, int, int],
               shared_bytes: int, stream: int, params: ctypes.Array) -> None:  # fmt: skip
        raise NotImplementedError

    def param_size(self, func: ctypes.c_void_p) -> int | None:
        """Size of the kernel's first parameter as the runtime sees it, when it can tell."""
        return None

    def max_active_blocks(self, func: ctypes.c_void_p, threads: int) -> int | None:
        """Blocks of ``threads`` threads of ``func`` that one multiprocessor (compute unit)
        holds at once, by the runtime's occupancy calculator (registers, LDS, wavefront
        slots); None when the runtime cannot tell."""
        return None


def _declare(lib: ctypes.CDLL, name: str, *argtypes: type) -> ctypes._CFuncPtr:
    fn = getattr(lib, name)
    fn.argtypes = list(argtypes)
    fn.restype = ctypes.c_int
    return fn


def _optional(lib: ctypes.CDLL, name: str, *argtypes: type) -> ctypes._CFuncPtr | None:
    """``_declare``, or None where the library lacks the function (an older runtime)."""
    try:
        return _declare(lib, name, *argtypes)
    except AttributeError:
        return None


class HipDriver(GpuDriver):
    name = "hip"

    def __init__(self, lib: ctypes.CDLL | None = None) -> None:
        lib = lib or find_hip_library()
        self._lib = lib
        vp, u, i = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int
        self._load = _declare(lib, "hipModuleLoadData", _c_void_pp, vp)
        self._getfn = _declare(lib, "hipModuleGetFunction", _c_void_pp, vp, ctypes.c_char_p)
        self._unload = _declare(lib, "hipModuleUnload", vp)
        self._launch = _declare(
            lib, "hipModuleLaunchKernel", vp, u, u, u, u, u, u, u, vp, _c_void_pp, _c_void_pp
        )
        self._errstr = lib.hipGetErrorString
        self._errstr.argtypes, self._errstr.restype = [i], ctypes.c_char_p
        self._occupancy = _optional(lib, "hipModuleOccupancyMaxActiveBlocksPerMultiprocessor",
                                    ctypes.POINTER(i), vp, i, ctypes.c_size_t)  # fmt: skip

    def _check(self, err: int, what: str) -> None:
        if err != 0:
            msg = (self._errstr(err) or b"unknown error").decode(errors="replace")
            raise DriverError(f"{what} failed: hipError {err} ({msg})")

    def load_module(self, image: bytes) -> ctypes.c_void_p:
        module = ctypes.c_void_p()
        buf = ctypes.create_string_buffer(image, len(image))
        self._check(self._load(ctypes.byref(module), buf), "hipModuleLoadData")
        return module

    def get_function(self, module, name):
        func = ctypes.c_void_p()
        self._check(
            self._getfn(ctypes.byref(func), module, name.encode()), f"hipModuleGetFunction({name})"
        )
        return func

    def unload_module(self, module) -> None:
        self._check(self._unload(module), "hipModuleUnload")

    def launch(self, func, grid, block, shared_bytes, stream, params) -> None:
        err = self._launch(func, *grid, *block, shared_bytes, stream, params, None)
        if err:
            self._check(err, "hipModuleLaunchKernel")

    def max_active_blocks(self, func, threads: int) -> int | None:
        if self._occupancy is None:
            return None
        n = ctypes.c_int()
        if self._occupancy(ctypes.byref(n), func, threads, 0) != 0:
            return None
        return n.value


#: CUresult of a driver call on a thread with no current context
CUDA_ERROR_INVALID_CONTEXT = 201


class CudaDriver(GpuDriver):
    name = "cuda"

    def __init__(self, lib: ctypes.CDLL | None = None) -> None:
        if lib is None:
            names = (
                ["nvcuda.dll"]
                if sys.platform == "win32"
                else [*_mapped_libraries("libcuda.so"), "libcuda.so.1"]
            )
            errors = []
            for cand in names:
                try:
                    lib = ctypes.CDLL(cand)
                    break
                except OSError as exc:
                    errors.append(f"{cand} ({exc})")
            else:
                raise DriverError("cannot load the CUDA driver library; tried " + ", ".join(errors))
        self._lib = lib
        vp, u, i = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int
        self._load = _declare(lib, "cuModuleLoadData", _c_void_pp, vp)
        self._getfn = _declare(lib, "cuModuleGetFunction", _c_void_pp, vp, ctypes.c_char_p)
        self._unload = _declare(lib, "cuModuleUnload", vp)
        self._launch = _declare(
            lib, "cuLaunchKernel", vp, u, u, u, u, u, u, u, vp, _c_void_pp, _c_void_pp
        )
        self._errstr = _declare(lib, "cuGetErrorString", i, ctypes.POINTER(ctypes.c_char_p))
        self._ctx_get = _declare(lib, "cuCtxGetCurrent", _c_void_pp)
        self._ctx_set = _declare(lib, "cuCtxSetCurrent", vp)
        self._device_get = _declare(lib, "cuDeviceGet", ctypes.POINTER(i), i)
        self._primary_retain = _declare(lib, "cuDevicePrimaryCtxRetain", _c_void_pp, i)
        self._occupancy = _optional(lib, "cuOccupancyMaxActiveBlocksPerMultiprocessor",
                                    ctypes.POINTER(i), vp, i, ctypes.c_size_t)  # fmt: skip
        try:
            sz = ctypes.POINTER(ctypes.c_size_t)
            self._param_info = _declare(lib, "cuFuncGetParamInfo", vp, ctypes.c_size_t, sz, sz)
        except AttributeError:  # drivers before CUDA 12.4
            self._param_info = None

    def _check(self, err: int, what: str) -> None:
        if err != 0:
            msg = ctypes.c_char_p()
            self._errstr(err, ctypes.byref(msg))
            raise DriverError(
                f"{what} failed: CUresult {err} ({(msg.value or b'unknown').decode()})"
            )

    def _bind_thread_context(self) -> bool:
        """Make the primary context of torch's current device current on this thread, where
        the thread has none; whether it did. A thread that torch's runtime calls never bound
        (autograd's device threads start without one: torch skips setting a device that is
        already the current one) makes every driver call fail with CUDA_ERROR_INVALID_CONTEXT.
        The primary context is the one torch's runtime uses; it is retained for the process."""
        current = ctypes.c_void_p()
        if self._ctx_get(ctypes.byref(current)) != 0 or current.value:
            return False
        from mamba2_rocm._torch import require_torch

        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        index = require_torch().cuda.current_device()
        self._check(self._device_get(ctypes.byref(dev), index), "cuDeviceGet")
        self._check(self._primary_retain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        self._check(self._ctx_set(ctx), "cuCtxSetCurrent")
        return True

    def load_module(self, image: bytes) -> ctypes.c_void_p:
        module = ctypes.c_void_p()
        buf = ctypes.create_string_buffer(image, len(image))
        err = self._load(ctypes.byref(module), buf)
        if err == CUDA_ERROR_INVALID_CONTEXT and self._bind_thread_context():
            err = self._load(ctypes.byref(module), buf)
        self._check(err, "cuModuleLoadData")
        return module

    def get_function(self, module, name):
        func = ctypes.c_void_p()
        self._check(
            self._getfn(ctypes.byref(func), module, name.encode()), f"cuModuleGetFunction({name})"
        )
        return func

    def unload_module(self, module) -> None:
        self._check(self._unload(module), "cuModuleUnload")

    def launch(self, func, grid, block, shared_bytes, stream, params) -> None:
        err = self._launch(func, *grid, *block, shared_bytes, stream, params, None)
        if err:  # (the common path is the one call above)
            if err == CUDA_ERROR_INVALID_CONTEXT and self._bind_thread_context():
                err = self._launch(func, *grid, *block, shared_bytes, stream, params, None)
            self._check(err, "cuLaunchKernel")

    def max_active_blocks(self, func, threads: int) -> int | None:
        if self._occupancy is None:
            return None
        n = ctypes.c_int()
        err = self._occupancy(ctypes.byref(n), func, threads, 0)
        if err == CUDA_ERROR_INVALID_CONTEXT and self._bind_thread_context():
            err = self._occupancy(ctypes.byref(n), func, threads, 0)
        return n.value if err == 0 else None

    def param_size(self, func) -> int | None:
        if self._param_info is None:
            return None
        offset, size = ctypes.c_size_t(), ctypes.c_size_t()
        if self._param_info(func, 0, ctypes.byref(offset), ctypes.byref(size)) != 0:
            return None
        return size.value


_DRIVER: GpuDriver | None = None


def get_driver() -> GpuDriver:
    """The driver for the runtime torch was built against (HIP for ROCm torch, else CUDA)."""
    global _DRIVER
    if _DRIVER is None:
        from mamba2_rocm._torch import require_torch

        torch = require_torch()
        _DRIVER = HipDriver() if torch.version.hip is not None else CudaDriver()
    return _DRIVER
