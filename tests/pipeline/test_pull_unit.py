"""pull's checks on hand-written inputs: pip's install report and the installed files."""

from __future__ import annotations

import json

import pytest

from mamba2_rocm.pipeline.pull import (
    PullError,
    downloaded_hashes,
    hashed_requirements,
    read_manifest,
    verify_install,
)
from mamba2_rocm.pipeline.recipes import get_recipe

MANIFEST = {
    "target": "gfx1030", "version": "1.0",
    "wheels": {"mamba2_rocm-1.0-py3-none-any.whl": "a" * 64,
               "mamba2_rocm_dropin-1.0-py3-none-any.whl": "9" * 64,
               "mamba2_rocm_gfx1030-1.0-py3-none-any.whl": "b" * 64},
    "code_objects": {"gfx1030/conv1d_fwd.hsaco": "c" * 64, "gfx1030/rmsnorm.hsaco": "d" * 64},
}  # fmt: skip
INSTALLED = {
    "mamba2-rocm": {"version": "1.0", "code_objects": {}},
    "mamba2-rocm-dropin": {"version": "1.0", "code_objects": {}},
    "mamba2-rocm-gfx1030": {"version": "1.0", "code_objects": dict(MANIFEST["code_objects"])},
}


def test_downloaded_hashes_from_pip_report():
    report = {"install": [
        {"download_info": {"url": "http://127.0.0.1:1/packages/mamba2_rocm-1.0-py3-none-any.whl#sha256=x",
                           "archive_info": {"hashes": {"sha256": "a" * 64}}}},
        {"download_info": {"url": "http://127.0.0.1:1/packages/mamba2_rocm_gfx1030-1.0-py3-none-any.whl",
                           "archive_info": {"hash": "sha256=" + "b" * 64}}},
        {"download_info": {"url": "http://127.0.0.1:1/packages/filelock-1-py3-none-any.whl", "archive_info": {}}},
    ]}  # fmt: skip
    assert downloaded_hashes(report) == {
        "mamba2_rocm-1.0-py3-none-any.whl": "a" * 64,
        "mamba2_rocm_gfx1030-1.0-py3-none-any.whl": "b" * 64,
        "filelock-1-py3-none-any.whl": "",
    }


def test_a_matching_install_has_no_problems():
    downloaded = dict(MANIFEST["wheels"])
    assert verify_install(get_recipe("gfx1030"), MANIFEST, INSTALLED, downloaded) == []


def test_every_difference_is_named():
    installed = {
        "mamba2-rocm": {"version": "0.9", "code_objects": {}},
        "mamba2-rocm-dropin": {"version": "1.0", "code_objects": {}},
        "mamba2-rocm-gfx1030": {"version": "1.0", "code_objects": {
            "gfx1030/conv1d_fwd.hsaco": "e" * 64, "gfx1030/extra.hsaco": "f" * 64}},
    }  # fmt: skip
    downloaded = {"mamba2_rocm-1.0-py3-none-any.whl": "0" * 64,
                  "mamba2_rocm_dropin-1.0-py3-none-any.whl": "9" * 64,
                  "mamba2_rocm_gfx1030-1.0-py3-none-any.whl": ""}  # fmt: skip
    problems = verify_install(get_recipe("gfx1030"), MANIFEST, installed, downloaded)
    assert problems == [
        "mamba2-rocm 0.9 installed, the manifest is for 1.0",
        f"mamba2_rocm-1.0-py3-none-any.whl from the index has sha256 {'0' * 64}, the manifest says {'a' * 64}",
        "the index gave no sha256 for mamba2_rocm_gfx1030-1.0-py3-none-any.whl: its bytes cannot be checked",
        f"installed code object gfx1030/conv1d_fwd.hsaco has sha256 {'e' * 64}, the manifest says {'c' * 64}",
        "installed code object gfx1030/extra.hsaco is not in the manifest",
        "code object gfx1030/rmsnorm.hsaco is in the manifest but not installed",
    ]
    assert verify_install(get_recipe("gfx1030"), MANIFEST, {}, {})[:3] == [
        "mamba2-rocm is not installed", "mamba2-rocm-dropin is not installed",
        "mamba2-rocm-gfx1030 is not installed"]  # fmt: skip


