"""``bench ssd-error`` on CPU: the harness (the torch tier standing in for the kernels) against
the float64 recurrence, the rounding floor, a wrong output caught, the per-dtype summary against
Triton, and the record's command."""

from __future__ import annotations

import pytest
import torch

from mamba2_rocm.bench import ssd_error

SMALL = {
    "odd": (2, 67, 3, 24, 1, 16, 32, ()),
    "varlen": (1, 97, 4, 16, 2, 16, 32, ("varlen",)),
    "z init": (2, 41, 2, 16, 1, 16, 16, ("z", "init")),
}


def test_errors_are_measured_against_the_float64_recurrence():
    rows = ssd_error.run(dtypes=("float32", "bfloat16"), cases=SMALL, device="cpu",
                         ours_tier="torch", procs=1)  # fmt: skip
    table = [r for r in rows if "summary" not in r]
    assert len(table) == 6 and {r["impl"] for r in table} == {"torch"}
    for r in table:
        assert r["floor_rel_rms"] <= r["rel_rms"] * 1.01  # nothing beats rounding once
        limit = 1e-5 if r["dtype"] == "float32" else 1e-2
        assert 0 < r["rel_rms"] < limit and 0 < r["max_rel"] < 10 * limit, r
    assert rows[-1]["summary"][0].startswith("float32: torch worst ")


def test_cases_spread_over_processes_give_the_same_rows():
    """Each case in a process of its own (how the GPU run keeps Triton's compiles side by
    side): the same rows, in the grid's order, as one process gives."""
    kw = dict(dtypes=("float32",), cases=SMALL, device="cpu", ours_tier="torch")
    assert ssd_error.run(procs=3, **kw) == ssd_error.run(procs=1, **kw)


def test_a_failing_case_process_names_the_case():
    bad = {"odd": SMALL["odd"], "broken": (1, 10, 2, 8, 3, 8, 4, ())}  # 2 heads, 3 groups
    with pytest.raises(RuntimeError, match="case 'broken' failed"):
        ssd_error.run(dtypes=("float32",), cases=bad, device="cpu", ours_tier="torch", procs=2)


def test_a_wrong_output_is_seen(monkeypatch):
    """A scan that drops one head's D term: the error is far above the floor."""
    import mamba2_rocm

    real = mamba2_rocm.mamba_chunk_scan_combined

    def wrong(*args, **kw):
        out = real(*args, **kw)
        out = out[0] if isinstance(out, tuple) else out
        return out - kw["D"][0] * args[0] * (torch.arange(out.shape[2]) == 0)[:, None]

    monkeypatch.setattr(mamba2_rocm, "mamba_chunk_scan_combined", wrong)
    (row,) = [r for r in ssd_error.run(dtypes=("float32",), cases={"odd": SMALL["odd"]},
                                       device="cpu", ours_tier="torch") if "summary" not in r]  # fmt: skip
    assert row["rel_rms"] > 1000 * row["floor_rel_rms"]


def test_varlen_case_packs_sequences_with_seq_idx_and_cu_seqlens():
    args, kw = ssd_error.make_case(SMALL["varlen"], "bfloat16", "cpu")
    bounds = kw["cu_seqlens"].tolist()
    assert bounds[0] == 0 and bounds[-1] == 97 and len(bounds) == 5
    assert kw["return_varlen_states"] is True
    for i in range(4):
        assert (kw["seq_idx"][0, bounds[i] : bounds[i + 1]] == i).all()
    assert args[0].dtype == torch.bfloat16 and args[2].dtype == torch.float32


def test_summary_names_the_cases_where_ours_is_above_triton():
    def row(case, impl, rms):
        return {"case": case, "dtype": "bfloat16", "impl": impl, "rel_rms": rms,
                "max_rel": rms, "floor_rel_rms": 1e-3}  # fmt: skip

    rows = [row("a", "kernel", 1.6e-3), row("a", ssd_error.TRITON, 1.8e-3),
            row("b", "kernel", 2.1e-3), row("b", ssd_error.TRITON, 2.0e-3)]  # fmt: skip
    (line,) = ssd_error.summary(rows)
    assert line == ("bfloat16: kernel worst 0.0021 (b); mamba_ssm triton worst 0.002 (b); "
                    "ours at or below Triton in 1 of 2 cases (above in: b)")  # fmt: skip
    text = ssd_error.format_table([*rows, {"summary": [line]}])
    assert text.splitlines()[-1] == line


def test_the_record_names_no_dtype():
    import argparse

    from mamba2_rocm.bench.cli import _command

    args = argparse.Namespace(op="ssd-error", dtype="bfloat16", backward=False, shape=None,
                              triton_procs=3)  # fmt: skip
    assert _command(args) == "python -m mamba2_rocm bench ssd-error"


@pytest.mark.parametrize("name", list(ssd_error.GRID))
def test_grid_cases_build(name):
    args, kw = ssd_error.make_case(ssd_error.GRID[name], "float16", "cpu")
    b, L, h, p, g, n, cs, extras = ssd_error.GRID[name]
    assert args[0].shape == (b, L, h, p) and args[3].shape == (b, L, g, n) and args[5] == cs
    assert ("seq_idx" in kw) == bool({"seq_idx", "varlen"} & set(extras))
    assert ("z" in kw) == ("z" in extras) and ("initial_states" in kw) == ("init" in extras)


def test_without_a_gpu_it_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="bench ssd-error needs a GPU"):
        ssd_error.run(cases=SMALL)
