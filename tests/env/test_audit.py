import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import fake_torch, make_kfd

from mamba2_rocm.env import audit, detect
from mamba2_rocm.env.audit import Facts, Finding, TorchInfo, check, exit_code, report
from mamba2_rocm.env.detect import GpuDevice
from mamba2_rocm.runtime.discovery import KernelDir

ROOT = Path(__file__).resolve().parents[2]
ROCM = TorchInfo(True, "2.5.1+rocm6.2", hip="6.2.41133", location="/v/torch")
CUDA = TorchInfo(True, "2.5.1+cu124", cuda="12.4", location="/v/torch")
CPU = TorchInfo(True, "2.5.1+cpu", location="/v/torch")
NO_TORCH = TorchInfo(False, error="not installed")
GFX1100 = GpuDevice(0, "gfx1100", "gfx1100", {}, "Radeon RX 7900 XTX", "torch")


def facts(torch=ROCM, devices=(GFX1100,), amd=True, kfd="ok", **kw):
    return Facts(
        environ=kw.pop("environ", {}),
        torch=torch,
        devices=list(devices),
        device_sources=kw.pop("device_sources", ["torch: 1 device(s)"]),
        amd_gpus=amd,
        kfd=kfd,
        kernel_dirs=kw.pop("kernel_dirs", [KernelDir("gfx1100", Path("/k"), "package x 1", {})]),
        **kw,
    )


def by_id(found):
    return {f.id: f for f in found}


def test_clean_rocm_machine_has_no_findings():
    assert check(facts()) == []
    assert exit_code([]) == 0


def test_finding_rejects_unknown_severity():
    with pytest.raises(ValueError, match="got 'fatal'"):
        Finding("x", "fatal", "m", "f")


def test_torch_missing_is_a_warning():
    found = by_id(check(facts(torch=NO_TORCH, devices=(), amd=False, kfd="missing")))
    assert found["torch-missing"].severity == "warning"
    assert "pip install torch --index-url" in found["torch-missing"].fix
    assert exit_code(list(found.values())) == 0


@pytest.mark.parametrize(
    ("devices", "amd", "line"),
    [
        ([GpuDevice(0, "gfx1030", "gfx1030", {}, "", "rocminfo")], True,
         "for this machine (AMD GPU): pip install torch --index-url "
         "https://download.pytorch.org/whl/rocm6.4 "),
        ([], True, "(AMD GPU): pip install torch --index-url https://download.pytorch.org/whl/rocm"),
        ([GpuDevice(0, "sm_90", "sm_90", {}, "", "nvidia-smi")], False,
         "for this machine (NVIDIA GPU): pip install torch, then"),
        ([], False, "for this machine (no GPU): pip install torch --index-url "
         "https://download.pytorch.org/whl/cpu, then"),
    ],
)  # fmt: skip
def test_torch_missing_gives_the_install_line_for_the_detected_gpu(devices, amd, line):
    found = by_id(check(facts(torch=NO_TORCH, devices=devices, amd=amd, kfd="missing")))
    assert "cannot run at all" in found["torch-missing"].message
    assert line in found["torch-missing"].fix


def test_without_torch_no_fallback_is_promised():
    found = by_id(check(facts(torch=NO_TORCH, devices=(), amd=False, kfd="missing")))
    assert "reference fallback" not in found["no-gpu"].fix.split(";")[0]
    assert "without torch no op runs here" in found["no-gpu"].fix
    found = by_id(check(facts(torch=CPU, devices=(), amd=False, kfd="missing")))
    assert found["no-gpu"].fix.startswith(
        "nothing to do on a CPU-only machine: ops use the PyTorch"
    )


