"""Each op checks its arguments once per call (mamba2_rocm.ops.checks), whatever tier then runs;
the references it may reach are pure math and check nothing (they once re-checked every call)."""

from __future__ import annotations

import pytest
import torch

from mamba2_rocm.ops import checks


def _counting(monkeypatch, module, name):
    calls = []
    real = getattr(checks, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_the_references_import_no_checks():
    import sys

    import mamba2_rocm.reference.add_norm
    import mamba2_rocm.reference.conv1d
    import mamba2_rocm.reference.selective_scan
    import mamba2_rocm.reference.ssd  # noqa: F401

    for name, mod in list(sys.modules.items()):
        if name.startswith("mamba2_rocm.reference."):
            assert not any(getattr(mod, a, None) is getattr(checks, a) for a in checks.__all__
                           if callable(getattr(checks, a))), name  # fmt: skip


@pytest.mark.parametrize("tier", ["torch", "eager"])
def test_ssd_checks_once(monkeypatch, tier):
    from mamba2_rocm.ops import ssd

    monkeypatch.setenv("MAMBA2_ROCM_BACKEND", tier)
    calls = _counting(monkeypatch, ssd, "check_chunk_scan_args")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 37, 4, 8, generator=g)
    dt = torch.rand(1, 37, 4, generator=g)
    B = torch.randn(1, 37, 2, 16, generator=g)
    out = ssd.mamba_chunk_scan_combined(x, dt, -torch.rand(4, generator=g), B, B.clone(), 64)
    assert out.shape == x.shape and calls == ["check_chunk_scan_args"]


@pytest.mark.parametrize("tier", ["torch", "eager"])
def test_selective_scan_checks_once(monkeypatch, tier):
    from mamba2_rocm.ops import selective_scan

    monkeypatch.setenv("MAMBA2_ROCM_BACKEND", tier)
    calls = _counting(monkeypatch, selective_scan, "check_selective_scan_args")
    g = torch.Generator().manual_seed(4)
    u = torch.randn(2, 6, 19, generator=g)
    out = selective_scan.selective_scan_fn(u, torch.rand(2, 6, 19, generator=g),
                                           -torch.rand(6, 4, generator=g),
                                           torch.randn(2, 4, 19, generator=g),
                                           torch.randn(2, 4, 19, generator=g))  # fmt: skip
    assert out.shape == u.shape and calls == ["check_selective_scan_args"]


@pytest.mark.parametrize("tier", ["torch", "eager"])
def test_state_update_checks_once(monkeypatch, tier):
    from mamba2_rocm.ops import state_update

    monkeypatch.setenv("MAMBA2_ROCM_BACKEND", tier)
    state_update.clear_plan_cache()
    shapes = _counting(monkeypatch, state_update, "check_state_update_args")
    rows = _counting(monkeypatch, state_update, "check_state_rows")
    g = torch.Generator().manual_seed(5)
    state = torch.randn(3, 4, 8, 16, generator=g)
    x = torch.randn(2, 4, 8, generator=g)
    B = torch.randn(2, 2, 16, generator=g)
    idx = torch.tensor([2, 0], dtype=torch.int32)
    out = state_update.selective_state_update(state, x, x.abs(), -torch.rand(4, 8, 16, generator=g),
                                              B, B.clone(), state_batch_indices=idx)  # fmt: skip
    assert out.shape == x.shape
    assert shapes == ["check_state_update_args"] and rows == ["check_state_rows"]
    with pytest.raises(IndexError, match=r"state_batch_indices\[0\] = 3 is out of range"):
        state_update.selective_state_update(state, x, x.abs(), -torch.rand(4, 8, 16), B, B,
                                            state_batch_indices=idx + 1)  # fmt: skip
    state_update.clear_plan_cache()


@pytest.mark.parametrize("tier", ["torch", "eager"])
def test_rmsnorm_checks_once(monkeypatch, tier):
    from mamba2_rocm.ops import rmsnorm

    monkeypatch.setenv("MAMBA2_ROCM_BACKEND", tier)
    rmsnorm.clear_plan_cache()
    calls = _counting(monkeypatch, rmsnorm, "check_rmsnorm_args")
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 48, generator=g)
    out = rmsnorm.rmsnorm_fn(x, torch.ones(48), None, z=torch.randn(5, 48, generator=g),
                             group_size=16)  # fmt: skip
    assert out.shape == x.shape and calls == ["check_rmsnorm_args"]
