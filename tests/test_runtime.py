"""The runtime without a GPU: discovery, the HIP library search, the loader with a fake driver,
and the ops' choice of tier.
"""

import contextlib
import ctypes
import hashlib
import importlib
import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
from fakewheels import stand_in_arch, stand_in_code_object
from helpers import require_tool

from mamba2_rocm.kernels import SOURCES
from mamba2_rocm.params import ConvUpdateParams, packer
from mamba2_rocm.runtime import discovery, loader
from mamba2_rocm.runtime import driver as rt_driver
from mamba2_rocm.runtime.discovery import KernelDir, find_kernel_dir, kernel_dirs, pip_install_hint
from mamba2_rocm.runtime.driver import DriverError, GpuDriver
from mamba2_rocm.runtime.loader import KernelSet, LoaderError


@pytest.fixture(autouse=True)
def _isolated_runtime(tmp_path, monkeypatch):
    """No kernel dirs from the caller's shell or user cache; no selections left behind."""
    monkeypatch.delenv("MAMBA2_ROCM_KERNEL_PATH", raising=False)
    monkeypatch.delenv("MAMBA2_ROCM_HIP_LIBRARY", raising=False)
    monkeypatch.setenv("MAMBA2_ROCM_CACHE", str(tmp_path / "empty-cache"))
    # write_kernel_dir's stand-ins name their target
    monkeypatch.setattr(loader, "_code_object_arch", stand_in_arch(loader._code_object_arch))
    loader.reset()
    yield
    loader.reset()


def write_kernel_dir(path: Path, target: str, vendor: str = "amd") -> Path:
    """A kernel dir as the build writes it, with stand-in code objects (the fake driver never
    parses them)."""
    path.mkdir(parents=True, exist_ok=True)
    suffix = "hsaco" if vendor == "amd" else "cubin"
    objects = []
    for name, src in SOURCES.items():
        image = stand_in_code_object(name, target)
        (path / f"{name}.{suffix}").write_bytes(image)
        objects.append(
            {
                "source": name,
                "file": f"{name}.{suffix}",
                "sha256": hashlib.sha256(image).hexdigest(),
                "code_object_version": 5 if vendor == "amd" else None,
                "kernels": [
                    {"name": k, "target": target, "arg_size": ctypes.sizeof(src.params)}
                    for k in src.kernels
                ],
            }
        )
    manifest = {"format": 1, "target": target, "vendor": vendor, "code_objects": objects}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


# --- discovery --------------------------------------------------------------------------------


def _targets(dirs):
    return [(d.target, d.path) for d in dirs]


def test_env_path_to_a_kernel_dir(tmp_path, monkeypatch):
    kdir = write_kernel_dir(tmp_path / "mine", "gfx1100")
    monkeypatch.setenv("MAMBA2_ROCM_KERNEL_PATH", str(kdir))
    (found,) = [d for d in kernel_dirs() if d.origin == "env MAMBA2_ROCM_KERNEL_PATH"]
    assert (found.target, found.path) == ("gfx1100", kdir)
    assert found.kernels == sorted(k for s in SOURCES.values() for k in s.kernels)
    assert find_kernel_dir("gfx1100") == found


