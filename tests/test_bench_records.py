"""Benchmark records (``mamba2_rocm.bench.records``): what ``bench --record`` writes, the
newest record per device and command, ``docs/performance.md`` rendered from them, and the
committed file kept equal to the records."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from mamba2_rocm.bench import records

ENV = {"device": "NVIDIA H100 80GB HBM3", "arch": "sm_90", "runtime": "CUDA 13.0",
       "driver": "580.1", "torch": "2.11.0", "triton": "3.6.0", "python": "3.12.3",
       "kernels": "kernels: sm_90 (env MAMBA2_ROCM_KERNEL_PATH)"}  # fmt: skip


def _row(case, impl, best, frac=None):
    return {"case": case, "impl": impl, "us": best * 1.1, "graph_us": best, "best_us": best,
            "copy_frac": frac, "gbs": 1.0, "copy_gbs": 3000.0, "mbytes": 1.0}  # fmt: skip


def _write(tmp_path, op, rows, when, command=None, env=ENV):
    return records.write(op, command or f"python -m mamba2_rocm bench {op} --dtype bfloat16",
                         rows, tmp_path, env=env, now=when)  # fmt: skip


def test_a_record_names_everything_its_numbers_depend_on(tmp_path):
    when = dt.datetime(2026, 12, 6, 6, 0, 0, tzinfo=dt.timezone.utc)
    path = _write(tmp_path, "add-norm", [_row("d768", "kernel", 50.0, 0.95)], when)
    assert path.name == "20261206T060000Z-nvidia-h100-80gb-hbm3-add-norm.json"
    rec = json.loads(path.read_text())
    assert rec["format"] == records.FORMAT and rec["date"] == "2026-12-06T06:00:00Z"
    assert rec["environment"] == ENV and rec["op"] == "add-norm"
    assert rec["commit"] is None or len(rec["commit"]) == 40
    assert isinstance(rec["dirty"], bool)
    assert records.load(tmp_path)[0]["rows"] == rec["rows"]


def test_the_source_tree_names_uncommitted_changes_exactly(tmp_path):
    """records.tree(): the git tree of the tracked files as on disk -- HEAD's tree when clean,
    the tree a commit of the changes would have when dirty (untracked files left out) -- with
    the checkout's own index untouched; the rendered line names it for a dirty record."""
    import subprocess

    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True,
                              capture_output=True, text=True).stdout.strip()  # fmt: skip

    git("init", "-q")
    git("config", "user.email", "t@example.invalid")
    git("config", "user.name", "t")
    (tmp_path / "a.hip").write_text("one\n")
    git("add", "a.hip")
    git("commit", "-q", "-m", "one")
    assert records.tree(tmp_path) == git("rev-parse", "HEAD^{tree}")
    (tmp_path / "a.hip").write_text("two\n")
    (tmp_path / "untracked.txt").write_text("x\n")
    dirty = records.tree(tmp_path)
    assert dirty != git("rev-parse", "HEAD^{tree}")
    assert "?? untracked.txt" in git("status", "--porcelain")  # (left out of the tree)
    git("commit", "-q", "-am", "two")
    assert dirty == git("rev-parse", "HEAD^{tree}")
    assert records.tree(tmp_path / "nowhere") is None
    rec = {"op": "ssd", "date": "2026-12-06T06:00:00Z", "rows": [], "environment": ENV,
           "commit": "a" * 40, "dirty": True, "tree": "b" * 40, "command": "c"}  # fmt: skip
    assert f"commit {'a' * 12} with uncommitted changes (source tree {'b' * 12})" in (
        records.render([rec])
    )


