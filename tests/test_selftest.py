"""``python -m mamba2_rocm selftest`` on CPU: the harness run with the torch tier standing in for
the kernels (every check in bf16 against float64: the tolerances hold, an injected wrong result
fails naming its check), the report's schema and privacy, and its validation for the truth table
(wrong arch, unknown sha256, a failed check: refused with the reason)."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from mamba2_rocm import selftest
from mamba2_rocm.selftest import checks
from mamba2_rocm.selftest.report import REPORT_FORMAT, privacy_problems, report_problems

KERNELS = {"target": "gfx1100", "origin": "package mamba2-rocm-gfx1100 1.0",
           "code_objects": {"ssd.hsaco": "a" * 64, "conv1d.hsaco": "b" * 64}}  # fmt: skip
MANIFEST = {"code_objects": {"gfx1100/ssd.hsaco": "a" * 64, "gfx1100/conv1d.hsaco": "b" * 64}}


@pytest.fixture
def cpu_dry_run(monkeypatch):
    """The harness on CPU: 'kernel' runs the torch tier too (in the check's dtype)."""
    real = checks.backend

    @contextlib.contextmanager
    def backend(tier):
        with real("torch"):
            yield

    monkeypatch.setattr(checks, "backend", backend)
    monkeypatch.setattr(selftest, "_environment", lambda device: {
        "name": "AMD Radeon RX 7900 XTX", "arch": "gfx1100", "arch_full": "gfx1100",
        "runtime": "HIP 6.4.1", "driver": "6.10", "torch": torch.__version__, "mamba2_rocm": "1.0"})  # fmt: skip
    monkeypatch.setattr(selftest, "_kernels", lambda device: KERNELS)
    monkeypatch.setattr(checks, "special_checks", lambda: [])
    monkeypatch.setattr(selftest, "_timings", lambda device, quick, log: [])


def test_quick_dry_run_passes_and_writes_a_report(cpu_dry_run, tmp_path, capsys):
    path = tmp_path / "report.json"
    ok, report = selftest.run_selftest(quick=True, report_path=path, device=torch.device("cpu"))
    out = capsys.readouterr().out
    assert ok, out
    assert "[12/12] ok" in out and "12 of 12 checks passed" in out
    written = json.loads(path.read_text())
    assert written == json.loads(json.dumps(report))
    assert written["format"] == REPORT_FORMAT and written["tier"] == "kernel"
    assert {c["family"] for c in written["checks"]} == set(checks.FAMILIES)
    assert all(c["ok"] and c["error"] <= c["tolerance"] for c in written["checks"])
    assert privacy_problems(path.read_text()) == []
    assert report_problems(written, ("gfx1100",), "gfx1100", MANIFEST) == []


def test_a_wrong_result_fails_and_names_the_check(cpu_dry_run, monkeypatch, capsys):
    monkeypatch.setenv(checks.FAULT_ENV, "ssd fwd")
    ok, report = selftest.run_selftest(quick=True, device=torch.device("cpu"))
    out = capsys.readouterr().out
    assert not ok
    failed = [c for c in report["checks"] if not c["ok"]]
    assert [c["family"] for c in failed] == ["ssd fwd"] and failed[0][
        "detail"
    ] == "output 0 differs"
    assert "FAIL ssd fwd bfloat16 b2 l259 h6 p40 n32 g2 c64" in out
    assert "11 of 12 checks passed" in out and "FAILED ssd fwd bfloat16" in out
    assert report_problems(report, ("gfx1100",), "gfx1100", MANIFEST) == [
        "1 check(s) failed: ssd fwd bfloat16 b2 l259 h6 p40 n32 g2 c64"
    ]


def test_a_report_with_this_machines_identity_is_not_written(cpu_dry_run, monkeypatch, tmp_path):
    from mamba2_rocm.selftest import report

    monkeypatch.setattr(report.socket, "gethostname", lambda: "build-box-7")
    monkeypatch.setattr(selftest, "_kernels",
                        lambda device: {**KERNELS, "origin": "jit cache on build-box-7"})  # fmt: skip
    monkeypatch.setattr(checks, "correctness_checks", lambda quick: [])
    with pytest.raises(RuntimeError, match="the report would contain this machine's host name"):
        selftest.run_selftest(
            quick=True, report_path=tmp_path / "r.json", device=torch.device("cpu")
        )
    assert not (tmp_path / "r.json").exists()


def _report(**edits):
    rep = {"format": REPORT_FORMAT, "tier": "kernel", "date": "2026-12-06T10:00:00Z",
           "mamba2_rocm": "1.0", "device": {"name": "AMD Radeon RX 7900 XTX", "arch": "gfx1100",
                                             "runtime": "HIP 6.4.1"},
           "kernels": KERNELS, "checks": [{"name": "ssd fwd bfloat16", "ok": True}]}  # fmt: skip
    rep.update(edits)
    return rep


@pytest.mark.parametrize(("edits", "manifest", "reason"), [
    ({}, MANIFEST, None),
    ({"device": {"arch": "gfx1030"}}, MANIFEST, "its GPU is gfx1030, not one of gfx1100's archs (gfx1100)"),
    ({"kernels": {**KERNELS, "code_objects": {"ssd.hsaco": "c" * 64}}}, MANIFEST,
     "gfx1100/ssd.hsaco: sha256 cccccccccccc is not the build's (aaaaaaaaaaaa)"),
    ({"checks": [{"name": "decode step bfloat16", "ok": False}]}, MANIFEST,
     "1 check(s) failed: decode step bfloat16"),
    ({"checks": []}, MANIFEST, "it holds no checks"),
    ({"tier": "torch"}, MANIFEST, "it ran the 'torch' tier, not the kernels"),
    ({}, None, "no build manifest of gfx1100 to compare its kernels with"),
    ({"format": 9}, MANIFEST, "format 9, expected 1"),
    ({"kernels": {**KERNELS, "source_commit": "ab" * 20}}, {**MANIFEST, "source_commit": "cd" * 20},
     "its kernels were built from abababababab, the build manifest says cdcdcdcdcdcd"),
    ({"kernels": {**KERNELS, "source_commit": "cd" * 20}}, {**MANIFEST, "source_commit": "cd" * 20}, None),
])  # fmt: skip
def test_report_validation(edits, manifest, reason):
    problems = report_problems(_report(**edits), ("gfx1100",), "gfx1100", manifest)
    assert problems == ([] if reason is None else [reason])


def test_selftest_without_a_gpu_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError) as info:
        selftest.run_selftest(quick=True)
    assert str(info.value) == ("selftest needs a ROCm (or CUDA) GPU that torch can see; "
                               "`python -m mamba2_rocm doctor` says why it cannot")  # fmt: skip
    from mamba2_rocm import cli

    assert cli.main(["selftest", "--quick"]) == 1


