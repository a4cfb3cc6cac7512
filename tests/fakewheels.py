"""Wheels for the loopback indexes of the tests: minimal hand-made ones (stand-in torch and
friends) and repacked installed distributions, so an index can serve the host package's
dependencies without reaching PyPI."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import re
import zipfile
from pathlib import Path


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def _entry(name: str) -> zipfile.ZipInfo:
    """A fixed timestamp: the same contents give the same wheel bytes (tests compare sha256s)."""
    return zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))


def build_wheel(
    outdir: Path,
    name: str,
    version: str,
    files: dict[str, str | bytes],
    requires: tuple[str, ...] = (),
) -> Path:
    """Write a minimal valid pure-Python wheel (METADATA, WHEEL, RECORD) and return its path."""
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    contents = dict(files)
    contents[f"{info}/METADATA"] = "".join(
        [
            "Metadata-Version: 2.1\n",
            f"Name: {name}\n",
            f"Version: {version}\n",
            *(f"Requires-Dist: {r}\n" for r in requires),
        ]
    )
    contents[f"{info}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: mamba2-rocm-tests\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n"
    )
    outdir.mkdir(parents=True, exist_ok=True)
    path = outdir / f"{dist}-{version}-py3-none-any.whl"
    record = []
    with zipfile.ZipFile(path, "w") as zf:
        for arc, text in contents.items():
            data = text if isinstance(text, bytes) else text.encode()
            zf.writestr(_entry(arc), data)
            record.append(_record_line(arc, data))
        record.append(f"{info}/RECORD,,")
        zf.writestr(_entry(f"{info}/RECORD"), "\n".join(record) + "\n")
    return path


def build_torch_wheel(outdir: Path, version: str, hip=None, cuda=None, extra: str = "") -> Path:
    """A stand-in ``torch`` distribution: ``__version__`` and a ``torch.version`` module."""
    version_py = (
        "from typing import Optional\n\n"
        f"__version__ = {version!r}\n"
        f"hip: Optional[str] = {hip!r}\n"
        f"cuda: Optional[str] = {cuda!r}\n"
        f"git_version = 'standin'\n{extra}"
    )
    return build_wheel(
        outdir,
        "torch",
        version,
        {
            "torch/__init__.py": f"from torch import version\n__version__ = {version!r}\n",
            "torch/version.py": version_py,
        },
    )


_SKIP = {"INSTALLER", "REQUESTED", "RECORD", "direct_url.json"}


def wheel_from_installed(name: str, out: Path) -> Path:
    """Repack the installed distribution ``name`` (as pip installed it from a wheel) into
    ``out``; the tags come from its own WHEEL file."""
    dist = md.distribution(name)
    tags = [line.split(":", 1)[1].strip() for line in (dist.read_text("WHEEL") or "").splitlines()
            if line.startswith("Tag:")]  # fmt: skip
    if not tags:
        raise RuntimeError(f"{name}: installed without a WHEEL file; cannot repack it")
    py, abi, plat = (sorted({t.split("-")[i] for t in tags}) for i in range(3))
    dname = dist.metadata["Name"].replace("-", "_").replace(".", "_").lower()
    path = out / f"{dname}-{dist.version}-{'.'.join(py)}-{'.'.join(abi)}-{'.'.join(plat)}.whl"
    out.mkdir(parents=True, exist_ok=True)
    record, info_dir = [], None
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for f in dist.files or []:
            arc = f.as_posix()
            if arc.startswith("..") or "__pycache__" in f.parts or arc.endswith(".pyc"):
                continue
            if f.parts[0].endswith(".dist-info"):
                info_dir = f.parts[0]
                if f.name in _SKIP:
                    continue
            data = f.locate().read_bytes()
            zf.writestr(arc, data)
            record.append(_record_line(arc, data))
        if info_dir is None:
            raise RuntimeError(f"{name}: no .dist-info among its files")
        record.append(f"{info_dir}/RECORD,,")
        zf.writestr(f"{info_dir}/RECORD", "\n".join(record) + "\n")
    return path


def stand_in_code_object(source: str, target: str) -> bytes:
    """Bytes that stand for a code object of ``target`` (see :func:`stand_in_arch`)."""
    return f"code object {source} for {target}".encode()


def stand_in_arch(real):
    """A replacement for ``code_object_arch`` that reads stand-ins' ISA and hands anything else
    (real code objects) to ``real``."""

    def arch(data: bytes) -> str:
        m = re.fullmatch(rb"code object \w+ for ([\w-]+)", data)
        return m.group(1).decode() if m else real(data)

    return arch