def test_the_newest_record_per_device_and_command_is_rendered(tmp_path):
    day = dt.datetime(2026, 12, 6, tzinfo=dt.timezone.utc)
    _write(
        tmp_path, "add-norm", [_row("d768", "kernel", 60.0, 0.8), _row("d768", "torch", 300.0)], day
    )
    _write(tmp_path, "add-norm",
           [_row("d768", "kernel", 50.0, 0.95), _row("d768", "mamba_ssm triton", 55.0)],
           day + dt.timedelta(hours=1))  # fmt: skip
    _write(
        tmp_path,
        "generate",
        [
            {
                "shape": "130m",
                "side": "ours",
                "prefill_ms": 10.7,
                "launched": ["m2r_ssd"],
                "host": {"mamba2-rocm": 1.0},
            }
        ],
        day,
    )
    _write(
        tmp_path,
        "add-norm",
        [_row("d768 fwd+bwd", "kernel", 90.0, 0.9)],
        day,
        command="python -m mamba2_rocm bench add-norm --dtype bfloat16 --backward",
    )
    _write(tmp_path, "add-norm", [_row("d768", "kernel", 70.0, 0.7)], day,
           env={**ENV, "device": "AMD Radeon RX 7900 XTX", "arch": "gfx1100"})  # fmt: skip
    text = records.render(records.load(tmp_path))
    assert text.count("## add-norm on ") == 2 and "## generate on NVIDIA H100" in text
    assert text.count("## add-norm forward + backward on NVIDIA H100") == 1  # its own section
    assert "| d768 | 50.0 | 55.0 | 1.10x | 95.0% |" in text  # the newer H100 run only
    assert "60.0" not in text
    assert "| shape | side | prefill_ms |" in text and "| 130m | ours | 10.7 |" in text
    assert "m2r_ssd" not in text  # (nested values stay in the record)
    assert "gfx1100" in text


def test_a_record_of_another_format_is_refused(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"format": 99, "op": "ssd"}))
    with pytest.raises(ValueError, match="not a bench record of format 1"):
        records.load(tmp_path)


def test_check_mode(tmp_path, capsys):
    out = tmp_path / "performance.md"
    assert records.main(["--records", str(tmp_path / "none"), "--out", str(out), "--check"]) == 1
    assert records.main(["--records", str(tmp_path / "none"), "--out", str(out)]) == 0
    assert records.main(["--records", str(tmp_path / "none"), "--out", str(out), "--check"]) == 0
    assert "No records yet" in out.read_text()


def test_the_committed_performance_doc_equals_the_records():
    """docs/performance.md is generated: regenerate it with python -m mamba2_rocm.bench.records."""
    recs = records.load(records.RECORDS) if records.RECORDS.is_dir() else []
    assert records.DOC.read_text() == records.render(recs)


def test_bench_record_flag_writes_a_record(monkeypatch, tmp_path, capsys):
    from mamba2_rocm import cli
    from mamba2_rocm.bench import add_norm

    written = []
    monkeypatch.setattr(
        add_norm, "run", lambda dtype, backward=False: [_row("d768", "kernel", 5.0)]
    )
    monkeypatch.setattr(add_norm, "format_table", lambda rows: "table")
    monkeypatch.setattr(
        records, "write", lambda op, command, rows: written.append((op, command)) or tmp_path
    )
    assert cli.main(["bench", "add-norm", "--backward", "--record"]) == 0
    assert written == [
        ("add-norm", "python -m mamba2_rocm bench add-norm --dtype bfloat16 --backward")
    ]


def test_our_variants_floors_and_summaries(tmp_path):
    """Every "mamba2-rocm kernel…" row is ours (one per case), a copy of the same bytes is a floor
    (its time shown, no ratio), and a bench's summary lines follow its table."""
    day = dt.datetime(2026, 12, 6, tzinfo=dt.timezone.utc)
    rows = [_row("fwd", "mamba2-rocm kernel", 90.0, 0.97), _row("fwd", "copy of the same bytes", 88.0),
            _row("fwd", "F.conv1d", 900.0), _row("fwd cl", "mamba2-rocm kernel (channel-last)", 100.0, 0.9),
            _row("fwd cl", "F.conv1d", 500.0), {"summary": ["worst ratio 1.15x"]}]  # fmt: skip
    _write(tmp_path, "conv1d", rows, day)
    text = records.render(records.load(tmp_path))
    assert "| case | mamba2-rocm kernel µs | copy of the same bytes µs | F.conv1d µs | " in text
    assert "copy of the same bytes / ours" not in text
    assert "| fwd | 90.0 | 88.0 | 900.0 | - | 10.00x | 97.0% |" in text
    assert "| fwd cl | - | - | 500.0 | 100.0 | 5.00x | 90.0% |" in text
    assert text.rstrip().endswith("- worst ratio 1.15x")
