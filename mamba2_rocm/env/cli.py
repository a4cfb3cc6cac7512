"""Commands: ``doctor [--json]`` and ``env {fingerprint,verify,protect-torch,compile-safety}``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _doctor(args: argparse.Namespace) -> int:
    from mamba2_rocm.env.audit import render_text, run_audit

    rep, code = run_audit()
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        sys.stdout.write(render_text(rep))
    return code


def _fingerprint(args: argparse.Namespace) -> int:
    from mamba2_rocm.env.protect import fingerprint

    fp = fingerprint(args.python)
    if args.out:
        Path(args.out).write_text(fp.to_json() + "\n")
        print(f"fingerprint of {fp.python}: {fp.summary()} -> {args.out}", file=sys.stderr)
    else:
        print(fp.to_json())
    return 0


def _verify(args: argparse.Namespace) -> int:
    from mamba2_rocm.env.protect import Fingerprint, TorchStackChanged, verify

    try:
        text = Path(args.file).read_text()
    except OSError as exc:
        raise FileNotFoundError(
            f"cannot read fingerprint {args.file!r} ({exc.strerror}); create it first with "
            f"`python -m mamba2_rocm env fingerprint --out {args.file}`"
        ) from exc
    before = Fingerprint.from_json(text)
    try:
        after = verify(before, args.python)
    except TorchStackChanged as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    print(f"torch stack unchanged in {after.python}: {after.summary()}", file=sys.stderr)
    return 0


def _protect(args: argparse.Namespace) -> int:
    from mamba2_rocm.env.protect import (
        NoTorchToProtect,
        TorchStackChanged,
        WouldOverwriteTorch,
        protected_install,
    )

    try:
        return protected_install(args.pip_args, args.python, allow_no_torch=args.allow_no_torch)
    except TorchStackChanged as exc:
        print(f"error: protect-torch: {exc}", file=sys.stderr)
        return 3
    except NoTorchToProtect as exc:
        print(f"protect-torch: {exc}", file=sys.stderr)
        return 4
    except WouldOverwriteTorch as exc:
        print(f"error: protect-torch: {exc}", file=sys.stderr)
        return 5


def _compile_safety(args: argparse.Namespace) -> int:
    from mamba2_rocm.env.compile_safety import shell_unset_lines

    for line in shell_unset_lines():
        print(line)
    return 0


def register(subparsers: Any) -> None:
    doctor = subparsers.add_parser(
        "doctor",
        help="audit the ROCm/torch environment",
        description="Audit the ROCm/torch environment; exit 1 when a finding is an error.",
    )
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.set_defaults(func=_doctor)

    env = subparsers.add_parser("env", help="torch protection and torch.compile safety")
    sub = env.add_subparsers(dest="env_command", metavar="ENV_COMMAND", required=True)
    py_help = "the interpreter whose torch stack to use (default: this one)"

    fp = sub.add_parser("fingerprint", help="record the installed torch stack")
    fp.add_argument("--python", help=py_help)
    fp.add_argument("--out", help="write the fingerprint JSON here (default: stdout)")
    fp.set_defaults(func=_fingerprint)

    ver = sub.add_parser(
        "verify", help="check the torch stack against a fingerprint (exit 3 if changed)"
    )
    ver.add_argument("file", help="a fingerprint written by `env fingerprint --out`")
    ver.add_argument("--python", help="the interpreter (default: the one fingerprinted)")
    ver.set_defaults(func=_verify)

    prot = sub.add_parser(
        "protect-torch",
        help="pip install with the torch stack pinned",
        description="Run `pip install ARGS` with the installed torch stack pinned by a "
        "constraints file; exit with pip's code, 3 if the stack changed anyway, 4 (pip not run) "
        "if there is no torch to protect, or 5 (pip not run) if a planned package would write "
        "into the stack's files.",
        usage="%(prog)s [--python PATH] [--allow-no-torch] -- PIP_INSTALL_ARGS...",
    )
    prot.add_argument("--python", help=py_help)
    prot.add_argument(
        "--allow-no-torch",
        action="store_true",
        help="run pip even when the interpreter has no torch (a torch pip installs is then "
        "reported as a change, exit 3)",
    )
    prot.add_argument("pip_args", nargs=argparse.REMAINDER, help="arguments of `pip install`")
    prot.set_defaults(func=_protect)

    cs = sub.add_parser(
        "compile-safety",
        help="print `unset` lines for a shell entry step (empty off ROCm)",
        description='Use as: eval "$(python -m mamba2_rocm env compile-safety)". In-process '
        "Inductor settings need mamba2_rocm.env.configure_torch_compile().",
    )
    cs.set_defaults(func=_compile_safety)