def test_env_path_to_a_parent_of_target_dirs(tmp_path, monkeypatch):
    a = write_kernel_dir(tmp_path / "out" / "gfx1030", "gfx1030")
    b = write_kernel_dir(tmp_path / "out" / "gfx90a", "gfx90a")
    (tmp_path / "out" / "not-a-kernel-dir").mkdir()
    (tmp_path / "out" / "broken").mkdir()
    (tmp_path / "out" / "broken" / "manifest.json").write_text("{ not json")
    other = write_kernel_dir(tmp_path / "other" / "sm_90", "sm_90", vendor="nvidia")
    monkeypatch.setenv(
        "MAMBA2_ROCM_KERNEL_PATH",
        os.pathsep.join(map(str, (tmp_path / "out", tmp_path / "missing", other))),
    )
    with pytest.warns(UserWarning, match=r"skipped kernel dir .*broken \(env "
                      r"MAMBA2_ROCM_KERNEL_PATH\): unreadable manifest.json"):  # fmt: skip
        assert _targets(kernel_dirs()) == [("gfx1030", a), ("gfx90a", b), ("sm_90", other)]


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (lambda m: m.pop("code_objects"), "'code_objects' must be a non-empty list, got None"),
        (lambda m: m.update(target=["gfx1030"]), "'target' must be a string, got ['gfx1030']"),
        (lambda m: m.update(vendor="intel"), "'vendor' must be 'amd' or 'nvidia', got 'intel'"),
        (lambda m: m.update(emulates="gfx1010"),
         "'emulates' must be one of gfx1030, gfx11, gfx12, gfx9, got 'gfx1010'"),
        (lambda m: m["code_objects"][0].update(file="../x.hsaco"),
         "code_objects[0].file must be a file name in the kernel dir, got '../x.hsaco'"),
        (lambda m: m["code_objects"][0].update(sha256="x"), "code_objects[0].sha256 must be a sha256"),
        (lambda m: m["code_objects"][0]["kernels"].append({"name": "k"}),
         "code_objects[0].kernels must be a list of {name, arg_size} objects"),
    ],
)  # fmt: skip
def test_a_manifest_off_the_schema_is_skipped_saying_why(tmp_path, monkeypatch, edit, reason):
    kdir = write_kernel_dir(tmp_path / "k" / "gfx1030", "gfx1030")
    manifest = json.loads((kdir / "manifest.json").read_text())
    edit(manifest)
    (kdir / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setenv("MAMBA2_ROCM_KERNEL_PATH", str(tmp_path / "k"))
    with pytest.warns(UserWarning, match="skipped kernel dir") as record:
        assert kernel_dirs() == []
    assert reason in str(record[0].message)


@pytest.mark.parametrize(
    ("target", "emulates", "matrix_cores"),
    [
        ("gfx1030", None, False),
        ("gfx10-3-generic", None, False),
        ("gfx1100", None, True),
        ("gfx11-generic", None, True),
        ("gfx1151", None, True),
        ("gfx1201", None, True),
        ("gfx90a", None, True),
        ("gfx942", None, True),
        ("gfx9-4-generic", None, True),
        ("sm_90", None, True),
        ("sm_75", None, False),
        ("sm_90", "gfx1030", False),  # the FMA path run on an NVIDIA GPU
        ("sm_90", "gfx11", True),
        ("sm_90", "gfx9", True),
    ],
)
def test_kernel_dir_says_whether_its_16bit_kernels_run_on_matrix_cores(
    target, emulates, matrix_cores
):
    """What the SSD forward picks chunk_scan's block by (ops.ssd._scan_form)."""
    manifest = {"emulates": emulates} if emulates else {}
    assert KernelDir(target, Path("/k"), "test", manifest).matrix_cores is matrix_cores


def test_code_objects_without_a_manifest_are_reported(tmp_path, monkeypatch):
    (tmp_path / "k" / "gfx1030").mkdir(parents=True)
    (tmp_path / "k" / "gfx1030" / "ssd.hsaco").write_bytes(b"x")
    monkeypatch.setenv("MAMBA2_ROCM_KERNEL_PATH", str(tmp_path / "k"))
    with pytest.warns(UserWarning, match="gfx1030 .*: code objects but no manifest.json"):
        assert kernel_dirs() == []


def test_env_path_comes_before_the_jit_cache(tmp_path, monkeypatch):
    from mamba2_rocm import __version__

    cached = write_kernel_dir(tmp_path / "empty-cache" / __version__ / "gfx1030", "gfx1030")
    mine = write_kernel_dir(tmp_path / "mine", "gfx1030")
    assert find_kernel_dir("gfx1030").path == cached
    assert find_kernel_dir("gfx1030").origin == "jit cache"
    monkeypatch.setenv("MAMBA2_ROCM_KERNEL_PATH", str(mine))
    assert find_kernel_dir("gfx1030").path == mine


@pytest.fixture
def site_dir(tmp_path, monkeypatch):
    """A directory on sys.path that importlib.metadata scans; ``add(target, layout)`` puts a
    fake kernel package (module + dist-info with a ``mamba2_rocm.kernels`` entry point) in it."""
    site = tmp_path / "site"
    site.mkdir()
    added = []

    def add(target: str, kernel_dir_attr: bool = False, namespace: bool = False) -> Path:
        module = f"fake_kernels_{target.replace('-', '_')}"
        pkg = site / module
        pkg.mkdir()
        if namespace:  # data only: no __init__.py
            kdir = write_kernel_dir(pkg, target)
        elif kernel_dir_attr:  # the module names a folder of target dirs
            (pkg / "__init__.py").write_text(
                "from pathlib import Path\nKERNEL_DIR = Path(__file__).parent / 'kernels'\n"
            )
            kdir = write_kernel_dir(pkg / "kernels" / target, target)
        else:  # the module's own folder is the kernel dir
            (pkg / "__init__.py").write_text("")
            kdir = write_kernel_dir(pkg, target)
        dist = site / f"{module}-1.0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 1.0\n"
        )
        (dist / "entry_points.txt").write_text(f"[mamba2_rocm.kernels]\n{target} = {module}\n")
        added.append(module)
        importlib.invalidate_caches()
        return kdir

    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    yield add
    for module in added:
        sys.modules.pop(module, None)
    importlib.invalidate_caches()


def _package_dirs():
    return [d for d in kernel_dirs() if d.origin.startswith("package fake-kernels")]


def test_kernel_package_through_its_entry_point(site_dir):
    kdir = site_dir("gfx1030")
    (found,) = _package_dirs()
    assert (found.target, found.path) == ("gfx1030", kdir)
    assert found.origin == "package fake-kernels-gfx1030 1.0"
    assert find_kernel_dir("gfx1030") == found


def test_two_kernel_packages_side_by_side(site_dir):
    a = site_dir("gfx1030")
    b = site_dir("gfx11-generic", kernel_dir_attr=True)
    assert sorted(_targets(_package_dirs())) == [("gfx1030", a), ("gfx11-generic", b)]
    assert find_kernel_dir("gfx1030").path == a
    assert find_kernel_dir("gfx1151").path == b  # through its generic family


def test_kernel_package_without_init_py(site_dir):
    a = site_dir("gfx1030")
    b = site_dir("gfx1100", namespace=True)
    assert sorted(_targets(_package_dirs())) == [("gfx1030", a), ("gfx1100", b)]


def test_broken_kernel_package_warns_and_hides_nothing(site_dir, tmp_path):
    good = site_dir("gfx1030")
    site_dir("gfx1100")
    (tmp_path / "site" / "fake_kernels_gfx1100" / "__init__.py").write_text("raise OSError('x')")
    with pytest.warns(UserWarning, match="cannot load kernel package fake-kernels-gfx1100 1.0"):
        found = _package_dirs()
    assert _targets(found) == [("gfx1030", good)]


