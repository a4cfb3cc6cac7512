"""Recipes: ``recipes/<target>.toml``, the single source of truth for what is built.

Schema (every key required unless marked optional):

=====================  ==========================================================================
``target``             the release target; equals the file name; names the package
                       ``mamba2-rocm-<target>``
``archs``              offload archs compiled into that package (known to ``mamba2_rocm.arch``)
``wavefront_size``     32 or 64; must match every arch
``code_object_version`` 5 or 6; generic targets need 6
``compile_flags``      extra compiler flags (list of strings)
``min_rocm``           oldest ROCm runtime that loads the code objects ("6.4")
``runner_labels``      self-hosted runner labels that can test it ([] = no hardware)
``gpu_gate``           "required" (publish only after a passing GPU test) or "compile-only"
``[toolchain]``        ``suite`` (Debian suite) and ``packages`` {apt package: exact version}
=====================  ==========================================================================

A malformed recipe is rejected with a message naming the file and the field.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from mamba2_rocm.arch import arch_info

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["GPU_GATES", "Recipe", "RecipeError", "load_recipe", "load_recipes", "recipes_dir"]

GPU_GATES = ("required", "compile-only")
_KEYS = {
    "target", "archs", "wavefront_size", "code_object_version", "compile_flags", "min_rocm",
    "runner_labels", "gpu_gate", "toolchain",
}  # fmt: skip


class RecipeError(ValueError):
    """A recipe that does not follow the schema; the message names file and field."""


@dataclass(frozen=True)
class Recipe:
    path: Path
    target: str
    archs: tuple[str, ...]
    wavefront_size: int
    code_object_version: int
    compile_flags: tuple[str, ...]
    min_rocm: str
    runner_labels: tuple[str, ...]
    gpu_gate: str
    toolchain_suite: str
    toolchain_packages: dict[str, str]

    @property
    def package_name(self) -> str:
        return f"mamba2-rocm-{self.target}"

    @property
    def module_name(self) -> str:
        return "mamba2_rocm_" + self.target.replace("-", "_")

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()

    @property
    def toolchain_key(self) -> str:
        """Identifies the toolchain image: recipes with the same pins share one image."""
        blob = json.dumps(
            {"suite": self.toolchain_suite, "packages": self.toolchain_packages}, sort_keys=True
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def recipes_dir() -> Path:
    """``recipes/`` of the source checkout this package runs from."""
    here = Path(__file__).resolve().parents[2] / "recipes"
    if not here.is_dir():
        raise FileNotFoundError(
            f"no recipes/ directory at {here}: the pipeline runs from a source checkout"
        )
    return here


#: What may reach the toolchain Dockerfile, apt and the shell. Debian's rules: a package name is
#: lower-case alphanumerics and + - . (Policy 5.6.1); a version digits, letters and . + ~ - :
#: (5.6.12); a suite a plain word. Runner labels and archs are plain words too.
_SAFE = {
    "suite": re.compile(r"[a-z][a-z0-9-]*"),
    "package": re.compile(r"[a-z0-9][a-z0-9+.-]+"),
    "version": re.compile(r"[A-Za-z0-9.+~:-]+"),
    "label": re.compile(r"[A-Za-z0-9_.-]+"),
}
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _no_control(path: Path, field: str, value: str) -> str:
    """Refuse control characters (a newline in a field is a new line in a Dockerfile or
    an apt source list)."""
    m = _CONTROL.search(value)
    if m:
        raise _fail(path, field, f"control character {m.group()!r} in {value!r}")
    return value


def _safe(path: Path, field: str, value: str, kind: str) -> str:
    _no_control(path, field, value)
    if not _SAFE[kind].fullmatch(value):
        raise _fail(
            path, field, f"{value!r} is not a valid {kind} (allowed: {_SAFE[kind].pattern})"
        )
    return value


def _fail(path: Path, field: str, msg: str) -> RecipeError:
    return RecipeError(f"{path.name}: field '{field}': {msg}")


def _typed(path: Path, data: dict[str, Any], field: str, kind: type, what: str) -> Any:
    if field not in data:
        return _missing(path, field)
    value = data[field]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _fail(path, field, f"expected {what}, got {value!r}")
    return value


def _missing(path: Path, field: str):
    raise _fail(path, field, "missing")


def _str_list(path: Path, data: dict[str, Any], field: str, allow_empty: bool) -> tuple[str, ...]:
    value = _typed(path, data, field, list, "a list of strings")
    if not all(isinstance(v, str) and v for v in value):
        raise _fail(path, field, f"expected a list of non-empty strings, got {value!r}")
    if not value and not allow_empty:
        raise _fail(path, field, "must not be empty")
    return tuple(value)


def _check_target_archs(path: Path, target: str, archs: tuple[str, ...]) -> None:
    """An exact target's package holds its own ISA only; a generic target's holds the generic
    ISA, and possibly members of that family (the code objects the loader can select)."""
    try:
        info = arch_info(target)
    except ValueError as exc:
        raise _fail(path, "target", str(exc)) from None
    if target not in archs:
        raise _fail(path, "archs", f"{list(archs)} does not contain the target {target!r}")
    if not info.is_generic:
        if archs != (target,):
            raise _fail(path, "archs", f"the exact target {target!r} lists only itself, "
                                       f"got {list(archs)}")  # fmt: skip
        return
    strangers = [a for a in archs if a != target and arch_info(a).generic != target]
    if strangers:
        raise _fail(path, "archs", f"{strangers} are not in the {target} family")


def load_recipe(path: str | Path) -> Recipe:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"{path.name}: not valid TOML: {exc}") from exc
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise _fail(path, unknown[0], f"unknown field (known: {', '.join(sorted(_KEYS))})")
    target = _typed(path, data, "target", str, "a string")
    if target != path.stem:
        raise _fail(path, "target", f"{target!r} does not match the file name {path.stem!r}")
    _no_control(path, "target", target)
    archs = _str_list(path, data, "archs", allow_empty=False)
    wave = _typed(path, data, "wavefront_size", int, "32 or 64")
    for arch in archs:
        _safe(path, "archs", arch, "label")
        try:
            info = arch_info(arch)
        except ValueError as exc:
            raise _fail(path, "archs", str(exc)) from None
        if info.vendor != "amd":
            raise _fail(path, "archs", f"{arch} is not an AMD target")
        if info.wavefront_size != wave:
            raise _fail(
                path, "wavefront_size", f"{wave}, but {arch} runs wave{info.wavefront_size}"
            )
    _check_target_archs(path, target, archs)
    cov = _typed(path, data, "code_object_version", int, "5 or 6")
    if cov not in (5, 6):
        raise _fail(path, "code_object_version", f"expected 5 or 6, got {cov}")
    if cov < 6 and any(arch_info(a).is_generic for a in archs):
        raise _fail(path, "code_object_version", f"{cov}, but generic targets need code-object v6")
    flags = _str_list(path, data, "compile_flags", allow_empty=True)
    for flag in flags:
        _no_control(path, "compile_flags", flag)
    min_rocm = _typed(path, data, "min_rocm", str, 'a version string like "6.4"')
    try:
        Version(min_rocm)
    except InvalidVersion:
        raise _fail(path, "min_rocm", f"not a version: {min_rocm!r}") from None
    labels = _str_list(path, data, "runner_labels", allow_empty=True)
    for label in labels:
        _safe(path, "runner_labels", label, "label")
    gate = _typed(path, data, "gpu_gate", str, f"one of {GPU_GATES}")
    if gate not in GPU_GATES:
        raise _fail(path, "gpu_gate", f"expected one of {GPU_GATES}, got {gate!r}")
    if gate == "required" and not labels:
        raise _fail(path, "gpu_gate", '"required" needs runner_labels that can run the GPU test')
    tc = _typed(path, data, "toolchain", dict, "a [toolchain] table")
    suite = tc.get("suite")
    if not isinstance(suite, str) or not suite:
        raise _fail(path, "toolchain.suite", f"expected a Debian suite name, got {suite!r}")
    _safe(path, "toolchain.suite", suite, "suite")
    pkgs = tc.get("packages")
    if not isinstance(pkgs, dict) or not pkgs:
        raise _fail(path, "toolchain.packages", 'expected a table {package = "exact version"}')
    for name, ver in pkgs.items():
        _safe(path, "toolchain.packages", name, "package")
        if not isinstance(ver, str) or not ver or any(c in ver for c in " *<>="):
            raise _fail(
                path, f"toolchain.packages.{name}", f"expected an exact apt version, got {ver!r}"
            )
        _safe(path, f"toolchain.packages.{name}", ver, "version")
    if "hipcc" not in pkgs:
        raise _fail(path, "toolchain.packages", "must pin hipcc")
    extra = sorted(set(tc) - {"suite", "packages"})
    if extra:
        raise _fail(path, f"toolchain.{extra[0]}", "unknown field (known: suite, packages)")
    return Recipe(
        path,
        target,
        archs,
        wave,
        cov,
        flags,
        min_rocm,
        labels,
        gate,
        suite,
        dict(sorted(pkgs.items())),
    )


def load_recipes(directory: str | Path | None = None) -> dict[str, Recipe]:
    """All recipes by target, sorted; every file is checked."""
    directory = Path(directory) if directory is not None else recipes_dir()
    recipes = {}
    for path in sorted(directory.glob("*.toml")):
        recipe = load_recipe(path)
        recipes[recipe.target] = recipe
    if not recipes:
        raise RecipeError(f"no recipes found in {directory}")
    return recipes


def get_recipe(target: str, directory: str | Path | None = None) -> Recipe:
    recipes = load_recipes(directory)
    if target not in recipes:
        raise RecipeError(f"unknown target {target!r}; recipes exist for: {', '.join(recipes)}")
    return recipes[target]
