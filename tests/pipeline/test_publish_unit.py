"""publish's refusals, each on a small hand-made wheels/<target>/ (no Docker, no index)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fakewheels import build_wheel, stand_in_arch

from mamba2_rocm.pipeline import publish
from mamba2_rocm.pipeline.package import (
    COMPILE_ONLY_SUMMARY,
    DROPIN_PTH,
    DROPIN_PTH_FILE,
    kernel_summary,
)
from mamba2_rocm.pipeline.publish import PublishError, check_release, check_target, sha256_file
from mamba2_rocm.pipeline.recipes import get_recipe

VERSION = "1.2.3"
PASSED = {"tests": 5, "passed": 5, "failed": 0, "errors": 0, "skipped": 0}


COMMIT = "c0ffee" * 6 + "abcd"


@pytest.fixture(autouse=True)
def stand_in_code_objects(monkeypatch):
    """The kernel wheels here hold stand-ins that name their ISA ("code object X for gfx1030");
    real code objects are read by the Docker end-to-end tests (test_release_index.py)."""
    monkeypatch.setattr(publish, "code_object_arch", stand_in_arch(publish.code_object_arch))
    monkeypatch.delenv("GITHUB_RUN_ID", raising=False)


def kernel_files(recipe, archs=None, where=None) -> dict[str, str | bytes]:
    files: dict[str, str | bytes] = {f"{recipe.module_name}/__init__.py": ""}
    for arch in archs or recipe.archs:
        folder = where or arch
        files[f"{recipe.module_name}/kernels/{folder}/ssd.hsaco"] = (
            f"code object ssd for {arch}".encode()
        )
    return files


def make_target(root: Path, target: str, host_extra: str = "", dropin_files=None) -> Path:
    """wheels/<target>/ as the build writes it: three wheels and a manifest naming their hashes."""
    recipe = get_recipe(target)
    d = root / target
    host = build_wheel(d, "mamba2-rocm", VERSION, {"mamba2_rocm/__init__.py": host_extra})
    dropin = build_wheel(d, "mamba2-rocm-dropin", VERSION,
                         dropin_files or {DROPIN_PTH_FILE: DROPIN_PTH})  # fmt: skip
    kern = build_wheel(d, recipe.package_name, VERSION, kernel_files(recipe))
    # build_wheel writes no Summary: add the one package.py's metadata has
    _set_summary(kern, kernel_summary(recipe))
    manifest = {
        "format": 2, "target": target, "version": VERSION, "gpu_gate": recipe.gpu_gate,
        "source_commit": COMMIT,
        "recipe": {"file": f"recipes/{target}.toml", "sha256": recipe.sha256},
        "verification": {"static": "passed", "smoke_test": "passed", "gpu_test": "not run"},
        "wheels": {w.name: sha256_file(w) for w in (host, dropin, kern)},
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
    gate = {"format": 2, "target": manifest["target"], "result": "passed", "tests": PASSED,
            "wheels": manifest["wheels"], "device_archs": ["gfx1030"], "commit": COMMIT,
            "run_id": "4242"}  # fmt: skip
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
        f"mamba2_rocm_dropin-{VERSION}-py3-none-any.whl",
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
        ({"commit": "f" * 40}, f"it tested commit {'f' * 40!r}, the wheels are from {COMMIT!r}"),
        ({"format": 1}, "format 1, expected 2"),
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
    assert len(files) == 3


def _replace_kernel_wheel(d: Path, target: str, files, summary: str) -> None:
    recipe = get_recipe(target)
    old = next(d.glob(f"{recipe.module_name}-*.whl"))
    old.unlink()
    kern = build_wheel(d, recipe.package_name, VERSION, files)
    _set_summary(kern, summary)
    edit_manifest(d, lambda m: m["wheels"].pop(old.name) and None)
    edit_manifest(d, lambda m: m["wheels"].update({kern.name: sha256_file(kern)}))


@pytest.mark.parametrize(
    ("target", "summary"),
    [
        ("gfx1101", "kernels for gfx1101"),  # compile-only, but not said
        ("gfx1101", "kernels for gfx1101 [not compile-only]"),  # the old substring test passed it
        ("gfx1030", kernel_summary(get_recipe("gfx1030")) + COMPILE_ONLY_SUMMARY),  # required
    ],
)
def test_the_kernel_summary_must_be_exactly_the_pipelines(root, target, summary):
    d = root / target
    _replace_kernel_wheel(d, target, kernel_files(get_recipe(target)), summary)
    if target == "gfx1030":
        write_gate(d)
    with pytest.raises(PublishError, match=f"{target}: .*'s Summary is .*expected exactly"):
        check_target(d, get_recipe(target))


@pytest.mark.parametrize(
    ("files", "message"),
    [
        (lambda r: kernel_files(r, archs=["gfx1100"]),
         "kernels/gfx1100/ssd.hsaco is built for gfx1100, not one of ['gfx1101']"),
        (lambda r: kernel_files(r, where="gfx1030"),
         "kernels/gfx1030/ssd.hsaco is built for gfx1101 but lies in 'gfx1030'"),
        (lambda r: {f"{r.module_name}/__init__.py": ""}, "no code objects for ['gfx1101']"),
        (lambda r: {**kernel_files(r), f"{r.module_name}/kernels/gfx1101/x.hsaco": b"junk"},
         "x.hsaco: not a code object"),
    ],
)  # fmt: skip
def test_wheel_contents_must_match_the_recipe(root, files, message):
    recipe = get_recipe("gfx1101")
    _replace_kernel_wheel(root / "gfx1101", "gfx1101", files(recipe), kernel_summary(recipe))
    with pytest.raises(PublishError, match="gfx1101: mamba2_rocm_gfx1101-.* does not match "
                       "recipes/gfx1101.toml") as err:  # fmt: skip
        check_target(root / "gfx1101", recipe)
    assert message in str(err.value)


def test_a_host_wheel_with_code_objects_is_refused(tmp_path):
    d = make_target(tmp_path, "gfx1101")
    host = next(d.glob("mamba2_rocm-*.whl"))
    host.unlink()
    host = build_wheel(d, "mamba2-rocm", VERSION, {"mamba2_rocm/k/ssd.hsaco": b"x"})
    edit_manifest(d, lambda m: m["wheels"].update({host.name: sha256_file(host)}))
    with pytest.raises(PublishError, match="the host wheel .* holds code objects"):
        check_target(d, get_recipe("gfx1101"))


def test_in_ci_the_gate_must_come_from_this_run(root, monkeypatch):
    monkeypatch.setenv("GITHUB_RUN_ID", "4242")
    check_target(root / "gfx1030", get_recipe("gfx1030"))  # the fixture's gate: run 4242
    monkeypatch.setenv("GITHUB_RUN_ID", "999")
    with pytest.raises(PublishError, match="it is from workflow run '4242', this is run 999"):
        check_target(root / "gfx1030", get_recipe("gfx1030"))


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
    assert args[-3:] == [str(f) for f in files] and env["TWINE_PASSWORD"] == "p"
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


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({DROPIN_PTH_FILE: DROPIN_PTH, "evil.py": "x"}, r"files other than mamba2_rocm_dropin.pth: \['evil.py'\]"),
        ({DROPIN_PTH_FILE: "import os; os.system('x')\n"}, "mamba2_rocm_dropin.pth is not the pipeline's"),
        ({"other.pth": DROPIN_PTH}, "files other than"),
        ({}, "holds no mamba2_rocm_dropin.pth"),
    ],
)  # fmt: skip
def test_the_dropin_wheel_holds_only_the_pipelines_pth(tmp_path, files, message):
    """The drop-in's .pth runs at every interpreter start: anything else in it is refused."""
    d = make_target(tmp_path / "wheels", "gfx1101", dropin_files=files or {"x.dist-info/y": ""})
    with pytest.raises(PublishError, match=message):
        check_target(d, get_recipe("gfx1101"))


def test_a_release_without_the_dropin_wheel_is_refused(root):
    d = root / "gfx1101"
    dropin = next(d.glob("mamba2_rocm_dropin-*.whl"))
    dropin.unlink()
    edit_manifest(d, lambda m: m["wheels"].pop(dropin.name) and None)
    with pytest.raises(
        PublishError,
        match="expected one wheel each of mamba2_rocm-1.2.3, "
        "mamba2_rocm_dropin-1.2.3, mamba2_rocm_gfx1101-1.2.3",
    ):
        check_target(d, get_recipe("gfx1101"))  # fmt: skip


def test_differing_dropin_wheels_between_targets_are_refused(tmp_path):
    r = tmp_path / "wheels"
    write_gate(make_target(r, "gfx1030"))
    make_target(r, "gfx1101", dropin_files={DROPIN_PTH_FILE: DROPIN_PTH, "x.dist-info/extra": ""})
    with pytest.raises(PublishError, match="the drop-in wheel differs between targets"):
        check_release([get_recipe("gfx1030"), get_recipe("gfx1101")], r)
