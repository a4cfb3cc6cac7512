"""``python -m mamba2_rocm.pipeline resources``: the AMD targets' register / LDS / spill table of
the work tree's kernels, its per-arch summary, what changed against an earlier run, and exit 1 on
a spill (issue #72: 0 spills on every target)."""

from __future__ import annotations

import json

from mamba2_rocm.pipeline import resources
from mamba2_rocm.pipeline.__main__ import main
from mamba2_rocm.pipeline.recipes import get_recipe


def _row(vgpr=32, sgpr=20, spills=0, waves=8):
    return {"vgpr": vgpr, "sgpr": sgpr, "agpr": 0, "lds_bytes": 0, "spills": spills,
            "waves_per_simd": waves}  # fmt: skip


def test_summary_names_the_largest_and_the_spilling():
    table = {"gfx1030": {"a": _row(40, 30), "b": _row(64, 20, spills=8), "c": _row(12, 90)},
             "gfx942": {"a": _row(28, 28)}, "gfx1100": {}}  # fmt: skip
    lines = resources.summary(table)
    assert lines[0] == ("gfx1030: 3 kernels, max 64 VGPRs (b), max 90 SGPRs (c), "
                        "1 spilling: b")  # fmt: skip
    assert lines[1] == "gfx942: 1 kernels, max 28 VGPRs (a), max 28 SGPRs (a), 0 spills"
    assert lines[2] == "gfx1100: no kernels"


def test_changes_lists_moved_added_and_removed_kernels():
    before = {"gfx1030": {"a": _row(), "b": _row(), "gone": _row()}, "gfx90a": {"a": _row()}}
    after = {"gfx1030": {"a": _row(), "b": _row(40, 24, waves=6), "new": _row()},
             "gfx1100": {"a": _row()}}  # fmt: skip
    assert resources.changes(before, after) == [
        "gfx1030: b: vgpr 32 -> 40, sgpr 20 -> 24, waves_per_simd 8 -> 6",
        "gfx1030: gone removed",
        "gfx1030: new added",
    ]  # (archs only one side compiled are not compared)


def test_an_unknown_source_is_refused_before_any_compile(tmp_path, capsys):
    assert main(["resources", "--target", "gfx1030", "--source", "no_such_kernel",
                 "--out", str(tmp_path)]) == 1  # fmt: skip
    assert "no csrc/no_such_kernel.hip" in capsys.readouterr().err


def test_work_tree_kernels_compile_and_compare(toolchain_image, tmp_path, monkeypatch):
    """In the toolchain image (docker): one small source for one target, twice; the second run
    against the first finds nothing changed; a spill in the table makes the exit 1."""
    logged = []
    recipes = [get_recipe("gfx1030")]
    first, second = tmp_path / "before", tmp_path / "after"
    assert resources.run(recipes, ["state_rows"], first, log=logged.append) == 0
    table = json.loads((first / "resources.json").read_text())
    row = table["gfx1030"]["m2r_state_rows"]
    assert row["spills"] == 0 and row["vgpr"] > 0 and row["waves_per_simd"] >= 1
    assert logged[0].startswith("gfx1030: 1 kernels, max ") and logged[0].endswith("0 spills")
    logged.clear()
    assert resources.run(recipes, ["state_rows"], second, against=first, log=logged.append) == 0
    assert logged[-1] == f"against {first}: 0 kernels changed"

    real = resources.kernel_table
    monkeypatch.setattr(resources, "kernel_table", lambda folders: {
        a: {k: {**r, "spills": 4} for k, r in rows.items()} for a, rows in real(folders).items()})  # fmt: skip
    assert resources.run(recipes, ["state_rows"], tmp_path / "spilled", log=logged.append) == 1


def test_kernel_table_reads_what_the_build_wrote(built_gfx1030):
    table = resources.kernel_table({"gfx1030": built_gfx1030})["gfx1030"]
    assert "m2r_state_rows" in table and all(r["spills"] == 0 for r in table.values())
