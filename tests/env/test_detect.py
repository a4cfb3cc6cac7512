from pathlib import Path

import pytest
from conftest import fake_torch, make_kfd

from mamba2_rocm.env import detect
from mamba2_rocm.env.detect import (
    amd_gpus_present,
    detect_devices,
    fp8_dtype_name,
    hsa_override,
    is_rocm,
    kfd_archs,
    override_to_arch,
    parse_rocm_agent_enumerator,
    parse_rocminfo,
)

ROCMINFO = """\
ROCk module is loaded
=====================
HSA Agents
==========
*******
Agent 1
*******
  Name:                    AMD Ryzen 9 7950X 16-Core Processor
  Uuid:                    CPU-XX
  Marketing Name:          AMD Ryzen 9 7950X 16-Core Processor
  Vendor Name:             CPU
  Device Type:             CPU
*******
Agent 2
*******
  Name:                    gfx90a
  Uuid:                    GPU-0123456789abcdef
  Marketing Name:          AMD Instinct MI210
  Vendor Name:             AMD
  Device Type:             GPU
  ISA Info:
    ISA 1
      Name:                    amdgcn-amd-amdhsa--gfx90a:sramecc+:xnack-
*******
Agent 3
*******
  Name:                    gfx1100
  Marketing Name:          Radeon RX 7900 XTX
  Device Type:             GPU
  ISA Info:
    ISA 1
      Name:                    amdgcn-amd-amdhsa--gfx1100
*** Done ***
"""


def test_parse_rocminfo_gpu_agents_with_features():
    assert parse_rocminfo(ROCMINFO) == [
        ("gfx90a:sramecc+:xnack-", "AMD Instinct MI210"),
        ("gfx1100", "Radeon RX 7900 XTX"),
    ]
    assert parse_rocminfo("no agents here") == []


def test_parse_rocm_agent_enumerator_skips_cpu():
    assert parse_rocm_agent_enumerator("gfx000\ngfx1030\n\ngfx1030\n") == ["gfx1030", "gfx1030"]


@pytest.mark.parametrize(
    ("value", "arch"),
    [("10.3.0", "gfx1030"), ("11.0.0", "gfx1100"), ("9.4.2", "gfx942"), ("9.0.10", "gfx90a"),
     ("11.5.1", "gfx1151"), (" 12.0.1 ", "gfx1201")],
)  # fmt: skip
def test_override_to_arch(value, arch):
    assert override_to_arch(value) == arch


@pytest.mark.parametrize("value", ["10.3", "gfx1030", "10.3.x", "10.3.16", "1.0.0"])
def test_override_malformed_names_value(value):
    with pytest.raises(ValueError, match=rf"HSA_OVERRIDE_GFX_VERSION={value!r}"):
        override_to_arch(value)
    ov = hsa_override({"HSA_OVERRIDE_GFX_VERSION": value})
    assert ov.arch is None and value in ov.error


def test_hsa_override_unset_or_empty():
    assert hsa_override({}) is None
    assert hsa_override({"HSA_OVERRIDE_GFX_VERSION": " "}) is None
    assert hsa_override({"HSA_OVERRIDE_GFX_VERSION": "10.3.0"}).arch == "gfx1030"


def test_kfd_archs_real_isa_in_node_order(tmp_path):
    root = make_kfd(tmp_path, [100301, 90010, 90402, 110501])
    assert kfd_archs(root) == ["gfx1031", "gfx90a", "gfx942", "gfx1151"]
    assert kfd_archs(tmp_path / "missing") == []


def test_amd_gpus_present_from_pci(tmp_path):
    pci = tmp_path / "pci"
    for name, vendor, cls in [("a", "0x8086", "0x030000"), ("b", "0x1002", "0x040300")]:
        (pci / name).mkdir(parents=True)
        (pci / name / "vendor").write_text(vendor + "\n")
        (pci / name / "class").write_text(cls + "\n")
    assert not amd_gpus_present(tmp_path / "nokfd", pci)  # Intel VGA, AMD audio
    (pci / "c").mkdir()
    (pci / "c" / "vendor").write_text("0x1002\n")
    (pci / "c" / "class").write_text("0x030000\n")
    assert amd_gpus_present(tmp_path / "nokfd", pci)


def test_is_rocm_from_torch_version():
    assert is_rocm(fake_torch(hip="6.2.41133"))
    assert not is_rocm(fake_torch(cuda="12.4"))
    assert not is_rocm(fake_torch())


def test_is_rocm_real_cpu_torch():
    pytest.importorskip("torch")
    assert is_rocm() is False


def _no_tools(name):
    return None, f"{name}: not found"


def test_devices_from_torch_split_features(tmp_path):
    torch = fake_torch(hip="6.2", archs=["gfx90a:sramecc+:xnack-", "gfx1100"])
    devices, notes = detect_devices(torch, run_tool=_no_tools, kfd_root=tmp_path, environ={})
    assert [(d.index, d.arch, d.arch_full, d.features) for d in devices] == [
        (0, "gfx90a", "gfx90a:sramecc+:xnack-", {"sramecc": True, "xnack": False}),
        (1, "gfx1100", "gfx1100", {}),
    ]
    assert notes == ["torch: 2 device(s)"]  # the fallbacks are not run when torch sees GPUs
    assert devices[1].generic_family == "gfx11-generic" and devices[0].generic_family is None
    assert devices[0].real_arch is None


def test_devices_from_cuda_torch():
    torch = fake_torch(cuda="12.4", caps=[(9, 0)], version="2.5.1+cu124")
    devices, _ = detect_devices(torch, run_tool=_no_tools, environ={})
    assert devices[0].arch == "sm_90" and devices[0].vendor == "nvidia"
    assert devices[0].fp8_dtype == "float8_e4m3fn"


