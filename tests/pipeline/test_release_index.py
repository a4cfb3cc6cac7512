"""The release round trip against a real index on 127.0.0.1 (pypiserver, uploads need a
password): publish two targets built by the real pipeline, a wrong password, a re-upload of
the same version, a tampered wheel, then pull a target into a fresh venv and check its hashes.

The GPU gate of gfx1030 (``gpu_gate = "required"``) cannot be earned here (no AMD GPU): the
fixture writes the gate file that ``gpu-tests-gfx1030`` would write after a passing run, with
``gputest.write_gate``. gfx1101 is ``compile-only`` and needs none.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.request
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from fakewheels import build_wheel, wheel_from_installed
from loopback_index import pip_env, pypiserver

from mamba2_rocm.kernels import SOURCES
from mamba2_rocm.pipeline import gputest

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.docker, pytest.mark.slow]
HOST_DEPS = ("packaging", "pyelftools", "msgpack", "platformdirs", "filelock")


def _pipeline(*args, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mamba2_rocm.pipeline", *map(str, args)],
                          cwd=REPO, env=env, capture_output=True, text=True)  # fmt: skip


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    with warnings.catch_warnings():  # passlib imports the deprecated crypt module
        warnings.simplefilter("ignore", DeprecationWarning)
        from passlib.apache import HtpasswdFile

    root = tmp_path_factory.mktemp("index")
    packages = root / "packages"
    for name in HOST_DEPS:  # what PyPI would give the host package
        wheel_from_installed(name, packages)
    htpasswd = HtpasswdFile(str(root / "htpasswd"), new=True)
    htpasswd.set_password("maintainer", "right-password")
    htpasswd.save()
    auth = ("-P", str(root / "htpasswd"), "-a", "update", "--hash-algo", "sha256")
    with pypiserver(packages, root / "pypiserver.log", *auth) as base:
        yield SimpleNamespace(upload=base + "/", simple=base + "/simple/", packages=packages)


@pytest.fixture(scope="module")
def wheels(release_wheels, tmp_path_factory):
    """A copy of the real build, with the gfx1030 gate a passing GPU run would have written."""
    root = tmp_path_factory.mktemp("publish") / "wheels"
    shutil.copytree(release_wheels, root)
    manifest = json.loads((root / "gfx1030" / "build-manifest.json").read_text())
    counts = {"tests": 12, "passed": 12, "failed": 0, "errors": 0, "skipped": 0}
    gputest.write_gate(root / "gfx1030", manifest, ["gfx1030"], counts, "stand-in", {})
    return root


def _ours(index) -> list[str]:
    return sorted(p.name for p in index.packages.glob("mamba2_rocm*.whl"))


@pytest.fixture(scope="module")
def published(index, wheels):
    # A wrong password first: refused by the index, reported as such, nothing uploaded.
    r = _pipeline("publish", "gfx1030", "gfx1101", "--wheels", wheels, "--repository-url",
                  index.upload, env=pip_env(TWINE_USERNAME="maintainer", TWINE_PASSWORD="wrong"))  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    assert "refused the credentials (HTTP 403)" in r.stderr, r.stderr
    assert "TWINE_PASSWORD" in r.stderr
    assert _ours(index) == []
    # The real upload.
    r = _pipeline("publish", "gfx1030", "gfx1101", "--wheels", wheels, "--repository-url",
                  index.upload, env=pip_env(TWINE_USERNAME="maintainer", TWINE_PASSWORD="right-password"))  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def test_publish_uploads_both_targets_after_the_checks(published, index, wheels):
    out = published.stdout
    assert "gfx1030 " in out and "GPU gate passed (12 tests on gfx1030)" in out
    assert "gfx1101 " in out and "compile-only (no GPU test; marked in its metadata)" in out
    assert "twine check --strict: 4 wheel(s) passed" in out
    manifests = {
        t: json.loads((wheels / t / "build-manifest.json").read_text())
        for t in ("gfx1030", "gfx1101")
    }
    expected = sorted({name for m in manifests.values() for name in m["wheels"]})
    assert _ours(index) == expected and len(expected) == 4  # host, drop-in, two kernel wheels
    # the index serves exactly the verified bytes
    for m in manifests.values():
        for name, digest in m["wheels"].items():
            with urllib.request.urlopen(f"{index.upload}packages/{name}", timeout=5) as resp:
                import hashlib

                assert hashlib.sha256(resp.read()).hexdigest() == digest


def test_reupload_of_the_same_version_is_refused_and_reported(published, index, wheels):
    before = {p.name: p.stat().st_mtime_ns for p in index.packages.glob("mamba2_rocm*.whl")}
    r = _pipeline("publish", "gfx1030", "--wheels", wheels, "--repository-url", index.upload,
                  env=pip_env(TWINE_USERNAME="maintainer", TWINE_PASSWORD="right-password"))  # fmt: skip
    assert r.returncode == 1
    assert "already has this version (HTTP 400)" in r.stderr, r.stderr
    assert "never overwritten" in r.stderr and "already exists" in r.stderr
    assert {p.name: p.stat().st_mtime_ns for p in index.packages.glob("mamba2_rocm*.whl")} == before


def test_tampered_wheel_is_refused_before_any_upload(published, index, wheels, tmp_path):
    bad = tmp_path / "wheels"
    shutil.copytree(wheels, bad)
    manifest = json.loads((bad / "gfx1101" / "build-manifest.json").read_text())
    name = next(n for n in manifest["wheels"] if n.startswith("mamba2_rocm_gfx1101-"))
    data = bytearray((bad / "gfx1101" / name).read_bytes())
    data[len(data) // 2] ^= 0x01  # one byte, after the manifest was written
    (bad / "gfx1101" / name).write_bytes(bytes(data))
    before = _ours(index)
    r = _pipeline("publish", "gfx1101", "--wheels", bad, "--repository-url", index.upload,
                  env=pip_env(TWINE_USERNAME="maintainer", TWINE_PASSWORD="right-password"))  # fmt: skip
    assert r.returncode == 1
    assert f"gfx1101: {name} has sha256" in r.stderr and "refusing to publish it" in r.stderr
    assert "Uploading" not in r.stdout + r.stderr
    assert _ours(index) == before


def test_pull_installs_the_target_from_the_index_and_verifies_it(
    published, index, wheels, tmp_path
):
    # A user's ROCm torch, stood in for: version module for the fingerprint, no GPU.
    torch = build_wheel(tmp_path / "torch", "torch", "2.5.1+rocm6.2", {
        "torch/__init__.py": "from torch import cuda, version\n__version__ = '2.5.1+rocm6.2'\n",
        "torch/cuda.py": "def is_available():\n    return False\n",
        "torch/version.py": "__version__ = '2.5.1+rocm6.2'\nhip = '6.2.41133'\ncuda = None\n",
    })  # fmt: skip
    r = _pipeline("pull", "gfx1030", "--index-url", index.simple,
                  "--manifest", wheels / "gfx1030" / "build-manifest.json",
                  "--torch", torch, env=pip_env())  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "torch in the fresh venv: torch==2.5.1+rocm6.2" in r.stdout
    assert "pinning torch==2.5.1+rocm6.2" in r.stderr
    assert f"wheel sha256s and {len(SOURCES)} code objects match" in r.stdout  # one per source
    assert "import mamba_ssm / causal_conv1d served by the drop-in" in r.stdout
    # the check can fail: a manifest whose code-object hash differs is reported by name
    manifest = json.loads((wheels / "gfx1030" / "build-manifest.json").read_text())
    key = sorted(manifest["code_objects"])[0]
    manifest["code_objects"][key] = "0" * 64
    other = tmp_path / "other-manifest.json"
    other.write_text(json.dumps(manifest))
    r = _pipeline(
        "pull", "gfx1030", "--index-url", index.simple, "--manifest", other, env=pip_env()
    )
    assert r.returncode == 1
    assert f"installed code object {key} has sha256" in r.stderr, r.stderr
    assert f"the manifest says {'0' * 64}" in r.stderr
    assert "mamba2_rocm info" not in r.stderr  # nothing from an unverified install ran
    # a wheel that is not the one built: pip's hash-checking mode refuses it, nothing installed
    manifest = json.loads((wheels / "gfx1030" / "build-manifest.json").read_text())
    kernel_wheel = next(w for w in manifest["wheels"] if w.startswith("mamba2_rocm_gfx1030-"))
    manifest["wheels"][kernel_wheel] = "1" * 64
    other.write_text(json.dumps(manifest))
    venv = tmp_path / "refused-venv"
    r = _pipeline("pull", "gfx1030", "--index-url", index.simple, "--manifest", other,
                  "--venv", venv, env=pip_env())  # fmt: skip
    assert r.returncode == 1
    assert "pip could not install the manifest's wheels (hash-checked)" in r.stderr, r.stderr
    assert "THESE PACKAGES DO NOT MATCH THE HASHES" in r.stdout + r.stderr
    listed = subprocess.run([venv / "bin" / "python", "-m", "pip", "list", "--format=json"],
                            capture_output=True, text=True)  # fmt: skip
    names = {d["name"] for d in json.loads(listed.stdout)}
    assert not names & {"mamba2-rocm", "mamba2-rocm-gfx1030", "mamba2_rocm"}, names
