"""Keep pip from replacing the installed torch stack.

A ROCm torch (``torch==2.5.1+rocm6.2``) is installed from PyTorch's own index; any later
``pip install`` of a package that requires another torch version quietly swaps it for a CUDA
build from PyPI. :func:`protected_install` prevents that: it fingerprints the stack (torch and,
where present, torchvision, torchaudio and the triton variants: versions, RECORDs, and every
file under their directories as it is on disk), resolves the request first
(``pip install --dry-run --report``) under a constraints file pinning exactly those versions,
fetches every planned wheel and refuses (:class:`WouldOverwriteTorch`, nothing installed) if
one would reinstall a protected distribution or write into its directories (a wheel shipping
``torch/__init__.py``; PyPI's ``triton`` over ``pytorch-triton-rocm``), then runs the install
and verifies the fingerprint afterwards, raising :class:`TorchStackChanged` (naming each
change, file by file, and how to restore it) if anything changed anyway. :func:`fingerprint` and :func:`verify` are the same steps for use around any install
step, e.g. in a Dockerfile::

    python -m mamba2_rocm env fingerprint --out /tmp/torch.json
    ... any install step ...
    python -m mamba2_rocm env verify /tmp/torch.json

The fingerprint is taken inside the interpreter pip installs into (``python=``, default
``sys.executable``), by a small script run there, without importing torch.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "STACK",
    "Fingerprint",
    "TorchStackChanged",
    "WouldOverwriteTorch",
    "constraints",
    "diff",
    "fingerprint",
    "protected_install",
    "restore_hint",
    "verify",
]

FINGERPRINT_SCHEMA = 2  # 2: the files on disk (size, mtime) per distribution

#: The distributions that make up "the torch stack" (the triton variants ROCm and CUDA use).
STACK = (
    "torch",
    "torchvision",
    "torchaudio",
    "triton",
    "pytorch-triton-rocm",
    "pytorch-triton",
    "triton-rocm",
)

# Runs in the target interpreter (any Python >= 3.8): keep it self-contained and old-syntax.
# The file hash covers each distribution's RECORD entries (path and hash), leaving out
# byte-code (its header changes with every install) and install bookkeeping in .dist-info
# (INSTALLER, REQUESTED, direct_url.json differ between an index and a file install).
_FINGERPRINT_SCRIPT = r"""
import ast, hashlib, json, os, sys
import importlib.metadata as md

def version_module(dist):
    path = dist.locate_file("torch/version.py")
    try:
        tree = ast.parse(open(str(path)).read())
    except (OSError, SyntaxError):
        return None
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for t in targets:
            if isinstance(t, ast.Name) and t.id in ("__version__", "hip", "cuda", "rocm", "git_version"):
                try:
                    found[t.id] = ast.literal_eval(value)
                except ValueError:
                    pass
    return found

def on_disk(dist):
    # The files as they are now, not as RECORD says they were: every file under the
    # distribution's top-level directories (a file another package wrote there, or overwrote,
    # shows) and its top-level single files, as "size:mtime_ns" (a rewrite changes it).
    root = os.path.realpath(str(dist.locate_file("")))
    tops, singles = set(), set()
    for f in dist.files or []:
        parts = f.as_posix().split("/")
        if parts[0] in ("..", "") or parts[0].endswith((".dist-info", ".data")):
            continue
        if len(parts) > 1:
            tops.add(parts[0])
        elif not parts[0].endswith(".pyc"):
            singles.add(parts[0])
    found = {}
    def add(rel):
        try:
            st = os.stat(os.path.join(root, rel))
        except OSError:
            return
        found[rel] = "%d:%d" % (st.st_size, st.st_mtime_ns)
    for top in sorted(tops):
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for fn in filenames:
                if not fn.endswith(".pyc"):
                    add(os.path.relpath(os.path.join(dirpath, fn), root).replace(os.sep, "/"))
    for single in sorted(singles):
        add(single)
    return found

out = {"python": sys.executable, "python_version": "%d.%d.%d" % sys.version_info[:3],
       "packages": {}, "torch_version_module": None}
for name in json.loads(sys.argv[1]):
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        continue
    entries = []
    for f in dist.files or []:
        p = f.as_posix()
        parts = p.split("/")
        if p.endswith(".pyc"):
            continue
        if parts[0].endswith(".dist-info") and parts[-1] != "METADATA":
            continue
        h = "%s=%s" % (f.hash.mode, f.hash.value) if f.hash else ""
        entries.append(p + "," + h)
    entries.sort()
    version = dist.version
    out["packages"][name] = {
        "version": version,
        "local": version.split("+", 1)[1] if "+" in version else None,
        "files": len(entries),
        "files_sha256": hashlib.sha256("\n".join(entries).encode()).hexdigest(),
        "location": str(dist.locate_file("")),
        "disk": on_disk(dist),
    }
    if name == "torch":
        out["torch_version_module"] = version_module(dist)