def test_devices_fall_back_to_rocminfo_then_enumerator(tmp_path):
    calls = []

    def tools(name):
        calls.append(name)
        return (ROCMINFO, "rocminfo: ran") if name == "rocminfo" else (None, "x")

    devices, notes = detect_devices(fake_torch(), run_tool=tools, kfd_root=tmp_path, environ={})
    assert calls == ["rocminfo"]
    assert [(d.arch, d.source, d.name) for d in devices] == [
        ("gfx90a", "rocminfo", "AMD Instinct MI210"),
        ("gfx1100", "rocminfo", "Radeon RX 7900 XTX"),
    ]
    assert notes == ["torch: 0 device(s)", "rocminfo: ran"]

    def enum_only(name):
        if name == "rocm_agent_enumerator":
            return "gfx000\ngfx1201\n", "rocm_agent_enumerator: ran"
        return None, f"{name}: not found"

    devices, notes = detect_devices(
        use_torch=False, run_tool=enum_only, kfd_root=tmp_path, environ={}
    )
    assert [(d.arch, d.source) for d in devices] == [("gfx1201", "rocm_agent_enumerator")]
    assert notes == ["rocminfo: not found", "rocm_agent_enumerator: ran"]


def test_devices_from_kfd_last_with_override(tmp_path):
    kfd = make_kfd(tmp_path, [100301])
    env = {"HSA_OVERRIDE_GFX_VERSION": "10.3.0"}
    devices, notes = detect_devices(use_torch=False, run_tool=_no_tools, kfd_root=kfd, environ=env)
    assert [(d.arch, d.real_arch, d.source) for d in devices] == [("gfx1030", "gfx1031", "kfd")]
    assert notes[-1] == "kfd: 1 GPU node(s)"


def test_override_real_and_effective_arch_from_torch(tmp_path):
    """Under an override torch reports the effective ISA; KFD keeps the real one."""
    kfd = make_kfd(tmp_path, [110003])  # a gfx1103 APU
    torch = fake_torch(hip="6.2", archs=["gfx1100"])
    env = {"HSA_OVERRIDE_GFX_VERSION": "11.0.0"}
    devices, _ = detect_devices(torch, run_tool=_no_tools, kfd_root=kfd, environ=env)
    assert (devices[0].arch, devices[0].real_arch) == ("gfx1100", "gfx1103")
    # Without an override the real arch is not duplicated into the record.
    devices, _ = detect_devices(torch, run_tool=_no_tools, kfd_root=kfd, environ={})
    assert devices[0].real_arch is None


def test_torch_query_failure_is_a_note_not_a_crash(tmp_path):
    torch = fake_torch(hip="6.2", archs=["gfx1100"])

    def boom(i):
        raise RuntimeError("HIP error: invalid device ordinal")

    torch.cuda.get_device_properties = boom
    devices, notes = detect_devices(torch, run_tool=_no_tools, kfd_root=tmp_path, environ={})
    assert devices == []
    assert "invalid device ordinal" in notes[0]


@pytest.mark.parametrize(
    ("arch", "dtype"),
    [("gfx942", "float8_e4m3fnuz"), ("gfx940", "float8_e4m3fnuz"), ("gfx950", "float8_e4m3fn"),
     ("gfx1100", "float8_e4m3fn"), ("gfx1201", "float8_e4m3fn"), ("gfx1030", "float8_e4m3fn"),
     ("gfx942:sramecc+:xnack-", "float8_e4m3fnuz"), ("sm_90", "float8_e4m3fn"),
     ("gfx9-4-generic", None), ("gfx12-generic", "float8_e4m3fn"), ("bogus", None)],
)  # fmt: skip
def test_fp8_dtype_name(arch, dtype):
    assert fp8_dtype_name(arch) == dtype


def test_fp8_dtype_is_a_torch_dtype():
    torch = pytest.importorskip("torch")
    from mamba2_rocm.env import fp8_dtype

    assert fp8_dtype("gfx942") is torch.float8_e4m3fnuz
    assert fp8_dtype("gfx950") is torch.float8_e4m3fn
    with pytest.raises(ValueError, match="gfx9-4-generic"):
        fp8_dtype("gfx9-4-generic")


def test_tool_lookup_uses_rocm_path(tmp_path, monkeypatch):
    tool = tmp_path / "bin" / "rocminfo"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\nprintf '%s' \"$ROCMINFO_OUT\"\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("ROCM_PATH", str(tmp_path))
    monkeypatch.setenv("ROCMINFO_OUT", ROCMINFO)
    assert detect.find_rocm_tool("rocminfo") == str(tool)
    out, note = detect._run_tool("rocminfo")
    assert note == "rocminfo: ran" and parse_rocminfo(out)[1][0] == "gfx1100"
    tool.write_text("#!/bin/sh\necho 'hsa_init failed' >&2\nexit 2\n")
    assert detect._run_tool("rocminfo") == (None, "rocminfo: exit 2 (hsa_init failed)")
    assert detect._run_tool("rocm_agent_enumerator") == (None, "rocm_agent_enumerator: not found")


def test_import_does_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys, mamba2_rocm.env, mamba2_rocm.env.cli, mamba2_rocm.env.protect;"
        "sys.exit('torch' in sys.modules)"
    )
    root = Path(__file__).resolve().parents[2]
    assert subprocess.run([sys.executable, "-c", code], cwd=root, check=False).returncode == 0
