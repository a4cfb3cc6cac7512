"""The benchmark helpers that need no GPU."""

import os
import sys

import pytest
import torch

from mamba2_rocm.bench.timing import backend


@pytest.mark.parametrize("before", [None, "torch"])
def test_backend_sets_and_restores_the_switch(before, monkeypatch):
    if before is None:
        monkeypatch.delenv("MAMBA2_ROCM_BACKEND", raising=False)
    else:
        monkeypatch.setenv("MAMBA2_ROCM_BACKEND", before)
    with pytest.raises(RuntimeError, match="inside"), backend("kernel"):
        assert os.environ["MAMBA2_ROCM_BACKEND"] == "kernel"
        raise RuntimeError("inside")
    assert os.environ.get("MAMBA2_ROCM_BACKEND") == before


# --- bench model: the parts that need no GPU ----------------------------------------------


def test_model_shapes_are_the_checkpoints():
    from mamba2_rocm.bench.model import config_kwargs

    for shape, heads in (("130m", 24), ("1.3b", 64)):
        kw = config_kwargs(shape)
        assert kw["num_heads"] == heads and kw["head_dim"] == 64 and kw["state_size"] == 128
        assert kw["n_groups"] == 1 and kw["chunk_size"] == 256


def test_a_side_must_prove_what_it_ran():
    from mamba2_rocm.bench.model import side_problems

    ours = ["m2r_conv1d_fwd_bf16_w4_vec", "m2r_ssd_bf16_x", "m2r_ssu_bf16_bf16_n128_contig"]
    assert side_problems("ours", ours, None) == []
    assert side_problems("ours", ours[:1], None) == [
        "the ours side never launched m2r_ssd*",
        "the ours side never launched m2r_ssu*",
    ]
    assert side_problems("torch", [], None) == []
    assert side_problems("torch", ours, None) == [
        f"the torch side launched mamba2-rocm kernels: {ours}"
    ]
    real = "/x/mamba_ssm/__init__.py"
    assert side_problems("triton", ours[:1], real) == []
    assert side_problems("triton", ours, real) == ["the triton side ran our scan / decode kernels"]
    facade = "/y/mamba2_rocm/dropin/facades/mamba_ssm/__init__.py"
    assert side_problems("triton", ours[:1], facade) == [
        f"mamba_ssm came from {facade}, not a real mamba_ssm"
    ]


def test_model_table_prints_ratios_and_every_problem():
    from mamba2_rocm.bench.model import format_table

    rows = [
        {"side": "ours", "shape": "130m", "dtype": "bfloat16", "transformers": "5.17.0",
         "prefill_ms": 10.0, "decode_b1_tok_s": 200.0, "decode_b16_tok_s": 3000.0,
         "decode_b1_gpu_busy": 0.5, "decode_b1_host_us": {"mamba2-rocm": 2150.4}, "problems": []},
        {"side": "torch", "shape": "130m", "prefill_ms": 900.0, "decode_b1_tok_s": 50.0,
         "decode_b16_tok_s": 600.0, "problems": ["the torch side launched x"]},
        {"side": "triton", "shape": "130m", "skipped": "no real mamba_ssm importable"},
    ]  # fmt: skip
    table = format_table(rows)
    prefill = next(ln for ln in table.splitlines() if "prefill" in ln)
    assert prefill.split()[-2:] == ["90.00x", "-"]  # torch 900 ms / ours 10 ms; no triton
    decode = next(ln for ln in table.splitlines() if "decode b1 " in ln)
    assert "4.00x" in decode  # 200 / 50 tok/s: higher is better
    assert "ours decode b1: GPU busy 50% of wall time" in table
    assert ("ours decode b1: 5000 µs a step (all layers); host µs a step inside the named ops: "
            "mamba2-rocm 2150") in table  # fmt: skip
    assert "torch: NOT VALID: the torch side launched x" in table
    assert "triton: skipped (no real mamba_ssm importable)" in table


def test_sides_hide_a_real_mamba_ssm_except_the_triton_one():
    from mamba2_rocm.bench.model import _side_code

    code = _side_code("ours", "/peers/src", "130m", "bfloat16", 3)
    assert "'/peers/src'" in code and "d.activate()" in code
    assert "d.deactivate()" in _side_code("torch", "/peers/src", "130m", "bfloat16", 3)
    ns: dict = {}
    import sys

    saved = list(sys.path)
    try:
        sys.path[:] = ["/peers/src", "/keep"]
        exec(code.splitlines()[1], {"sys": sys}, ns)  # the sys.path filter line
        assert "sys.path" not in _side_code("triton", None, "130m", "bfloat16", 3)
        assert sys.path == ["/keep"]
    finally:
        sys.path[:] = saved


def test_model_rounds_rotate_the_sides_and_take_medians(monkeypatch, capsys):
    """``bench model --rounds 3``: the sides run in turns, the order rotating each round; each
    number is the median of its rounds (each round's kept beside it), the rest from the first
    round that ran; a round that failed is noted, a side whose every round failed is an error."""
    from mamba2_rocm import cli
    from mamba2_rocm.bench import model

    order = []
    tok = {"ours": [70.0, 90.0, 60.0], "torch": [40.0, 41.0, 42.0], "triton": [55.0, 50.0, 52.0]}

    def spawn(side, shape, dtype, repeats, real_root):
        k = sum(1 for s, _ in order if s == side)
        order.append((side, shape))
        if side == "torch" and k == 1:
            return {"side": side, "shape": shape, "error": "Traceback ... boom"}
        return {"side": side, "shape": shape, "dtype": dtype, "decode_b1_tok_s": tok[side][k],
                "transformers": "5.17.0", "launched": [f"k{k}"], "problems": []}  # fmt: skip

    monkeypatch.setattr(model, "_spawn", spawn)
    monkeypatch.setattr(model, "real_mamba_ssm_root", lambda: "/somewhere")
    rows = model.run(shapes=("130m",), rounds=3)
    assert [s for s, _ in order] == ["ours", "torch", "triton", "torch", "triton", "ours",
                                     "triton", "ours", "torch"]  # fmt: skip
    by = {r["side"]: r for r in rows}
    assert by["ours"]["decode_b1_tok_s"] == 70.0 and by["ours"]["decode_b1_tok_s_rounds"] == [
        70.0, 90.0, 60.0]  # fmt: skip
    assert by["ours"]["launched"] == ["k0"] and by["ours"]["rounds"] == 3
    assert by["torch"]["decode_b1_tok_s"] == 41.0  # the median of the two that ran (40, 42)
    assert by["torch"]["rounds_failed"] == ["Traceback ... boom"]
    assert by["triton"]["decode_b1_tok_s"] == 52.0
    assert model.merge_rounds([{"side": "x", "error": "e1"}, {"side": "x", "error": "e2"}]) == {
        "side": "x", "error": "e1"}  # fmt: skip
    # one round, as before: no per-round lists
    order.clear()
    (row, *_) = model.run(shapes=("130m",), rounds=1)
    assert row["decode_b1_tok_s"] == 70.0 and "decode_b1_tok_s_rounds" not in row
    assert cli.main(["bench", "ssd", "--rounds", "3"]) != 0
    assert "--rounds applies to `bench model` only" in capsys.readouterr().err
    assert cli.main(["bench", "model", "--rounds", "0"]) != 0
    assert "--rounds takes a count >= 1" in capsys.readouterr().err


def test_bench_model_takes_chosen_shapes(monkeypatch, capsys):
    """``bench model --shape 1.3b`` (and ``bench generate``) runs only that shape (a whole run
    can outlast one device call); --shape on another op is refused."""
    from mamba2_rocm import cli
    from mamba2_rocm.bench import generate, model

    seen = []
    for mod in (model, generate):
        monkeypatch.setattr(mod, "run", lambda dtype, shapes=None: seen.append(shapes) or [])
    assert cli.main(["bench", "model", "--shape", "1.3b", "--json"]) == 0
    assert cli.main(["bench", "generate", "--shape", "130m", "--json"]) == 0
    assert seen == [("1.3b",), ("130m",)]
    assert cli.main(["bench", "ssd", "--shape", "1.3b"]) == 1
    assert "--shape applies to `bench model` / `bench generate` only" in capsys.readouterr().err


