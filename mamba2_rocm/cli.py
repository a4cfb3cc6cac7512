"""``python -m mamba2_rocm <command>``: build | info | bench | doctor | env | selftest.

Each command lives in the module that owns its logic; this file only collects them. A module
contributes commands through ``register(subparsers)``, which adds its parsers and sets
``func`` on each to a callable taking the parsed namespace and returning an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

_COMMAND_MODULES = (
    "mamba2_rocm.build.cli",
    "mamba2_rocm.runtime.cli",
    "mamba2_rocm.bench.cli",
    "mamba2_rocm.env.cli",
    "mamba2_rocm.selftest",
)


def make_parser() -> argparse.ArgumentParser:
    from mamba2_rocm import __version__

    parser = argparse.ArgumentParser(
        prog="python -m mamba2_rocm", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--version", action="version", version=f"mamba2-rocm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # Skip a command module (or its package) that does not exist yet; a real missing
            # dependency inside the module is an error: say so.
            if exc.name is None or not (name == exc.name or name.startswith(exc.name + ".")):
                raise
            continue
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, RuntimeError, FileNotFoundError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
