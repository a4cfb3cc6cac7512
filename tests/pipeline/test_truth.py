"""The hardware-truth table from sample records: emulation runs, runner gate records (valid,
tampered, for another target, missing), and the README's copy of the table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mamba2_rocm.pipeline import publish
from mamba2_rocm.pipeline.recipes import get_recipe, load_recipes
from mamba2_rocm.pipeline.truth import (
    check_emulation_kernels,
    emulation_record,
    format_table,
    read_reports,
    truth_table,
    unplaced_reports,
)

REPO = Path(__file__).resolve().parents[2]
SHA = "ab" * 20

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0"
failures="2" skipped="3" tests="40" time="1.0"></testsuite></testsuites>"""


def _gate(target, **change):
    gate = {"format": publish.GATE_FORMAT, "target": target, "result": "passed",
            "tests": {"tests": 12, "passed": 12, "failed": 0, "errors": 0, "skipped": 0},
            "wheels": {"w.whl": "0" * 64}, "device_archs": [target], "commit": SHA,
            "run_id": "77"}  # fmt: skip
    gate.update(change)
    return gate


@pytest.fixture
def records(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)
    rec = emulation_record(junit, "gfx1030", SHA, "NVIDIA H100", "2026-11-23T17:00:00Z")
    assert (rec["passed"], rec["failed"], rec["skipped"]) == (35, 2, 3)
    d = tmp_path / "records"
    d.mkdir()
    (d / "gfx1030.json").write_text(json.dumps(rec))
    return d


def _rows(records, gates_root, wheels):
    recipes = [get_recipe(t) for t in ("gfx1030", "gfx10-3-generic", "gfx1100", "gfx1101",
                                        "gfx1102", "gfx90a")]  # fmt: skip
    return {r.target: r for r in truth_table(recipes, records, [gates_root], wheels)}


def test_every_level_comes_from_a_record(records, tmp_path):
    gates = tmp_path / "artifacts"
    for name, gate in {
        "gpu-gate-gfx1100": _gate("gfx1100"),
        "gpu-gate-gfx1101": _gate("gfx1101", tests={"passed": 12, "failed": 2, "errors": 0}),
        "gpu-gate-gfx1102": _gate("gfx1102", device_archs=["gfx1100"]),
        "gpu-gate-gfx90a": _gate("gfx90a", emulates="gfx1030"),
    }.items():
        (gates / name).mkdir(parents=True)
        (gates / name / "gpu-gate.json").write_text(json.dumps(gate))
    rows = _rows(records, gates, tmp_path / "no-wheels")
    # emulation: the gfx1030 variant stands for both gfx10.3 targets, with its counts
    for t in ("gfx1030", "gfx10-3-generic"):
        assert rows[t].emulation.startswith("gfx1030 on NVIDIA H100: gpu 35 passed, 2 failed")
    assert rows["gfx1100"].emulation == "variant exists, no recorded run yet"  # gfx11's
    assert rows["gfx90a"].emulation == "variant exists, no recorded run yet"  # gfx9's (wave64)
    # hardware: only a record that holds together counts
    assert rows["gfx1100"].hardware == f"12 passed on gfx1100 ({SHA[:12]}, run 77)"
    assert rows["gfx1101"].hardware.startswith("invalid record gpu-gate.json: a pass with 2 failed")
    assert "device archs ['gfx1100'] are not the recipe's ['gfx1102']" in rows["gfx1102"].hardware
    assert "records an emulation run" in rows["gfx90a"].hardware
    assert rows["gfx1030"].hardware == "no runner record"
    assert all(r.static.startswith("yes") for r in rows.values())
    assert "| gfx1100 | gfx1100 | yes" in format_table(list(rows.values()))


