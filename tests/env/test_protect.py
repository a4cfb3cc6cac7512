"""Torch protection: unit tests of the pieces, then the real thing in a throw-away venv.

The slow test serves stand-in torch wheels from a pypiserver on 127.0.0.1 and shows both
sides: a protected install refuses to replace torch (fingerprint unchanged), the unprotected
control replaces it (so the test can fail), and a same-version reinstall with other files is
caught by the after-install verification.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from fakewheels import build_torch_wheel, build_wheel
from loopback_index import pip_env, pypiserver

from mamba2_rocm.env import protect
from mamba2_rocm.env.protect import (
    Fingerprint,
    TorchStackChanged,
    constraints,
    diff,
    fingerprint,
    restore_hint,
)

ROOT = Path(__file__).resolve().parents[2]


def fp(**packages) -> Fingerprint:
    pk = {}
    for name, spec in packages.items():
        version, _, files = spec.partition("@")
        pk[name] = {
            "version": version,
            "local": version.split("+", 1)[1] if "+" in version else None,
            "files": 3,
            "files_sha256": files or "a" * 64,
            "location": "/v/site-packages",
        }
    tv = (
        {"__version__": pk["torch"]["version"], "hip": "6.2", "cuda": None}
        if "torch" in pk
        else None
    )
    return Fingerprint("/v/bin/python", "3.11.7", pk, tv)


def test_constraints_pin_exactly():
    assert constraints(fp(torch="2.5.1+rocm6.2", torchvision="0.20.1")) == [
        "torch==2.5.1+rocm6.2",
        "torchvision===0.20.1",  # plain == would also admit 0.20.1+cu124
    ]
    assert constraints(fp()) == []


def test_diff_names_each_change():
    before = fp(torch="2.5.1+rocm6.2", **{"pytorch-triton-rocm": "3.1.0"})
    assert diff(before, before) == []
    after = fp(torch="2.6.0", torchvision="0.21.0")
    after.torch_version_module = {"hip": None, "cuda": "12.4"}
    assert diff(before, after) == [
        "torch: version 2.5.1+rocm6.2 -> 2.6.0",
        "torchvision: added 0.21.0 (it was not installed)",
        "pytorch-triton-rocm: removed (was 3.1.0)",
        "torch.version.hip: '6.2' -> None",
        "torch.version.cuda: None -> '12.4'",
    ]
    changed = diff(
        before, fp(torch="2.5.1+rocm6.2@" + "b" * 64, **{"pytorch-triton-rocm": "3.1.0"})
    )
    assert changed == [
        "torch: reinstalled with different files, same version 2.5.1+rocm6.2 (3 -> 3 files, "
        "hash aaaaaaaaaaaa -> bbbbbbbbbbbb)"
    ]


def test_restore_hint_uses_pytorch_index_for_local_labels():
    hint = restore_hint(fp(torch="2.5.1+rocm6.2", triton="3.1.0"))
    assert hint == [
        '/v/bin/python -m pip install --force-reinstall --no-deps "torch==2.5.1+rocm6.2" '
        "--index-url https://download.pytorch.org/whl/rocm6.2",
        '/v/bin/python -m pip install --force-reinstall --no-deps "triton==3.1.0"',
    ]
    err = TorchStackChanged(["torch: version 2.5.1+rocm6.2 -> 2.6.0"], fp(torch="2.5.1+rocm6.2"))
    assert "torch: version 2.5.1+rocm6.2 -> 2.6.0" in str(err) and "whl/rocm6.2" in str(err)


def test_fingerprint_json_round_trip(tmp_path):
    f = fp(torch="2.5.1+rocm6.2")
    assert Fingerprint.from_json(f.to_json()) == f
    with pytest.raises(ValueError, match="schema_version 99"):
        Fingerprint.from_json(json.dumps({"schema_version": 99}))


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--", "install", "-U", "foo"], ["-U", "foo"]),
        (["foo", "--index-url", "u"], ["foo", "--index-url", "u"]),
        (["install", "foo"], ["foo"]),
    ],
)
def test_install_args(args, expected):
    assert protect._install_args(args) == expected


def test_install_args_errors_name_the_problem():
    with pytest.raises(ValueError, match="needs the arguments of `pip install`"):
        protect._install_args(["--"])
    with pytest.raises(ValueError, match="got the pip command 'uninstall'"):
        protect._install_args(["uninstall", "torch"])


def test_fingerprint_of_this_interpreter():
    torch = pytest.importorskip("torch")
    f = fingerprint()
    assert f.python == sys.executable
    t = f.packages["torch"]
    assert t["version"] == torch.__version__ and t["files"] > 100
    assert len(t["files_sha256"]) == 64
    assert f.torch_version_module["hip"] == torch.version.hip
    assert f.torch_version_module["cuda"] == torch.version.cuda
    assert fingerprint(sys.executable) == f  # deterministic


def test_fingerprint_bad_interpreter_names_it(tmp_path):
    with pytest.raises(RuntimeError, match=r"cannot run the interpreter '/nonexistent/python'"):
        fingerprint("/nonexistent/python")
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\necho boom >&2\nexit 5\n")
    script.chmod(0o755)
    with pytest.raises(RuntimeError, match=r"failed \(exit 5\): boom"):
        fingerprint(script)


def test_verify_cli_missing_file_says_how_to_create_it(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mamba2_rocm", "env", "verify", str(tmp_path / "fp.json")],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "env fingerprint --out" in proc.stderr and "fp.json" in proc.stderr


# --------------------------------------------------------------------------- real venv + index


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    pytest.importorskip("pypiserver")
    root = tmp_path_factory.mktemp("index")
    pkgs, local = root / "packages", root / "local"
    rocm_torch = build_torch_wheel(local, "2.5.1+rocm6.2", hip="6.2.41133")
    # What PyPI would offer: a newer (CUDA) torch, and the same ROCm version with other files.
    build_torch_wheel(pkgs, "2.6.0", cuda="12.4")
    build_torch_wheel(pkgs, "2.5.1+rocm6.2", hip="6.2.41133", extra="patched = True\n")
    build_wheel(
        pkgs, "needs-new-torch", "1.0", {"needs_new_torch/__init__.py": ""}, ("torch>=2.6",)
    )
    build_wheel(pkgs, "harmless", "1.0", {"harmless/__init__.py": ""}, ("torch>=2.0",))
    # a package that ships a file inside torch's directory (the pin cannot see it)
    build_wheel(pkgs, "sneaky", "1.0", {"sneaky/__init__.py": "", "torch/__init__.py": "boom"})
    # ROCm's triton is pytorch-triton-rocm; a package requiring "triton" pulls in PyPI's, which
    # writes the same triton/ directory
    rocm_triton = build_wheel(
        local, "pytorch-triton-rocm", "3.1.0", {"triton/__init__.py": "rocm = 1\n"}
    )
    build_wheel(pkgs, "triton", "3.1.0", {"triton/__init__.py": "cuda = 1\n"})
    build_wheel(pkgs, "needs-triton", "1.0", {"needs_triton/__init__.py": ""}, ("triton",))
    with pypiserver(pkgs, root / "pypiserver.log") as base:
        yield SimpleNamespace(url=base + "/simple/", rocm_torch=rocm_torch, root=root,
                              rocm_triton=rocm_triton)  # fmt: skip


def _run(*cmd, env=None):
    return subprocess.run(
        [str(c) for c in cmd], cwd=ROOT, env=env or pip_env(), capture_output=True, text=True
    )


def _venv(path: Path) -> Path:
    """A fresh venv at ``path``; its python."""
    assert _run(sys.executable, "-m", "venv", path).returncode == 0
    return path / "bin" / "python"


def _cli(*args):
    return _run(sys.executable, "-m", "mamba2_rocm", "env", *args)


@pytest.mark.slow
def test_protect_torch_in_a_real_venv(index, tmp_path):
    venv = tmp_path / "venv"
    py = _venv(venv)
    pip = (py, "-m", "pip", "install", "--no-cache-dir", "--index-url", index.url)
    r = _run(*pip, "--no-index", index.rocm_torch)
    assert r.returncode == 0, r.stderr
    fp_file = tmp_path / "torch.json"
    r = _cli("fingerprint", "--python", py, "--out", fp_file)
    assert r.returncode == 0, r.stderr
    before = Fingerprint.from_json(fp_file.read_text())
    assert before.packages["torch"]["version"] == "2.5.1+rocm6.2"
    assert before.torch_version_module["hip"] == "6.2.41133"
    assert str(venv) in before.packages["torch"]["location"]

    # 1. A package that accepts the installed torch installs normally under protection.
    r = _cli("protect-torch", "--python", py, "--", "--no-cache-dir", "--index-url", index.url,
             "harmless")  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "pinning torch==2.5.1+rocm6.2" in r.stderr
    assert _run(py, "-c", "import harmless").returncode == 0

    # 2. A package that needs a newer torch is refused; torch stays byte-for-byte the same.
    r = _cli("protect-torch", "--python", py, "--", "install", "--no-cache-dir",
             "--index-url", index.url, "needs-new-torch")  # fmt: skip
    assert r.returncode not in (0, 3), r.stdout + r.stderr
    assert "the torch stack is unchanged (torch==2.5.1+rocm6.2, hip 6.2.41133)" in r.stderr
    assert fingerprint(py) == before
    assert _run(py, "-c", "import needs_new_torch").returncode != 0
    r = _cli("verify", fp_file)
    assert r.returncode == 0, r.stderr
    assert "torch stack unchanged" in r.stderr

    # 3. A change the pin cannot prevent (same version, other files) is refused beforehand
    r = _cli("protect-torch", "--python", py, "--", "--no-cache-dir", "--index-url", index.url,
             "--force-reinstall", "--no-deps", "torch")  # fmt: skip
    assert r.returncode == 5, r.stdout + r.stderr
    assert "torch 2.5.1+rocm6.2 would be reinstalled over the protected one" in r.stderr
    assert fingerprint(py) == before
    # ... and, done without protection, caught afterwards with the way back
    r = _run(*pip, "--force-reinstall", "--no-deps", "torch==2.5.1+rocm6.2")
    assert r.returncode == 0, r.stderr
    r = _cli("verify", fp_file)
    assert r.returncode == 3
    assert "torch: reinstalled with different files, same version 2.5.1+rocm6.2" in r.stderr
    assert "--index-url https://download.pytorch.org/whl/rocm6.2" in r.stderr
    # put the original back for the control: the same RECORD, the files written anew
    r = _run(*pip, "--no-index", "--force-reinstall", index.rocm_torch)
    assert r.returncode == 0, r.stderr
    assert all("files rewritten on disk" in c for c in diff(before, fingerprint(py)))
    before = fingerprint(py)
    fp_file.write_text(before.to_json())

    # 4. Control: the same request without protection replaces torch, and verify says so.
    r = _run(*pip, "needs-new-torch")
    assert r.returncode == 0, r.stderr
    after = fingerprint(py)
    assert after.packages["torch"]["version"] == "2.6.0"
    r = _cli("verify", fp_file)
    assert r.returncode == 3
    assert "torch: version 2.5.1+rocm6.2 -> 2.6.0" in r.stderr
    assert "torch.version.hip: '6.2.41133' -> None" in r.stderr
    assert "torch.version.cuda: None -> '12.4'" in r.stderr


@pytest.mark.slow
def test_protect_torch_without_torch_stops_before_pip(index, tmp_path):
    py = _venv(tmp_path / "bare")
    request = ("--", "--no-cache-dir", "--index-url", index.url, "harmless")  # needs torch>=2.0
    r = _cli("protect-torch", "--python", py, *request)
    assert r.returncode == 4, r.stdout + r.stderr
    assert "has no torch installed: there is nothing to protect, so pip was not run" in r.stderr
    assert "pip install torch --index-url https://download.pytorch.org/whl/" in r.stderr
    assert "--allow-no-torch" in r.stderr
    assert fingerprint(py).packages == {}  # pip really did not run: harmless pulls a torch
    assert _run(py, "-c", "import harmless").returncode != 0

    # the explicit flag runs pip; the torch it pulls in is reported as a change
    r = _cli("protect-torch", "--python", py, "--allow-no-torch", *request)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "nothing to pin (--allow-no-torch)" in r.stderr
    assert "torch: added 2.6.0 (it was not installed)" in r.stderr


@pytest.mark.slow
def test_protect_torch_refuses_before_installing_into_the_stacks_files(index, tmp_path):
    py = _venv(tmp_path / "venv")
    pip = (py, "-m", "pip", "install", "--no-cache-dir", "--no-index")
    assert _run(*pip, index.rocm_torch, index.rocm_triton).returncode == 0
    before = fingerprint(py)
    assert set(before.packages) == {"torch", "pytorch-triton-rocm"}
    request = ("--", "--no-cache-dir", "--index-url", index.url)

    # 1. a wheel with torch/__init__.py in it: refused before pip install runs
    r = _cli("protect-torch", "--python", py, *request, "sneaky")
    assert r.returncode == 5, r.stdout + r.stderr
    assert "pip was not run" in r.stderr
    assert "sneaky 1.0 ships torch/__init__.py, inside torch's files" in r.stderr
    assert fingerprint(py) == before
    assert _run(py, "-c", "import sneaky").returncode != 0

    # 2. PyPI's triton over pytorch-triton-rocm's triton/: refused too
    r = _cli("protect-torch", "--python", py, *request, "needs-triton")
    assert r.returncode == 5, r.stdout + r.stderr
    assert "triton 3.1.0 ships triton/__init__.py, inside pytorch-triton-rocm's files" in r.stderr
    assert fingerprint(py) == before

    # 3. what slips past a pin (no preflight: plain pip) is seen on disk, by path
    assert (
        _run(*pip, "--find-links", str(index.root / "packages"), "--no-deps", "sneaky").returncode
        == 0
    )
    changes = diff(before, fingerprint(py))
    assert changes == ["torch: files rewritten on disk: torch/__init__.py"], changes