def test_the_table_says_when_the_kernels_are_an_emulation_build(monkeypatch, tmp_path):
    """A gfx1030-emulation timing on the NVIDIA GPU must never read as a Radeon timing."""
    import types

    import torch

    from mamba2_rocm.bench import timing
    from mamba2_rocm.runtime import loader

    kdir = types.SimpleNamespace(path=tmp_path, origin="MAMBA2_ROCM_KERNEL_PATH",
                                 manifest={"emulates": "gfx1030"})  # fmt: skip
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(loader, "kernels_for_device",
                        lambda i: types.SimpleNamespace(target="sm_90", kdir=kdir))  # fmt: skip
    note = timing.kernel_build_note()
    assert note.startswith(f"kernels: sm_90 from {tmp_path} (MAMBA2_ROCM_KERNEL_PATH); EMULATION")
    assert "gfx1030's code paths" in note and "not of an AMD GPU" in note
    kdir.manifest = {}
    assert "EMULATION" not in timing.kernel_build_note()
    monkeypatch.setattr(loader, "kernels_for_device", lambda i: None)
    assert timing.kernel_build_note() == "kernels: none (torch fallback)"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert timing.kernel_build_note() == "kernels: none (no GPU)"


# --- bench selective-scan: the table and the peer lookup ----------------------------------


def test_selective_scan_table_prints_ratios_and_the_worst(monkeypatch):
    import mamba2_rocm.bench.timing as timing
    from mamba2_rocm.bench.selective_scan import BUTTERFLY, DEFERRED, REF, format_table

    monkeypatch.setattr(timing, "require_torch", lambda: type("T", (), {"cuda": type(
        "C", (), {"get_device_name": staticmethod(lambda: "GPU")})}))  # fmt: skip
    row = dict(mbytes=1.0, us=1.0, graph_us=None, gbs=1.0, copy_frac=0.5, copy_gbs=2.0, tflops=1.0)
    rows = [
        {**row, "case": "a", "impl": "kernel", "best_us": 10.0},
        {**row, "case": "a", "impl": DEFERRED, "best_us": 4.0},
        {**row, "case": "a", "impl": BUTTERFLY, "best_us": 30.0},
        {**row, "case": "a", "impl": "torch", "best_us": 400.0},
        {**row, "case": "a", "impl": REF, "best_us": 1000.0},
        {**row, "case": "b", "impl": "kernel", "best_us": 20.0},
        {**row, "case": "b", "impl": "torch", "best_us": 60.0},
    ]
    table = format_table(rows)
    assert f"a: kernel is 40.0x faster than torch, 100.0x faster than {REF}" in table
    assert "b: kernel is 3.0x faster than torch" in table
    assert "a: the default form is 0.40x as fast as the deferred form" in table
    assert "a: the default form is 3.00x as fast as the butterfly form" in table
    assert table.endswith("worst ratio over all cases: 3.0x")


def test_selective_scan_table_gives_the_cuda_peer_ratio_over_the_narrow_grid(monkeypatch):
    """Issue #72's narrow grid (d 768-2048, batch 1-8): the CUDA peer's worst ratio there, from
    the forward cases inside it only (not the wide ones, not a backward table)."""
    import mamba2_rocm.bench.timing as timing
    from mamba2_rocm.bench.selective_scan import (
        CUDA_PEER,
        NARROW,
        SHAPES,
        _narrow_case,
        format_table,
    )

    monkeypatch.setattr(timing, "require_torch", lambda: type("T", (), {"cuda": type(
        "C", (), {"get_device_name": staticmethod(lambda: "GPU")})}))  # fmt: skip
    row = dict(mbytes=1.0, us=1.0, graph_us=None, gbs=1.0, copy_frac=0.5, copy_gbs=2.0, tflops=1.0)
    times = {
        "sscan b1 d1536 l2048 n16 bfloat16": (79.0, 57.0),  # inside: 0.72x
        "sscan b8 d2048 l2048 n16 bfloat16": (400.0, 600.0),  # inside: 1.5x
        "sscan b8 d4096 l2048 n16 bfloat16": (500.0, 100.0),
    }  # outside (wide): 0.2x
    rows = [{**row, "case": c, "impl": impl, "best_us": t}
            for c, (ours, peer) in times.items()
            for impl, t in (("kernel", ours), (CUDA_PEER, peer))]  # fmt: skip
    assert format_table(rows).endswith(
        f"narrow grid (d 768-2048, batch 1-8; goal >= 1.0x): {CUDA_PEER} / kernel 0.72x at worst "
        "over 2 cases"
    )
    assert "narrow grid" not in format_table(rows[4:])  # the wide case alone
    assert [_narrow_case(f"sscan b{b} d{d} l{L} n{n} bfloat16") for b, d, L, n in NARROW] == [
        True] * len(NARROW)  # fmt: skip
    assert [_narrow_case(f"sscan b{b} d{d} l{L} n{n} bfloat16") for b, d, L, n in SHAPES] == [
        False, False, True]  # fmt: skip
    assert not _narrow_case("sscan fwd+bwd b1 d1536 l2048 n16 bfloat16")


def test_selective_scan_peer_is_never_the_drop_in():
    """Under the drop-in, mamba_ssm's selective_scan_ref is ours: no peer column then."""
    import mamba2_rocm.dropin as dropin
    from mamba2_rocm.bench.selective_scan import _mamba_ssm_ref

    was, before = dropin.is_active(), set(sys.modules)
    dropin.activate()
    try:
        assert _mamba_ssm_ref() is None
    finally:
        if not was:
            dropin.deactivate()
        for name in set(sys.modules) - before:
            if name.split(".")[0] in dropin.FACADES:
                del sys.modules[name]


def test_selective_scan_cuda_peer_gets_its_own_argument_forms(monkeypatch):
    """mamba_ssm's CUDA forward takes variable B / C in the input dtype, grouped (b, 1, n, l):
    the peer is called the way mamba_ssm's wrapper calls it, everything else passed as is."""
    import types

    from mamba2_rocm.bench.selective_scan import _mamba_ssm_cuda

    seen = []
    fake = types.ModuleType("selective_scan_cuda")
    fake.fwd = lambda *a: (seen.append(a) or a[0] * 2, None, a[0] * 3)  # (out, states, out_z)
    monkeypatch.setitem(sys.modules, "selective_scan_cuda", fake)
    u, delta, z = (torch.randn(2, 3, 5, dtype=torch.bfloat16) for _ in range(3))
    A, B, C = torch.randn(3, 4), torch.randn(2, 4, 5), torch.randn(2, 4, 5)
    D, bias = torch.randn(3), torch.randn(3)
    call = _mamba_ssm_cuda()(u, delta, A, B, C, D, z, bias, True)
    assert not seen  # prepared, not run
    assert torch.equal(call(), u * 3)  # with z: the gated output
    (args,) = seen
    for t, src in ((args[3], B), (args[4], C)):
        assert t.shape == (2, 1, 4, 5) and t.dtype == torch.bfloat16 and t.is_contiguous()
        assert torch.equal(t[:, 0], src.to(torch.bfloat16))
    assert args[0] is u and args[1] is delta and args[2] is A and args[5] is D
    assert args[6] is z and args[7] is bias and args[8] is True
    assert torch.equal(_mamba_ssm_cuda()(u, delta, A, B, C, D, None, bias, True)(), u * 2)


