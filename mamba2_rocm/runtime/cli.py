"""``python -m mamba2_rocm info [--json]``: which kernels are installed, and for which device."""

from __future__ import annotations

import argparse
import json
from typing import Any


def collect() -> dict[str, Any]:
    """Kernel dirs (packages, env path, JIT cache) and, when torch sees GPUs, who serves each."""
    from mamba2_rocm import __version__
    from mamba2_rocm.runtime.discovery import find_kernel_dir, kernel_dirs, pip_install_hint

    dirs = kernel_dirs()
    info: dict[str, Any] = {
        "schema_version": 1,
        "mamba2_rocm_version": __version__,
        "kernel_dirs": [
            {
                "target": d.target,
                "origin": d.origin,
                "path": str(d.path),
                "built_by": d.manifest.get("mamba2_rocm_version"),
                "kernels": d.kernels,
            }
            for d in dirs
        ],
        "devices": [],
    }
    try:
        import torch
    except ImportError:
        info["torch"] = None
        return info
    info["torch"] = torch.__version__
    if torch.cuda.is_available():
        from mamba2_rocm.runtime.device import device_arch_full

        for i in range(torch.cuda.device_count()):
            arch = device_arch_full(i)
            kdir = find_kernel_dir(arch, dirs)
            info["devices"].append(
                {
                    "index": i,
                    "name": torch.cuda.get_device_name(i),
                    "arch": arch,
                    "served_by": None
                    if kdir is None
                    else {"target": kdir.target, "origin": kdir.origin},
                    "install_hint": None if kdir is not None else pip_install_hint(arch),
                }
            )
    return info


def _run(args: argparse.Namespace) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
        return 0
    print(f"mamba2-rocm {info['mamba2_rocm_version']}  (torch: {info['torch'] or 'not installed'})")
    if not info["kernel_dirs"]:
        print(
            'kernel dirs: none (install a kernel package, e.g. pip install "mamba2-rocm[gfx1030]")'
        )
    for d in info["kernel_dirs"]:
        print(f"  {d['target']:16} {len(d['kernels']):3} kernels  {d['origin']}  {d['path']}")
    for dev in info["devices"]:
        served = dev["served_by"]
        how = (
            f"{served['target']} ({served['origin']})"
            if served
            else f"torch fallback; {dev['install_hint']}"
        )
        print(f"device {dev['index']}: {dev['name']} [{dev['arch']}] -> {how}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "info", help="list installed kernel code objects and which device they serve"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output (stable keys)")
    p.set_defaults(func=_run)