def test_manifest_must_exist_and_be_of_the_target(tmp_path):
    with pytest.raises(PullError, match="no build manifest at .*: pass --manifest"):
        read_manifest(tmp_path / "none.json", get_recipe("gfx1030"))
    other = tmp_path / "m.json"
    other.write_text('{"target": "gfx90a"}')
    with pytest.raises(PullError, match="is the manifest of 'gfx90a', not gfx1030"):
        read_manifest(other, get_recipe("gfx1030"))


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (dict(wheels={}), "'wheels' must be a non-empty table of sha256s, got {}"),
        (dict(code_objects=None), "'code_objects' must be a non-empty table of sha256s, got None"),
        (dict(version=""), "'version' must be a non-empty string"),
        (dict(wheels={**MANIFEST["wheels"], "mamba2_rocm-1.0-py3-none-any.whl": "A" * 64}),
         "'wheels' entry 'mamba2_rocm-1.0-py3-none-any.whl': 'AAAA"),
        (dict(wheels={"mamba2_rocm-1.0-py3-none-any.whl": "a" * 64}),
         "'wheels' must list exactly one mamba2_rocm_gfx1030 wheel, got []"),
        (dict(wheels={**MANIFEST["wheels"], "evil-1.0-py3-none-any.whl": "e" * 64}),
         "'wheels' lists files of other distributions: ['evil-1.0-py3-none-any.whl']"),
        (dict(wheels={"mamba2_rocm-0.9-py3-none-any.whl": "a" * 64,
                      "mamba2_rocm_dropin-1.0-py3-none-any.whl": "9" * 64,
                      "mamba2_rocm_gfx1030-1.0-py3-none-any.whl": "b" * 64}),
         "mamba2_rocm-0.9-py3-none-any.whl is not version 1.0"),
        (dict(wheels={"mamba2_rocm-1.0-py3-none-any.whl": "a" * 64,
                      "mamba2_rocm_gfx1030-1.0-py3-none-any.whl": "b" * 64}),
         "'wheels' must list exactly one mamba2_rocm_dropin wheel, got []"),
        (dict(code_objects={"gfx1100/ssd.hsaco": "c" * 64}),
         "code objects outside the recipe's archs ['gfx1030']: ['gfx1100/ssd.hsaco']"),
    ],
)  # fmt: skip
def test_an_unusable_manifest_is_an_error_not_a_pass(tmp_path, change, expected):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({**MANIFEST, **change}))
    with pytest.raises(PullError, match="is not a usable build manifest") as exc:
        read_manifest(path, get_recipe("gfx1030"))
    assert expected in str(exc.value)


def test_the_manifest_becomes_hash_pinned_requirements(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(MANIFEST))
    assert hashed_requirements(read_manifest(path, get_recipe("gfx1030"))) == (
        f"mamba2-rocm==1.0 --hash=sha256:{'a' * 64}\n"
        f"mamba2-rocm-dropin==1.0 --hash=sha256:{'9' * 64}\n"
        f"mamba2-rocm-gfx1030==1.0 --hash=sha256:{'b' * 64}\n"
    )


def test_dropin_import_names_must_be_ours_at_the_version():
    """pull and the build's smoke test read the drop-in's report from the new environment."""
    from mamba2_rocm.pipeline.package import dropin_problems

    good = [
        {"name": "mamba_ssm", "owner": "mamba2-rocm", "version": "2.3.2+mamba2rocm.1.0"},
        {"name": "causal_conv1d", "owner": "mamba2-rocm", "version": "1.6.1+mamba2rocm.1.0"},
    ]
    assert dropin_problems(good, "1.0") == []
    bad = [
        {"name": "mamba_ssm", "owner": "other", "path": "/x/mamba_ssm/__init__.py"},
        {"name": "causal_conv1d", "owner": "mamba2-rocm", "version": "1.6.1+mamba2rocm.0.9"},
    ]
    assert dropin_problems(bad, "1.0") == [
        "import mamba_ssm is other (/x/mamba_ssm/__init__.py), not mamba2-rocm's drop-in",
        "causal_conv1d's version reads '1.6.1+mamba2rocm.0.9', expected 1.6.1+mamba2rocm.1.0",
    ]
    assert dropin_problems([], "1.0") == [
        "import mamba_ssm: not reported",
        "import causal_conv1d: not reported",
    ]