def test_selective_scan_cuda_peer_is_never_the_drop_in(monkeypatch):
    """Beside the real pure-Python mamba_ssm, ``selective_scan_cuda`` is the drop-in's facade
    over our kernels: timing it as the peer would compare ours with ours."""
    import types

    from mamba2_rocm.bench.selective_scan import _mamba_ssm_cuda
    from mamba2_rocm.ops import extension_abi

    facade = types.ModuleType("selective_scan_cuda")
    facade.fwd, facade.bwd = extension_abi.selective_scan_fwd, extension_abi.selective_scan_bwd
    monkeypatch.setitem(sys.modules, "selective_scan_cuda", facade)
    assert _mamba_ssm_cuda() is None


def test_selective_scan_cuda_peer_is_absent_without_its_module(monkeypatch):
    from mamba2_rocm.bench.selective_scan import _mamba_ssm_cuda

    monkeypatch.setitem(sys.modules, "selective_scan_cuda", None)  # import raises ImportError
    assert _mamba_ssm_cuda() is None


def test_selective_scan_table_says_when_the_cuda_peer_disagrees(monkeypatch):
    import mamba2_rocm.bench.timing as timing
    from mamba2_rocm.bench.selective_scan import CUDA_PEER, format_table

    monkeypatch.setattr(timing, "require_torch", lambda: type("T", (), {"cuda": type(
        "C", (), {"get_device_name": staticmethod(lambda: "GPU")})}))  # fmt: skip
    row = dict(mbytes=1.0, us=1.0, graph_us=None, gbs=1.0, copy_frac=0.5, copy_gbs=2.0, tflops=1.0)
    peer = dict(row, impl=CUDA_PEER)
    rows = [
        {**row, "case": "a", "impl": "kernel", "best_us": 10.0},
        {**peer, "case": "a", "best_us": 15.0, "agrees": True, "max_diff_vs_kernel": 0.01},
        {**row, "case": "b", "impl": "kernel", "best_us": 10.0},
        {**peer, "case": "b", "best_us": 5.0, "agrees": False, "max_diff_vs_kernel": 3.0},
    ]
    table = format_table(rows)
    assert f"a: kernel is 1.5x faster than {CUDA_PEER}" in table
    disagrees = f"b: {CUDA_PEER} DISAGREES with the kernel (max |diff| 3): its timing is not"
    assert disagrees in table
    assert f"a: {CUDA_PEER} DISAGREES" not in table


# --- bench host: the launch switch and the table ------------------------------------------


def test_launches_disabled_counts_and_restores():
    import mamba2_rocm.ops.conv1d as conv
    import mamba2_rocm.ops.state_update as su
    from mamba2_rocm.bench.host import launches_disabled
    from mamba2_rocm.ops import _launch

    before = (conv.launch, su.launch, _launch.launch)
    with launches_disabled() as count:
        assert conv.launch is not before[0] and su.launch is not before[1]
        conv.launch("launcher", None, (), (1, 1, 1), 32)
        _launch.launch("launcher", None, (), (1, 1, 1), 32)
        assert count == [2]
    assert (conv.launch, su.launch, _launch.launch) == before


def test_host_table_names_the_ops_over_the_target():
    from mamba2_rocm.bench.host import format_table

    row = dict(python_us=5.0, launch_us=3.0, launches_per_call=1.0, kernel_us=2.0)
    rows = [{**row, "case": "selective_state_update b1", "host_us": 14.5},
            {**row, "case": "rmsnorm_fn gated", "host_us": 8.0}]  # fmt: skip
    table = format_table(rows)
    assert "selective_state_update b1" in table and "14.5" in table
    assert table.endswith("worst host time per call: 14.5 us (selective_state_update); "
                          "over the 10 us target: selective_state_update")  # fmt: skip
    rows[0]["host_us"] = 9.0
    assert format_table(rows).endswith("every op within the 10 us target")


def test_host_table_lists_the_floors_and_says_when_the_target_is_below_them():
    from mamba2_rocm.bench.host import format_table

    row = dict(python_us=5.0, launch_us=3.0, launches_per_call=1.0, kernel_us=2.0)
    rows = [{**row, "case": "rmsnorm_fn gated", "host_us": 30.0},
            {"case": "floor: driver launch alone (ctypes)", "host_us": 9.6, "floor": True},
            {"case": "floor: torch y.add_(1), one launch", "host_us": 13.7, "floor": True}]  # fmt: skip
    lines = format_table(rows).splitlines()
    assert any(line.startswith("floor: torch y.add_(1)") and "13.7" in line for line in lines)
    assert lines[-1].startswith("worst host time per call: 30.0 us (rmsnorm_fn)")  # 9.6: fine
    rows[1]["host_us"] = 10.4
    lines = format_table(rows).splitlines()
    assert lines[-2].startswith("worst host time per call: 30.0 us (rmsnorm_fn)")
    assert lines[-1] == (
        "this machine's floor for one launch from Python is 10.4 us (the driver call alone): "
        "the 10 us target is below it"
    )


# --- the grids and the ratio summary -------------------------------------------------------


def test_ssd_grid_covers_every_model_at_every_point():
    from mamba2_rocm.bench.ssd import ISSUE_SHAPES, MODELS, POINTS, grid

    cases = grid()
    assert len(cases) == len(ISSUE_SHAPES) + len(MODELS) * len(POINTS)
    assert {label for label, _ in cases} == {"issue", *MODELS}
    # the checkpoints' heads (d_inner / 64) and the grouped hybrid
    assert [MODELS[f"mamba2-{m}"][0] for m in ("130m", "370m", "780m", "1.3b", "2.7b")] == [
        24, 32, 48, 64, 80
    ]  # fmt: skip
    assert MODELS["codestral-7b"][:4] == (128, 64, 8, 128)


def test_ratio_summary_flags_cases_below_the_target_and_the_worst():
    from mamba2_rocm.bench.timing import ratio_summary

    rows = [
        {"case": "a", "impl": "kernel", "best_us": 100.0, "us": 120.0},
        {"case": "b", "impl": "kernel", "best_us": 50.0, "us": 60.0},
        {"case": "c", "impl": "kernel", "best_us": 10.0, "us": 10.0},  # no Triton row: left out
        {"case": "a", "impl": "torch", "best_us": 1.0, "us": 1.0},
    ]
    best = {"a": {"best_us": 150.0, "us": 480.0}, "b": {"best_us": 55.0, "us": 66.0}}
    lines = ratio_summary(rows, best, 1.2)
    assert lines[0] == ("a: 100.0 us vs Triton's best 150.0 us: 1.50x; eager per call 120.0 vs "
                        "480.0 us: 4.00x")  # fmt: skip
    assert lines[1] == ("b: 50.0 us vs Triton's best 55.0 us: 1.10x  (below 1.2x); eager per call "
                        "60.0 vs 66.0 us: 1.10x")  # fmt: skip
    assert lines[-1] == ("worst ratio over the grid (Triton best / ours): 1.10x device time, "
                         "1.10x eager per call")  # fmt: skip
    assert len(lines) == 3


