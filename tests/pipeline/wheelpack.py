"""Wheels of installed distributions, so a loopback index can serve the host package's
dependencies without the network (the test index must not reach PyPI)."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import zipfile
from pathlib import Path

_SKIP = {"INSTALLER", "REQUESTED", "RECORD", "direct_url.json"}


def _record(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


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
            record.append(_record(arc, data))
        if info_dir is None:
            raise RuntimeError(f"{name}: no .dist-info among its files")
        record.append(f"{info_dir}/RECORD,,")
        zf.writestr(f"{info_dir}/RECORD", "\n".join(record) + "\n")
    return path
