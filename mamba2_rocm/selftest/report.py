"""The selftest report: what a user sends back, and how the project validates it.

A report names the device (name, ``gcnArchName``), the runtime (HIP / CUDA version, driver),
torch, mamba2-rocm and the kernel package with its code objects' sha256s, each check's result
and the timings. It holds no host name, user name or path (:func:`privacy_problems` checks the
text). :func:`report_problems` is what ``python -m mamba2_rocm.pipeline truth --reports DIR``
applies before a report counts for a target: it is this format, it passed every check, its
device arch is one the target's recipe builds for, and its kernels are byte for byte a build's
(every sha256 equals the target's build manifest). Reports never gate a publish: a gate is a
runner's GPU test of the exact wheels (``gpu-gate.json``).
"""

from __future__ import annotations

import getpass
import os
import re
import socket
from pathlib import Path
from typing import Any

__all__ = ["REPORT_FORMAT", "privacy_problems", "report_problems", "report_summary"]

REPORT_FORMAT = 1
_SHA256 = re.compile(r"[0-9a-f]{64}")


def report_problems(report: Any, archs: tuple[str, ...] | list[str], target: str,
                    manifest: dict | None) -> list[str]:  # fmt: skip
    """Why ``report`` cannot count for ``target`` (empty: it counts). ``manifest`` is the
    target's build manifest (``build-manifest.json``), whose code-object sha256s the report's
    kernels must equal."""
    if not isinstance(report, dict):
        return ["not a JSON object"]
    problems = []
    if report.get("format") != REPORT_FORMAT:
        problems.append(f"format {report.get('format')!r}, expected {REPORT_FORMAT}")
        return problems
    device = report.get("device") or {}
    arch = str(device.get("arch", ""))
    if arch not in archs:
        problems.append(f"its GPU is {arch or 'unknown'}, not one of {target}'s archs "
                        f"({', '.join(archs)})")  # fmt: skip
    checks = report.get("checks")
    if not isinstance(checks, list) or not checks:
        problems.append("it holds no checks")
    else:
        failed = [
            c.get("name") for c in checks if not (isinstance(c, dict) and c.get("ok") is True)
        ]
        if failed:
            problems.append(f"{len(failed)} check(s) failed: {', '.join(map(str, failed[:5]))}")
    if report.get("tier") != "kernel":
        problems.append(f"it ran the {report.get('tier')!r} tier, not the kernels")
    kernels = report.get("kernels") or {}
    objects = kernels.get("code_objects")
    if not isinstance(objects, dict) or not objects:
        problems.append("it names no code objects")
    elif manifest is None:
        problems.append(f"no build manifest of {target} to compare its kernels with")
    else:
        built, released_commit = kernels.get("source_commit"), manifest.get("source_commit")
        if built and released_commit and built != released_commit:
            problems.append(f"its kernels were built from {str(built)[:12]}, the build manifest "
                            f"says {str(released_commit)[:12]}")  # fmt: skip
        released = manifest.get("code_objects") or {}
        for file, digest in sorted(objects.items()):
            key = f"{kernels.get('target')}/{file}"
            if not (isinstance(digest, str) and _SHA256.fullmatch(digest)):
                problems.append(f"{file}: {digest!r} is not a sha256")
            elif released.get(key) != digest:
                problems.append(f"{key}: sha256 {digest[:12]} is not the build's "
                                f"({str(released.get(key))[:12]})")  # fmt: skip
                break
    return problems


def report_summary(report: dict) -> str:
    device = report.get("device") or {}
    checks = report.get("checks") or []
    passed = sum(1 for c in checks if c.get("ok") is True)
    commit = (report.get("kernels") or {}).get("source_commit")
    return (f"{passed} checks passed on {device.get('name')} ({device.get('arch')}, "
            f"{device.get('runtime')}), {report.get('date')}, mamba2-rocm "
            f"{report.get('mamba2_rocm')}" + (f", kernels of {commit[:12]}" if commit else ""))  # fmt: skip


def privacy_problems(text: str) -> list[str]:
    """What of this machine's identity ``text`` contains (a report must hold none)."""
    found = []
    for what, value in (("host name", socket.gethostname()), ("user name", _user()),
                        ("home folder", str(Path.home())), ("working folder", os.getcwd())):  # fmt: skip
        if value and len(value) > 2 and value not in ("/", "root") and value in text:
            found.append(what)
    return found


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:
        return ""
