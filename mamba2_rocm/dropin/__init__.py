"""The drop-in import names ``mamba_ssm`` and ``causal_conv1d``, served by mamba2-rocm's ops.

Code written for those packages (transformers' Mamba2-family models above all) finds kernels
by importing them; they do not build on ROCm. This module provides the names, opt-in: nothing
happens unless the ``mamba2-rocm-dropin`` distribution is installed (its ``.pth`` file calls
:func:`activate` at interpreter start; ``MAMBA2_ROCM_DROPIN=0`` turns that off) or code calls
:func:`activate` itself.

How: a finder appended to ``sys.meta_path``, after the standard path finder, answers for the
top-level names only when nothing on ``sys.path`` provides them, so a real ``mamba_ssm`` or
``causal_conv1d`` always wins (``doctor`` reports the collision). The facade packages live in
``facades/`` and load under the real names, so their submodules resolve through ``__path__``
as any package's do. The same finder answers ``importlib.metadata`` queries for the two names,
again only where no real distribution exists, with versions that pass transformers' checks
(mamba_ssm >= 2.0.4) and say whose they are: ``<mirrored API version>+mamba2rocm.<ours>``.

Why a finder rather than top-level ``mamba_ssm/`` folders in a wheel: two distributions owning
the same files break each other (installing the real package overwrites ours, and uninstalling
ours then deletes the real package's files). Here no file is shared, pip never sees a phantom
``mamba-ssm`` (it reads dist-info folders, not finders), and uninstalling the drop-in leaves
nothing behind. setuptools' editable installs put packages on the import path the same way.

This module imports neither torch nor the ops: it runs at every interpreter start once the
drop-in is installed. The facades import the ops when they are imported.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import re
import sys
from pathlib import Path

__all__ = [
    "DISTRIBUTION",
    "ENV_SWITCH",
    "EXTENSIONS",
    "FACADES",
    "NameReport",
    "activate",
    "deactivate",
    "facade_version",
    "is_active",
    "missing",
    "report",
    "setup",
]

#: The distribution whose ``.pth`` file activates the finder at interpreter start.
DISTRIBUTION = "mamba2-rocm-dropin"
#: ``MAMBA2_ROCM_DROPIN=0`` keeps an installed drop-in from activating.
ENV_SWITCH = "MAMBA2_ROCM_DROPIN"
#: Import name -> the upstream API version its facade mirrors (the public names and signatures
#: of that release that transformers and the upstream test suites use).
FACADES = {"mamba_ssm": "2.3.2", "causal_conv1d": "1.6.1"}
#: Compiled-extension modules of those packages, served where no real one exists: beside the
#: real pure-Python mamba-ssm (which installs no extension), its ``Mamba`` reaches the scan
#: through ``selective_scan_cuda``. No distribution owns them, so they have no metadata.
EXTENSIONS = ("selective_scan_cuda",)
SERVED = (*FACADES, *EXTENSIONS)
FACADE_DIR = Path(__file__).resolve().parent / "facades"


def facade_version(name: str, version: str | None = None) -> str:
    """``2.3.2+mamba2rocm.0.4.0``: the mirrored API version, with ours (``version``, default
    the installed one) as the local label."""
    if version is None:
        from mamba2_rocm import __version__ as version

    return f"{FACADES[name]}+mamba2rocm.{re.sub(r'[^A-Za-z0-9]+', '.', version).strip('.')}"


def _real_spec(name: str):
    """The spec of a real ``name`` on sys.path (standard path finder only), or None."""
    return importlib.machinery.PathFinder.find_spec(name)


class _Finder:
    """A meta-path finder (and metadata finder) for the facade names; see the module doc."""

    def find_spec(self, fullname, path=None, target=None):
        if path is not None or fullname not in SERVED:
            return None  # submodules resolve through the facade package's __path__
        pkg = FACADE_DIR / fullname
        return importlib.util.spec_from_file_location(
            fullname, pkg / "__init__.py", submodule_search_locations=[str(pkg)]
        )

    def find_distributions(self, context=None):
        name = getattr(context, "name", None)
        if name is None:
            return iter(())
        key = re.sub(r"[-_.]+", "_", name).lower()
        if key not in FACADES or _real_spec(key) is not None:
            return iter(())
        return iter((_facade_distribution(key),))

    def invalidate_caches(self) -> None:
        pass


def _facade_distribution(name: str):
    """An ``importlib.metadata.Distribution`` describing a facade (metadata only, no files)."""
    import importlib.metadata as md

    class FacadeDistribution(md.Distribution):
        def read_text(self, filename):
            if filename in ("METADATA", "PKG-INFO"):
                return (
                    f"Metadata-Version: 2.1\nName: {name}\nVersion: {facade_version(name)}\n"
                    f"Summary: {name} import name served by mamba2-rocm's kernels "
                    f"(installed by {DISTRIBUTION})\n"
                )
            return None

        def locate_file(self, path):
            return FACADE_DIR / name / path

    return FacadeDistribution()


_FINDER = _Finder()


def is_active() -> bool:
    return _FINDER in sys.meta_path


def activate() -> None:
    """Serve ``mamba_ssm`` / ``causal_conv1d`` from mamba2-rocm where no real one is installed.
    Idempotent; appended last, so every real package on sys.path takes precedence."""
    if not is_active():
        sys.meta_path.append(_FINDER)


def deactivate() -> None:
    """Stop serving the names (modules already imported stay in ``sys.modules``)."""
    while _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


def activate_from_pth() -> None:
    """The ``.pth`` hook: activate unless ``MAMBA2_ROCM_DROPIN`` is 0/false/off/no."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no"):
        activate()


