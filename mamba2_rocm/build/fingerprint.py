"""Per-kernel fingerprints of built code objects, to show that a change of the sources' layout
(a kernel moved to another file, shared code moved to a header) left every kernel's machine
code as it was.

A kernel's fingerprint is the sha256 of its machine code and the descriptors the runtime reads
with it, independent of where in its code object it lies:

- CUDA cubin: the bytes of the kernel's ``.text.<name>`` section, its ``.nv.info.<name>``
  records (parameter layout, barriers, ...) with the one field that depends on the file
  (``EIATTR_PARAM_CBANK``'s section index) zeroed, and ``.nv.shared.<name>``'s size (static
  LDS).
- AMD code object: the bytes of the kernel's function symbol in ``.text`` (branches are
  PC-relative: the same code at any offset) and its 64-byte kernel descriptor ``<name>.kd``
  without the one field that depends on placement (``kernel_code_entry_byte_offset``, bytes
  16-23).

``python -m mamba2_rocm.build.fingerprint BEFORE AFTER`` compares two build folders (``build
--out`` folders, one subfolder per target): every kernel of BEFORE must be in AFTER with the
same fingerprint. pyelftools reads the ELF files (already the build's reader).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import sys
from pathlib import Path

from elftools.elf.elffile import ELFFile

from mamba2_rocm.build.codeobject import _amd_elf, _nv_info_records

__all__ = ["compare", "folder_fingerprints", "kernel_fingerprints"]

_KD_ENTRY_OFFSET = slice(16, 24)
_EIATTR_PARAM_CBANK = 0x0A  # payload: the constant bank's section index (4 bytes), offset, size


def _nv_info(blob: bytes) -> bytes:
    out = bytearray()
    for attr, payload in _nv_info_records(blob):
        if attr == _EIATTR_PARAM_CBANK:
            payload = bytes(4) + payload[4:]
        out += bytes([attr]) + len(payload).to_bytes(2, "little") + payload
    return bytes(out)


def _cuda(elf: ELFFile) -> dict[str, str]:
    sections = {s.name: s for s in elf.iter_sections()}
    out = {}
    for name, sec in sections.items():
        if not name.startswith(".text."):
            continue
        kernel = name[len(".text.") :]
        h = hashlib.sha256(sec.data())
        info = sections.get(f".nv.info.{kernel}")
        h.update(_nv_info(info.data()) if info is not None else b"")
        shared = sections.get(f".nv.shared.{kernel}")
        h.update(str(shared["sh_size"] if shared is not None else 0).encode())
        out[kernel] = h.hexdigest()
    return out


def _amd(elf: ELFFile) -> dict[str, str]:
    symtab = elf.get_section_by_name(".symtab")
    if symtab is None:
        raise ValueError("AMD code object without a symbol table")
    by_index = {i: s for i, s in enumerate(elf.iter_sections())}

    def read(sym) -> bytes:
        sec = by_index[sym["st_shndx"]]
        start = sym["st_value"] - sec["sh_addr"]
        return sec.data()[start : start + sym["st_size"]]

    syms = {s.name: s for s in symtab.iter_symbols() if isinstance(s["st_shndx"], int)}
    out = {}
    for name, sym in syms.items():
        if sym["st_info"]["type"] != "STT_FUNC" or f"{name}.kd" not in syms:
            continue
        kd = bytearray(read(syms[f"{name}.kd"]))
        kd[_KD_ENTRY_OFFSET] = bytes(8)
        out[name] = hashlib.sha256(read(sym) + bytes(kd)).hexdigest()
    return out


def kernel_fingerprints(data: bytes) -> dict[str, str]:
    """``{kernel: sha256}`` of one code object (a cubin, an AMD ELF or a single-target bundle)."""
    if data[:4] == b"\x7fELF":
        elf = ELFFile(io.BytesIO(data))
        return _amd(elf) if elf.header["e_machine"] == "EM_AMDGPU" else _cuda(elf)
    return _amd(ELFFile(io.BytesIO(_amd_elf(data))))


def folder_fingerprints(folder: Path) -> dict[tuple[str, str], str]:
    """``{(target, kernel): sha256}`` over a build folder's targets and code objects."""
    out = {}
    for target in sorted(p for p in Path(folder).iterdir() if p.is_dir()):
        for co in sorted(target.iterdir()):
            if co.suffix in (".hsaco", ".cubin", ".co"):
                for kernel, digest in kernel_fingerprints(co.read_bytes()).items():
                    out[(target.name, kernel)] = digest
    return out


def _problems(a: dict, b: dict, before: Path) -> list[str]:
    """Kernels of fingerprints ``a`` missing from or differing in ``b``, then ``b``'s new ones."""
    problems = [f"{t} {k}: {'missing' if (t, k) not in b else 'machine code differs'}"
                for (t, k), d in sorted(a.items()) if b.get((t, k)) != d]  # fmt: skip
    return problems + [f"{t} {k}: new (not in {before})" for (t, k) in sorted(set(b) - set(a))]


def compare(before: Path, after: Path) -> tuple[int, list[str]]:
    """``(kernels compared, problems)``: every kernel of ``before`` must be in ``after`` with
    the same fingerprint."""
    a = folder_fingerprints(before)
    return len(a), _problems(a, folder_fingerprints(after), before)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mamba2_rocm.build.fingerprint",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    a, b = folder_fingerprints(args.before), folder_fingerprints(args.after)  # (each read once)
    problems = _problems(a, b, args.before)
    for p in problems:
        print(p)
    n, new = len(a), len(set(b) - set(a))
    targets = len({t for t, _ in a})
    print(f"{n} kernels over {targets} targets: {n - len(problems) + new} identical, "
          f"{len(problems) - new} differing or missing, {new} new")  # fmt: skip
    return 1 if problems or n == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
