"""Compile every csrc source for each target and verify the code objects statically.

Output layout: ``OUT/<target>/<source>.{hsaco,cubin}`` and ``OUT/<target>/manifest.json``. The
manifest is written only after every check passed, so a directory with a manifest is always a
verified one (the runtime relies on that).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mamba2_rocm.arch import ArchInfo, arch_info
from mamba2_rocm.build.codeobject import (
    CodeObjectError,
    KernelInfo,
    amd_code_object_version,
    amd_kernels,
    cuda_kernels,
)
from mamba2_rocm.kernels import SOURCES, KernelSource

__all__ = [
    "CLANG_EMULATIONS",
    "EMULATED_WAVEFRONT",
    "EMULATIONS",
    "MANIFEST_FORMAT",
    "BuildError",
    "BuildResult",
    "Toolchain",
    "build",
    "csrc_dir",
    "detect_native_archs",
    "find_clang_cuda",
    "find_toolchain",
    "verify_kernels",
]

MANIFEST_FORMAT = 1
_TAIL_LINES = 40


class BuildError(RuntimeError):
    """A compile or verification failure; the message says which kernel, target and why."""


@dataclass(frozen=True)
class Toolchain:
    vendor: str  # "amd" or "nvidia"
    compiler: str  # path to hipcc / nvcc, or clang++ for the WMMA emulation builds
    version: str  # first line(s) of `--version`, recorded in the manifest
    cuda_path: str = ""  # clang only: the CUDA toolkit (headers, libdevice, ptxas)
    stubs: str = ""  # clang only: the folder of empty stand-ins (see CLANG_CUDA_STUBS)

    def command(
        self, src: Path, out: Path, info: ArchInfo, include: Path,
        code_object_version: int | None = None, extra_flags: Sequence[str] = (),
        wavefront: int | None = None,
    ) -> list[str]:  # fmt: skip
        """``wavefront`` overrides the target's (the wave64 emulation on a 32-lane GPU)."""
        common = [
            "-O3",
            "-std=c++17",
            f"-DM2R_WAVEFRONT_SIZE={wavefront or info.wavefront_size}",
            "-I",
            str(include),
        ]
        common += list(extra_flags)
        if self.vendor == "amd":
            # generic targets exist only from code-object v6; v5 loads on every ROCm 6 runtime
            cov = code_object_version or (6 if info.is_generic else 5)
            return [
                self.compiler, "-x", "hip", f"--offload-arch={info.name}", "--cuda-device-only",
                f"-mcode-object-version={cov}", "-Wno-unused-command-line-argument",
                # keep absolute paths out of the output so builds are byte-reproducible
                f"-ffile-prefix-map={include}=csrc",
                *common, "-o", str(out), str(src),
            ]  # fmt: skip
        sm = info.name.removeprefix("sm_")
        if self.cuda_path:  # clang's CUDA mode: a cubin through the toolkit's ptxas
            return [
                self.compiler, "-x", "cuda", f"--cuda-gpu-arch=sm_{sm}",
                f"--cuda-path={self.cuda_path}", "--cuda-device-only", "-c", "-I", self.stubs,
                "-Wno-unknown-cuda-version", "-Xcuda-ptxas", "-v", *common, "-o", str(out),
                str(src),
            ]  # fmt: skip
        return [
            self.compiler, "-x", "cu", "-cubin", f"-gencode=arch=compute_{sm},code=sm_{sm}",
            "--resource-usage", *common, "-o", str(out), str(src),
        ]  # fmt: skip


