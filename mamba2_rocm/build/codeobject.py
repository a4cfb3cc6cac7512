"""Reading kernel facts out of code objects: AMD offload bundles / HSA ELF, NVIDIA cubins.

AMD: the clang offload bundle is unpacked (its layout is a documented, fixed header), then the
HSA code object's ``NT_AMDGPU_METADATA`` note is decoded. That note is MessagePack, so we use
``msgpack``; ELF sections and notes are read with ``pyelftools`` rather than by hand.

NVIDIA: a cubin's ``.nv.info`` sections carry, per kernel, the parameter-bank size and the
register count; spills and shared memory come from ptxas' ``--resource-usage`` report, which
the driver captures when it compiles.
"""

from __future__ import annotations

import io
import re
import struct
from dataclasses import asdict, dataclass
from typing import Any

import msgpack
from elftools.elf.elffile import ELFFile

__all__ = [
    "CodeObjectError",
    "KernelInfo",
    "amd_kernels",
    "cuda_kernels",
    "parse_ptxas_resource_usage",
    "unbundle",
]

BUNDLE_MAGIC = b"__CLANG_OFFLOAD_BUNDLE__"
COMPRESSED_BUNDLE_MAGIC = b"CCOB"
NT_AMDGPU_METADATA = 32
ELFOSABI_AMDGPU_HSA = 64
# EI_ABIVERSION of an HSA code object -> code-object version (AMDGPUUsage, "ELF Code Object").
_AMD_ABI_TO_COV = {2: 4, 3: 5, 4: 6}

# .nv.info attribute records: (format, attribute) and the attributes we read.
_EIFMT_NVAL, _EIFMT_BVAL, _EIFMT_HVAL, _EIFMT_SVAL = 1, 2, 3, 4
_EIATTR_CBANK_PARAM_SIZE = 0x19
_EIATTR_REGCOUNT = 0x2F


class CodeObjectError(ValueError):
    """A code object that is not what it claims to be."""


@dataclass(frozen=True)
class KernelInfo:
    """Per-kernel resources as the code object states them."""

    name: str
    target: str
    arg_size: int  # explicit kernel arguments, bytes (hidden/implicit ones excluded)
    vgpr: int  # vector registers (AMD) / registers per thread (NVIDIA)
    sgpr: int  # scalar registers (AMD); 0 on NVIDIA
    agpr: int  # accumulation registers (CDNA); 0 elsewhere
    vgpr_spill: int  # AMD: VGPRs spilled; NVIDIA: spill-store bytes
    sgpr_spill: int  # AMD: SGPRs spilled; NVIDIA: spill-load bytes
    lds_bytes: int  # static LDS / shared memory per workgroup
    scratch_bytes: int  # private segment / local-memory stack frame per lane
    wavefront_size: int
    max_workgroup_size: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def spills(self) -> int:
        return self.vgpr_spill + self.sgpr_spill


def unbundle(data: bytes) -> dict[str, bytes]:
    """Split a clang offload bundle into ``{triple: code object}``; a bare ELF passes through."""
    if data[:4] == b"\x7fELF":
        return {"": data}
    if data[:4] == COMPRESSED_BUNDLE_MAGIC:
        raise CodeObjectError(
            "compressed offload bundles are not supported; build without --offload-compress"
        )
    if not data.startswith(BUNDLE_MAGIC):
        raise CodeObjectError("not an ELF code object or clang offload bundle (bad magic)")
    pos = len(BUNDLE_MAGIC) + 8
    if len(data) < pos:
        raise CodeObjectError("offload bundle truncated inside its header")
    (count,) = struct.unpack_from("<Q", data, len(BUNDLE_MAGIC))
    entries: dict[str, bytes] = {}
    for i in range(count):
        if pos + 24 > len(data):
            raise CodeObjectError(f"offload bundle truncated in entry {i} of {count}")
        offset, size, triple_len = struct.unpack_from("<QQQ", data, pos)
        if pos + 24 + triple_len > len(data):
            raise CodeObjectError(f"offload bundle truncated in the triple of entry {i} of {count}")
        triple = data[pos + 24 : pos + 24 + triple_len].decode()
        pos += 24 + triple_len
        if offset + size > len(data):
            raise CodeObjectError(f"offload bundle entry {triple!r} runs past the end of the file")
        if size:
            entries[triple] = data[offset : offset + size]
    return entries


