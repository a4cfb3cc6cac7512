"""The hardware-truth table: for every recipe target, the deepest verification it has had.

Levels, each only from a record that says so (never written by hand into the table):

1. **compiled + statically verified**: every recipe is built by ``ci.yml``'s build matrix
   (arch, spills, LDS and kernel ABI checked on every code object); a local
   ``wheels/<target>/build-manifest.json`` whose static verification passed names the commit.
2. **executed in emulation**: ``records/emulation/<variant>[-<suite>].json``, written on the
   NVIDIA machine by ``python -m mamba2_rocm.pipeline emulation-record`` from the junit report of
   a run on a ``build --emulate <variant>`` build and committed: our GPU suite
   (``EMULATE=<variant> scripts/device_check.sh``) and the upstream suites through the drop-in
   names (``EMULATE=<variant> scripts/device_compat.sh``), one record per suite
   (:data:`EMULATION_SUITES`). A variant stands for the targets whose code paths it builds
   (:data:`EMULATED_TARGETS`).
3. **executed on the AMD GPU**: only a GPU gate record (``gpu-gate.json``) that a self-hosted
   runner's ``nox -s gpu-tests-<target>`` wrote and the GPU workflow uploaded; passed with
   ``--gates DIR`` (the downloaded artifacts). A record that does not hold together (not this
   target, a device arch the recipe does not have, a pass with failures, no commit, other wheels
   than the local build's) is shown as invalid and never counts.

4. **reported by a user**: ``python -m mamba2_rocm selftest --report FILE`` run by someone on
   their own card, passed with ``--reports DIR``. It counts only when it holds together
   (``mamba2_rocm.selftest.report.report_problems``: every check passed on the kernels, the
   GPU is one of the recipe's archs, and every code object's sha256 is the local build's);
   the newest valid one per target is shown. A report never gates a publish.

Emulation is never a GPU gate: publish takes only gate records, and refuses an emulation
record presented as one (``publish.check_gate``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mamba2_rocm.pipeline.gputest import junit_counts
from mamba2_rocm.pipeline.publish import GATE_FILE, gate_record_problems
from mamba2_rocm.pipeline.recipes import Recipe

__all__ = [
    "EMULATED_TARGETS",
    "EMULATION_FORMAT",
    "EMULATION_SUITES",
    "TruthRow",
    "check_emulation_kernels",
    "emulation_record",
    "format_table",
    "gate_problems",
    "truth_table",
]

EMULATION_FORMAT = 1
#: emulation variant -> the recipe targets whose code paths (matrix-core path, wavefront) it
#: builds for the NVIDIA GPU (mamba2_rocm.build.driver.EMULATIONS)
EMULATED_TARGETS = {
    "gfx1030": ("gfx1030", "gfx10-3-generic"),
    "gfx11": ("gfx1100", "gfx1101", "gfx1102", "gfx1103", "gfx1150", "gfx1151", "gfx11-generic"),
    "gfx12": ("gfx1200", "gfx1201", "gfx12-generic"),
    # wave64 as two warps exchanging through shared memory (csrc/platform.h), MFMA emulated
    "gfx9": ("gfx90a", "gfx942", "gfx950", "gfx9-4-generic"),
}
#: suite key (``emulation-record --suite``) -> what ran; the table lists them in this order
EMULATION_SUITES = {
    "gpu": "pytest -m gpu tests",
    "upstream-mamba": "state-spaces/mamba tests (drop-in names)",
    "upstream-causal-conv1d": "Dao-AILab/causal-conv1d tests (drop-in names)",
}
_SUITE_NAMES = {v: k for k, v in EMULATION_SUITES.items()}
_SHA = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class TruthRow:
    target: str
    archs: tuple[str, ...]
    static: str
    emulation: str
    hardware: str
    reported: str = "no user report"


def emulation_record(junit: Path, variant: str, commit: str, device: str, date: str,
                     suite: str = "gpu") -> dict:  # fmt: skip
    """The record of one suite's run on an emulation build, from pytest's junit report."""
    if variant not in EMULATED_TARGETS:
        raise ValueError(
            f"unknown emulation variant {variant!r}; known: {sorted(EMULATED_TARGETS)}"
        )
    if suite not in EMULATION_SUITES:
        raise ValueError(f"unknown suite {suite!r}; known: {sorted(EMULATION_SUITES)}")
    if not _SHA.fullmatch(commit):
        raise ValueError(f"commit must be a 40-hex git sha, got {commit!r}")
    counts = junit_counts(junit)
    return {
        "format": EMULATION_FORMAT, "variant": variant, "suite": EMULATION_SUITES[suite],
        **{k: counts[k] for k in ("passed", "failed", "errors", "skipped")},
        "commit": commit, "device": device, "date": date,
    }  # fmt: skip


def check_emulation_kernels(kernels: Path, variant: str) -> str:
    """Refuse a prebuilt kernel folder that is not ``variant``'s emulation build (``""``: a
    native build), so a run's record never names the wrong code paths. Returns a summary line."""
    manifests = sorted(kernels.glob("*/manifest.json"))
    if len(manifests) != 1:
        raise ValueError(f"{kernels}: expected one <arch>/manifest.json, found {len(manifests)}")
    m = _read(manifests[0])
    if not isinstance(m, dict):
        raise ValueError(f"{manifests[0]}: {m}")
    built = m.get("emulates") or ""
    if built != variant:
        raise ValueError(f"{kernels} holds a build of {built or 'no emulation'}, "
                         f"the run says {variant or 'none'}")  # fmt: skip
    return f"prebuilt {m.get('target')} kernels ({m.get('compiler')}; emulates {built or 'none'})"