def csrc_dir() -> Path:
    """The kernel sources: inside the installed package, or beside it in a source checkout."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "csrc", here.parent / "csrc"):
        if (candidate / "platform.h").is_file():
            return candidate
    raise FileNotFoundError(
        f"kernel sources not found in {here / 'csrc'} or {here.parent / 'csrc'}"
    )


def _version_of(compiler: str) -> str:
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60,
                             env=_compiler_env())  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"cannot run {compiler} --version: {exc}") from exc
    lines = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
    return " | ".join(ln for ln in lines if "version" in ln.lower() or "release" in ln.lower())[
        :300
    ]


def _compiler_env() -> dict[str, str]:
    env = dict(os.environ)
    env["HIP_PLATFORM"] = "amd"  # hipcc otherwise switches to nvcc when it sees one
    return env


def find_toolchain(vendor: str) -> Toolchain:
    """hipcc for AMD targets, nvcc for NVIDIA ones: env override, PATH, then the usual prefixes."""
    if vendor == "amd":
        env_var, name = "HIPCC", "hipcc"
        prefixes = [os.environ.get("ROCM_PATH", ""), "/opt/rocm", "/usr"]
    else:
        env_var, name = "NVCC", "nvcc"
        prefixes = [
            os.environ.get("CUDA_HOME", ""),
            os.environ.get("CUDA_PATH", ""),
            "/usr/local/cuda",
        ]
    override = os.environ.get(env_var, "")
    if override and not (Path(override).is_file() and os.access(override, os.X_OK)):
        # an explicit choice that points nowhere must not silently become another compiler
        raise BuildError(
            f"{env_var}={override} is not an executable file; point it at {name} or unset it"
        )
    tried = []
    candidates = [override, shutil.which(name) or ""]
    candidates += [str(Path(p) / "bin" / name) for p in prefixes if p]
    for cand in candidates:
        if not cand:
            continue
        tried.append(cand)
        if Path(cand).is_file() and os.access(cand, os.X_OK):
            return Toolchain(vendor, cand, _version_of(cand))
    raise BuildError(
        f"no {name} found for {vendor.upper()} targets (tried ${env_var}, PATH, "
        f"{', '.join(tried) or 'nothing'}); install it or set {env_var}=/path/to/{name}"
    )


#: Headers clang's CUDA wrapper includes that CUDA 13 no longer ships (texture and curand
#: internals, which no kernel here uses): empty stand-ins let clang 21 take CUDA 13.
CLANG_CUDA_STUBS = ("texture_fetch_functions.h", "texture_indirect_functions.h",
                    "curand_mtgp32_kernel.h")  # fmt: skip


DEFAULT_CUDA = "/usr/local/cuda"


def find_clang_cuda(stubs: Path) -> Toolchain:
    """clang++ in CUDA mode for the WMMA emulation builds (nvcc drops the AMD vector types
    their fragments use): ``$CLANG_CUDA``, then clang++-21 / clang++ on PATH; the CUDA toolkit
    from ``$CUDA_HOME`` / ``$CUDA_PATH`` / /usr/local/cuda (it must hold bin/ptxas). The stand-in
    headers are written to ``stubs``."""
    override = os.environ.get("CLANG_CUDA", "")
    if override and not (Path(override).is_file() and os.access(override, os.X_OK)):
        raise BuildError(f"CLANG_CUDA={override} is not an executable file; point it at clang++")
    compiler = override or shutil.which("clang++-21") or shutil.which("clang++") or ""
    if not compiler:
        raise BuildError(
            "the gfx11 / gfx12 emulation builds need clang++ (21 or newer) with the NVPTX "
            "target; none found (set CLANG_CUDA=/path/to/clang++). The toolchain image has it: "
            "run the build there with the CUDA toolkit mounted"
        )
    roots = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), DEFAULT_CUDA]
    cuda = next((r for r in roots if r and (Path(r) / "bin" / "ptxas").is_file()), "")
    if not cuda:
        raise BuildError(
            f"no CUDA toolkit with bin/ptxas in {', '.join(r for r in roots if r)}; clang needs "
            "one for sm_90 (set CUDA_HOME)"
        )
    stubs.mkdir(parents=True, exist_ok=True)
    for name in CLANG_CUDA_STUBS:
        (stubs / name).write_text("/* empty: see mamba2_rocm.build.driver.CLANG_CUDA_STUBS */\n")
    return Toolchain("nvidia", compiler, _version_of(compiler), cuda, str(stubs))


def detect_native_archs() -> list[str]:
    """The GPU architectures of this machine, for ``--arch native``."""
    found: list[str] = []
    try:
        import torch

        if torch.cuda.is_available():
            from mamba2_rocm.runtime.device import device_arch

            found = [device_arch(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        pass
    probes = (
        ["amdgpu-arch"],
        ["rocm_agent_enumerator"],
        ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
    )
    for cmd in probes if not found else ():
        if shutil.which(cmd[0]) is None:
            continue
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        for line in out.split():
            if line.startswith("gfx") and line != "gfx000":
                found.append(line)
            elif cmd[0] == "nvidia-smi" and line.replace(".", "").isdigit():
                found.append("sm_" + line.replace(".", ""))
    if not found:
        raise BuildError(
            "--arch native: no GPU found (asked torch, amdgpu-arch, rocm_agent_enumerator, "
            "nvidia-smi); name the target instead, e.g. --arch gfx1030"
        )
    return sorted(set(found))


@dataclass
class CodeObject:
    source: KernelSource
    path: Path
    kernels: list[KernelInfo]
    code_object_version: int | None

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source.name,
            "file": self.path.name,
            "sha256": hashlib.sha256(self.path.read_bytes()).hexdigest(),
            "code_object_version": self.code_object_version,
            "kernels": [k.to_json() for k in sorted(self.kernels, key=lambda k: k.name)],
        }


@dataclass
class BuildResult:
    out_dir: Path
    targets: dict[str, Path] = field(default_factory=dict)  # target -> its kernel dir

    def manifest(self, target: str) -> dict[str, Any]:
        return json.loads((self.targets[target] / "manifest.json").read_text())


def _tail(text: str) -> str:
    return "\n".join(text.strip().splitlines()[-_TAIL_LINES:])


def _compile(
    tc: Toolchain, src: KernelSource, info: ArchInfo, target_dir: Path, include: Path,
    cov: int | None = None, extra_flags: Sequence[str] = (), wavefront: int | None = None,
) -> CodeObject:  # fmt: skip
    suffix = "hsaco" if tc.vendor == "amd" else "cubin"
    out = target_dir / f"{src.name}.{suffix}"
    cmd = tc.command(include / src.filename, out, info, include, cov, extra_flags, wavefront)
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=_compiler_env(), timeout=1800
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"{src.filename} for {info.name}: cannot run {cmd[0]}: {exc}") from exc
    if proc.returncode != 0:
        raise BuildError(
            f"{src.filename} for {info.name}: {Path(cmd[0]).name} exited {proc.returncode}\n"
            f"command: {' '.join(cmd)}\n--- compiler output (tail) ---\n{_tail(proc.stderr + proc.stdout)}"
        )
    data = out.read_bytes()
    try:
        if tc.vendor == "amd":
            target, kernels = amd_kernels(data)
            cov = amd_code_object_version(data)
        else:
            target, kernels = cuda_kernels(data, proc.stderr + proc.stdout)
            cov = None
    except CodeObjectError as exc:
        raise BuildError(f"{out}: {exc}") from exc
    if target != info.name:
        raise BuildError(f"{out}: code object target is {target!r}, expected {info.name!r}")
    return CodeObject(src, out, kernels, cov)


def verify_kernels(co: CodeObject, info: ArchInfo, allow_spills: bool = False) -> list[str]:
    """Every reason this code object must not ship; empty when it is fine. ``allow_spills``:
    an emulation build, whose spills on the NVIDIA GPU say nothing about an AMD target."""
    problems = []
    expected = ctypes.sizeof(co.source.params)
    by_name = {k.name: k for k in co.kernels}
    for name in co.source.kernels:
        k = by_name.get(name)
        where = f"{info.name} {co.source.name}: kernel {name}"
        if k is None:
            problems.append(f"{where} is missing from the code object")
            continue
        if k.arg_size != expected:
            problems.append(
                f"{where} takes {k.arg_size} argument bytes but {co.source.params.__name__} "
                f"is {expected} (csrc/params.h and mamba2_rocm/params.py disagree)"
            )
        if k.spills and not allow_spills:
            problems.append(f"{where} spills registers ({k.vgpr_spill} vgpr / {k.sgpr_spill} sgpr)")
        if k.lds_bytes > info.lds_limit_bytes:
            problems.append(
                f"{where} uses {k.lds_bytes} bytes of LDS, over the {info.lds_limit_bytes} limit"
            )
        if k.wavefront_size != info.wavefront_size:
            problems.append(
                f"{where} was built for wave{k.wavefront_size}, {info.name} runs wave{info.wavefront_size}"
            )
        if k.target != info.name:
            problems.append(f"{where} targets {k.target}, expected {info.name}")
    return problems


#: ``build --emulate``: AMD targets whose code paths an NVIDIA build can take, and the define
#: that selects them (csrc/mma.h). Such builds are for running those paths on the NVIDIA
#: machine; their manifests say ``emulates`` and no wheel takes them.
EMULATIONS = {
    "gfx1030": "-DM2R_EMULATE_GFX1030=1",  # the FMA path (M2R_MMA 0), built by nvcc
    "gfx11": "-DM2R_EMULATE_GFX11=1",  # RDNA3/3.5 WMMA layout (M2R_MMA 3), emulated: clang
    "gfx12": "-DM2R_EMULATE_GFX12=1",  # RDNA4 WMMA layout (M2R_MMA 4), emulated: clang
    # CDNA2/3/4 (gfx90a, gfx94x, gfx950): wave64 as two warps, MFMA (M2R_MMA 2) emulated: clang
    "gfx9": "-DM2R_EMULATE_GFX9=1",
}
#: Emulations whose sources need clang (csrc/mma_emu.h); their spills are recorded, not refused.
CLANG_EMULATIONS = frozenset({"gfx11", "gfx12", "gfx9"})
#: Emulations that compile for another wavefront than the GPU's (platform.h: wave64 emulated).
EMULATED_WAVEFRONT = {"gfx9": 64}


def _finish_target(info: ArchInfo, tc: Toolchain, objects: list[CodeObject], target_dir: Path,
                   extra_flags: Sequence[str], emulate: str | None = None) -> Path:  # fmt: skip
    """Verify one target's code objects; write its manifest only when all of them pass."""
    from mamba2_rocm import __version__

    problems = [p for co in objects
                for p in verify_kernels(co, info, allow_spills=emulate in CLANG_EMULATIONS)]  # fmt: skip
    if problems:
        raise BuildError(
            f"{len(problems)} verification failure(s) for {info.name}:\n  " + "\n  ".join(problems)
        )
    manifest = {
        "format": MANIFEST_FORMAT,
        "target": info.name,
        "vendor": info.vendor,
        "wavefront_size": info.wavefront_size,
        "mamba2_rocm_version": __version__,
        "compiler": tc.version,
        "compile_flags": list(extra_flags),
        "code_objects": [co.to_json() for co in objects],
    }
    if emulate is not None:
        manifest["emulates"] = emulate
    (target_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return target_dir


def build(
    archs: Iterable[str],
    out_dir: str | os.PathLike[str],
    sources: Iterable[str] | None = None,
    jobs: int | None = None,
    code_object_version: int | None = None,
    extra_flags: Sequence[str] = (),
    emulate: str | None = None,
) -> BuildResult:
    """Compile ``sources`` (default: all) for each arch into ``out_dir``; raise BuildError on failure.

    ``code_object_version`` (AMD) defaults to 6 for generic targets and 5 otherwise;
    ``extra_flags`` go to every compile (a recipe's ``compile_flags``). ``emulate`` (NVIDIA
    archs only, see :data:`EMULATIONS`) builds an AMD target's code paths for the NVIDIA GPU.
    """
    archs = list(archs)
    if "native" in archs:
        archs = [a for a in archs if a != "native"] + detect_native_archs()
    if not archs:
        raise BuildError("no target given: pass --arch gfx1030 (repeatable), or --arch native")
    infos = [arch_info(a) for a in archs]  # unknown names fail here, before any compile
    if emulate is not None:
        if emulate not in EMULATIONS:
            raise BuildError(f"--emulate {emulate!r}: known emulations are {sorted(EMULATIONS)}")
        amd = [i.name for i in infos if i.vendor != "nvidia"]
        if amd:
            raise BuildError(f"--emulate {emulate} builds for NVIDIA GPUs only, not {amd}")
        extra_flags = (*extra_flags, EMULATIONS[emulate])
    names = list(sources) if sources is not None else list(SOURCES)
    unknown = [n for n in names if n not in SOURCES]
    if unknown:
        raise BuildError(f"unknown source(s) {unknown}; known: {sorted(SOURCES)}")
    srcs = [SOURCES[n] for n in names]
    include = csrc_dir()
    args = (Path(out_dir), jobs, code_object_version, extra_flags, emulate)
    if emulate in CLANG_EMULATIONS:  # clang's stand-in headers live as long as the build
        with tempfile.TemporaryDirectory(prefix="m2r-clang-stubs-") as stubs:
            return _build_all(infos, srcs, include, {"nvidia": find_clang_cuda(Path(stubs))}, *args)
    toolchains = {v: find_toolchain(v) for v in {i.vendor for i in infos}}
    return _build_all(infos, srcs, include, toolchains, *args)


def _build_all(infos, srcs, include, toolchains, out, jobs, code_object_version, extra_flags,
               emulate) -> BuildResult:  # fmt: skip
    wavefront = EMULATED_WAVEFRONT.get(emulate or "")
    jobs = jobs or os.cpu_count() or 1
    for info in infos:
        (out / info.name).mkdir(parents=True, exist_ok=True)
        (out / info.name / "manifest.json").unlink(missing_ok=True)  # unverified until proven
    # One pool over every (target, source) pair: all cores stay busy across targets.
    pairs = [(info, src) for info in infos for src in srcs]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        objects = list(pool.map(
            lambda pair: _compile(toolchains[pair[0].vendor], pair[1], pair[0], out / pair[0].name,
                                  include, code_object_version, extra_flags, wavefront),
            pairs))  # fmt: skip
    result = BuildResult(out)
    for info in infos:
        mine = [co for (i, _), co in zip(pairs, objects, strict=True) if i is info]
        result.targets[info.name] = _finish_target(
            info, toolchains[info.vendor], mine, out / info.name, extra_flags, emulate
        )
    return result