def test_conv1d_summary_takes_the_large_cases_and_the_worst_cudnn_ratio():
    from mamba2_rocm.bench.conv1d import COPY, CUDNN, KERNEL_CL, LARGE_BYTES, summary

    big, small = LARGE_BYTES, LARGE_BYTES - 1
    k, cl, cl_case = "mamba2-rocm kernel", KERNEL_CL, " channel-last"
    rows = [
        {"case": "m fwd b1 d8 l8", "impl": k, "bytes": big, "copy_frac": 0.8, "best_us": 10.0},
        # the channel-last kernel: its own line, the small case left out, no cuDNN ratio
        {
            "case": "m fwd b1 d8 l8" + cl_case,
            "impl": cl,
            "bytes": big,
            "copy_frac": 0.85,
            "best_us": 9.0,
        },
        # a copy of the large forward case's bytes: both layouts' kernels are taken against it
        {"case": "m fwd b1 d8 l8", "impl": COPY, "bytes": big, "copy_frac": 0.9, "best_us": 8.1},
        {
            "case": "n fwd b8 d8 l8" + cl_case,
            "impl": cl,
            "bytes": small,
            "copy_frac": 0.05,
            "best_us": 1,
        },
        {"case": "m fwd b1 d8 l8", "impl": CUDNN, "bytes": big, "copy_frac": 0.5, "best_us": 15.0},
        {"case": "n fwd b8 d8 l8", "impl": k, "bytes": small, "copy_frac": 0.1, "best_us": 4.0},
        {"case": "n fwd b8 d8 l8", "impl": CUDNN, "bytes": small, "copy_frac": 0.1, "best_us": 2.0},
        {"case": "m update b64 d8", "impl": k, "bytes": big, "copy_frac": 0.95, "best_us": 3.0},
        {"case": "m update b64 d8", "impl": COPY, "bytes": big, "copy_frac": 1, "best_us": 2.4},
        {"case": "m update b256 d8", "impl": k, "bytes": small, "copy_frac": 0.9, "best_us": 5.0},
        {"case": "m update b256 d8", "impl": COPY, "bytes": small, "copy_frac": 1, "best_us": 4.5},
        {"case": "m update b1 d8", "impl": k, "bytes": small, "copy_frac": 0.1, "best_us": 2.0},
        {"case": "m update b1 d8", "impl": COPY, "bytes": small, "copy_frac": 0.1, "best_us": 1.0},
    ]
    assert summary(rows) == [
        "worst fwd at >= 64 MB: 80.0% of copy (m fwd b1 d8 l8; target 90%)",
        "worst update at >= 64 MB: 95.0% of copy (m update b64 d8; target 90%)",
        "worst fwd channel-last at >= 64 MB: 85.0% of copy (m fwd b1 d8 l8 channel-last; target 90%)",
        "worst fwd against a copy of its bytes (device time), at >= 64 MB: 81.0% (m fwd b1 d8 l8; "
        "target 90%)",
        "worst fwd channel-last against a copy of its bytes (device time), at >= 64 MB: 90.0% "
        "(m fwd b1 d8 l8 channel-last; target 90%)",
        "worst update against a copy of its bytes (device time): 50.0% (m update b1 d8); "
        "at batch 256: 90.0% (m update b256 d8)",
        "worst ratio to cuDNN (device time): 0.50x (n fwd b8 d8 l8)",
    ]


# --- bench conv1d --backward: the cases, the flag, the table --------------------------------


def test_conv1d_backward_cases_are_the_ssd_shapes_convs():
    from mamba2_rocm.bench.conv1d import backward_cases

    cases = backward_cases()
    # bench ssd's issue shapes: h32 p64 g1 n128 -> 2048 + 256; h64 p64 g8 n128 -> 4096 + 2048
    assert cases[:2] == [("ssd-issue h32 g1", 2, 2304, 4096, "channel-last"),
                         ("ssd-issue h64 g8", 1, 6144, 16384, "channel-last")]  # fmt: skip
    assert ("mamba2-1.3b", 4, 4352, 2048, "channel-last") in cases
    # Mamba1's block convolves x seqlen-contiguous (mamba_ssm's Mamba: in_proj's output as b d l)
    assert ("mamba-2.8b", 4, 5120, 2048, "seqlen-contiguous") in cases


def test_backward_flag_only_where_a_training_mode_exists(capsys):
    from mamba2_rocm import cli

    assert cli.main(["bench", "decode", "--backward"]) == 1
    assert "--backward applies to bench conv1d / ssd" in capsys.readouterr().err


def test_rmsnorm_backward_table_names_the_worst_speed_up(monkeypatch):
    """bench rmsnorm --backward's table ends with the worst ratio of Triton's training step to
    ours; forward tables have no such line."""
    from mamba2_rocm.bench import rmsnorm
    from mamba2_rocm.bench.cli import BACKWARD_OPS
    from mamba2_rocm.bench.timing import TRITON

    assert "rmsnorm" in BACKWARD_OPS
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "GPU")
    base = dict(graph_us=None, gbs=1.0, copy_frac=0.5, copy_gbs=2.0, mbytes=1.0)
    a, b = "rmsnorm fwd+bwd a", "rmsnorm fwd+bwd b"
    rows = [dict(base, case=a, impl="kernel", us=10.0, best_us=10.0),
            dict(base, case=a, impl=TRITON, us=12.0, best_us=12.0),
            dict(base, case=b, impl="kernel", us=10.0, best_us=10.0),
            dict(base, case=b, impl=TRITON, us=9.0, best_us=9.0),
            dict(base, case=b, impl="torch", us=90.0, best_us=90.0)]  # fmt: skip
    assert rmsnorm.format_table(rows).splitlines()[-1] == (
        f"worst speed-up over mamba_ssm's Triton norm (training step): 0.90x ({b})"
    )
    fwd = [dict(base, case="rmsnorm rows64", impl="kernel", us=1.0, best_us=1.0)]
    assert "worst" not in rmsnorm.format_table(fwd)


def test_conv1d_table_shows_peak_memory_and_its_ratio(monkeypatch):
    from mamba2_rocm.bench import conv1d

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "GPU")
    row = dict(case="m fwd+bwd b1 d8 l16", graph_us=None, gbs=1.0, copy_frac=0.5, bytes=1 << 30,
               copy_gbs=2.0, iqr_us=0.0)  # fmt: skip
    rows = [dict(row, impl="mamba2-rocm kernel", us=10.0, best_us=10.0, peak_mb=30.0),
            dict(row, impl=conv1d.CUDNN, us=20.0, best_us=20.0, peak_mb=20.0)]  # fmt: skip
    text = conv1d.format_table(rows)
    assert "peak MB" in text and "30.0" in text
    assert "worst ratio to cuDNN (device time): 2.00x" in text
    assert "highest peak memory relative to cuDNN: 1.50x" in text
    assert "worst fwd+bwd at >= 64 MB: 50.0%" in text


def test_bandwidth_row_takes_the_better_of_eager_and_graph():
    """Rows with both timings (bench conv1d --backward's training steps among them): bandwidth and
    the summary's device time use the better (an eager training step is mostly host time),
    whichever it is; the extra fields pass through."""
    from mamba2_rocm.bench.timing import Timing, bandwidth_row

    nbytes = 10**9
    host_bound = bandwidth_row("c", "k", Timing(500.0, 9.0, 100), Timing(125.0, 1.0, 25), nbytes, 4000.0,
                               iqr_us=9.0, bytes=nbytes, peak_mb=7.0)  # fmt: skip
    assert (host_bound["us"], host_bound["graph_us"], host_bound["best_us"]) == (
        500.0,
        125.0,
        125.0,
    )
    assert host_bound["gbs"] == pytest.approx(8000.0) and host_bound["copy_frac"] == pytest.approx(
        2.0
    )
    assert (
        host_bound["iqr_us"] == 9.0
        and host_bound["peak_mb"] == 7.0
        and host_bound["bytes"] == nbytes
    )
    graph_slower = bandwidth_row(
        "c", "k", Timing(100.0, 1.0, 100), Timing(250.0, 1.0, 25), nbytes, 4000.0
    )
    assert graph_slower["best_us"] == 100.0 and graph_slower["gbs"] == pytest.approx(10000.0)
    eager_only = bandwidth_row("c", "k", Timing(100.0, 1.0, 100), None, nbytes, 4000.0)
    assert eager_only["graph_us"] is None and eager_only["best_us"] == 100.0


def test_ssd_backward_table_has_peak_memory_and_the_ratio(monkeypatch):
    """bench ssd --backward's table: the peak-memory column, and the summary's ratio against
    Triton's best (the training issue's target: 1x)."""
    from mamba2_rocm.bench import ssd, timing

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "GPU")
    base = dict(case="issue fwd+bwd b2", graph_us=None, gbs=1.0, copy_frac=0.1, copy_gbs=10.0,
                mbytes=5.0)  # fmt: skip
    ours = dict(base, impl="kernel", us=300.0, best_us=300.0, peak_mb=12.5)
    best = {
        "issue fwd+bwd b2": dict(base, impl=timing.TRITON, us=200.0, best_us=200.0, peak_mb=9.0)
    }
    rows = [ours, *best.values(),
            {"summary": timing.ratio_summary([ours], best, ssd.TARGET_BACKWARD)}]  # fmt: skip
    text = ssd.format_table(rows)
    assert "peak MB" in text and "12.5" in text
    assert "0.67x  (below 1.0x)" in text


