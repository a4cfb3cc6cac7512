"""GPU architecture facts shared by the build driver, the runtime and the environment guard.

One table answers, for every ISA we know: its wavefront width (a compile-time constant of
every kernel), its generic family (the code object that can stand in for it), and how much
LDS/shared memory one workgroup may use. Torch-free, so the build image can import it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "EMULATION_PATHS",
    "GENERIC_FAMILIES",
    "MMA_PATHS",
    "ArchInfo",
    "arch_info",
    "expected_mma_path",
    "generic_family",
    "is_amd_arch",
    "is_cuda_arch",
    "split_arch_name",
]

#: LLVM's generic targets and the ISAs each one runs on (AMDGPUUsage, "Generic processors").
#: A generic code object needs code-object v6 and a ROCm runtime that loads v6 (ROCm >= 6.4).
GENERIC_FAMILIES: dict[str, tuple[str, ...]] = {
    "gfx9-generic": ("gfx900", "gfx902", "gfx904", "gfx906", "gfx909", "gfx90c"),
    "gfx9-4-generic": ("gfx940", "gfx941", "gfx942", "gfx950"),
    "gfx10-1-generic": ("gfx1010", "gfx1011", "gfx1012", "gfx1013"),
    "gfx10-3-generic": (
        "gfx1030",
        "gfx1031",
        "gfx1032",
        "gfx1033",
        "gfx1034",
        "gfx1035",
        "gfx1036",
    ),
    "gfx11-generic": (
        "gfx1100",
        "gfx1101",
        "gfx1102",
        "gfx1103",
        "gfx1150",
        "gfx1151",
        "gfx1152",
        "gfx1153",
    ),
    "gfx12-generic": ("gfx1200", "gfx1201"),
}

_FAMILY_OF = {isa: fam for fam, isas in GENERIC_FAMILIES.items() for isa in isas}
_AMD_RE = re.compile(r"^gfx(?:[0-9]{1,2}[0-9a-f]{2}|[0-9]+(?:-[0-9]+)?-generic)$")
_CUDA_RE = re.compile(r"^sm_([0-9]{2,3})[af]?$")

#: Every AMD ISA this project can name, beyond those in a generic family.
_EXTRA_AMD = ("gfx908", "gfx90a")


@dataclass(frozen=True)
class ArchInfo:
    """What the build and the loader need to know about one target."""

    name: str
    vendor: str  # "amd" or "nvidia"
    wavefront_size: int
    lds_limit_bytes: int
    generic: str | None  # the generic family that can run this ISA's code, if any

    @property
    def is_generic(self) -> bool:
        return self.name.endswith("-generic")


def split_arch_name(name: str) -> tuple[str, dict[str, bool]]:
    """Split ``gfx90a:sramecc+:xnack-`` into ``("gfx90a", {"sramecc": True, "xnack": False})``.

    Feature suffixes are reported but never part of the ISA we select code objects by: our code
    objects are built feature-agnostic ("any"), which loads under either setting.
    """
    base, *feats = name.strip().split(":")
    features: dict[str, bool] = {}
    for feat in feats:
        if not feat:
            continue
        if feat[-1] not in "+-":
            raise ValueError(
                f"malformed target feature {feat!r} in {name!r} (expected e.g. xnack-)"
            )
        features[feat[:-1]] = feat[-1] == "+"
    return base, features


def is_amd_arch(name: str) -> bool:
    return bool(_AMD_RE.match(split_arch_name(name)[0]))


def is_cuda_arch(name: str) -> bool:
    return bool(_CUDA_RE.match(name))


def generic_family(arch: str) -> str | None:
    """The generic target whose code objects run on ``arch`` (gfx1031 -> gfx10-3-generic)."""
    base = split_arch_name(arch)[0]
    if base in GENERIC_FAMILIES:
        return None
    return _FAMILY_OF.get(base)


def _wavefront(base: str) -> int:
    if base.startswith("sm_"):
        return 32
    # gfx9 (GCN/CDNA, gfx9xx and gfx9-*-generic) runs wave64; gfx10 and later default to wave32.
    suffix = base[3:]
    # gfx<major><minor><stepping>: the last two characters are minor and stepping (gfx90a).
    major = suffix.split("-")[0] if base.endswith("-generic") else suffix[:-2]
    return 64 if major == "9" else 32


def arch_info(arch: str) -> ArchInfo:
    """Facts about ``arch``; raises ValueError naming the value for anything we cannot build."""
    base = split_arch_name(arch)[0]
    if is_cuda_arch(base):
        # 48 KiB static shared memory per block without an opt-in; we stay under 64 KiB anyway.
        return ArchInfo(base, "nvidia", 32, 48 * 1024, None)
    known = base in _FAMILY_OF or base in GENERIC_FAMILIES or base in _EXTRA_AMD
    if not known:
        raise ValueError(
            f"unknown GPU architecture {arch!r}: expected a gfx ISA such as gfx1030, gfx90a, "
            f"a generic target such as gfx11-generic, or a CUDA target such as sm_90"
        )
    return ArchInfo(base, "amd", _wavefront(base), 64 * 1024, generic_family(base))


#: ``M2R_MMA`` values (csrc/mma.h) -> what they are.
MMA_PATHS = {
    0: "no matrix cores: the fp32 FMA path (gfx10.3)",
    1: "NVIDIA mma.sync m16n8k16",
    2: "AMD MFMA 16x16x16, wave64 (CDNA2/3/4)",
    3: "AMD WMMA 16x16x16, wave32, gfx11 layout (RDNA3/3.5)",
    4: "AMD WMMA 16x16x16, wave32, gfx12 layout (RDNA4)",
}
#: ``build --emulate`` variant -> the path its build takes (csrc/mma.h's M2R_EMULATE_*).
EMULATION_PATHS = {"gfx1030": 0, "gfx11": 3, "gfx12": 4, "gfx9": 2}
_MFMA_TARGETS = frozenset({"gfx90a", "gfx942", "gfx950", "gfx9-4-generic"})


def expected_mma_path(target: str, emulates: str | None = None) -> int:
    """The ``M2R_MMA`` path csrc/mma.h selects for a kernel dir's target (or emulation)."""
    if emulates:
        return EMULATION_PATHS[emulates]
    if target.startswith("sm_"):
        return 1 if int(re.sub(r"\D", "", target)) >= 80 else 0
    if target in _MFMA_TARGETS:
        return 2
    if target.startswith("gfx11"):
        return 3
    if target.startswith("gfx12"):
        return 4
    return 0