def test_generic_family_fallback_and_exact_first(tmp_path):
    generic = discovery._dirs_below(write_kernel_dir(tmp_path / "g", "gfx10-3-generic"), "test")
    exact = discovery._dirs_below(write_kernel_dir(tmp_path / "e", "gfx1031"), "test")
    assert find_kernel_dir("gfx1031", generic).target == "gfx10-3-generic"
    # the exact ISA wins whichever comes first in priority order
    assert find_kernel_dir("gfx1031", generic + exact).target == "gfx1031"
    assert find_kernel_dir("gfx1031", exact + generic).target == "gfx1031"
    assert find_kernel_dir("gfx1100", generic + exact) is None  # another family
    assert find_kernel_dir("gfx10-3-generic", generic + exact).target == "gfx10-3-generic"


def test_feature_suffixes_are_ignored(tmp_path):
    dirs = discovery._dirs_below(write_kernel_dir(tmp_path / "a", "gfx90a"), "test")
    assert find_kernel_dir("gfx90a:sramecc+:xnack-", dirs).target == "gfx90a"
    assert find_kernel_dir("gfx90a:xnack+", dirs).target == "gfx90a"


@pytest.mark.parametrize(
    ("arch", "hint"),
    [
        ("gfx1100", 'pip install "mamba2-rocm[gfx1100]"'),  # a release target
        ("gfx90a:xnack-", 'pip install "mamba2-rocm[gfx90a]"'),
        ("gfx1031", 'pip install "mamba2-rocm[gfx10-3-generic]"'),  # a family member
        ("gfx1152", 'pip install "mamba2-rocm[gfx11-generic]"'),
    ],
)
def test_pip_install_hint(arch, hint):
    assert pip_install_hint(arch) == hint


@pytest.mark.parametrize("arch", ["gfx908", "gfx1010", "sm_90", "gfx9999"])
def test_pip_install_hint_without_a_package(arch):
    hint = pip_install_hint(arch)
    assert hint.startswith(f"no mamba2-rocm kernel package is published for {arch}")
    assert f"python -m mamba2_rocm build --arch {arch} --out DIR" in hint
    assert "MAMBA2_ROCM_KERNEL_PATH=DIR" in hint


# --- HIP library search -----------------------------------------------------------------------


def test_hip_library_candidates_order(tmp_path, monkeypatch):
    torch_lib = tmp_path / "torch" / "lib"
    torch_lib.mkdir(parents=True)
    for name in ("libamdhip64.so.6", "libamdhip64.so", "libc10.so"):
        (torch_lib / name).write_bytes(b"")
    env = str(tmp_path / "chosen" / "libamdhip64.so")
    monkeypatch.setenv("MAMBA2_ROCM_HIP_LIBRARY", env)
    monkeypatch.setenv("ROCM_PATH", str(tmp_path / "rocm"))
    monkeypatch.setattr(rt_driver, "_torch_lib_dir", lambda: torch_lib)
    monkeypatch.setattr(rt_driver, "_mapped_libraries", lambda stem: ["/mapped/libamdhip64.so.6"])
    # ldconfig repeats the env choice: each path is listed (and tried) once
    monkeypatch.setattr(rt_driver, "_ldconfig", lambda stem: ["/usr/lib/libamdhip64.so.6", env])
    assert rt_driver.hip_library_candidates() == [
        env,
        "/mapped/libamdhip64.so.6",
        str(torch_lib / "libamdhip64.so"),
        str(torch_lib / "libamdhip64.so.6"),
        "/usr/lib/libamdhip64.so.6",
        str(tmp_path / "rocm" / "lib" / "libamdhip64.so"),
        "/opt/rocm/lib/libamdhip64.so",
    ]


def test_hip_library_candidates_without_env_or_torch(monkeypatch):
    monkeypatch.delenv("ROCM_PATH", raising=False)
    monkeypatch.setattr(rt_driver, "_torch_lib_dir", lambda: None)
    monkeypatch.setattr(rt_driver, "_mapped_libraries", lambda stem: [])
    monkeypatch.setattr(rt_driver, "_ldconfig", lambda stem: [])
    assert rt_driver.hip_library_candidates() == ["/opt/rocm/lib/libamdhip64.so"]


def test_find_hip_library_lists_every_path_tried(tmp_path, monkeypatch):
    not_a_library = tmp_path / "libamdhip64.so"
    not_a_library.write_text("not an ELF file")
    cands = [str(tmp_path / "missing" / "libamdhip64.so"), str(not_a_library), "/nowhere/x.so"]
    monkeypatch.setattr(rt_driver, "hip_library_candidates", lambda: cands)
    with pytest.raises(DriverError) as err:
        rt_driver.find_hip_library()
    msg = str(err.value)
    assert msg.startswith("cannot find the HIP runtime (libamdhip64) that torch uses")
    lines = msg.splitlines()
    for cand in cands:
        assert any(line.strip().startswith(f"{cand} (") for line in lines), cand
    assert "Set MAMBA2_ROCM_HIP_LIBRARY=/path/to/libamdhip64.so" in msg


def test_find_hip_library_with_no_candidate(monkeypatch):
    monkeypatch.setattr(rt_driver, "hip_library_candidates", lambda: [])
    with pytest.raises(DriverError, match=r"\(no candidate existed\)"):
        rt_driver.find_hip_library()