print(json.dumps(out))
"""


@dataclass
class Fingerprint:
    """The torch stack of one interpreter."""

    python: str
    python_version: str
    packages: dict[str, dict[str, Any]] = field(default_factory=dict)
    torch_version_module: dict[str, Any] | None = None

    def to_json(self) -> str:
        return json.dumps({"schema_version": FINGERPRINT_SCHEMA, **asdict(self)}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> Fingerprint:
        data = json.loads(text)
        if data.get("schema_version") != FINGERPRINT_SCHEMA:
            raise ValueError(
                f"fingerprint schema_version {data.get('schema_version')!r} is not "
                f"{FINGERPRINT_SCHEMA}: re-create it with `python -m mamba2_rocm env fingerprint`"
            )
        data.pop("schema_version")
        return cls(**data)

    def summary(self) -> str:
        if not self.packages:
            return "no torch stack installed"
        parts = [f"{n}=={p['version']}" for n, p in self.packages.items()]
        tv = self.torch_version_module or {}
        if tv.get("hip"):
            parts.append(f"hip {tv['hip']}")
        elif tv.get("cuda"):
            parts.append(f"cuda {tv['cuda']}")
        return ", ".join(parts)


class TorchStackChanged(RuntimeError):
    """pip changed the torch stack; the message names every change and how to undo it."""

    def __init__(self, changes: list[str], before: Fingerprint) -> None:
        self.changes = changes
        lines = [f"the torch stack of {before.python} changed:"]
        lines += [f"  - {c}" for c in changes]
        lines.append("restore it with:")
        lines += [f"  {h}" for h in restore_hint(before)]
        super().__init__("\n".join(lines))


def fingerprint(python: str | os.PathLike[str] | None = None) -> Fingerprint:
    """Fingerprint the torch stack of ``python`` (default: this interpreter)."""
    python = str(python or sys.executable)
    with tempfile.TemporaryDirectory() as cwd:  # no stray ./torch can shadow the real one
        try:
            proc = subprocess.run(
                [python, "-c", _FINGERPRINT_SCRIPT, json.dumps(STACK)],
                capture_output=True,
                text=True,
                cwd=cwd,
                check=False,
            )
        except OSError as exc:
            raise RuntimeError(
                f"cannot run the interpreter {python!r} to fingerprint its torch stack: {exc}; "
                f"pass --python with the path of the environment's python"
            ) from exc
    if proc.returncode != 0:
        raise RuntimeError(
            f"fingerprinting the torch stack of {python!r} failed (exit {proc.returncode}): "
            f"{proc.stderr.strip()[-2000:]}; it needs Python >= 3.8"
        )
    return Fingerprint(**json.loads(proc.stdout))


def constraints(fp: Fingerprint) -> list[str]:
    """pip constraint lines pinning ``fp``'s stack exactly.

    A local label (``+rocm6.2``) makes ``==`` exact; without one ``==2.5.1`` would also accept
    ``2.5.1+cu124``, so arbitrary equality (``===``) is used.
    """
    return [
        f"{name}{'==' if info['local'] else '==='}{info['version']}"
        for name, info in fp.packages.items()
    ]


def diff(before: Fingerprint, after: Fingerprint) -> list[str]:
    """Human-readable changes from ``before`` to ``after`` (empty when identical)."""
    changes = []
    for name in sorted(set(before.packages) | set(after.packages), key=STACK.index):
        old, new = before.packages.get(name), after.packages.get(name)
        if old is None:
            changes.append(f"{name}: added {new['version']} (it was not installed)")
        elif new is None:
            changes.append(f"{name}: removed (was {old['version']})")
        elif old["version"] != new["version"]:
            changes.append(f"{name}: version {old['version']} -> {new['version']}")
        elif old["files_sha256"] != new["files_sha256"]:
            changes.append(
                f"{name}: reinstalled with different files, same version {old['version']} "
                f"({old['files']} -> {new['files']} files, hash {old['files_sha256'][:12]} -> "
                f"{new['files_sha256'][:12]})"
            )
        elif old["location"] != new["location"]:
            changes.append(f"{name}: moved from {old['location']} to {new['location']}")
        else:
            changes += _disk_changes(name, old.get("disk") or {}, new.get("disk") or {})
    tv_old, tv_new = before.torch_version_module or {}, after.torch_version_module or {}
    for key in ("hip", "cuda"):
        if tv_old.get(key) != tv_new.get(key) and (tv_old or tv_new):
            changes.append(f"torch.version.{key}: {tv_old.get(key)!r} -> {tv_new.get(key)!r}")
    return changes


def _disk_changes(name: str, old: dict[str, str], new: dict[str, str]) -> list[str]:
    """Files of ``name`` that another install rewrote, added or removed, by path."""
    rewritten = sorted(p for p in old.keys() & new.keys() if old[p] != new[p])
    added, removed = sorted(new.keys() - old.keys()), sorted(old.keys() - new.keys())
    out = []
    for what, paths in (("rewritten", rewritten), ("added", added), ("removed", removed)):
        if paths:
            shown = ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
            out.append(f"{name}: files {what} on disk: {shown}")
    return out


def restore_hint(fp: Fingerprint) -> list[str]:
    """pip lines that reinstall ``fp``'s stack (PyTorch's index chosen from the local label)."""
    if not fp.packages:
        return [f"{fp.python} -m pip uninstall torch  (there was no torch stack before)"]
    by_index: dict[str, list[str]] = {}
    for name, info in fp.packages.items():
        label = info["local"] or ""
        index = ""
        if re.fullmatch(r"rocm\d+(\.\d+)*|cu\d+|cpu|xpu", label):
            index = f" --index-url https://download.pytorch.org/whl/{label}"
        by_index.setdefault(index, []).append(f'"{name}=={info["version"]}"')
    return [
        f"{fp.python} -m pip install --force-reinstall --no-deps {' '.join(pins)}{index}"
        for index, pins in by_index.items()
    ]


def verify(before: Fingerprint, python: str | os.PathLike[str] | None = None) -> Fingerprint:
    """Fingerprint again and raise :class:`TorchStackChanged` if anything differs."""
    after = fingerprint(python or before.python)
    changes = diff(before, after)
    if changes:
        raise TorchStackChanged(changes, before)
    return after


_PIP_COMMANDS = {"download", "uninstall", "freeze", "list", "show", "wheel", "check", "config"}


def _install_args(pip_args: list[str]) -> list[str]:
    args = list(pip_args)
    if args[:1] == ["--"]:
        args = args[1:]
    if args[:1] == ["install"]:
        args = args[1:]
    if not args:
        raise ValueError(
            "protect-torch needs the arguments of `pip install`, e.g. "
            "`python -m mamba2_rocm env protect-torch -- mamba2-rocm-gfx1030`"
        )
    if args[0] in _PIP_COMMANDS:
        raise ValueError(
            f"protect-torch runs `pip install`, got the pip command {args[0]!r}: pass only the "
            f"install arguments (packages, -r FILE, --index-url ...)"
        )
    return args


class WouldOverwriteTorch(RuntimeError):
    """The planned install would write into a protected distribution's files: pip install did
    not run. The message names each offending package and path."""


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _owned_tops(fp: Fingerprint) -> dict[str, str]:
    """Top-level names (``torch``, ``triton``, ``functorch``...) -> the protected distribution
    whose files live there."""
    owners = {}
    for name, info in fp.packages.items():
        for path in info.get("disk") or {}:
            owners.setdefault(path.split("/", 1)[0], name)
    return owners


def planned_overwrites(plan: dict[str, Any], wheels: dict[str, Path], owners: dict[str, str]
                       ) -> list[str]:  # fmt: skip
    """What a pip ``--report`` plan would do to protected files: a protected distribution
    reinstalled, or a wheel (``wheels``: canonical name -> file) with paths in a protected
    distribution's directories."""
    import zipfile

    problems = []
    for item in plan.get("install", []):
        meta = item.get("metadata") or {}
        name, version = _canonical(meta.get("name", "?")), meta.get("version", "?")
        if name in set(owners.values()):
            problems.append(f"{name} {version} would be reinstalled over the protected one")
            continue
        wheel = wheels.get(name)
        if wheel is None:
            continue
        with zipfile.ZipFile(wheel) as zf:
            hits = sorted(n for n in zf.namelist() if n.split("/", 1)[0] in owners
                          and not n.split("/", 1)[0].endswith((".dist-info", ".data")))  # fmt: skip
        if hits:
            owner = owners[hits[0].split("/", 1)[0]]
            shown = ", ".join(hits[:3]) + (f" and {len(hits) - 3} more" if len(hits) > 3 else "")
            problems.append(f"{name} {version} ships {shown}, inside {owner}'s files")
    return problems