def _emulation_problems(rec: Any) -> list[str]:
    if not isinstance(rec, dict):
        return ["not a JSON object"]
    problems = []
    if rec.get("format") != EMULATION_FORMAT:
        problems.append(f"format {rec.get('format')!r}, expected {EMULATION_FORMAT}")
    if rec.get("variant") not in EMULATED_TARGETS:
        problems.append(f"unknown variant {rec.get('variant')!r}")
    if rec.get("suite") not in _SUITE_NAMES:
        problems.append(f"unknown suite {rec.get('suite')!r}")
    for key in ("passed", "failed", "errors", "skipped"):
        if not isinstance(rec.get(key), int) or rec[key] < 0:
            problems.append(f"{key} must be a count, got {rec.get(key)!r}")
    if not _SHA.fullmatch(str(rec.get("commit", ""))):
        problems.append(f"commit {rec.get('commit')!r} is not a git sha")
    return problems


def gate_problems(gate: Any, recipe: Recipe, manifest: dict | None = None) -> list[str]:
    """Why a GPU gate record cannot count for ``recipe`` (empty: it counts)."""
    if not isinstance(gate, dict):
        return ["not a JSON object"]
    problems = gate_record_problems(gate, recipe.target)
    archs = gate.get("device_archs")
    if not isinstance(archs, list) or not archs or any(a not in recipe.archs for a in archs):
        problems.append(f"device archs {archs!r} are not the recipe's {list(recipe.archs)}")
    if not _SHA.fullmatch(str(gate.get("commit", ""))):
        problems.append(f"commit {gate.get('commit')!r} is not a git sha")
    if manifest is not None and gate.get("wheels") != manifest.get("wheels"):
        problems.append("it tested other wheels than the local build's")
    return problems


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return f"unreadable ({exc})"


def read_reports(roots: list[Path]) -> list[tuple[Path, Any]]:
    """Every ``*.json`` under ``roots`` with its parsed content (or why it is unreadable): the
    users' selftest reports that :func:`truth_table` and :func:`unplaced_reports` read."""
    return [(path, _read(path)) for root in roots for path in sorted(root.rglob("*.json"))]


def _reported(recipe: Recipe, reports: list[tuple[Path, Any]], manifest: dict | None) -> str:
    """The newest valid user report for ``recipe``, or why the ones for it were refused."""
    from mamba2_rocm.selftest.report import report_problems, report_summary

    mine = [(p, r) for p, r in reports if isinstance(r, dict)
            and (r.get("kernels") or {}).get("target") in recipe.archs]  # fmt: skip
    valid, refused = [], []
    for path, rep in mine:
        problems = report_problems(rep, recipe.archs, recipe.target, manifest)
        if problems:
            refused.append(f"{path.name}: {'; '.join(problems)}")
        else:
            valid.append(rep)
    if valid:
        best = max(valid, key=lambda r: str(r.get("date")))
        return report_summary(best) + (f" ({len(refused)} refused)" if refused else "")
    if refused:
        return "refused " + "; ".join(refused)
    return "no user report"