# --- the CUDA driver on a thread without a current context ------------------------------------


def _fake_libcuda(calls: list, current: list):
    """A stand-in for libcuda: module loads and launches fail with CUDA_ERROR_INVALID_CONTEXT
    while no context is current (``current`` holds it), as on a thread torch never bound."""
    from types import SimpleNamespace

    def needs_ctx(name):
        def fn(*args):
            calls.append(name)
            return 0 if current else rt_driver.CUDA_ERROR_INVALID_CONTEXT

        return fn

    def ctx_get(out):
        calls.append("cuCtxGetCurrent")
        out._obj.value = current[0] if current else None
        return 0

    def device_get(out, index):
        calls.append(("cuDeviceGet", index))
        out._obj.value = 10 + index
        return 0

    def retain(out, dev):
        calls.append(("cuDevicePrimaryCtxRetain", getattr(dev, "value", dev)))
        out._obj.value = 0xC0
        return 0

    def ctx_set(ctx):
        ctx = getattr(ctx, "value", ctx)
        calls.append(("cuCtxSetCurrent", ctx))
        current.append(ctx)
        return 0

    def errstr(err, out):
        return 0

    return SimpleNamespace(
        cuModuleLoadData=needs_ctx("cuModuleLoadData"), cuLaunchKernel=needs_ctx("cuLaunchKernel"),
        cuModuleGetFunction=needs_ctx("cuModuleGetFunction"), cuModuleUnload=needs_ctx("x"),
        cuGetErrorString=errstr, cuCtxGetCurrent=ctx_get, cuCtxSetCurrent=ctx_set,
        cuDeviceGet=device_get, cuDevicePrimaryCtxRetain=retain,
    )  # fmt: skip