def _preflight(python: str, args: list[str], cfile: Path | None, before: Fingerprint,
               tmp: Path) -> None:  # fmt: skip
    """Resolve first (``pip install --dry-run --report``), fetch every planned wheel (building
    sdists), and refuse before anything is installed if one would write into a protected
    distribution's files. A plan pip cannot make is left to the real run to report."""
    report = tmp / "plan.json"
    # ours last: a --report among the caller's arguments must not take the plan elsewhere
    cmd = [python, "-m", "pip", "install", "--dry-run", "--quiet", *args, "--report", str(report)]
    if cfile is not None:
        cmd += ["-c", str(cfile)]
    if subprocess.run(cmd, capture_output=True, text=True, check=False).returncode != 0:
        return
    if not report.is_file():
        raise WouldOverwriteTorch("pip's dry run wrote no plan: nothing was installed")
    plan = json.loads(report.read_text())
    urls = [
        (item.get("download_info") or {}).get("url")
        for item in plan.get("install", [])
        if "dir_info" not in (item.get("download_info") or {})  # a local project: checked after
    ]
    urls = [u for u in urls if u]
    inspect = tmp / "inspect"
    if urls:
        proc = subprocess.run(
            [python, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(inspect), *urls],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if proc.returncode != 0:
            raise WouldOverwriteTorch(
                "could not fetch the planned packages to inspect their files (nothing was "
                f"installed): {proc.stderr.strip()[-1500:]}"
            )
    wheels = {}
    for w in inspect.glob("*.whl") if inspect.is_dir() else []:
        wheels[_canonical(w.name.split("-")[0])] = w
    problems = planned_overwrites(plan, wheels, _owned_tops(before))
    if problems:
        raise WouldOverwriteTorch(
            "this install would change the protected torch stack's files, so pip was not run:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )


class NoTorchToProtect(RuntimeError):
    """protect-torch was asked to guard an interpreter that has no torch: pip did not run."""


def _no_torch_message(python: str) -> str:
    from mamba2_rocm.env.audit import torch_install_line
    from mamba2_rocm.env.detect import amd_gpus_present

    amd = amd_gpus_present()
    where = "this machine has AMD GPUs" if amd else "no AMD GPU found here"
    return (
        f"{python} has no torch installed: there is nothing to protect, so pip was not run. "
        f"Install torch first ({where}: {torch_install_line(amd, False)}), or pass "
        f"--allow-no-torch to run pip anyway (a torch it installs is then reported as a change)"
    )


def protected_install(
    pip_args: list[str],
    python: str | os.PathLike[str] | None = None,
    *,
    log: Any = None,
    allow_no_torch: bool = False,
) -> int:
    """``pip install *pip_args`` into ``python`` with the torch stack pinned; pip's exit code.

    Raises :class:`NoTorchToProtect` before pip runs when ``python`` has no torch (unless
    ``allow_no_torch``), and :class:`TorchStackChanged` when the stack changed anyway (also
    when pip failed half-way). A non-zero return means pip refused or failed and the stack is
    unchanged.
    """
    log = sys.stderr if log is None else log
    args = _install_args(pip_args)
    python = str(python or sys.executable)
    before = fingerprint(python)
    if "torch" not in before.packages and not allow_no_torch:
        raise NoTorchToProtect(_no_torch_message(python))
    pins = constraints(before)
    if pins:
        print(f"protect-torch: pinning {', '.join(pins)} in {python}", file=log)
    else:
        print(
            f"protect-torch: {python} has no torch stack installed; nothing to pin "
            f"(--allow-no-torch), but a torch that pip installs now is reported as a change",
            file=log,
        )
    with tempfile.TemporaryDirectory() as tmp:
        cfile = Path(tmp) / "torch-constraints.txt"
        cfile.write_text("".join(p + "\n" for p in pins))
        if pins:  # refuse before installing what would write into the stack's files
            _preflight(python, args, cfile, before, Path(tmp))
        cmd = [python, "-m", "pip", "install", *args]
        if pins:
            cmd += ["-c", str(cfile)]
        log.flush()
        rc = subprocess.run(cmd, check=False).returncode
    verify(before, python)
    if rc != 0:
        print(
            f"protect-torch: pip exited with {rc}; the torch stack is unchanged "
            f"({before.summary()}). If pip reports a conflict on torch, the requested packages "
            f"need a different torch: pick versions of them that support the installed one, "
            f"or change torch deliberately (outside protect-torch) from PyTorch's index",
            file=log,
        )
    return rc
