"""Recipes: every shipped one loads; malformed ones are rejected naming file and field."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mamba2_rocm.arch import arch_info
from mamba2_rocm.pipeline.recipes import RecipeError, get_recipe, load_recipe, load_recipes
from mamba2_rocm.targets import RELEASE_TARGETS

REPO = Path(__file__).resolve().parents[2]
GOOD = (REPO / "recipes" / "gfx1030.toml").read_text()


def test_every_release_target_has_a_valid_recipe():
    recipes = load_recipes()
    assert set(recipes) == set(RELEASE_TARGETS)
    for r in recipes.values():
        for arch in r.archs:
            assert arch_info(arch).wavefront_size == r.wavefront_size
        assert r.code_object_version == (6 if r.target.endswith("-generic") else 5)
        assert (r.gpu_gate == "required") == bool(r.runner_labels)


def _write(tmp_path, text, name="gfx1030"):
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.replace('target = "gfx1030"', 'target = "gfx1031"'),
            "gfx1030.toml: field 'target': 'gfx1031' does not match the file name",
        ),
        (
            lambda t: t.replace('archs = ["gfx1030"]', 'archs = ["gfx1037"]'),
            "gfx1030.toml: field 'archs': unknown GPU architecture 'gfx1037'",
        ),
        (
            lambda t: t.replace('archs = ["gfx1030"]', "archs = []"),
            "field 'archs': must not be empty",
        ),
        (
            lambda t: t.replace('archs = ["gfx1030"]', 'archs = ["sm_90"]'),
            "field 'archs': sm_90 is not an AMD target",
        ),
        (
            lambda t: t.replace("wavefront_size = 32", "wavefront_size = 64"),
            "field 'wavefront_size': 64, but gfx1030 runs wave32",
        ),
        (
            lambda t: t.replace("wavefront_size = 32", 'wavefront_size = "32"'),
            "field 'wavefront_size': expected 32 or 64, got '32'",
        ),
        (
            lambda t: t.replace("code_object_version = 5", "code_object_version = 4"),
            "field 'code_object_version': expected 5 or 6, got 4",
        ),
        (
            lambda t: t.replace('min_rocm = "6.0"', 'min_rocm = "six"'),
            "field 'min_rocm': not a version: 'six'",
        ),
        (
            lambda t: t.replace('gpu_gate = "required"', 'gpu_gate = "maybe"'),
            "field 'gpu_gate': expected one of",
        ),
        (
            lambda t: re.sub(r"runner_labels = \[[^\]]*\]", "runner_labels = []", t),
            "field 'gpu_gate': \"required\" needs runner_labels",
        ),
        (
            lambda t: t.replace("compile_flags", "compile_flag"),
            "field 'compile_flag': unknown field",
        ),
        (lambda t: t.replace('min_rocm = "6.0"', ""), "field 'min_rocm': missing"),
        (
            lambda t: t.replace('hipcc = "7.0.2+dfsg-3"', 'hipcc = ">=7"'),
            "field 'toolchain.packages.hipcc': expected an exact apt version",
        ),
        (
            lambda t: t.replace('hipcc = "7.0.2+dfsg-3", ', ""),
            "field 'toolchain.packages': must pin hipcc",
        ),
        (lambda t: t.replace('suite = "unstable"', 'suite = ""'), "field 'toolchain.suite'"),
        (lambda t: t.replace("[toolchain]", "[toolchain\n"), "gfx1030.toml: not valid TOML"),
        # a newline in a field that reaches the Dockerfile / apt sources: a second apt source
        (
            lambda t: t.replace('suite = "unstable"',
                                'suite = "unstable\\ndeb [trusted=yes] http://evil/ x main"'),
            "field 'toolchain.suite': control character '\\n' in 'unstable\\ndeb [trusted=yes]",
        ),
        (
            lambda t: t.replace('suite = "unstable"', 'suite = "unstable main"'),
            "field 'toolchain.suite': 'unstable main' is not a valid suite",
        ),
        (
            lambda t: t.replace('hipcc = "7.0.2+dfsg-3"', 'hipcc = "7.0.2+dfsg-3\\tx"'),
            "field 'toolchain.packages.hipcc': control character '\\t'",
        ),
        (
            lambda t: t.replace('hipcc = "7.0.2+dfsg-3"', 'hipcc = "7.0.2;rm"'),
            "field 'toolchain.packages.hipcc': '7.0.2;rm' is not a valid version",
        ),
        (
            lambda t: t.replace("hipcc = ", "'hipcc/x' = "),
            "field 'toolchain.packages': 'hipcc/x' is not a valid package",
        ),
        (
            lambda t: t.replace('compile_flags = ["-O3"]', 'compile_flags = ["-O3\\n-O0"]'),
            "field 'compile_flags': control character '\\n'",
        ),
        (
            lambda t: t.replace('"gfx1030"]  # self', '"gfx 1030"]  # self'),
            "field 'runner_labels': 'gfx 1030' is not a valid label",
        ),
        # the target and what is compiled into its package must agree
        (
            lambda t: t.replace('archs = ["gfx1030"]', 'archs = ["gfx1100"]'),
            "field 'archs': ['gfx1100'] does not contain the target 'gfx1030'",
        ),
        (
            lambda t: t.replace('archs = ["gfx1030"]', 'archs = ["gfx1030", "gfx1031"]'),
            "field 'archs': the exact target 'gfx1030' lists only itself, got ['gfx1030', 'gfx1031']",
        ),
    ],
)  # fmt: skip
def test_malformed_recipe(tmp_path, edit, message):
    with pytest.raises(RecipeError, match=re.escape(message)):
        load_recipe(_write(tmp_path, edit(GOOD)))


def test_generic_recipe_needs_v6(tmp_path):
    text = (
        (REPO / "recipes" / "gfx11-generic.toml")
        .read_text()
        .replace("code_object_version = 6", "code_object_version = 5")
    )
    with pytest.raises(RecipeError, match="5, but generic targets need code-object v6"):
        load_recipe(_write(tmp_path, text, "gfx11-generic"))


def test_generic_recipe_archs_stay_in_the_family(tmp_path):
    text = (REPO / "recipes" / "gfx11-generic.toml").read_text()
    ok = text.replace('archs = ["gfx11-generic"]', 'archs = ["gfx11-generic", "gfx1103"]')
    assert load_recipe(_write(tmp_path, ok, "gfx11-generic")).archs == ("gfx11-generic", "gfx1103")
    bad = text.replace('archs = ["gfx11-generic"]', 'archs = ["gfx11-generic", "gfx1200"]')
    with pytest.raises(
        RecipeError, match=re.escape("['gfx1200'] are not in the gfx11-generic family")
    ):
        load_recipe(_write(tmp_path, bad, "gfx11-generic"))


def test_unknown_target_lists_the_known_ones():
    with pytest.raises(
        RecipeError, match="unknown target 'gfx9000'; recipes exist for: gfx10-3-generic, gfx1030"
    ):
        get_recipe("gfx9000")


def test_toolchain_key_shared_by_equal_pins(tmp_path):
    a = load_recipe(_write(tmp_path, GOOD))
    other = tmp_path / "other"
    other.mkdir()
    b = load_recipe(_write(other, GOOD.replace('lld-21 = "1:21.1.8-14"', 'lld-21 = "1:21.1.8-15"')))
    assert a.toolchain_key == load_recipe(REPO / "recipes" / "gfx1030.toml").toolchain_key
    assert a.toolchain_key != b.toolchain_key


def test_cli_unknown_target_and_bad_recipe(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mamba2_rocm.pipeline", "build", "gfx9000"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert proc.returncode == 1 and "error: unknown target 'gfx9000'" in proc.stderr


def test_nox_sessions_come_from_recipes():
    if shutil.which("nox") is None:
        pytest.skip("nox is not installed")
    out = subprocess.run(["nox", "-l"], capture_output=True, text=True, cwd=REPO, check=True).stdout
    for target in load_recipes():
        assert re.search(
            rf"^- build-{re.escape(target)} -> Build, verify and package", out, re.M
        ), target
    for name in ("build-all", "toolchain", "reproducibility", "tests", "lint"):
        assert re.search(rf"^[*-] {name} -> \S", out, re.M), name