@pytest.mark.parametrize("call", ["load", "launch"])
def test_cuda_driver_binds_the_primary_context_on_a_bare_thread(monkeypatch, call):
    """The first driver call on a thread without a context (autograd's backward thread, the
    first backward kernel) binds the primary context of torch's current device and retries,
    instead of failing with 'invalid device context'."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    calls, current = [], []
    drv = rt_driver.CudaDriver(lib=_fake_libcuda(calls, current))
    if call == "load":
        drv.load_module(b"image")
    else:
        drv.launch(ctypes.c_void_p(1), (1, 1, 1), (1, 1, 1), 0, 0, None)
    name = "cuModuleLoadData" if call == "load" else "cuLaunchKernel"
    assert calls == [name, "cuCtxGetCurrent", ("cuDeviceGet", 1), ("cuDevicePrimaryCtxRetain", 11),
                     ("cuCtxSetCurrent", 0xC0), name]  # fmt: skip
    calls.clear()  # bound now: one call, no retry
    drv.launch(ctypes.c_void_p(1), (1, 1, 1), (1, 1, 1), 0, 0, None)
    assert calls == ["cuLaunchKernel"]


def test_cuda_driver_does_not_mask_other_context_errors(monkeypatch):
    """With a context current, CUDA_ERROR_INVALID_CONTEXT has another cause: raised as is."""
    calls, current = [], []
    lib = _fake_libcuda(calls, current)
    lib.cuCtxGetCurrent = lambda out: (out._obj.__setattr__("value", 0xAB), 0)[1]
    drv = rt_driver.CudaDriver(lib=lib)
    with pytest.raises(DriverError, match="cuModuleLoadData failed: CUresult 201"):
        drv.load_module(b"image")


# --- loader with a fake driver ----------------------------------------------------------------


class FakeDriver(GpuDriver):
    """Records every call; a launch copies the parameter bytes out while they are alive."""

    def __init__(self, name: str = "hip", param_sizes: dict[str, int] | None = None) -> None:
        self.name = name
        self.param_sizes = param_sizes  # kernel name -> what the runtime reports; None: unknown
        self.loaded: list[bytes] = []
        self.functions: list[tuple[int, str]] = []
        self.launches: list[dict] = []
        self.unloaded: list[int] = []

    def load_module(self, image):
        self.loaded.append(image)
        return ctypes.c_void_p(0x1000 * len(self.loaded))

    def get_function(self, module, name):
        self.functions.append((module.value, name))
        return ctypes.c_void_p(0x10 * len(self.functions) + 1)

    def unload_module(self, module):
        self.unloaded.append(module.value)

    def launch(self, func, grid, block, shared_bytes, stream, params):
        ptr = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))[0]
        self.launches.append(
            dict(func=func.value, grid=grid, block=block, shared=shared_bytes, stream=stream,
                 ptr=ptr, data=ctypes.string_at(ptr, ctypes.sizeof(ConvUpdateParams)))
        )  # fmt: skip

    def param_size(self, func):
        if self.param_sizes is None:
            return None
        return self.param_sizes[self.functions[(func.value - 1) // 0x10 - 1][1]]


@pytest.fixture
def no_cuda_device(monkeypatch):
    """``torch.cuda.device(i)`` needs a CUDA build of torch; record the index instead."""
    entered = []

    @contextlib.contextmanager
    def device(index):
        entered.append(index)
        yield

    monkeypatch.setattr(torch.cuda, "device", device)
    return entered


def _kset(tmp_path, target="gfx1030", vendor="amd", drv=None, device_index=0):
    kdir = discovery._dirs_below(write_kernel_dir(tmp_path / target, target, vendor), "test")[0]
    return KernelSet(kdir, device_index, drv or FakeDriver())


UPDATE_KERNEL = SOURCES["conv1d_update"].kernels[0]


@pytest.mark.parametrize(("target", "matrix_cores"), [("gfx1030", False), ("gfx1100", True)])
def test_kernel_set_carries_its_dirs_matrix_cores(tmp_path, target, matrix_cores):
    assert _kset(tmp_path, target).matrix_cores is matrix_cores


def test_a_code_object_of_another_arch_is_refused_before_loading(tmp_path, no_cuda_device):
    kdir = write_kernel_dir(tmp_path / "gfx1030", "gfx1030")
    image = stand_in_code_object("conv1d_update", "gfx1100")  # matching sha256, wrong ISA inside
    (kdir / "conv1d_update.hsaco").write_bytes(image)
    manifest = json.loads((kdir / "manifest.json").read_text())
    for co in manifest["code_objects"]:
        if co["source"] == "conv1d_update":
            co["sha256"] = hashlib.sha256(image).hexdigest()
    (kdir / "manifest.json").write_text(json.dumps(manifest))
    drv = FakeDriver()
    kset = KernelSet(discovery._dirs_below(kdir, "test")[0], 0, drv)
    with pytest.raises(LoaderError, match=r"conv1d_update.hsaco: the code object is built for "
                       r"gfx1100, its kernel dir says gfx1030"):  # fmt: skip
        kset.launcher(UPDATE_KERNEL)
    assert drv.loaded == []  # never handed to the driver
    (kdir / "conv1d_update.hsaco").write_bytes(b"\x7fELF garbage")
    for co in manifest["code_objects"]:
        if co["source"] == "conv1d_update":
            co["sha256"] = hashlib.sha256(b"\x7fELF garbage").hexdigest()
    (kdir / "manifest.json").write_text(json.dumps(manifest))
    kset = KernelSet(discovery._dirs_below(kdir, "test")[0], 0, drv)
    with pytest.raises(LoaderError, match="not a code object mamba2-rocm can read"):
        kset.launcher(UPDATE_KERNEL)


def test_kernel_set_refuses_the_other_vendor(tmp_path):
    with pytest.raises(LoaderError, match=r"gfx1030: built for amd, this torch runs cuda"):
        _kset(tmp_path, drv=FakeDriver("cuda"))
    with pytest.raises(LoaderError, match=r"sm_90: built for nvidia, this torch runs hip"):
        _kset(tmp_path, target="sm_90", vendor="nvidia", drv=FakeDriver("hip"))


def test_kernel_set_refuses_arg_size_mismatch(tmp_path):
    path = write_kernel_dir(tmp_path / "gfx1030", "gfx1030")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["code_objects"][1]["kernels"][2]["arg_size"] = 200
    (path / "manifest.json").write_text(json.dumps(manifest))
    kdir = discovery._dirs_below(path, "test")[0]
    co = manifest["code_objects"][1]
    want = ctypes.sizeof(SOURCES[co["source"]].params)
    with pytest.raises(LoaderError) as err:
        KernelSet(kdir, 0, FakeDriver())
    msg = str(err.value)
    assert str(path / co["file"]) in msg
    assert (
        f"{co['kernels'][2]['name']} takes 200 argument bytes, this mamba2-rocm passes {want}"
        in msg
    )
    assert "does not match the installed mamba2-rocm version" in msg


def test_kernel_set_refuses_a_tampered_code_object(tmp_path, no_cuda_device):
    drv = FakeDriver()
    kset = _kset(tmp_path, drv=drv)
    (tmp_path / "gfx1030" / "conv1d_update.hsaco").write_bytes(b"something else")
    with pytest.raises(LoaderError, match=r"conv1d_update.hsaco: sha256 differs from its manifest"):
        kset.launcher(UPDATE_KERNEL)
    assert drv.loaded == []  # refused before the runtime saw it


def test_kernel_set_refuses_runtime_param_size_mismatch(tmp_path, no_cuda_device):
    kset = _kset(tmp_path, drv=FakeDriver(param_sizes={UPDATE_KERNEL: 8}))
    with pytest.raises(LoaderError, match=r"runtime reports a 8-byte parameter, ConvUpdateParams"):
        kset.launcher(UPDATE_KERNEL)


def test_launcher_asks_the_runtime_for_resident_blocks_once_per_block_size(
    tmp_path, no_cuda_device
):
    """``Launcher.resident_blocks``: the driver's occupancy answer, cached per block size;
    None where the runtime cannot tell (the base driver's default)."""
    asked = []

    class Occupancy(FakeDriver):
        def max_active_blocks(self, func, threads):
            asked.append((func.value, threads))
            return 4096 // threads

    kset = _kset(tmp_path, drv=Occupancy())
    launcher = kset.launcher(UPDATE_KERNEL)
    assert launcher.resident_blocks(256) == 16 and launcher.resident_blocks(256) == 16
    assert launcher.resident_blocks(512) == 8
    assert asked == [(launcher.func.value, 256), (launcher.func.value, 512)]
    assert (
        _kset(tmp_path, "gfx1100", drv=FakeDriver()).launcher(UPDATE_KERNEL).resident_blocks(64)
        is None
    )


def test_launcher_loads_each_module_once_and_caches(tmp_path, no_cuda_device):
    sizes = {k: ctypes.sizeof(s.params) for s in SOURCES.values() for k in s.kernels}
    drv = FakeDriver(param_sizes=sizes)  # the runtime agrees with the manifest
    kset = _kset(tmp_path, drv=drv, device_index=3)
    update = SOURCES["conv1d_update"].kernels
    fwd = SOURCES["conv1d_fwd"].kernels
    first = kset.launcher(update[0])
    assert kset.launcher(update[0]) is first
    kset.launcher(update[1])
    kset.launcher(fwd[0])
    kset.launcher(fwd[5])
    assert drv.loaded == [
        b"code object conv1d_update for gfx1030",
        b"code object conv1d_fwd for gfx1030",
    ]
    assert no_cuda_device == [3, 3]  # each module loaded on the set's device
    assert [name for _, name in drv.functions] == [update[0], update[1], fwd[0], fwd[5]]
    assert first.params_type is ConvUpdateParams and first.name == update[0]
    assert kset.has(update[0]) and kset.has(fwd[-1])
    assert not kset.has("m2r_no_such_kernel")


def test_launch_packs_the_params_struct(tmp_path, no_cuda_device):
    drv = FakeDriver()
    launcher = _kset(tmp_path, drv=drv).launcher(UPDATE_KERNEL)
    n_ptr, n_i64, n_i32 = 7, 12, 10
    values = (
        *(0x7F00_0000_0000 + 0x100 * i for i in range(n_ptr - 1)), 0,  # and a null pointer
        *(-(2**40) + i for i in range(n_i64)),  # negative strides survive
        *(-3 + i for i in range(n_i32)),
    )  # fmt: skip
    assert len(values) == len(ConvUpdateParams._fields_)
    launcher(values, grid=(5, 2, 1), block=(128, 1, 1), stream=0xABC, shared_bytes=64)
    (call,) = drv.launches
    assert call["data"] == packer(ConvUpdateParams).pack(*values)
    assert call["data"] == bytes(ConvUpdateParams(*values))  # the ctypes layout, independently
    assert call["func"] == launcher.func.value
    assert (call["grid"], call["block"], call["shared"], call["stream"]) == (
        (5, 2, 1),
        (128, 1, 1),
        64,
        0xABC,
    )


def _update_values(seed: int) -> tuple:
    """ConvUpdateParams values that differ from seed to seed in every field."""
    return tuple(seed * 1000 + i for i in range(len(ConvUpdateParams._fields_)))


def test_launches_reuse_a_buffer_and_pass_each_calls_values(tmp_path, no_cuda_device):
    """A thread's launches of one kernel pack into one buffer (no allocation per call), and the
    driver reads each call's own values when it is called."""
    drv = FakeDriver()
    launcher = _kset(tmp_path, drv=drv).launcher(UPDATE_KERNEL)
    for seed in (1, 2, 3):
        launcher(_update_values(seed), (1, 1, 1), (128, 1, 1), 0)
    assert [c["data"] for c in drv.launches] == [
        packer(ConvUpdateParams).pack(*_update_values(seed)) for seed in (1, 2, 3)
    ]
    assert len({c["ptr"] for c in drv.launches}) == 1


def test_threads_pack_into_buffers_of_their_own(tmp_path, no_cuda_device):
    """The driver call releases the GIL while it reads the parameter bytes: a launch on another
    thread meanwhile must not overwrite them. The fake driver waits inside every launch until
    both threads are inside one, then reads."""
    import threading

    both_inside = threading.Barrier(2, timeout=10)

    class SlowDriver(FakeDriver):
        def launch(self, func, grid, block, shared_bytes, stream, params):
            both_inside.wait()  # the other thread has packed its values by now
            super().launch(func, grid, block, shared_bytes, stream, params)

    drv = SlowDriver()
    launcher = _kset(tmp_path, drv=drv).launcher(UPDATE_KERNEL)
    threads = [
        threading.Thread(target=launcher, args=(_update_values(seed), (1, 1, 1), (128, 1, 1), 0))
        for seed in (1, 2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    packed = {packer(ConvUpdateParams).pack(*_update_values(seed)) for seed in (1, 2)}
    assert {c["data"] for c in drv.launches} == packed
    assert len({c["ptr"] for c in drv.launches}) == 2


def test_release_unloads_every_module(tmp_path, no_cuda_device):
    drv = FakeDriver()
    kset = _kset(tmp_path, drv=drv)
    kset.launcher(SOURCES["conv1d_update"].kernels[0])
    kset.launcher(SOURCES["conv1d_fwd"].kernels[0])
    kset.release()
    assert sorted(drv.unloaded) == [0x1000, 0x2000]
    kset.release()
    assert len(drv.unloaded) == 2  # nothing twice
    kset.launcher(SOURCES["conv1d_update"].kernels[0])  # usable again: loads afresh
    assert len(drv.loaded) == 3


def test_release_survives_a_dead_context(tmp_path, no_cuda_device):
    class DyingDriver(FakeDriver):
        def unload_module(self, module):
            super().unload_module(module)
            raise DriverError("hipModuleUnload failed: context is destroyed")

    drv = DyingDriver()
    kset = _kset(tmp_path, drv=drv)
    kset.launcher(SOURCES["conv1d_update"].kernels[0])
    kset.launcher(SOURCES["conv1d_fwd"].kernels[0])
    kset.release()
    assert len(drv.unloaded) == 2


@pytest.fixture
def fake_devices(monkeypatch):
    """Devices with the given archs, served by a fake driver."""
    import mamba2_rocm.runtime.device as device

    archs: dict[int, str] = {}
    drv = FakeDriver()
    monkeypatch.setattr(device, "device_arch", lambda index: archs[index])
    monkeypatch.setattr(loader, "get_driver", lambda: drv)
    return archs, drv


def _no_kernel_warnings(record):
    return [str(w.message) for w in record if "no kernels for" in str(w.message)]


def test_no_kernels_warns_once_per_arch(fake_devices, monkeypatch):
    archs, _ = fake_devices
    archs.update({0: "gfx1031", 1: "gfx1031", 2: "gfx1100"})
    monkeypatch.setenv("MAMBA2_ROCM_JIT", "0")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for index in (0, 0, 1, 2, 2, 1):
            assert loader.kernels_for_device(index) is None
    assert _no_kernel_warnings(record) == [
        "mamba2-rocm: no kernels for gfx1031 (device 0); using the slower PyTorch fallback. "
        'To get kernels: pip install "mamba2-rocm[gfx10-3-generic]"',
        "mamba2-rocm: no kernels for gfx1100 (device 2); using the slower PyTorch fallback. "
        'To get kernels: pip install "mamba2-rocm[gfx1100]"',
    ]
    loader.reset()  # forgets the warnings too
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loader.kernels_for_device(1)
    assert len(_no_kernel_warnings(record)) == 1


def test_kernels_for_device_selects_and_caches(fake_devices, tmp_path, monkeypatch):
    archs, drv = fake_devices
    archs.update({0: "gfx1031", 1: "gfx1100"})
    monkeypatch.setenv("MAMBA2_ROCM_JIT", "0")
    kdir = write_kernel_dir(tmp_path / "k" / "gfx10-3-generic", "gfx10-3-generic")
    monkeypatch.setenv("MAMBA2_ROCM_KERNEL_PATH", str(tmp_path / "k"))
    kset = loader.kernels_for_device(0)
    assert kset.target == "gfx10-3-generic" and kset.kdir.path == kdir and kset.driver is drv
    assert loader.kernels_for_device(0) is kset
    # the path the user set has nothing for gfx1100: an error naming it, not a silent fallback
    with pytest.raises(LoaderError, match=r"device 1, gfx1100\): MAMBA2_ROCM_KERNEL_PATH=.*k "
                       r"has kernels for gfx10-3-generic but none for gfx1100 \(looked for "
                       r"gfx1100 or gfx11-generic\)"):  # fmt: skip
        loader.kernels_for_device(1)
    monkeypatch.delenv("MAMBA2_ROCM_KERNEL_PATH")  # unset: the usual fallback, with its warning
    with pytest.warns(UserWarning, match="no kernels for gfx1100"):
        assert loader.kernels_for_device(1) is None


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda root: root / "nowhere", r"entry '.*nowhere' does not exist"),
        (lambda root: (root / "f").write_text("x") and root / "f", r"entry '.*f' is not a directory"),
        (lambda root: (root / "empty").mkdir() or root / "empty",
         r"entry '.*empty' holds no kernel dir \(looked for .*empty/manifest.json and "
         r".*empty/<target>/manifest.json"),
    ],
)  # fmt: skip
def test_an_unusable_kernel_path_is_an_error(fake_devices, tmp_path, monkeypatch, make, expected):
    archs, _ = fake_devices
    archs[0] = "gfx1030"
    monkeypatch.setenv("MAMBA2_ROCM_JIT", "0")
    good = write_kernel_dir(tmp_path / "good" / "gfx1030", "gfx1030")
    bad = make(tmp_path)
    monkeypatch.setenv("MAMBA2_ROCM_KERNEL_PATH", os.pathsep.join(map(str, (good.parent, bad))))
    assert discovery.kernel_path_problems() != []
    with pytest.raises(LoaderError, match=expected):
        loader.kernels_for_device(0)
    # fixed: the next call works (errors are not cached)
    monkeypatch.setenv("MAMBA2_ROCM_KERNEL_PATH", str(good.parent))
    assert discovery.kernel_path_problems() == []
    assert loader.kernels_for_device(0).kdir.path == good