def unplaced_reports(recipes: list[Recipe], reports: list[tuple[Path, Any]]) -> list[str]:
    """The reports (:func:`read_reports`) that no recipe's row shows, each with why: unreadable,
    not a selftest report, or from kernels no recipe builds (an NVIDIA run, an unknown arch).
    ``truth --reports`` prints them under the table, so that none is dropped unsaid."""
    archs = {a for r in recipes for a in r.archs}
    out = []
    for path, rep in reports:
        if isinstance(rep, str):
            out.append(f"{path.name}: {rep}")
        elif not isinstance(rep, dict) or not isinstance(rep.get("kernels"), dict):
            out.append(f"{path.name}: not a selftest report (no kernels section)")
        elif rep["kernels"].get("target") not in archs:
            dev = rep.get("device") if isinstance(rep.get("device"), dict) else {}
            out.append(f"{path.name}: kernels for {rep['kernels'].get('target')!r} "
                       f"({dev.get('name', 'unknown device')}), which no recipe builds")  # fmt: skip
    return out


def truth_table(recipes: list[Recipe], records: Path, gate_roots: list[Path],
                wheels: Path, reports: list[tuple[Path, Any]] | None = None) -> list[TruthRow]:  # fmt: skip
    """A row per recipe; ``reports`` (:func:`read_reports`) fill the users' column."""
    emulations: dict[str, list[tuple[int, str, dict]]] = {}  # target -> (suite order, run, rec)
    invalid: dict[str, list[str]] = {}
    for path in sorted(records.glob("*.json")) if records.is_dir() else []:
        rec = _read(path)
        problems = [rec] if isinstance(rec, str) else _emulation_problems(rec)
        variant = rec.get("variant") if isinstance(rec, dict) else None
        targets = EMULATED_TARGETS.get(variant, ())
        if problems:
            for target in targets or (path.stem,):
                invalid.setdefault(target, []).append(f"{path.name}: {'; '.join(problems)}")
            continue
        run = (f"{_SUITE_NAMES[rec['suite']]} {rec['passed']} passed, {rec['failed']} failed, "
               f"{rec['errors']} errors ({rec.get('date')}, {rec['commit'][:12]})")  # fmt: skip
        for target in targets:
            emulations.setdefault(target, []).append(
                (list(EMULATION_SUITES).index(_SUITE_NAMES[rec["suite"]]), run, rec)
            )
    reports = reports or []
    gates: dict[str, list[tuple[Path, Any]]] = {}
    for root in gate_roots:
        for path in sorted(root.rglob(GATE_FILE)):
            rec = _read(path)
            target = rec.get("target") if isinstance(rec, dict) else None
            gates.setdefault(str(target), []).append((path, rec))
    rows = []
    for recipe in recipes:
        manifest_path = wheels / recipe.target / "build-manifest.json"
        manifest = _read(manifest_path) if manifest_path.is_file() else None
        manifest = manifest if isinstance(manifest, dict) else None
        static = "yes (ci.yml builds every recipe)"
        if manifest and (manifest.get("verification") or {}).get("static") == "passed":
            static = f"yes; local build of {str(manifest.get('source_commit'))[:12]}"
        runs = sorted(emulations.get(recipe.target, []), key=lambda r: r[0])
        problems = invalid.get(recipe.target, [])
        if problems:
            emulation = "invalid record " + "; ".join(problems)
        elif runs:
            rec = runs[0][2]
            emulation = f"{rec['variant']} on {rec.get('device')}: " + "; ".join(r[1] for r in runs)
        elif recipe.target in {t for ts in EMULATED_TARGETS.values() for t in ts}:
            emulation = "variant exists, no recorded run yet"
        else:
            emulation = "not emulated (no variant yet)"
        hardware = "no runner record"
        for path, gate in gates.get(recipe.target, []):
            problems = [gate] if isinstance(gate, str) else gate_problems(gate, recipe, manifest)
            if problems:
                hardware = f"invalid record {path.name}: {'; '.join(problems)}"
                continue
            tests = gate["tests"]
            hardware = (f"{tests['passed']} passed on {', '.join(gate['device_archs'])} "
                        f"({str(gate['commit'])[:12]}, run {gate.get('run_id')})")  # fmt: skip
            break
        reported = _reported(recipe, reports, manifest)
        rows.append(TruthRow(recipe.target, tuple(recipe.archs), static, emulation, hardware,
                             reported))  # fmt: skip
    return rows


def format_table(rows: list[TruthRow], reports: bool = False) -> str:
    """The table; with ``reports`` the column of user reports too (``truth --reports``)."""
    head = ["target", "archs", "compiled + statically verified", "executed in emulation",
            "executed on the AMD GPU"] + (["reported by a user"] if reports else [])  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = [r.target, ", ".join(r.archs), r.static, r.emulation, r.hardware]
        lines.append("| " + " | ".join(cells + ([r.reported] if reports else [])) + " |")
    return "\n".join(lines)