def test_a_record_for_other_wheels_or_unreadable_is_invalid(records, tmp_path):
    gates = tmp_path / "artifacts"
    (gates / "a").mkdir(parents=True)
    (gates / "a" / "gpu-gate.json").write_text(json.dumps(_gate("gfx1100")))
    wheels = tmp_path / "wheels"
    (wheels / "gfx1100").mkdir(parents=True)
    manifest = {"wheels": {"other.whl": "1" * 64}, "source_commit": SHA,
                "verification": {"static": "passed"}}  # fmt: skip
    (wheels / "gfx1100" / "build-manifest.json").write_text(json.dumps(manifest))
    (records / "broken.json").write_text("{not json")
    rows = _rows(records, gates, wheels)
    assert rows["gfx1100"].hardware.endswith("it tested other wheels than the local build's")
    assert rows["gfx1100"].static == f"yes; local build of {SHA[:12]}"


def test_an_invalid_emulation_record_is_shown_as_such(tmp_path):
    d = tmp_path / "records"
    d.mkdir()
    (d / "gfx1030.json").write_text(json.dumps({"format": 1, "variant": "gfx1030", "passed": -1,
                                                "failed": 0, "errors": 0, "skipped": 0,
                                                "commit": "nope"}))  # fmt: skip
    rows = _rows(d, tmp_path / "none", tmp_path / "none")
    assert rows["gfx1030"].emulation == ("invalid record gfx1030.json: unknown suite None; passed "
                                         "must be a count, got -1; commit 'nope' is not a git sha")  # fmt: skip


def test_a_variants_suites_are_listed_in_order_and_one_bad_record_taints_the_row(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)
    d = tmp_path / "records"
    d.mkdir()
    for suite in ("upstream-causal-conv1d", "gpu", "upstream-mamba"):  # written out of order
        rec = emulation_record(junit, "gfx11", SHA, "H100", "2026-11-24T01:00:00Z", suite)
        (d / f"gfx11-{suite}.json").write_text(json.dumps(rec))
    rows = _rows(d, tmp_path / "none", tmp_path / "none")
    run = f"35 passed, 2 failed, 0 errors (2026-11-24T01:00:00Z, {SHA[:12]})"
    assert rows["gfx1100"].emulation == (f"gfx11 on H100: gpu {run}; upstream-mamba {run}; "
                                         f"upstream-causal-conv1d {run}")  # fmt: skip
    assert rows["gfx1030"].emulation == "variant exists, no recorded run yet"
    bad = json.loads((d / "gfx11-upstream-mamba.json").read_text()) | {"suite": "my own tests"}
    (d / "gfx11-upstream-mamba.json").write_text(json.dumps(bad))
    rows = _rows(d, tmp_path / "none", tmp_path / "none")
    assert rows["gfx1101"].emulation == (
        "invalid record gfx11-upstream-mamba.json: unknown suite 'my own tests'"
    )
    with pytest.raises(ValueError, match="unknown suite 'bench'"):
        emulation_record(junit, "gfx11", SHA, "H100", "d", "bench")


def test_a_prebuilt_kernel_folder_must_be_the_named_emulation(tmp_path):
    (tmp_path / "k" / "sm_90").mkdir(parents=True)
    manifest = tmp_path / "k" / "sm_90" / "manifest.json"
    manifest.write_text(json.dumps({"target": "sm_90", "compiler": "clang", "emulates": "gfx12"}))
    assert check_emulation_kernels(tmp_path / "k", "gfx12") == (
        "prebuilt sm_90 kernels (clang; emulates gfx12)"
    )
    with pytest.raises(ValueError, match="holds a build of gfx12, the run says gfx11"):
        check_emulation_kernels(tmp_path / "k", "gfx11")
    with pytest.raises(ValueError, match="holds a build of gfx12, the run says none"):
        check_emulation_kernels(tmp_path / "k", "")
    manifest.write_text(json.dumps({"target": "sm_90", "compiler": "nvcc"}))
    with pytest.raises(ValueError, match="holds a build of no emulation, the run says gfx1030"):
        check_emulation_kernels(tmp_path / "k", "gfx1030")
    with pytest.raises(ValueError, match="expected one <arch>/manifest.json, found 0"):
        check_emulation_kernels(tmp_path / "none", "gfx12")