def test_an_empty_kernel_path_is_unset(monkeypatch):
    monkeypatch.setenv("MAMBA2_ROCM_KERNEL_PATH", os.pathsep)
    assert discovery.kernel_path_entries() == []
    assert discovery.kernel_path_error("gfx1030") is None


@pytest.mark.slow
def test_jit_build_into_the_cache_then_reuse(fake_devices, tmp_path, monkeypatch, no_cuda_device):
    from mamba2_rocm.build import driver as build_driver

    try:
        build_driver.find_toolchain("nvidia")
    except build_driver.BuildError as exc:
        require_tool(f"nvcc not installed: {exc}")
    archs, _ = fake_devices
    archs[0] = "sm_90"
    fake_devices[1].name = "cuda"
    monkeypatch.delenv("MAMBA2_ROCM_JIT", raising=False)
    cache = tmp_path / "jit-cache"
    monkeypatch.setenv("MAMBA2_ROCM_CACHE", str(cache))
    with pytest.warns(UserWarning, match=r"building kernels for sm_90 into .*jit-cache"):
        kset = loader.kernels_for_device(0)
    assert kset is not None and kset.target == "sm_90"
    assert kset.kdir.path.parent.parent == cache and kset.kdir.origin == "jit cache"
    assert (kset.kdir.path / "manifest.json").is_file()
    kset.launcher(UPDATE_KERNEL)  # the real cubin's sha256 matches its manifest
    # the real cubin's ISA is read from its ELF: relabelled as sm_80, it is refused
    relabelled = tmp_path / "relabelled" / "sm_80"
    shutil.copytree(kset.kdir.path, relabelled)
    manifest = json.loads((relabelled / "manifest.json").read_text())
    manifest["target"] = "sm_80"
    (relabelled / "manifest.json").write_text(json.dumps(manifest))
    other = KernelSet(discovery._dirs_below(relabelled, "test")[0], 0, kset.driver)
    with pytest.raises(
        LoaderError, match="the code object is built for sm_90, its kernel dir says sm_80"
    ):
        other.launcher(UPDATE_KERNEL)

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the cached build must be reused")

    monkeypatch.setattr(build_driver, "build", no_rebuild)
    loader.reset()  # a new process: nothing selected yet
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = loader.kernels_for_device(0)
    assert again is not kset and again.kdir.path == kset.kdir.path


