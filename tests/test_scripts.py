"""The device scripts: fresh temporary directories per run (no fixed /tmp paths that an
earlier run, or another user, could have filled and that would land on PYTHONPATH)."""

import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "scripts").glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_no_fixed_temporary_paths(script):
    text = script.read_text()
    assert not re.search(r"/tmp/", text), f"{script.name} uses a fixed /tmp path"
    if "PYTHONPATH" in text:
        assert "$(mktemp -d)" in text


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def _profile_ssd():
    return runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / "profile_ssd.py"))


def test_profile_ssd_scan_form_runs_the_form_it_names(monkeypatch):
    """--scan-form: the SSD forward launches the named chunk_scan form, not the rule's pick."""
    import math

    import torch
    from helpers import stand_in_kernels

    from mamba2_rocm.ops import ssd as ssd_ops

    monkeypatch.setattr(ssd_ops, "_scan_form", ssd_ops._scan_form)  # restored after the test
    kset = stand_in_kernels(monkeypatch, ssd_ops, matrix_cores=True)  # the rule: t64b128
    _profile_ssd()["force_scan_form"]("t128", {"s": (1, 300, 2, 64, 1, 16, 128)})
    x, B = torch.randn(1, 300, 2, 64).bfloat16(), torch.randn(1, 300, 1, 16).bfloat16()
    dt, A = torch.rand(1, 300, 2).bfloat16(), -torch.rand(2)
    ssd_ops._impl(x, dt, A, B, B.clone(), 128, None, None, None, None, None, None,
                  False, (0.0, math.inf), False, None)  # fmt: skip
    scans = [
        (n, blk)
        for (n, _, _), blk in zip(kset.launches, kset.blocks, strict=True)
        if "chunk_scan" in n
    ]
    assert scans == [("m2r_ssd_chunk_scan_bf16_t128", (256, 1, 1))]


def test_profile_ssd_scan_form_refuses_chunks_under_its_rows(monkeypatch):
    from mamba2_rocm.ops import ssd as ssd_ops

    monkeypatch.setattr(ssd_ops, "_scan_form", ssd_ops._scan_form)
    shapes = {"a": (1, 8, 1, 64, 1, 16, 64), "b": (1, 8, 1, 64, 1, 16, 256)}
    with pytest.raises(ValueError) as exc:
        _profile_ssd()["force_scan_form"]("t128", shapes)
    assert str(exc.value) == "--scan-form t128 takes chunks of 128 and more: not a"


def test_profile_ssd_scan_form_refuses_triton(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["profile_ssd.py", "--scan-form", "t128", "--triton"])
    with pytest.raises(SystemExit) as exc:
        _profile_ssd()["main"]()
    assert exc.value.code == 2
    assert (
        "error: --scan-form picks among our kernels: not with --triton" in capsys.readouterr().err
    )


def test_profile_ssd_triton_configs_reports_each_tuning_once():
    """--configs: every autotuned kernel's kept config, each (kernel, key) reported by the first
    shape that tuned it; plain jitted kernels and other module members are skipped."""
    import types

    triton_configs = _profile_ssd()["triton_configs"]

    class Tuned:  # triton's Autotuner: its configs, and the one kept per key
        def __init__(self, cache):
            self.configs, self.cache = ["a", "b"], cache

    class Jitted:  # a plain @triton.jit kernel: a cache of compiled code, no configs
        def __init__(self):
            self.cache = {0: {"compiled": object()}}

    mod = types.ModuleType("ssd_chunk_scan")
    mod._chunk_scan_fwd_kernel = Tuned({(128, 64): "BLOCK_SIZE_M: 64, BLOCK_SIZE_N: 64"})
    mod._helper_kernel = Jitted()
    mod.helper = lambda: None  # no cache
    mod.TRITON_22 = True
    seen = set()
    assert triton_configs([mod], seen) == {
        "_chunk_scan_fwd_kernel": [("(128, 64)", "BLOCK_SIZE_M: 64, BLOCK_SIZE_N: 64")]
    }
    assert triton_configs([mod], seen) == {}  # nothing new
    mod._chunk_scan_fwd_kernel.cache[(256, 64)] = "BLOCK_SIZE_M: 32, BLOCK_SIZE_N: 64"
    assert triton_configs([mod], seen) == {
        "_chunk_scan_fwd_kernel": [("(256, 64)", "BLOCK_SIZE_M: 32, BLOCK_SIZE_N: 64")]
    }


def test_profile_ssd_configs_needs_triton(monkeypatch, capsys):
    import sys

    monkeypatch.setattr(sys, "argv", ["profile_ssd.py", "--configs", "falcon-h1"])
    with pytest.raises(SystemExit):
        _profile_ssd()["main"]()
    assert "only with --triton" in capsys.readouterr().err