def test_emulation_record_refuses_unknown_variants_and_bad_commits(tmp_path):
    junit = tmp_path / "j.xml"
    junit.write_text(JUNIT)
    with pytest.raises(ValueError, match="unknown emulation variant 'gfx9000'"):
        emulation_record(junit, "gfx9000", SHA, "x", "d")
    with pytest.raises(ValueError, match="commit must be a 40-hex git sha"):
        emulation_record(junit, "gfx1030", "HEAD", "x", "d")


def test_publish_never_takes_an_emulation_record_as_a_gpu_gate(tmp_path):
    manifest = {"target": "gfx1030", "wheels": {"w.whl": "0" * 64}, "source_commit": SHA}
    gate = _gate("gfx1030", variant="gfx1030")
    with pytest.raises(publish.PublishError, match="records an emulation run"):
        publish.check_gate(gate, manifest, tmp_path / "gpu-gate.json")


def test_the_readme_table_is_the_commands_output(tmp_path):
    rows = truth_table(list(load_recipes().values()), REPO / "records" / "emulation", [],
                       tmp_path / "no-wheels")  # fmt: skip
    assert format_table(rows) in (REPO / "README.md").read_text()


def test_user_reports_in_the_truth_table(tmp_path):
    """`truth --reports DIR`: a valid report counts for its target (the newest one shown); one
    with a failed check, a GPU the recipe does not build for or other kernels is refused, saying
    why; nothing changes the other columns."""
    from mamba2_rocm.selftest.report import REPORT_FORMAT

    wheels = tmp_path / "wheels"
    for target, sha in (("gfx1100", "a"), ("gfx1030", "b")):
        (wheels / target).mkdir(parents=True)
        manifest = {"code_objects": {f"{target}/ssd.hsaco": sha * 64},
                    "verification": {"static": "passed"}, "source_commit": SHA}  # fmt: skip
        (wheels / target / "build-manifest.json").write_text(json.dumps(manifest))

    def report(target, sha, date, arch=None, ok=True):
        return {"format": REPORT_FORMAT, "tier": "kernel", "date": date, "mamba2_rocm": "1.0",
                "device": {"name": "Radeon", "arch": arch or target, "runtime": "HIP 6.4.1"},
                "kernels": {"target": target, "code_objects": {"ssd.hsaco": sha * 64}},
                "checks": [{"name": "ssd fwd bfloat16", "ok": ok}]}  # fmt: skip

    reports = tmp_path / "reports"
    reports.mkdir()
    for name, rep in {
        "old.json": report("gfx1100", "a", "2026-12-01T00:00:00Z"),
        "new.json": report("gfx1100", "a", "2026-12-05T00:00:00Z"),
        "failed.json": report("gfx1030", "b", "2026-12-05T00:00:00Z", ok=False),
        "tampered.json": report("gfx1101", "c", "2026-12-05T00:00:00Z"),
        "nvidia.json": report("sm_90", "d", "2026-12-05T00:00:00Z"),
    }.items():
        (reports / name).write_text(json.dumps(rep))
    (reports / "cut.json").write_text('{"format": ')
    recipes = [get_recipe(t) for t in ("gfx1030", "gfx1100", "gfx1101", "gfx90a")]
    read = read_reports([reports])
    rows = {r.target: r for r in truth_table(recipes, tmp_path / "none", [], wheels, read)}
    assert rows["gfx1100"].reported == (
        "1 checks passed on Radeon (gfx1100, HIP 6.4.1), 2026-12-05T00:00:00Z, mamba2-rocm 1.0"
    )
    assert rows["gfx1030"].reported == "refused failed.json: 1 check(s) failed: ssd fwd bfloat16"
    assert rows["gfx1101"].reported.startswith("refused tampered.json: ")
    assert "no build manifest of gfx1101" in rows["gfx1101"].reported
    assert rows["gfx90a"].reported == "no user report"
    table = format_table(list(rows.values()), reports=True)
    assert table.splitlines()[0].endswith("| reported by a user |")
    assert "reported by a user" not in format_table(list(rows.values()))
    assert unplaced_reports(recipes, read) == [
        "cut.json: unreadable (Expecting value: line 1 column 12 (char 11))",
        "nvidia.json: kernels for 'sm_90' (Radeon), which no recipe builds",
    ]