def test_jit_build_skipped_without_a_compiler(fake_devices, monkeypatch, tmp_path):
    from mamba2_rocm.build import driver as build_driver

    archs, _ = fake_devices
    archs[0] = "gfx1100"
    monkeypatch.delenv("MAMBA2_ROCM_JIT", raising=False)

    def no_compiler(vendor):
        raise build_driver.BuildError("no hipcc")

    monkeypatch.setattr(build_driver, "find_toolchain", no_compiler)
    with pytest.warns(UserWarning, match="no kernels for gfx1100"):
        assert loader.kernels_for_device(0) is None


# --- the ops' tier ----------------------------------------------------------------------------


def test_backend_kernel_on_cpu_tensors_is_an_error(backend):
    from mamba2_rocm.ops import _backend

    backend("kernel")
    with pytest.raises(
        ValueError, match="MAMBA2_ROCM_BACKEND=kernel needs GPU tensors, got tensors on cpu"
    ):
        _backend.choose(torch.device("cpu"))


@pytest.mark.parametrize(
    ("value", "tier"), [("auto", "torch"), ("torch", "torch"), (" Eager ", "eager"), ("", "torch")]
)
def test_backend_on_cpu(backend, value, tier):
    from mamba2_rocm.ops import _backend

    backend(value)
    assert _backend.choose(torch.device("cpu")) == (tier, None)


