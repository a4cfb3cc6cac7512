"""publish's refusals, each on a small hand-made wheels/<target>/ (no Docker, no index)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fakewheels import build_wheel

from mamba2_rocm.pipeline import publish
from mamba2_rocm.pipeline.publish import PublishError, check_release, check_target, sha256_file
from mamba2_rocm.pipeline.recipes import get_recipe

VERSION = "1.2.3"
PASSED = {"tests": 5, "passed": 5, "failed": 0, "errors": 0, "skipped": 0}


def make_target(root: Path, target: str, host_extra: str = "") -> Path:
    """wheels/<target>/ as the build writes it: two wheels and a manifest naming their hashes."""
    recipe = get_recipe(target)
    d = root / target
    host = build_wheel(d, "mamba2-rocm", VERSION, {"mamba2_rocm/__init__.py": host_extra})
    summary = "kernels" + (
        " [compile-only: not tested]" if recipe.gpu_gate == "compile-only" else ""
    )
    kern = build_wheel(d, recipe.package_name, VERSION, {f"{recipe.module_name}/__init__.py": ""})
    # build_wheel writes no Summary: add one the way package.py's metadata has it
    _set_summary(kern, summary)
    manifest = {
        "format": 1, "target": target, "version": VERSION, "gpu_gate": recipe.gpu_gate,
        "recipe": {"file": f"recipes/{target}.toml", "sha256": recipe.sha256},
        "verification": {"static": "passed", "smoke_test": "passed", "gpu_test": "not run"},
        "wheels": {w.name: sha256_file(w) for w in (host, kern)},
        "code_objects": {},
    }  # fmt: skip
    (d / "build-manifest.json").write_text(json.dumps(manifest))
    return d


def _set_summary(wheel: Path, summary: str) -> None:
    import zipfile

    with zipfile.ZipFile(wheel) as zf:
        items = {n: zf.read(n) for n in zf.namelist()}
    meta = next(n for n in items if n.endswith("METADATA"))
    items[meta] = items[meta].replace(b"\nVersion:", f"\nSummary: {summary}\nVersion:".encode(), 1)
    with zipfile.ZipFile(wheel, "w") as zf:
        for n, data in items.items():
            zf.writestr(n, data)


def write_gate(d: Path, **changes) -> Path:
    manifest = json.loads((d / "build-manifest.json").read_text())
    gate = {"format": 1, "target": manifest["target"], "result": "passed", "tests": PASSED,
            "wheels": manifest["wheels"], "device_archs": ["gfx1030"]}  # fmt: skip
    gate.update(changes)
    (d / "gpu-gate.json").write_text(json.dumps(gate))
    return d / "gpu-gate.json"


def edit_manifest(d: Path, fn) -> None:
    m = json.loads((d / "build-manifest.json").read_text())
    fn(m)
    (d / "build-manifest.json").write_text(json.dumps(m))


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "wheels"
    write_gate(make_target(r, "gfx1030"))  # gpu_gate "required"
    make_target(r, "gfx1101")  # "compile-only"
    return r


def test_a_good_release_passes_with_the_host_wheel_first(root):
    files, releases = check_release([get_recipe("gfx1030"), get_recipe("gfx1101")], root)
    assert [f.name for f in files] == [
        f"mamba2_rocm-{VERSION}-py3-none-any.whl",
        f"mamba2_rocm_gfx1030-{VERSION}-py3-none-any.whl",
        f"mamba2_rocm_gfx1101-{VERSION}-py3-none-any.whl",
    ]
    assert releases[0].gate_result["tests"]["passed"] == 5 and releases[1].gate_result is None


@pytest.mark.parametrize(
    ("step", "value"), [("static", "failed"), ("smoke_test", "not run"), ("static", None)]
)
def test_failed_verification_is_refused(root, step, value):
    edit_manifest(root / "gfx1101", lambda m: m["verification"].update({step: value}))
    with pytest.raises(PublishError, match=f"gfx1101: build verification '{step}' is {value!r}"):
        check_target(root / "gfx1101", get_recipe("gfx1101"))


def test_missing_gpu_gate_is_refused_for_a_required_recipe(root):
    (root / "gfx1030" / "gpu-gate.json").unlink()
    with pytest.raises(
        PublishError, match=r"gfx1030: recipe requires a GPU gate, and there is no gpu-gate.json"
    ) as err:
        check_target(root / "gfx1030", get_recipe("gfx1030"))
    assert "nox -s gpu-tests-gfx1030" in str(err.value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"result": "failed"}, "result is 'failed', not 'passed'"),
        ({"tests": {**PASSED, "passed": 0, "skipped": 5}}, "a run of skips is not a pass"),
        ({"tests": {**PASSED, "failed": 1}}, "1 failed, 0 errors"),
        ({"target": "gfx90a"}, "it is for target 'gfx90a'"),
        (
            {"wheels": {"other.whl": "0" * 64}},
            "it tested other wheel bytes than the manifest lists",
        ),
    ],
)
def test_a_gate_that_does_not_pass_is_refused(root, changes, message):
    write_gate(root / "gfx1030", **changes)
    with pytest.raises(PublishError, match="gfx1030: the GPU gate in .* does not pass") as err:
        check_target(root / "gfx1030", get_recipe("gfx1030"))
    assert message in str(err.value)


def test_gates_are_found_by_content_under_extra_folders(root, tmp_path):
    gate = root / "gfx1030" / "gpu-gate.json"
    moved = tmp_path / "gates" / "gpu-gate-gfx1030" / "gpu-gate.json"
    moved.parent.mkdir(parents=True)
    shutil.move(gate, moved)
    files, _ = check_release([get_recipe("gfx1030")], root, [tmp_path / "gates"])
    assert len(files) == 2


def test_compile_only_wheel_must_say_so(root):
    d = root / "gfx1101"
    next(d.glob("mamba2_rocm_gfx1101-*.whl")).unlink()
    kern = build_wheel(d, "mamba2-rocm-gfx1101", VERSION, {"mamba2_rocm_gfx1101/__init__.py": ""})
    _set_summary(kern, "kernels for gfx1101")
    edit_manifest(d, lambda m: m["wheels"].update({kern.name: sha256_file(kern)}))
    with pytest.raises(
        PublishError, match="compile-only target, but .* does not say 'compile-only'"
    ):
        check_target(d, get_recipe("gfx1101"))


def test_one_changed_byte_is_refused(root):
    kern = next((root / "gfx1030").glob("mamba2_rocm_gfx1030-*.whl"))
    data = bytearray(kern.read_bytes())
    data[10] ^= 0xFF
    kern.write_bytes(bytes(data))
    with pytest.raises(
        PublishError,
        match=rf"gfx1030: {kern.name} has sha256 [0-9a-f]{{64}}, the build manifest says",
    ):
        check_target(root / "gfx1030", get_recipe("gfx1030"))


def test_unlisted_and_missing_wheels_are_refused(root):
    build_wheel(root / "gfx1101", "stray", "1.0", {"stray/__init__.py": ""})
    with pytest.raises(PublishError, match="holds wheels the manifest does not list: stray-1.0"):
        check_target(root / "gfx1101", get_recipe("gfx1101"))
    (root / "gfx1101" / "stray-1.0-py3-none-any.whl").unlink()
    next((root / "gfx1101").glob("mamba2_rocm-*.whl")).unlink()
    with pytest.raises(PublishError, match="is listed in the manifest but missing"):
        check_target(root / "gfx1101", get_recipe("gfx1101"))


def test_recipe_changed_since_the_build_is_refused(root):
    edit_manifest(root / "gfx1101", lambda m: m["recipe"].update({"sha256": "f" * 64}))
    with pytest.raises(PublishError, match=r"recipes/gfx1101.toml changed since the build"):
        check_target(root / "gfx1101", get_recipe("gfx1101"))


def test_missing_manifest_and_differing_host_wheels(root, tmp_path):
    with pytest.raises(PublishError, match="no build manifest"):
        check_target(tmp_path / "nothing", get_recipe("gfx90a"))
    other = tmp_path / "other"
    make_target(other, "gfx1102", host_extra="# another host build\n")
    shutil.copytree(other / "gfx1102", root / "gfx1102")
    with pytest.raises(PublishError, match="the host wheel differs between targets"):
        check_release([get_recipe("gfx1101"), get_recipe("gfx1102")], root)


def test_upload_needs_credentials_and_never_skips_existing(root, monkeypatch):
    files, _ = check_release([get_recipe("gfx1101")], root)
    with pytest.raises(
        PublishError, match="no upload credentials: set TWINE_USERNAME and TWINE_PASSWORD"
    ):
        publish.twine_upload(files, "http://127.0.0.1:1/", env={})
    seen = []

    class Proc:
        returncode, stdout, stderr = 0, "ok", ""

    monkeypatch.setattr(
        publish, "_twine", lambda args, env=None: seen.append((args, env)) or Proc()
    )
    publish.twine_upload(
        files, "http://127.0.0.1:1/", env={"TWINE_USERNAME": "u", "TWINE_PASSWORD": "p"}
    )
    args, env = seen[0]
    assert (
        "--skip-existing" not in args and "p" not in args
    )  # the password stays in the environment
    assert args[-2:] == [str(f) for f in files] and env["TWINE_PASSWORD"] == "p"
    # trusted publishing: no password, but the job may request an OIDC token
    publish.twine_upload(files, "http://127.0.0.1:1/", env={"ACTIONS_ID_TOKEN_REQUEST_URL": "x"})


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ("HTTPError: 403 Forbidden from http://x/", "refused the credentials (HTTP 403)"),
        ("HTTPError: 401 Unauthorized", "refused the credentials (HTTP 401)"),
        ("HTTPError: 400 Bad Request\nFile already exists", "already has this version (HTTP 400)"),
        ("HTTPError: 409 Conflict", "already has this version (HTTP 409)"),
        ("HTTPError: 500 Internal", "failed (HTTP 500)"),
    ],
)
def test_upload_failures_are_explained(output, expected):
    assert expected in publish._explain_upload_failure(output, "http://x/")