@pytest.mark.chunk_rule
def test_ssd_table_shows_the_chunk_our_kernels_ran(monkeypatch):
    """bench ssd's chunk column: the size the kernel tier's rule runs a grid point in (the case
    names the model's), "-" for Triton's rows (which run the model's)."""
    from mamba2_rocm.bench import ssd, timing
    from mamba2_rocm.ops import ssd as ssd_ops

    monkeypatch.setattr(ssd_ops, "sm_count", lambda device: 132)
    assert ssd.run_chunk((1, 8192, 24, 128, 1, 256, 128)) == 256  # Falcon-H1-7B asks for 128
    assert ssd.run_chunk((1, 300, 24, 64, 1, 128, 256)) == 64
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "GPU")
    base = dict(case="falcon b1", graph_us=10.0, gbs=1.0, copy_frac=0.1, copy_gbs=10.0,
                mbytes=5.0, tflops=1.0)  # fmt: skip
    ours = dict(base, impl="kernel", us=20.0, best_us=10.0, chunk=256)
    triton = dict(base, impl=timing.TRITON, us=30.0, best_us=8.0)
    lines = ssd.format_table([ours, triton]).splitlines()
    assert lines[1].split()[-1] == "chunk"
    assert lines[2].split()[-1] == "256" and lines[3].split()[-1] == "-"


# --- bench ssd-paths: the parts that need no GPU --------------------------------------------


@pytest.mark.parametrize(
    ("chunk", "headdim", "dtype", "forms"),
    [
        (256, 64, "bfloat16", ["t64", "t128", "t64b128"]),  # no 128-column form at headdim 64
        (128, 128, "bfloat16", ["t64", "t128", "t64b128", "t64p128"]),
        (64, 72, "float16", ["t64", "t64b128", "t64p128"]),  # the 128-row form needs 128 rows
        (256, 128, "float32", ["t64", "t128"]),  # the 16-bit forms are not built for fp32
    ],
)
def test_ssd_paths_offers_the_forms_that_can_run_the_shape(chunk, headdim, dtype, forms):
    from mamba2_rocm.bench.ssd_paths import scan_forms

    assert scan_forms(chunk, headdim, dtype) == forms


@pytest.mark.parametrize(("scan", "path", "chunk"), [(None, None, None), ("t128", None, 256),
                                                     (None, "separate", 64),
                                                     ("t64p128", "chained_lds", None)])  # fmt: skip
def test_ssd_paths_forces_what_the_forward_launches(monkeypatch, scan, path, chunk):
    """Forced, the forward launches that chunk_scan form and that state path's kernels at that
    chunk size and the context records them; unforced it records the host's own picks; the
    rules come back after."""
    import math

    from helpers import seeded, stand_in_kernels

    from mamba2_rocm.bench.ssd_paths import forced
    from mamba2_rocm.ops import ssd as ssd_ops

    rules = ssd_ops._scan_form, ssd_ops._state_path, ssd_ops.scan_chunk_size
    kset = stand_in_kernels(monkeypatch, ssd_ops, matrix_cores=True)
    g = seeded("ssd-paths", scan, path)
    r = lambda *s: torch.randn(*s, generator=g).bfloat16()  # noqa: E731
    x, dt, B, C = r(2, 300, 4, 128), r(2, 300, 4), r(2, 300, 1, 32), r(2, 300, 1, 32)
    A = -torch.rand(4, generator=g) - 0.1
    with forced(scan, path, chunk) as seen:
        ssd_ops._impl(x, dt, A, B, C, 128, None, None, None, None, None, None,
                      False, (0.0, math.inf), False, None)  # fmt: skip
    assert (ssd_ops._scan_form, ssd_ops._state_path, ssd_ops.scan_chunk_size) == rules
    # the host's picks where not forced: NVIDIA's (the CPU torch has no torch.version.hip) 128
    # columns at headdim 128; chained (no GPU: 0 multiprocessors), through LDS; the caller's
    # chunk size (no GPU)
    assert seen == {"scan": scan or "t64p128", "path": path or "chained_lds", "chunk": chunk or 128}
    from mamba2_rocm.params import SsdParams

    assert {SsdParams(*params).chunk_size for _, params, _ in kset.launches} == {seen["chunk"]}
    names = [name for name, _, _ in kset.launches]
    assert [n for n in names if "chunk_scan" in n] == [f"m2r_ssd_chunk_scan_bf16_{seen['scan']}"]
    stage = ssd_ops._STATE_STAGES[seen["path"]]
    assert [n for n in names if n.startswith("m2r_ssd_chunk_state")] == [f"m2r_ssd_{stage}_bf16"]
    assert ("m2r_ssd_state_passing" in names) is (seen["path"] == "separate")


def test_a_forced_form_longer_than_the_chunk_is_refused(monkeypatch):
    """A chunk_scan form whose tile rows exceed the chunk size would launch a grid with no tiles:
    the host refuses it (only forcing can ask for it)."""
    import math

    from helpers import stand_in_kernels

    from mamba2_rocm.bench.ssd_paths import forced
    from mamba2_rocm.ops import ssd as ssd_ops

    kset = stand_in_kernels(monkeypatch, ssd_ops, matrix_cores=True)
    x, dt = torch.zeros(1, 100, 2, 64).bfloat16(), torch.zeros(1, 100, 2).bfloat16()
    B = C = torch.zeros(1, 100, 1, 32).bfloat16()
    with forced("t128", chunk=64), pytest.raises(ValueError, match="t128 takes chunks of 128"):
        ssd_ops._impl(x, dt, -torch.ones(2), B, C, 64, None, None, None, None, None, None,
                      False, (0.0, math.inf), False, None)  # fmt: skip
    assert not [name for name, _, _ in kset.launches if "chunk_scan" in name]


def test_ssd_paths_forcing_restores_the_rules_and_refuses_what_would_be_wrong():
    from mamba2_rocm.bench.ssd_paths import forced
    from mamba2_rocm.ops import ssd as ssd_ops

    rules = ssd_ops._scan_form, ssd_ops._state_path
    rule_chunk = ssd_ops.scan_chunk_size
    with pytest.raises(RuntimeError, match="inside"), forced("t64", "separate", 256):
        raise RuntimeError("inside")
    assert (ssd_ops._scan_form, ssd_ops._state_path) == rules
    assert ssd_ops.scan_chunk_size is rule_chunk
    with pytest.raises(ValueError, match="unknown state path 'linked'"), forced(path="linked"):
        pass
    with pytest.raises(ValueError, match="unknown chunk_scan form 't32'"), forced("t32"):
        pass
    with (
        pytest.raises(ValueError, match="unknown chunk size 32; one of 64, 128, 256"),
        forced(chunk=32),
    ):
        pass
    assert ssd_ops.scan_chunk_size is rule_chunk
    # the LDS link holds x's and B's offsets in 32 bits: forced beyond that it would be wrong
    x = torch.empty(1, 2**26, 64, 2, device="meta")
    B = torch.empty(1, 2**26, 1, 128, device="meta")
    with forced(path="chained_lds"), pytest.raises(ValueError, match="32-bit"):
        ssd_ops._state_path(64, 2**18, 132, x, B, 256)
    with forced(path="chained") as seen:
        assert ssd_ops._state_path(64, 2**18, 132, x, B, 256) == "chained"
    assert seen == {"path": "chained"}