def test_backend_invalid_value_names_the_choices(backend):
    from mamba2_rocm.ops import _backend

    backend("triton")
    with pytest.raises(ValueError) as err:
        _backend.choose(torch.device("cpu"))
    assert str(err.value) == "MAMBA2_ROCM_BACKEND='triton' is not one of auto, kernel, torch, eager"


def _fake_jit(monkeypatch, tmp_path):
    """A JIT cache under tmp_path whose compiler is a stand-in writing a good entry."""
    from mamba2_rocm.build import driver as build_driver

    monkeypatch.setenv("MAMBA2_ROCM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "jit_compiler", lambda vendor, environ=None: "hipcc")
    builds = []

    def build(archs, out):
        builds.append(Path(out))
        write_kernel_dir(Path(out) / archs[0], archs[0])
        return None

    monkeypatch.setattr(build_driver, "build", build)
    return discovery.jit_cache_root(), builds


@pytest.mark.filterwarnings("ignore:mamba2-rocm. building kernels")
@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_damaged_jit_cache_entry_is_rebuilt_not_used(tmp_path, monkeypatch, damage):
    root, builds = _fake_jit(monkeypatch, tmp_path)
    entry = write_kernel_dir(root / "gfx1100", "gfx1100")
    victim = sorted(entry.glob("*.hsaco"))[0]
    if damage == "truncated":
        victim.write_bytes(victim.read_bytes()[:3])
    else:
        victim.unlink()
    with pytest.warns(UserWarning, match=rf"cache entry .*gfx1100 is damaged \({victim.name}"):
        kdir = loader._jit_build("gfx1100")
    assert kdir is not None and kdir.path == root / "gfx1100"
    assert loader.cache_entry_damage(kdir) is None
    assert len(builds) == 1 and builds[0].name.startswith(".gfx1100.building-")
    assert sorted(p.name for p in root.iterdir()) == ["gfx1100", "gfx1100.lock"]
    # a good entry is used as it is
    assert loader._jit_build("gfx1100").path == root / "gfx1100" and len(builds) == 1


def test_an_interrupted_jit_build_leaves_no_entry(tmp_path, monkeypatch):
    root, _ = _fake_jit(monkeypatch, tmp_path)
    from mamba2_rocm.build import driver as build_driver

    def killed(archs, out):
        (Path(out) / archs[0]).mkdir(parents=True)
        (Path(out) / archs[0] / "ssd.hsaco").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(build_driver, "build", killed)
    with pytest.warns(UserWarning, match="building kernels for gfx1100"), \
            pytest.raises(KeyboardInterrupt):  # fmt: skip
        loader._jit_build("gfx1100")
    assert sorted(p.name for p in root.iterdir()) == ["gfx1100.lock"]
    # a killed process's staging folder (no cleanup ran) is removed by the next build
    (root / ".gfx1100.building-999999" / "gfx1100").mkdir(parents=True)
    _fake_jit(monkeypatch, tmp_path)
    with pytest.warns(UserWarning, match="building kernels for gfx1100"):
        assert loader._jit_build("gfx1100").path == root / "gfx1100"
    assert sorted(p.name for p in root.iterdir()) == ["gfx1100", "gfx1100.lock"]
