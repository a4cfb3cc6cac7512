"""The GPU test session without a GPU: its docker command line, the health check, the gate
verdict, and the fast failure on a machine without /dev/kfd (this one)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mamba2_rocm.pipeline import gputest
from mamba2_rocm.pipeline.gputest import GpuTestError, gate_verdict, health_check, junit_counts
from mamba2_rocm.pipeline.recipes import get_recipe

REPO = Path(__file__).resolve().parents[2]

ROCMINFO = """\
*******
Agent 1
*******
  Name:                    AMD Ryzen 9 7950X
  Uuid:                    CPU-XX
*******
Agent 2
*******
  Name:                    {arch}
  Uuid:                    GPU-1234
  Marketing Name:          AMD Radeon Graphics
"""


def test_run_args_hand_over_the_gpu_and_nothing_else():
    args = gputest.run_args("img:tag", 993, Path("/tmp/out"), ["rocminfo"])
    assert args[:3] == ["docker", "run", "--rm"]
    joined = " ".join(args)
    for pair in ("--device /dev/kfd", "--device /dev/dri", "--group-add video",
                 "--group-add 993", "--security-opt seccomp=unconfined", "--ipc host",
                 "-v /tmp/out:/out", "-e OUT=/out"):  # fmt: skip
        assert pair in joined
    assert args[-2:] == ["img:tag", "rocminfo"]
    # the host environment does not leak in: only the variables named here
    envs = [args[i + 1] for i, a in enumerate(args) if a == "-e"]
    assert envs == ["PYTHONUNBUFFERED=1", "OUT=/out"]
    assert "--privileged" not in args


def test_no_kfd_fails_fast_with_a_clear_message(tmp_path):
    with pytest.raises(
        GpuTestError, match=r"no .*/kfd on this machine, so there is no AMD GPU"
    ) as err:
        gputest.check_devices("gfx1030", tmp_path)
    assert "this is a failure, not a skip" in str(err.value)
    (tmp_path / "kfd").touch()
    with pytest.raises(GpuTestError, match="amdgpu render nodes are missing"):
        gputest.check_devices("gfx1030", tmp_path)
    (tmp_path / "dri").mkdir()
    gputest.check_devices("gfx1030", tmp_path)


def test_render_gid_comes_from_the_render_node(tmp_path):
    (tmp_path / "dri").mkdir()
    node = tmp_path / "dri" / "renderD128"
    node.touch()
    assert gputest.render_gid(tmp_path) == node.stat().st_gid


@pytest.mark.skipif(Path("/dev/kfd").exists(), reason="this machine has an AMD GPU")
def test_cli_without_kfd_fails_before_docker(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path))  # no docker on PATH: it must not be reached
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "mamba2_rocm.pipeline", "gpu-tests", "gfx1030"],
                          cwd=REPO, env=env, capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 1
    assert "gpu-tests-gfx1030: no /dev/kfd on this machine" in proc.stderr
    assert "not a skip" in proc.stderr and time.monotonic() - start < 30


def test_health_check_accepts_the_recipe_arch_and_its_generic_family():
    assert health_check(get_recipe("gfx1030"), ROCMINFO.format(arch="gfx1030")) == ["gfx1030"]
    # a generic target runs on every member of its family
    assert health_check(get_recipe("gfx11-generic"), ROCMINFO.format(arch="gfx1101")) == ["gfx1101"]


def test_health_check_names_what_it_found():
    with pytest.raises(
        GpuTestError,
        match=r"rocminfo lists the GPU arch\(s\) gfx1100, but the recipe's code objects are for gfx1030",
    ):
        health_check(get_recipe("gfx1030"), ROCMINFO.format(arch="gfx1100"))
    with pytest.raises(GpuTestError, match="rocminfo lists no GPU agent at all"):
        health_check(get_recipe("gfx1030"), "Agent 1\n  Name: AMD Ryzen\n")


def _junit(path: Path, tests: int, failures=0, errors=0, skipped=0) -> Path:
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="{tests}" '
                    f'failures="{failures}" errors="{errors}" skipped="{skipped}"/></testsuites>')  # fmt: skip
    return path


def test_gate_verdict_never_takes_skips_for_a_pass(tmp_path):
    ok = junit_counts(_junit(tmp_path / "a.xml", 10))
    assert ok == {"tests": 10, "passed": 10, "failed": 0, "errors": 0, "skipped": 0}
    assert gate_verdict(ok) is None
    skipped = junit_counts(_junit(tmp_path / "b.xml", 10, skipped=10))
    assert gate_verdict(skipped) == "10 GPU test(s) skipped (the GPU was not usable from the tests)"
    assert gate_verdict(junit_counts(_junit(tmp_path / "c.xml", 0))) == "no GPU test ran"
    assert (
        gate_verdict(junit_counts(_junit(tmp_path / "d.xml", 5, failures=1)))
        == "1 failed, 0 errors"
    )
    with pytest.raises(GpuTestError, match="no readable JUnit report"):
        junit_counts(tmp_path / "missing.xml")


def test_write_gate_refuses_a_run_that_did_not_pass(tmp_path):
    manifest = {"target": "gfx1030", "version": "1.0", "wheels": {"a.whl": "0" * 64}}
    counts = {"tests": 3, "passed": 0, "failed": 0, "errors": 0, "skipped": 3}
    with pytest.raises(GpuTestError, match="not writing a GPU gate for gfx1030: 3 GPU test"):
        gputest.write_gate(tmp_path, manifest, ["gfx1030"], counts, "img", {})
    assert not (tmp_path / "gpu-gate.json").exists()


def test_benchmark_reports_are_kept_beside_the_gate_and_bound_to_it(tmp_path):
    """A passed run's bench-<op>.json reports go to wheels/<target>/gpu-bench/<op>.json (an
    earlier run's removed) and the gate names each with its sha256; a report that is not JSON or
    holds no rows fails instead of being kept."""
    out, target = tmp_path / "out", tmp_path / "gfx1030"
    out.mkdir()
    rows = {"ssd-paths": [{"case": "a", "path_loss": 0.0}], "conv1d": [{"case": "b"}]}
    for op, r in rows.items():
        (out / f"bench-{op}.json").write_text(json.dumps(r))
    (out / "junit.xml").write_text("<testsuites/>")  # not a report
    stale = target / gputest.BENCH_DIR / "decode.json"
    stale.parent.mkdir(parents=True)
    stale.write_text("[]")
    digests = gputest.keep_benchmarks(out, target / gputest.BENCH_DIR)
    kept = sorted(p.name for p in (target / gputest.BENCH_DIR).iterdir())
    assert kept == ["conv1d.json", "ssd-paths.json"]
    for op, r in rows.items():
        path = target / gputest.BENCH_DIR / f"{op}.json"
        assert json.loads(path.read_text()) == r
        assert digests[op] == hashlib.sha256(path.read_bytes()).hexdigest()
    manifest = {"target": "gfx1030", "version": "1.0", "wheels": {"a.whl": "0" * 64}}
    counts = {"tests": 3, "passed": 3, "failed": 0, "errors": 0, "skipped": 0}
    gate = gputest.write_gate(target, manifest, ["gfx1030"], counts, "img", digests)
    assert json.loads(gate.read_text())["benchmarks"] == digests
    (out / "bench-decode.json").write_text("{not json")
    with pytest.raises(GpuTestError, match="bench-decode.json is not JSON"):
        gputest.keep_benchmarks(out, target / gputest.BENCH_DIR)
    (out / "bench-decode.json").write_text("[]")
    with pytest.raises(GpuTestError, match="bench-decode.json holds no rows"):
        gputest.keep_benchmarks(out, target / gputest.BENCH_DIR)


def test_the_image_installs_only_through_the_torch_protection():
    """The Dockerfile and its run script, read statically (no ROCm image can be pulled here)."""
    dockerfile = (REPO / "docker" / "gpu-test.Dockerfile").read_text()
    assert f"ARG BASE_IMAGE={gputest.DEFAULT_BASE_IMAGE}" in dockerfile
    steps = [line.strip() for line in dockerfile.splitlines()]
    # every pip install into the torch interpreter goes through protect-torch: the only plain
    # `pip install` is into the guard's own venv
    plain = [s for s in steps if "pip install" in s]
    assert plain == [
        '&& /opt/m2r/guard/bin/pip install -q "/opt/m2r/wheels/mamba2_rocm-${VERSION}-py3-none-any.whl"'
    ]
    order = ["env compile-safety", "env fingerprint", "env protect-torch", "env verify"]
    positions = [dockerfile.index(s) for s in order]
    assert positions == sorted(positions)
    assert steps[-3:] == [
        "USER m2r",
        "WORKDIR /opt/m2r/src",
        'ENTRYPOINT ["/opt/m2r/gpu-test-run.sh"]',
    ]
    script = (REPO / "docker" / "gpu-test-run.sh").read_text()
    order = ["-m mamba2_rocm env compile-safety", "-m mamba2_rocm doctor",
             "-m mamba2_rocm env verify", "-m pytest -m gpu", "-m mamba2_rocm bench"]  # fmt: skip
    positions = [script.index(s) for s in order]
    assert positions == sorted(positions)
    assert "--junitxml" in script and "for op in conv1d decode ssd" in script
    assert 'bench ssd-paths --json > "$OUT/bench-ssd-paths.json"' in script


def test_run_script_is_valid_bash():
    proc = subprocess.run(
        ["bash", "-n", str(REPO / "docker" / "gpu-test-run.sh")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