def test_ssd_paths_table_marks_the_picks_and_sums_up_the_misses():
    from mamba2_rocm.bench.ssd_paths import format_table, loss

    assert loss({"a": 10.0, "b": 12.0}, "a") == 0
    assert loss({"a": 10.0, "b": 12.0}, "b") == pytest.approx(0.2)
    rows = [
        {"case": "one", "chains": 96, "chunks": 64,
         "path_us": {"separate": 100.0, "chained": 110.0}, "path_pick": "chained", "path_loss": 0.1,
         "scan_us": {"t64b128": 50.0, "t64p128": 50.1}, "scan_pick": "t64p128", "scan_loss": 0.002},
        {"case": "two", "chains": 512, "chunks": 2,
         "path_us": {"separate": 20.0, "chained": 19.0}, "path_pick": "chained", "path_loss": 0.0,
         "scan_us": {"t64b128": 30.0}, "scan_pick": "t64b128", "scan_loss": 0.0,
         "chunk_us": {"64": 40.0, "128": 35.0, "256": 30.0}, "chunk_pick": "256", "chunk_loss": 0.0},
        {"case": "short", "chains": 24, "chunks": 5,  # a chunk-size-only row
         "chunk_us": {"64": 24.7, "128": 26.7, "256": 30.1}, "chunk_pick": "128",
         "chunk_loss": 0.081},
    ]  # fmt: skip
    text = format_table(rows)
    assert "separate 100.0  chained* 110.0  |  t64b128 50.0  t64p128* 50.1  |  -" in text
    assert "-  |  -  |  64 24.7  128* 26.7  256 30.1" in text
    assert (
        "state path: the host's pick is more than 0.5% slower than the fastest at 1 of 2 points"
        in text
    )
    assert "chunk size: the host's pick is more than 0.5% slower than the fastest at 1 of 2" in text
    assert "  short: 128 26.7 us, 64 24.7 us (8.1% slower)" in text
    assert "  one: chained 110.0 us, separate 100.0 us (10.0% slower)" in text
    assert (
        "chunk_scan form: the host's pick is more than 0.5% slower than the fastest at 0 of 2 points"
        in text
    )


def test_ssd_paths_without_a_gpu_says_so(monkeypatch):
    from mamba2_rocm.bench import ssd_paths

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="bench ssd-paths needs a GPU"):
        ssd_paths.run()


def test_conv_copy_reference_takes_whole_8k_runs():
    """The same-size copy's element count: nbytes / 4, cut to whole 4096-element runs from 2^18
    elements (torch's copy of other counts took a slower path on the H200), small ones as they
    are."""
    from mamba2_rocm.bench.conv1d import copy_elements

    assert copy_elements(117_458_432) == 29_364_224  # the 112 MB case: 384 elements cut
    assert copy_elements(4 * 29_364_224) == 29_364_224  # whole runs: unchanged
    assert copy_elements(4 * 1000) == 1000  # below 2^18 elements: as it is
    assert copy_elements(4 * (1 << 18) + 4 * 5) == 1 << 18


def test_generate_table_ratios_goals_and_failures():
    """bench generate's table: ours / upstream per metric (> 1: ours ahead, inverted for
    times), the goal beside it; a failed measurement and a skipped side are shown."""
    from mamba2_rocm.bench import generate

    rows = [
        {"shape": "130m", "side": "ours", "dtype": "bfloat16", "prefill_ms": 10.0,
         "train_ms": 30.0, "decode_b1_cg_tok_s": 600.0, "decode_b1_tok_s": 200.0,
         "decode_b16_cg_tok_s_error": "RuntimeError: boom"},
        {"shape": "130m", "side": "upstream", "dtype": "bfloat16", "prefill_ms": 20.0,
         "train_ms": 45.0, "decode_b1_cg_tok_s": 500.0, "decode_b1_tok_s": 100.0},
        {"shape": "1.3b", "side": "ours", "dtype": "bfloat16", "prefill_ms": 5.0},
        {"shape": "1.3b", "side": "upstream", "skipped": "no real mamba_ssm importable"},
    ]  # fmt: skip
    lines = generate.format_table(rows).splitlines()
    first = lines[: next(i for i, ln in enumerate(lines) if ln.startswith("MambaLMHeadModel 1.3b"))]
    row = {ln.split("(")[0].strip(): ln for ln in first if ln.startswith("  ") and "x" in ln}
    assert row["prefill b1 l4096"].split()[-2:] == ["2.00x", "1.5x"]
    assert row["train step b4 l2048"].split()[-2:] == ["1.50x", "1.5x"]
    assert row["decode b1 graph"].split()[-2:] == ["1.20x", "1.2x"]
    assert row["decode b1 eager"].split()[-2:] == ["2.00x", "1.5x"]
    assert "  ours decode_b16_cg_tok_s: FAILED: RuntimeError: boom" in lines
    assert "  upstream: skipped (no real mamba_ssm importable)" in lines


def test_generate_sides_take_turns_and_keep_their_own_medians():
    """bench generate times ours and upstream alternately (a drift reaches both), each side's
    median of its own timings; decode pairs stay long-then-short within a side."""
    from mamba2_rocm.bench import generate

    calls = []
    times = {"a": iter([5.0, 1.0, 6.0]), "b": iter([9.0, 100.0, 8.0])}

    def time_ms(fn):
        return next(times[fn()])

    def tag(name):
        return lambda: calls.append(name) or name

    got = generate.interleaved(time_ms, {"a": tag("a"), "b": tag("b")}, repeats=3)
    assert calls == ["a", "b"] * 3 and got == {"a": 5.0, "b": 9.0}

    calls.clear()
    times = {"al": iter([70.0, 71.0, 500.0]), "as": iter([6.0, 7.0, 6.0]),
             "bl": iter([140.0, 139.0, 141.0]), "bs": iter([12.0, 11.0, 13.0])}  # fmt: skip
    got = generate.interleaved_per_token(
        time_ms, {"a": (tag("al"), tag("as")), "b": (tag("bl"), tag("bs"))}, tokens=64, pairs=3
    )
    assert calls == ["al", "as", "bl", "bs"] * 3
    assert got["a"] == pytest.approx(64.0 / 64) and got["b"] == pytest.approx(128.0 / 64)


def test_generate_measure_runs_metric_by_metric_and_records_a_sides_failure(monkeypatch):
    """A side whose warm-up of a metric fails records that error and sits the metric out; the
    other side is still measured, and the next metric has both again. Decode rows become
    tokens per second (batch / step); gradients are dropped after each metric."""
    from mamba2_rocm.bench import generate

    order = []

    class Model:
        def __init__(self, name):
            self.name, self.zeroed = name, 0

        def zero_grad(self, set_to_none=True):
            self.zeroed += 1

    def workloads(torch_, model, repeats):
        def op(key, ms):
            return lambda: order.append((model.name, key)) or ms

        def broken():
            raise RuntimeError("no graphs here")

        work = {"prefill_ms": (op("warm", 0), op("prefill", 2.0 if model.name == "ours" else 4.0))}
        warm = broken if model.name == "upstream" else op("warm", 0)
        work["decode_b16_cg_tok_s"] = (warm, (op("long", 66.0), op("short", 2.0)))
        return work

    monkeypatch.setattr(generate, "_workloads", workloads)
    monkeypatch.setattr(generate, "_time_once_ms", lambda torch_: lambda fn: fn())
    models = {"ours": Model("ours"), "upstream": Model("upstream")}
    out = generate.measure(torch, models, repeats=3)
    assert out["ours"]["prefill_ms"] == 2.0 and out["upstream"]["prefill_ms"] == 4.0
    assert out["ours"]["decode_b16_cg_tok_s"] == pytest.approx(16 / (1.0 / 1e3))
    assert out["upstream"]["decode_b16_cg_tok_s_error"] == "RuntimeError: no graphs here"
    assert "decode_b16_cg_tok_s" not in out["upstream"]
    timed = [c for c in order if c[1] == "prefill"]
    assert timed == [("ours", "prefill"), ("upstream", "prefill")] * 3
    assert models["ours"].zeroed == models["upstream"].zeroed == 2