class NameReport(dict):
    """One import name's owner, for ``doctor``: keys ``name``, ``owner`` (``"mamba2-rocm"``,
    ``"other"`` or ``"absent"``), ``path``, ``version``, ``dropin_installed``, ``shadowed``
    (ours is installed but a real package takes the name: the finder gives way)."""


def report() -> list[NameReport]:
    """Who answers ``import mamba_ssm`` / ``import causal_conv1d`` in this interpreter."""
    import importlib.metadata as md

    try:
        dropin = md.version(DISTRIBUTION)
    except md.PackageNotFoundError:
        dropin = None
    rows = []
    for name in SERVED:
        real = _real_spec(name)
        row = NameReport(name=name, dropin_installed=dropin is not None, shadowed=False)
        if real is not None:
            version = None
            for dist in md.Distribution.discover(name=name, path=sys.path):
                version = dist.version
                break
            row.update(owner="other", path=real.origin, version=version)
            row["shadowed"] = dropin is not None or is_active()
        elif is_active():
            version = facade_version(name) if name in FACADES else None
            row.update(owner="mamba2-rocm", path=str(FACADE_DIR / name), version=version)
        else:
            row.update(owner="absent", path=None, version=None)
        rows.append(row)
    return rows


def missing(module: str, names: dict[str, str]):
    """A module ``__getattr__`` for names a facade does not serve yet: importing one raises
    ImportError with the reason (so ``from mamba_ssm import selective_scan_fn`` says what is
    missing, and transformers' lookup takes its own fallback instead of a stand-in)."""

    def __getattr__(attr: str):
        if attr in names:
            raise ImportError(
                f"{module}.{attr} is not provided by mamba2-rocm's drop-in: {names[attr]}",
                name=module,
            )
        raise AttributeError(f"module {module!r} has no attribute {attr!r}")

    return __getattr__


#: what runs each op family of code written for mamba_ssm, by who owns the names
_OPS = (
    ("modules, models, generation", "mamba_ssm"),
    ("SSD scan, decode step, fused norms", "mamba_ssm"),
    ("causal conv1d", "causal_conv1d"),
    ("selective scan (Mamba1)", "selective_scan_cuda"),
)


def setup(rows: list[dict] | None = None) -> dict:
    """Which setup the names form (``rows``: :func:`report`'s, default now) and who runs each
    op family for code written against mamba_ssm: ``{"setup", "summary", "ops": [[family,
    runner], ...]}``. Setups: ``alone`` (the drop-in serves mamba_ssm too), ``beside`` (a real
    mamba_ssm, our conv / scan under it), ``upstream`` (real packages only), ``off``."""
    owner = {r["name"]: r["owner"] for r in (report() if rows is None else rows)}
    mamba = owner.get("mamba_ssm", "absent")
    if mamba == "mamba2-rocm":
        kind, summary = "alone", "the drop-in serves mamba_ssm: its models and ops run mamba2-rocm"
    elif mamba == "other" and "mamba2-rocm" in owner.values():
        kind, summary = (
            "beside",
            (
                "a real mamba_ssm runs its own modules and Triton kernels; mamba2-rocm serves the "
                "compiled pieces it imports (causal_conv1d, selective_scan_cuda)"
            ),
        )
    elif mamba == "other":
        kind, summary = "upstream", "real packages only: no op reaches mamba2-rocm by these names"
    else:
        kind, summary = "off", "the drop-in is not active and no mamba_ssm is installed"

    def runner(name: str) -> str:
        who = owner.get(name, "absent")
        if name == "selective_scan_cuda" and mamba == "mamba2-rocm":
            who = "mamba2-rocm"  # our mamba_ssm calls the scan op directly
        if who == "mamba2-rocm":
            return "mamba2-rocm kernels"
        if who == "other":
            return "mamba_ssm's Triton kernels" if name == "mamba_ssm" else f"the real {name}"
        return "not available"

    return {"setup": kind, "summary": summary, "ops": [[f, runner(n)] for f, n in _OPS]}