def _amd_elf(data: bytes) -> bytes:
    devices = {t: d for t, d in unbundle(data).items() if "amdgcn" in t or t == ""}
    if len(devices) != 1:
        raise CodeObjectError(
            f"expected one AMDGPU code object in the bundle, found {sorted(devices)}"
        )
    return next(iter(devices.values()))


def _amd_metadata(elf: ELFFile) -> dict[str, Any]:
    for section in elf.iter_sections():
        if section["sh_type"] != "SHT_NOTE":
            continue
        for note in section.iter_notes():
            if note["n_name"] == "AMDGPU" and note["n_type"] == NT_AMDGPU_METADATA:
                desc = note["n_desc"]
                raw = desc if isinstance(desc, bytes) else bytes.fromhex(desc)
                return msgpack.unpackb(raw, raw=False, strict_map_key=False)
    raise CodeObjectError("no NT_AMDGPU_METADATA note: not an HSA code object")


def amd_code_object_version(data: bytes) -> int:
    elf = ELFFile(io.BytesIO(_amd_elf(data)))
    abi = elf.header["e_ident"]["EI_ABIVERSION"]
    return _AMD_ABI_TO_COV.get(abi, -1)


def _amd_target(meta: dict[str, Any]) -> str:
    # "amdgcn-amd-amdhsa--gfx1030" or with features "...--gfx90a:xnack-"
    return meta.get("amdhsa.target", "").rsplit("--", 1)[-1].split(":")[0]


def _amd_elf_file(data: bytes) -> ELFFile:
    elf = ELFFile(io.BytesIO(_amd_elf(data)))
    if elf.header["e_machine"] != "EM_AMDGPU":
        raise CodeObjectError(f"not an AMDGPU ELF (e_machine {elf.header['e_machine']})")
    return elf


def amd_kernels(data: bytes) -> tuple[str, list[KernelInfo]]:
    """``(target, kernels)`` of an AMD code object or single-target offload bundle."""
    elf = _amd_elf_file(data)
    meta = _amd_metadata(elf)
    target = _amd_target(meta)
    kernels = []
    for k in meta.get("amdhsa.kernels", []):
        explicit = [a for a in k.get(".args", []) if not a[".value_kind"].startswith("hidden_")]
        arg_size = max((a[".offset"] + a[".size"] for a in explicit), default=0)
        kernels.append(
            KernelInfo(
                name=k[".name"],
                target=target,
                arg_size=arg_size,
                vgpr=k.get(".vgpr_count", 0),
                sgpr=k.get(".sgpr_count", 0),
                agpr=k.get(".agpr_count", 0),
                vgpr_spill=k.get(".vgpr_spill_count", 0),
                sgpr_spill=k.get(".sgpr_spill_count", 0),
                lds_bytes=k.get(".group_segment_fixed_size", 0),
                scratch_bytes=k.get(".private_segment_fixed_size", 0),
                wavefront_size=k.get(".wavefront_size", 0),
                max_workgroup_size=k.get(".max_flat_workgroup_size", 0),
            )
        )
    return target, kernels


def code_object_arch(data: bytes) -> str:
    """The ISA a code object was built for, read from the code object itself: an AMDGPU ELF's
    (or single-target offload bundle's) ``amdhsa.target``, a cubin's ``sm_XX``. Raises
    CodeObjectError for anything else."""
    if data[:4] == b"\x7fELF":
        try:
            machine = ELFFile(io.BytesIO(data)).header["e_machine"]
        except Exception as exc:  # pyelftools raises several types for a malformed header
            raise CodeObjectError(f"malformed ELF: {exc}") from None
        if machine == "EM_CUDA":
            return _cuda_target(ELFFile(io.BytesIO(data)))
    try:  # the target only: no kernel descriptors are read
        return _amd_target(_amd_metadata(_amd_elf_file(data)))
    except CodeObjectError:
        raise
    except Exception as exc:
        raise CodeObjectError(f"not a code object: {type(exc).__name__}: {exc}") from None