def test_doctor_without_torch_in_a_subprocess():
    """The real CLI in an interpreter where `import torch` fails: the finding and its line."""
    code = (
        "import sys; sys.modules['torch'] = None\n"  # import torch -> ImportError
        "from mamba2_rocm.cli import main; sys.exit(main(['doctor']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "torch-missing: torch is not installed: the mamba2-rocm ops cannot run" in proc.stdout
    assert "pip install torch --index-url https://download.pytorch.org/whl/" in proc.stdout
    assert "ops use the PyTorch reference fallback" not in proc.stdout


def test_torch_import_failure_is_an_error():
    broken = TorchInfo(True, error="import failed: OSError: libamdhip64.so: cannot open")
    found = by_id(check(facts(torch=broken)))
    assert found["torch-import-failed"].severity == "error"
    assert "libamdhip64.so" in found["torch-import-failed"].message


def test_cuda_torch_on_amd_machine_is_an_error():
    found = by_id(check(facts(torch=CUDA, devices=())))
    f = found["torch-cuda-on-amd"]
    assert f.severity == "error" and "'12.4'" in f.message and "rocm" in f.fix
    assert "torch-cuda-on-amd" not in by_id(check(facts(torch=CUDA, devices=(), amd=False)))


def test_cpu_torch_on_amd_machine_is_a_warning():
    assert by_id(check(facts(torch=CPU, devices=())))["torch-cpu-on-amd"].severity == "warning"
    assert "torch-cpu-on-amd" not in by_id(check(facts(torch=CPU, devices=(), amd=False)))


@pytest.mark.parametrize(
    "name",
    [
        "TORCHINDUCTOR_MAX_AUTOTUNE",
        "TORCHINDUCTOR_MAX_AUTOTUNE_GEMM",
        "TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE",
    ],
)
def test_max_autotune_is_an_error_on_rocm(name):
    found = check(facts(environ={name: "1"}))
    assert [f.id for f in found] == ["inductor-max-autotune"]
    assert found[0].severity == "error" and f"{name}=1" in found[0].message
    assert f"unset {name}" in found[0].fix and "configure_torch_compile" in found[0].fix
    assert exit_code(found) == 1


@pytest.mark.parametrize("value", ["true", "false", "TRUE", "yes", " 1", "2", ""])
def test_max_autotune_is_read_as_inductor_reads_it(value):
    """Inductor turns autotuning on for exactly "1" (#19): "true"/"false" leave it off."""
    assert check(facts(environ={"TORCHINDUCTOR_MAX_AUTOTUNE": value})) == []


def test_secret_looking_values_are_redacted():
    env = {
        "HIP_AUTH_HEADER": "Bearer x", "ROCM_CREDENTIALS": "c", "TRITON_TOKEN": "t",
        "CUDA_SECRET": "s", "AMD_PASSWORD": "p", "HSA_API_KEY": "k", "HIP_VISIBLE_DEVICES": "1",
    }  # fmt: skip
    shown = report(facts(environ=env))["environment"]
    assert shown == {**{k: "<redacted>" for k in env}, "HIP_VISIBLE_DEVICES": "1"}


def test_max_autotune_severity_follows_context():
    env = {"TORCHINDUCTOR_MAX_AUTOTUNE": "1"}
    assert check(facts(environ={"TORCHINDUCTOR_MAX_AUTOTUNE": "0"})) == []
    cpu_box = check(facts(torch=CPU, devices=(), amd=False, environ=env))
    assert by_id(cpu_box)["inductor-max-autotune"].severity == "info"
    no_torch_amd = check(facts(torch=NO_TORCH, devices=(), environ=env))
    assert by_id(no_torch_amd)["inductor-max-autotune"].severity == "warning"


@pytest.mark.parametrize(
    ("value", "fix"),
    [
        ("max_split_size_mb:128", "unset PYTORCH_CUDA_ALLOC_CONF"),
        (
            "expandable_segments:True,max_split_size_mb:512",
            "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        ),
    ],
)
def test_max_split_size_is_an_error_on_rocm(value, fix):
    found = check(facts(environ={"PYTORCH_CUDA_ALLOC_CONF": value}))
    assert [f.id for f in found] == ["alloc-conf-max-split-size"]
    assert found[0].severity == "error" and repr(value) in found[0].message
    assert found[0].fix.startswith(fix + " ")


def test_max_split_size_context():
    env = {"PYTORCH_HIP_ALLOC_CONF": "max_split_size_mb:64"}
    assert by_id(check(facts(environ=env)))["alloc-conf-max-split-size"].severity == "error"
    # A CUDA torch without AMD hardware accepts the option: nothing to report.
    cuda_box = check(facts(torch=CUDA, devices=(), amd=False, environ=env))
    assert "alloc-conf-max-split-size" not in by_id(cuda_box)
    # No torch yet: a ROCm torch installed later will reject it.
    no_torch = by_id(check(facts(torch=NO_TORCH, devices=(), amd=False, environ=env)))
    assert no_torch["alloc-conf-max-split-size"].severity == "warning"
    assert check(facts(environ={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})) == []


def test_numa_balancing_from_proc_file(tmp_path):
    proc = tmp_path / "numa_balancing"
    proc.write_text("1\n")
    value = audit.read_numa_balancing(proc)
    found = check(facts(numa_balancing=value))
    assert [f.id for f in found] == ["numa-balancing"]
    assert found[0].severity == "warning" and "numa_balancing=1" in found[0].message
    assert "kernel.numa_balancing=0" in found[0].fix
    proc.write_text("0\n")
    assert check(facts(numa_balancing=audit.read_numa_balancing(proc))) == []
    assert audit.read_numa_balancing(tmp_path / "absent") is None
    cpu_box = check(facts(torch=CPU, devices=(), amd=False, numa_balancing="1"))
    assert by_id(cpu_box)["numa-balancing"].severity == "info"


def test_kfd_status(tmp_path, monkeypatch):
    monkeypatch.setattr(audit.sys, "platform", "linux")
    assert audit.kfd_status(tmp_path / "kfd") == "missing"
    (tmp_path / "kfd").write_text("")
    assert audit.kfd_status(tmp_path / "kfd") == "ok"
    monkeypatch.setattr(audit.os, "access", lambda path, mode: False)  # root passes any mode
    assert audit.kfd_status(tmp_path / "kfd") == "no-access"
    monkeypatch.setattr(audit.sys, "platform", "win32")
    assert audit.kfd_status(tmp_path / "kfd") == "n/a"


@pytest.mark.parametrize(
    ("status", "fid"), [("missing", "kfd-missing"), ("no-access", "kfd-no-access")]
)
def test_kfd_findings(status, fid):
    found = check(facts(kfd=status))
    assert [f.id for f in found] == [fid] and found[0].severity == "error"
    assert "/dev/kfd" in found[0].message and "--group-add" in found[0].fix
    # A CPU machine without AMD hardware has no business with /dev/kfd.
    assert fid not in by_id(check(facts(torch=CPU, devices=(), amd=False, kfd=status)))


def test_kfd_missing_fix_names_docker_flags():
    (f,) = check(facts(kfd="missing"))
    assert "--device=/dev/kfd --device=/dev/dri" in f.fix


def test_override_malformed_is_an_error():
    found = check(facts(environ={"HSA_OVERRIDE_GFX_VERSION": "gfx1030"}))
    assert [f.id for f in found] == ["hsa-override-malformed"]
    assert "HSA_OVERRIDE_GFX_VERSION='gfx1030'" in found[0].message


def test_override_same_family_is_info():
    dev = GpuDevice(0, "gfx1030", "gfx1030", {}, "", "torch", real_arch="gfx1031")
    kd = [KernelDir("gfx10-3-generic", Path("/k"), "p", {})]
    found = check(
        facts(devices=[dev], kernel_dirs=kd, environ={"HSA_OVERRIDE_GFX_VERSION": "10.3.0"})
    )
    assert [(f.id, f.severity) for f in found] == [("hsa-override", "info")]
    assert "real arch gfx1031, effective gfx1030" in found[0].message


def test_override_cross_family_warns_with_real_and_effective():
    dev = GpuDevice(0, "gfx1030", "gfx1030", {}, "", "torch", real_arch="gfx1010")
    kd = [KernelDir("gfx1030", Path("/k"), "p", {})]
    found = check(
        facts(devices=[dev], kernel_dirs=kd, environ={"HSA_OVERRIDE_GFX_VERSION": "10.3.0"})
    )
    assert [(f.id, f.severity) for f in found] == [("hsa-override-cross-family", "warning")]
    assert "gfx1010 (gfx10-1-generic)" in found[0].message
    assert "gfx1030 (gfx10-3-generic)" in found[0].message


def test_override_without_real_arch_is_info():
    dev = GpuDevice(0, "gfx1030", "gfx1030", {}, "", "torch")
    kd = [KernelDir("gfx1030", Path("/k"), "p", {})]
    found = check(
        facts(devices=[dev], kernel_dirs=kd, environ={"HSA_OVERRIDE_GFX_VERSION": "10.3.0"})
    )
    assert [(f.id, f.severity) for f in found] == [("hsa-override", "info")]
    assert "real arch is unknown" in found[0].message


def test_missing_kernels_name_the_pip_line():
    dev = GpuDevice(1, "gfx1031", "gfx1031", {}, "", "torch")
    found = check(facts(devices=[GFX1100, dev]))
    assert [f.id for f in found] == ["kernels-missing"]
    assert "device 1 (gfx1031)" in found[0].message
    assert found[0].fix == 'pip install "mamba2-rocm[gfx10-3-generic]"'


def test_generic_kernel_dir_serves_a_family_member():
    dev = GpuDevice(0, "gfx1103", "gfx1103", {}, "", "torch")
    kd = [KernelDir("gfx11-generic", Path("/k"), "package mamba2-rocm-gfx11-generic 1", {})]
    f = facts(devices=[dev], kernel_dirs=kd)
    assert check(f) == []
    (d,) = report(f)["devices"]
    assert d["kernel_dir"]["target"] == "gfx11-generic" and d["install_hint"] is None


def test_rocm_torch_that_sees_no_device():
    found = by_id(check(facts(devices=())))
    assert found["rocm-torch-no-device"].severity == "warning"
    dev = GpuDevice(0, "gfx1100", "gfx1100", {}, "", "rocminfo")
    found = by_id(check(facts(devices=[dev])))
    assert "rocminfo lists gfx1100" in found["rocm-torch-no-device"].message


def test_no_gpu_is_info():
    found = check(facts(torch=CPU, devices=(), amd=False, kfd="missing"))
    assert [(f.id, f.severity) for f in found] == [("no-gpu", "info")]


def test_broken_kernel_package_is_reported():
    found = check(facts(kernel_warnings=["mamba2-rocm: cannot load kernel package p 1: boom"]))
    assert [(f.id, f.severity) for f in found] == [("kernel-package-broken", "warning")]


def test_findings_sorted_errors_first():
    env = {"TORCHINDUCTOR_MAX_AUTOTUNE": "1"}
    found = check(facts(devices=(), environ=env, numa_balancing="1"))
    assert [f.severity for f in found] == sorted(
        (f.severity for f in found), key=audit.SEVERITIES.index
    )
    assert found[0].severity == "error"


REPORT_KEYS = {
    "schema_version", "mamba2_rocm_version", "ok", "python", "environment", "torch", "rocm",
    "amd_gpus_present", "hsa_override", "devices", "device_sources", "kernel_packages", "import_names",
    "kernel_dirs", "cpu_op_tier", "numa_balancing", "kfd", "findings",
}  # fmt: skip
DEVICE_KEYS = {
    "index", "arch", "arch_full", "features", "name", "source", "real_arch", "vendor",
    "generic_family", "fp8_dtype", "kernel_dir", "install_hint", "op_tier",
}  # fmt: skip


def test_report_keys_are_the_documented_ones():
    env = {"HIP_VISIBLE_DEVICES": "0", "HF_TOKEN": "x", "AMD_API_KEY": "s", "HOME": "/root"}
    dev = GpuDevice(0, "gfx942", "gfx942:sramecc+:xnack-", {"sramecc": True, "xnack": False})
    rep = report(facts(devices=[dev], environ=env))
    assert set(rep) == REPORT_KEYS and rep["schema_version"] == 1
    assert set(rep["devices"][0]) == DEVICE_KEYS
    assert rep["devices"][0]["fp8_dtype"] == "float8_e4m3fnuz"
    assert rep["devices"][0]["install_hint"] == 'pip install "mamba2-rocm[gfx942]"'
    assert rep["environment"] == {"AMD_API_KEY": "<redacted>", "HIP_VISIBLE_DEVICES": "0"}
    assert set(rep["findings"][0]) == {"id", "severity", "message", "fix"}
    for key in REPORT_KEYS:  # every key is documented in the module docstring
        assert f"``{key}``" in audit.__doc__
    json.dumps(rep)


def test_render_text_lists_devices_and_findings():
    dev = GpuDevice(0, "gfx90a", "gfx90a:xnack-", {"xnack": False}, "MI210", "torch")
    text = audit.render_text(report(facts(devices=[dev], numa_balancing="1")))
    assert "gfx90a" in text and "xnack-" in text and "MI210" in text
    assert "[warning] numa-balancing" in text and "[warning] kernels-missing" in text
    assert 'fix: pip install "mamba2-rocm[gfx90a]"' in text
    assert text.rstrip().endswith("0 error(s); OK")


def test_gather_with_controlled_machine(tmp_path, monkeypatch):
    """gather() reads torch, KFD, /proc, /dev and the kernel dirs from where it is told."""
    kdir = tmp_path / "kernels" / "gfx11-generic"
    kdir.mkdir(parents=True)
    co = {"source": "ssd", "file": "ssd.hsaco", "sha256": "0" * 64, "kernels": []}
    manifest = {"target": "gfx11-generic", "vendor": "amd", "code_objects": [co]}
    (kdir / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "numa").write_text("1\n")
    monkeypatch.setenv("MAMBA2_ROCM_KERNEL_PATH", str(tmp_path / "kernels"))
    monkeypatch.setenv("MAMBA2_ROCM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(audit, "NUMA_BALANCING", tmp_path / "numa")
    monkeypatch.setattr(audit, "DEV_KFD", tmp_path / "kfd")
    monkeypatch.setattr(audit.sys, "platform", "linux")
    monkeypatch.setattr(detect, "KFD_TOPOLOGY", make_kfd(tmp_path / "topo", [110003]))
    monkeypatch.setattr(detect, "find_rocm_tool", lambda name: None)
    torch = fake_torch(hip="6.2.41133", archs=["gfx1100"])
    monkeypatch.setattr(audit, "import_torch", lambda: (torch, None))
    env = {"HSA_OVERRIDE_GFX_VERSION": "11.0.0", "TORCHINDUCTOR_MAX_AUTOTUNE": "1"}

    rep = report(audit.gather(env))
    assert (
        rep["rocm"] and rep["torch"]["location"] == "/opt/venv/lib/python3.11/site-packages/torch"
    )
    (d,) = rep["devices"]
    assert (d["arch"], d["real_arch"], d["kernel_dir"]["target"]) == (
        "gfx1100",
        "gfx1103",
        "gfx11-generic",
    )
    assert rep["numa_balancing"] == "1" and rep["kfd"] == "missing"
    ids = {x["id"]: x["severity"] for x in rep["findings"]}
    assert ids == {
        "inductor-max-autotune": "error",
        "kfd-missing": "error",
        "numa-balancing": "warning",
        "hsa-override": "info",
    }
    assert not rep["ok"]


def _run_doctor(tmp_path, blocker="", *args):
    """doctor in a subprocess whose torch import is replaced by ``blocker``'s exception."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        f"            {blocker or 'return None'}\n"
        "sys.meta_path.insert(0, Block())\n"
        "from mamba2_rocm.cli import main\n"
        f"rc = main({['doctor', *args]!r})\n"
        "sys.exit(rc if 'torch' not in sys.modules else 99)\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("MAMBA2_ROCM")}
    env["MAMBA2_ROCM_CACHE"] = str(tmp_path / "cache")
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=False
    )


def test_doctor_without_torch(tmp_path):
    blocker = "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')"
    proc = _run_doctor(tmp_path, blocker, "--json")
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["torch"] == {
        "installed": False, "version": None, "hip": None, "cuda": None, "location": None,
        "error": "not installed",
    }  # fmt: skip
    assert "torch-missing" in {x["id"] for x in rep["findings"]}
    assert rep["device_sources"][0] == "torch: not installed"
    text = _run_doctor(tmp_path, blocker)
    assert text.returncode == 0 and "torch         unavailable (not installed)" in text.stdout


def test_doctor_with_broken_torch_exits_nonzero(tmp_path):
    blocker = "raise ImportError('libamdhip64.so.6: cannot open shared object file')"
    proc = _run_doctor(tmp_path, blocker, "--json")
    assert proc.returncode == 1, proc.stderr
    rep = json.loads(proc.stdout)
    (f,) = [x for x in rep["findings"] if x["severity"] == "error"]
    assert f["id"] == "torch-import-failed" and "libamdhip64.so.6" in f["message"]


def test_doctor_on_this_machine(tmp_path):
    torch = pytest.importorskip("torch")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("MAMBA2_ROCM")}
    env["MAMBA2_ROCM_CACHE"] = str(tmp_path / "cache")
    proc = subprocess.run(
        [sys.executable, "-m", "mamba2_rocm", "doctor", "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    rep = json.loads(proc.stdout)
    assert proc.returncode == (0 if rep["ok"] else 1)
    assert rep["torch"]["version"] == torch.__version__
    assert rep["rocm"] == (torch.version.hip is not None)
    assert set(rep) == REPORT_KEYS


def test_doctor_exit_code_on_error(monkeypatch, capsys, no_rocm_tools):
    from mamba2_rocm.cli import main

    monkeypatch.setattr(
        audit, "import_torch", lambda: (fake_torch(hip="6.2", archs=["gfx1100"]), None)
    )
    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "1")
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "[error] inductor-max-autotune: TORCHINDUCTOR_MAX_AUTOTUNE=1" in out
    assert "NOT OK" in out
    monkeypatch.delenv("TORCHINDUCTOR_MAX_AUTOTUNE")
    monkeypatch.setattr(audit, "kfd_status", lambda: "ok")
    monkeypatch.setattr(audit, "read_numa_balancing", lambda: "0")
    monkeypatch.setattr(
        audit, "_kernel_dirs", lambda: ([KernelDir("gfx1100", Path("/k"), "p", {})], [])
    )
    assert main(["doctor", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True


def test_override_onto_an_isa_without_family_is_cross_family():
    dev = GpuDevice(0, "gfx1100", "gfx1100", {}, "", "torch", real_arch="gfx90a")
    kd = [KernelDir("gfx1100", Path("/k"), "p", {})]
    env = {"HSA_OVERRIDE_GFX_VERSION": "11.0.0"}
    (f,) = check(facts(devices=[dev], kernel_dirs=kd, environ=env))
    assert f.id == "hsa-override-cross-family"
    assert "makes a gfx90a run code built for gfx1100 (gfx11-generic)" in f.message
    assert f.fix == (
        'unset HSA_OVERRIDE_GFX_VERSION and use kernels built for gfx90a (pip install "mamba2-rocm[gfx90a]")'
    )


# --------------------------------------------------------------------------- op tiers, kernel path

GFX1030 = GpuDevice(0, "gfx1030", "gfx1030", {}, "Radeon RX 6800", "torch")


def _tier(f, dev=GFX1030):
    return audit.op_tier(f, dev)


def test_op_tier_follows_the_runtime_rules(tmp_path):
    kd = KernelDir("gfx1030", Path("/k/gfx1030"), "package mamba2-rocm-gfx1030 0.3.0", {})
    assert _tier(facts(devices=[GFX1030], kernel_dirs=[kd])) == (
        "kernel",
        "gfx1030 kernels from package mamba2-rocm-gfx1030 0.3.0 (/k/gfx1030)",
    )
    bare = dict(devices=[GFX1030], kernel_dirs=[])
    tier, why = _tier(facts(**bare))
    assert tier == "torch" and 'pip install "mamba2-rocm[gfx1030]"' in why
    tier, why = _tier(facts(**bare, jit_compilers={"amd": "/usr/bin/hipcc"}))
    assert tier == "jit" and "/usr/bin/hipcc" in why
    assert _tier(facts(**bare, environ={"MAMBA2_ROCM_BACKEND": "kernel"}))[0] == "error"
    assert _tier(facts(**bare, environ={"MAMBA2_ROCM_BACKEND": "eager"})) == (
        "eager",
        "MAMBA2_ROCM_BACKEND=eager",
    )
    assert _tier(facts(**bare, environ={"MAMBA2_ROCM_BACKEND": "fast"}))[0] == "error"
    assert _tier(facts(torch=NO_TORCH, **bare)) == ("none", "torch is not installed: no op can run")
    assert _tier(facts(**bare), None) == ("torch", "CPU tensors take the PyTorch implementation")
    err = "MAMBA2_ROCM_KERNEL_PATH=/x has kernels for gfx1100 but none for gfx1030"
    assert _tier(facts(**bare, kernel_path_errors={"gfx1030": err})) == ("error", err)
    # the report and the text carry it per device
    rep = report(facts(devices=[GFX1030], kernel_dirs=[kd]))
    assert rep["devices"][0]["op_tier"]["tier"] == "kernel"
    assert rep["cpu_op_tier"]["tier"] == "torch"
    text = audit.render_text(rep)
    assert "device 0 (gfx1030)  kernel  gfx1030 kernels from package" in text


def test_kernel_path_findings_are_errors():
    found = by_id(
        check(facts(kernel_path_problems=["MAMBA2_ROCM_KERNEL_PATH entry '/n' does not exist"]))
    )
    assert found["kernel-path-unusable"].severity == "error"
    assert "'/n' does not exist" in found["kernel-path-unusable"].message
    err = "MAMBA2_ROCM_KERNEL_PATH=/x has kernels for gfx1030 but none for gfx1100"
    found = by_id(check(facts(kernel_path_errors={"gfx1100": err})))
    assert found["kernel-path-no-arch"].message == f"device 0: {err}"
    assert exit_code(list(found.values())) == 1


def test_gather_reads_the_kernel_path(tmp_path, monkeypatch):
    monkeypatch.setenv("MAMBA2_ROCM_KERNEL_PATH", str(tmp_path / "missing"))
    f = audit.gather(dict(os.environ), use_torch=False)
    assert f.kernel_path_problems == [
        f"MAMBA2_ROCM_KERNEL_PATH entry '{tmp_path / 'missing'}' does not exist"
    ]


def test_doctor_names_an_unusable_kernel_path(tmp_path):
    env = dict(os.environ, MAMBA2_ROCM_KERNEL_PATH=str(tmp_path))  # exists, holds nothing
    proc = subprocess.run([sys.executable, "-m", "mamba2_rocm", "doctor"], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=120)  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert (
        f"kernel-path-unusable: MAMBA2_ROCM_KERNEL_PATH entry '{tmp_path}' holds no kernel dir"
        in proc.stdout
    )
    assert "op tiers" in proc.stdout


def test_skipped_kernel_dirs_are_findings(tmp_path):
    (tmp_path / "gfx1030").mkdir()
    (tmp_path / "gfx1030" / "manifest.json").write_text('{"target": "gfx1030"}')
    env = dict(os.environ, MAMBA2_ROCM_KERNEL_PATH=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "mamba2_rocm", "doctor", "--json"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)  # fmt: skip
    found = {f["id"]: f for f in json.loads(proc.stdout)["findings"]}
    assert "manifest.json does not follow the schema" in found["kernel-dir-skipped"]["message"]
    assert "'code_objects' must be a non-empty list" in found["kernel-dir-skipped"]["message"]
    assert found["kernel-path-unusable"]["severity"] == "error"  # the path serves nothing


def test_doctor_suggests_the_selftest_on_an_amd_gpu():
    text = audit.render_text(report(facts()))
    assert "next: check this card's kernels (1-2 minutes): `python -m mamba2_rocm selftest" in text
    assert "selftest" not in audit.render_text(report(facts(torch=CPU, devices=(), amd=False)))