def test_breakdown_families_of_real_kernel_names():
    """Kernel names as torch.profiler shows them on both vendors, each in its family."""
    from mamba2_rocm.bench.breakdown import by_family, family

    names = {
        "m2r_ssd_chunk_scan_bf16_t64b128": "ours",
        "m2r_conv1d_fwd_bf16_w4": "ours",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1": "gemm",
        "nvjet_tst_128x192_64x4_1x2_h_bz_coopA_NTN": "gemm",
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn>("
        "Params)": "gemm",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>(int)": "gemm",
        "void gemv2T_kernel_val<int, int, __nv_bfloat16, float, 128, 16, 4, 4, false>(x)": "gemm",
        "Cijk_Alik_Bljk_BBS_BH_MT128x128x32_MI32x32x8x1_SN_1LDSB0": "gemm",
        "_chunk_scan_fwd_kernel": "triton",
        "_layer_norm_fwd_1pass_kernel": "triton",
        "triton_poi_fused_add_0": "triton",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
        "at::detail::Array<char*, 1> >(int, at::native::FillFunctor<float>)": "torch",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>(x)": "torch",
        "Memcpy DtoD (Device -> Device)": "torch",
    }  # fmt: skip
    assert {n: family(n) for n in names} == names
    got = by_family([("m2r_a", 3.0), ("_x_kernel", 2.0), ("Memset (Device)", 1.0)])
    assert got == {"ours": 3.0, "gemm": 0.0, "triton": 2.0, "torch": 1.0}


def test_breakdown_bound_and_table():
    """The bound: upstream's total over ours without our kernels; the table says whether the
    goal is within it."""
    from mamba2_rocm.bench.breakdown import bound, format_rows

    ours = {"ours": 40.0e3, "gemm": 150.0e3, "triton": 0.0, "torch": 20.0e3}
    up = {"ours": 5.0e3, "gemm": 150.0e3, "triton": 90.0e3, "torch": 25.0e3}
    assert bound(ours, up) == pytest.approx(270.0 / 170.0)
    lines = format_rows("train step b4 l2048 (ms)", ours, up, goal=1.5)
    assert lines[2].split() == ["ours", "40.00", "5.00"]
    assert lines[-2].split() == ["total", "210.00", "270.00"]
    assert lines[-1].strip() == ("upstream / ours 1.29x; with our kernels at zero at most 1.59x "
                                 "(goal 1.5x: within the kernels' reach)")  # fmt: skip
    assert "out of the kernels' reach" in format_rows("x", ours, up, goal=2.0)[-1]
    assert bound({"ours": 1.0, "gemm": 0.0, "triton": 0.0, "torch": 0.0}, up) is None


def test_top_kernels_sum_launches_by_name():
    """Launches of one kernel add up under its name without the argument list; the most
    device time first, ties by name; at most n."""
    from mamba2_rocm.bench.breakdown import top_kernels

    kernels = [("m2r_a", 5.0), ("void at::native::copy_kernel(int)", 2.0), ("m2r_a", 4.0),
               ("void at::native::copy_kernel(float)", 3.0), ("m2r_b", 5.0), ("nvjet_x", 1.0),
               ("void at::native::(anonymous namespace)::fill<float>(float*)", 0.5)]  # fmt: skip
    assert top_kernels(kernels, n=3) == [["m2r_a", 2, 9.0], ["at::native::copy_kernel", 2, 5.0],
                                         ["m2r_b", 1, 5.0]]  # fmt: skip
    assert top_kernels(kernels)[-1] == ["at::native::fill<float>", 1, 0.5]
    assert top_kernels([], n=3) == []


def test_generate_table_shows_breakdowns_and_the_flag_is_generate_only(capsys):
    from mamba2_rocm import cli
    from mamba2_rocm.bench import generate

    fams = {"ours": 1.0e3, "gemm": 2.0e3, "triton": 0.0, "torch": 1.0e3}
    rows = [{"shape": "130m", "side": "ours", "dtype": "bfloat16", "train_ms": 4.0,
             "train_ms_breakdown": fams},
            {"shape": "130m", "side": "upstream", "dtype": "bfloat16", "train_ms": 6.0,
             "train_ms_breakdown": {**fams, "triton": 2.0e3}}]  # fmt: skip
    rows[0]["train_ms_kernels"] = [["m2r_ssd_chunk_scan_bf16_t64b128", 48, 2500.0]]
    text = generate.format_table(rows)
    assert "train step b4 l2048 (ms): device ms by kernel family" in text
    assert "top kernels, ours: device ms, launches" in text
    assert "      2.50    48  m2r_ssd_chunk_scan_bf16_t64b128" in text
    assert "top kernels, upstream" not in text  # (its row has none)
    assert "with our kernels at zero at most 2.00x (goal 1.5x: within" in text
    assert cli.main(["bench", "ssd", "--breakdown"]) != 0
    assert "--breakdown applies to `bench generate` only" in capsys.readouterr().err


def test_generate_shapes_are_upstream_checkpoint_configs():
    """The configs build our model (and upstream's constructor takes the same keywords: the
    names are MambaConfig's); d_model / n_layer of mamba2-130m and mamba2-1.3b."""
    from mamba2_rocm.bench import generate
    from mamba2_rocm.models import MambaConfig, MambaLMHeadModel

    cfg = MambaConfig(**{**generate.config_kwargs("130m"), "n_layer": 1})
    model = MambaLMHeadModel(cfg)
    assert model.lm_head.out_features == 50288 and cfg.ssm_cfg["layer"] == "Mamba2"
    assert generate.config_kwargs("1.3b")["d_model"] == 2048
    assert generate.config_kwargs("130m")["ssm_cfg"] is not generate.COMMON["ssm_cfg"]


def test_triton_without_wgmma_runs_in_processes_and_a_cache_of_its_own(monkeypatch):
    """bench ssd's second Triton column (issue #72): its processes get DISABLE_MMA_V3=1 and a
    Triton cache folder nobody else uses; the default processes get neither. The summary rates
    ours against both, each against its own target."""
    import json
    import subprocess
    import types

    from mamba2_rocm.bench import timing

    seen = []

    def fake_run(cmd, capture_output, text, env):
        seen.append(env)
        slow = env is not None and env.get("DISABLE_MMA_V3") == "1"
        us = 120.0 if slow else 90.0 + len(seen)  # the default's best: its first process
        row = {"case": "a", "impl": timing.TRITON, "best_us": us, "us": us + 5}
        return types.SimpleNamespace(returncode=0, stdout=json.dumps([row]) + "\n", stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    ours = {"case": "a", "impl": "kernel", "best_us": 100.0, "us": 110.0}
    rows = timing.add_triton_best([ours], "ssd", 2, "bfloat16", 1.0, no_wgmma_target=1.0)
    assert seen[0] is None and seen[1] is None  # the default Triton: this process's environment
    for env in seen[2:]:
        assert env["DISABLE_MMA_V3"] == "1" and "m2r-triton-cache-" in env["TRITON_CACHE_DIR"]
    assert len(seen) == 4
    table, summary = timing.split_summary(rows)
    assert [r["impl"] for r in table] == [
        "kernel",
        f"{timing.TRITON} (best of 2)",
        f"{timing.TRITON_NO_WGMMA} (best of 2)",
    ]
    assert summary[0].startswith("a: 100.0 us vs Triton's best 91.0 us: 0.91x  (below 1.0x)")
    assert summary[2].startswith(
        "a: 100.0 us vs Triton's best with DISABLE_MMA_V3=1 120.0 us: 1.20x;"
    )
    assert summary[3].startswith("worst ratio over the grid (Triton's best with DISABLE_MMA_V3=1")


def test_no_wgmma_column_is_skipped_without_triton(monkeypatch):
    from mamba2_rocm.bench import timing

    monkeypatch.setattr(timing, "triton_best_of", lambda *a, **k: {})
    ours = {"case": "a", "impl": "kernel", "best_us": 100.0, "us": 110.0}
    rows = timing.add_triton_best([ours], "ssd", 2, "bfloat16", 1.0, no_wgmma_target=1.0)
    assert rows == [ours, {"summary": []}]


def test_selective_scan_cuda_training_peer_calls_forward_then_backward(monkeypatch):
    """bench selective-scan --backward's CUDA peer (issue #72): mamba_ssm's forward, then its
    backward with the forward's x and out, dz None, softplus, no recomputed out_z; the facade
    of the drop-in is no peer."""
    import types

    from mamba2_rocm.bench.selective_scan import _mamba_ssm_cuda_train
    from mamba2_rocm.ops import extension_abi

    calls = []
    fake = types.ModuleType("selective_scan_cuda")
    fake.fwd = lambda *a: calls.append(("fwd", a)) or ["out", "x", "out_z"]
    fake.bwd = lambda *a: calls.append(("bwd", a)) or ["du"]
    monkeypatch.setitem(sys.modules, "selective_scan_cuda", fake)
    u, delta, z, dout = (torch.randn(2, 3, 5, dtype=torch.bfloat16) for _ in range(4))
    A, B, C = torch.randn(3, 4), torch.randn(2, 4, 5), torch.randn(2, 4, 5)
    D, bias = torch.randn(3), torch.randn(3)
    step = _mamba_ssm_cuda_train()(u, delta, A, B, C, D, z, bias, True, dout)
    assert not calls and step() == ["du"]
    (_, fa), (_, ba) = calls
    assert fa[3].shape == (2, 1, 4, 5) and fa[3].dtype == torch.bfloat16
    assert ba[:8] == fa[:8] and ba[8] is dout and ba[9:] == ("x", "out", None, True, False)
    facade = types.ModuleType("selective_scan_cuda")
    facade.fwd, facade.bwd = extension_abi.selective_scan_fwd, extension_abi.selective_scan_bwd
    monkeypatch.setitem(sys.modules, "selective_scan_cuda", facade)
    assert _mamba_ssm_cuda_train() is None


def test_a_decode_step_is_the_median_of_paired_differences():
    """bench model / generate: one slow run of either side moves one pair, not the result."""
    from mamba2_rocm.bench.model import per_token_ms

    times = iter([130.0, 2.0, 131.0, 2.0, 129.0, 60.0, 400.0, 2.0, 130.0, 2.5])

    def time_ms(fn):
        fn()
        return next(times)

    calls = []
    step = per_token_ms(time_ms, lambda: calls.append("long"), lambda: calls.append("short"),
                        tokens=64, pairs=5)  # fmt: skip
    assert calls == ["long", "short"] * 5  # back to back, long first
    assert step == pytest.approx((130.0 - 2.0) / 64)


def test_decode_pool_cases_time_both_index_checks(monkeypatch):
    """bench decode's state-pool cases: the op as it chooses, then each way of checking the
    indices with SSU_CHECK_IN_KERNEL_MAX_BATCH pinned for that call only (the crossover the
    constant is set from); a Triton-only process runs the op's row alone."""
    from mamba2_rocm.bench import decode
    from mamba2_rocm.ops import state_update as ssu_ops

    seen = []

    def fake_compare(case, fn, triton, args, kw, nbytes, copy, impls):
        idx = kw["state_batch_indices"]
        assert idx.dtype == torch.int32 and len(set(idx.tolist())) == idx.numel()
        assert args[0].shape[0] == idx.numel() + decode.POOL_EXTRA  # the pool's rows
        seen.append((case, impls, triton is not None, ssu_ops.SSU_CHECK_IN_KERNEL_MAX_BATCH))
        return [{"case": case, "impl": impls[0]}]

    monkeypatch.setattr(decode, "compare", fake_compare)
    monkeypatch.setattr(decode, "POOL_GRID", (("pool", (1, 3), 2, 4, 8, 1),))
    real = ssu_ops.SSU_CHECK_IN_KERNEL_MAX_BATCH
    rows = decode._pool_rows("float32", None, object(), 1.0, device="cpu")
    assert [r["impl"] for r in rows] == ["kernel", *(i for i, _ in decode.INDEX_CHECKS)] * 2
    assert [s[3] for s in seen] == [real, *(lim for _, lim in decode.INDEX_CHECKS)] * 2
    assert [s[2] for s in seen] == [True, False, False] * 2  # Triton only beside the op's row
    assert real == ssu_ops.SSU_CHECK_IN_KERNEL_MAX_BATCH  # restored
    seen.clear()
    only = decode._pool_rows("float32", ("mamba_ssm triton",), object(), 1.0, device="cpu")
    assert [r["impl"] for r in only] == ["mamba_ssm triton"] * 2 and len(seen) == 2


# --- bench linear ----------------------------------------------------------------------


def test_linear_cases_are_the_mamba2_projections():
    from mamba2_rocm.bench.linear import LAYERS

    for label, k, n in LAYERS:
        d_model = {"130m": 768, "1.3b": 2048, "2.7b": 2560}[label.split()[0].split("-")[1]]
        d_inner = 2 * d_model
        if label.endswith("in_proj"):
            assert (k, n) == (d_model, 2 * d_inner + 2 * 128 + d_inner // 64)
        elif label.endswith("out_proj"):
            assert (k, n) == (d_inner, d_model)
        else:
            assert (k, n) == (d_model, 50288)


def test_linear_weights_rotate_past_the_cache():
    from mamba2_rocm.bench.linear import MIN_ROTATION_BYTES, rotation

    l2 = 50 << 20
    for wbytes in (1 << 20, 35 << 20, 206 << 20, 1 << 30):
        n = rotation(wbytes, l2)
        assert n >= 2 and n * wbytes >= max(4 * l2, MIN_ROTATION_BYTES)
        assert (n - 1) * wbytes < max(4 * l2, MIN_ROTATION_BYTES) or n == 2


def test_linear_table_prints_ratios_and_the_worst(monkeypatch):
    from mamba2_rocm.bench import linear

    monkeypatch.setattr("torch.cuda.get_device_name", lambda *a: "GPU")
    row = dict(mbytes=1.0, us=5.0, graph_us=4.0, gbs=1.0, copy_frac=0.5, copy_gbs=2.0,
               weight_copies=8)  # fmt: skip
    rows = [
        {**row, "case": "a rows1", "impl": "kernel", "best_us": 4.0},
        {**row, "case": "a rows1", "impl": linear.BLAS, "best_us": 6.0},
        {**row, "case": "b rows2", "impl": "kernel", "best_us": 5.0},
        {**row, "case": "b rows2", "impl": linear.BLAS, "best_us": 4.5},
    ]
    text = linear.format_table(rows)
    assert "a rows1: BLAS / ours 1.50x" in text and "b rows2: BLAS / ours 0.90x" in text
    assert "worst: 0.90x (b rows2)" in text


def test_env_items_reads_space_separated_items_over_the_default(monkeypatch):
    """The sweep scripts' knobs: each item through the reader; unset or blank gives the
    default."""
    from mamba2_rocm.bench.timing import env_items

    monkeypatch.delenv("M2R_TEST_ITEMS", raising=False)
    assert env_items("M2R_TEST_ITEMS", (1, 2), int) == (1, 2)
    monkeypatch.setenv("M2R_TEST_ITEMS", "  ")
    assert env_items("M2R_TEST_ITEMS", (1, 2), int) == (1, 2)
    monkeypatch.setenv("M2R_TEST_ITEMS", "8 16  4")
    assert env_items("M2R_TEST_ITEMS", (), int) == (8, 16, 4)
    monkeypatch.setenv("M2R_TEST_ITEMS", "1,2 3,4")
    assert env_items("M2R_TEST_ITEMS", (), lambda s: tuple(map(int, s.split(",")))) == (
        (1, 2),
        (3, 4),
    )
    monkeypatch.setenv("M2R_TEST_ITEMS", "x")
    with pytest.raises(ValueError):
        env_items("M2R_TEST_ITEMS", (), int)