def _nv_info_records(blob: bytes):
    pos = 0
    while pos + 4 <= len(blob):
        fmt, attr = blob[pos], blob[pos + 1]
        if fmt == _EIFMT_SVAL:
            (size,) = struct.unpack_from("<H", blob, pos + 2)
            yield attr, blob[pos + 4 : pos + 4 + size]
            pos += 4 + size
        elif fmt in (_EIFMT_NVAL, _EIFMT_BVAL, _EIFMT_HVAL):
            yield attr, blob[pos + 2 : pos + 4]
            pos += 4
        else:
            raise CodeObjectError(f"unknown .nv.info record format {fmt} at offset {pos}")


_PTXAS_FUNC = re.compile(r"Function properties for (\S+)")
_PTXAS_STACK = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_PTXAS_ENTRY = re.compile(r"Compiling entry function '(\S+)'")
_PTXAS_USED = re.compile(r"Used (\d+) registers(?:.*?, (\d+) bytes smem)?")


def parse_ptxas_resource_usage(text: str) -> dict[str, dict[str, int]]:
    """Per-kernel ``{registers, smem, stack, spill_stores, spill_loads}`` from ptxas' report."""
    usage: dict[str, dict[str, int]] = {}
    current = None
    for line in text.splitlines():
        if (m := _PTXAS_ENTRY.search(line)) or (m := _PTXAS_FUNC.search(line)):
            current = usage.setdefault(m.group(1), {})
        elif current is not None and (m := _PTXAS_STACK.search(line)):
            current.update(
                stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3))
            )
        elif current is not None and (m := _PTXAS_USED.search(line)):
            current.update(registers=int(m.group(1)), smem=int(m.group(2) or 0))
    return usage


def _cuda_target(elf: ELFFile) -> str:
    target = f"sm_{(elf.header['e_flags'] >> 8) & 0xFF}"
    # e_flags is the same for sm_90 and sm_90a (sm_100f, ...); the ptxas command line recorded
    # in the toolkit-info note carries the suffix.
    tkinfo = elf.get_section_by_name(".note.nv.tkinfo")
    if tkinfo is not None:
        m = re.search(rb"-arch (" + target.encode() + rb"[af]?)\b", tkinfo.data())
        target = m.group(1).decode() if m else target
    return target


def cuda_kernels(data: bytes, ptxas_report: str = "") -> tuple[str, list[KernelInfo]]:
    """``(target, kernels)`` of a cubin; resources not in the cubin come from ``ptxas_report``."""
    elf = ELFFile(io.BytesIO(data))
    if elf.header["e_machine"] != "EM_CUDA":
        raise CodeObjectError(f"not a cubin (e_machine {elf.header['e_machine']})")
    target = _cuda_target(elf)
    symtab = elf.get_section_by_name(".symtab")
    regs: dict[str, int] = {}
    glob = elf.get_section_by_name(".nv.info")
    if glob is not None:
        for attr, val in _nv_info_records(glob.data()):
            if attr == _EIATTR_REGCOUNT:
                sym, count = struct.unpack("<II", val[:8])
                regs[symtab.get_symbol(sym).name] = count
    report = parse_ptxas_resource_usage(ptxas_report)
    kernels = []
    for section in elf.iter_sections():
        if not section.name.startswith(".nv.info."):
            continue
        name = section.name[len(".nv.info.") :]
        arg_size = None
        for attr, val in _nv_info_records(section.data()):
            if attr == _EIATTR_CBANK_PARAM_SIZE:
                (arg_size,) = struct.unpack("<H", val)
        if arg_size is None:
            continue  # not a kernel entry
        r = report.get(name, {})
        kernels.append(
            KernelInfo(
                name=name,
                target=target,
                arg_size=arg_size,
                vgpr=regs.get(name, r.get("registers", 0)),
                sgpr=0,
                agpr=0,
                vgpr_spill=r.get("spill_stores", 0),
                sgpr_spill=r.get("spill_loads", 0),
                lds_bytes=r.get("smem", 0),
                scratch_bytes=r.get("stack", 0),
                wavefront_size=32,
                max_workgroup_size=0,
            )
        )
    return target, kernels