@pytest.mark.parametrize("emulates", [None, "gfx11"])
def test_the_kernels_section_names_an_emulation_build(monkeypatch, emulates):
    """A report from an NVIDIA build of an AMD target's code paths says which target it stands
    in for (the truth table then lists it under 'counted for no target', never as that GPU)."""
    import types
    from pathlib import Path

    from mamba2_rocm.runtime import loader

    manifest = {"code_objects": [{"file": "ssd.cubin", "sha256": "c" * 64}]}
    if emulates:
        manifest["emulates"] = emulates
    kdir = types.SimpleNamespace(target="sm_90", origin="env MAMBA2_ROCM_KERNEL_PATH",
                                 path=Path("/k/sm_90"), manifest=manifest)  # fmt: skip
    monkeypatch.setattr(loader, "kernels_for_device", lambda i: types.SimpleNamespace(kdir=kdir))
    section = selftest._kernels(torch.device("cpu"))
    assert section["target"] == "sm_90" and section["code_objects"] == {"ssd.cubin": "c" * 64}
    assert section.get("emulates") == emulates and section["source_commit"] is None


def test_peers_are_upstreams_ops_never_the_drop_ins(monkeypatch):
    """The timing's third column is upstream's op where the real package imports (its Triton
    SSD here); a name the drop-in serves is ours and gets no column, nor does a missing one."""
    import sys
    import types

    import mamba2_rocm

    def upstream_ssd(*a, **kw):
        return None

    upstream_ssd.__module__ = "mamba_ssm.ops.triton.ssd_combined"
    real = types.ModuleType("mamba_ssm.ops.triton.ssd_combined")
    real.mamba_chunk_scan_combined = upstream_ssd
    facade = types.ModuleType("mamba_ssm.ops.triton.layernorm_gated")
    facade.rmsnorm_fn = mamba2_rocm.rmsnorm_fn  # (what the drop-in's facade re-exports)
    monkeypatch.setitem(sys.modules, "mamba_ssm.ops.triton.ssd_combined", real)
    monkeypatch.setitem(sys.modules, "mamba_ssm.ops.triton.layernorm_gated", facade)
    monkeypatch.setitem(sys.modules, "mamba_ssm.ops.triton.selective_state_update", None)
    monkeypatch.setitem(sys.modules, "causal_conv1d", None)
    assert selftest.peer_ops() == {"ssd": ("mamba_ssm Triton", upstream_ssd)}
