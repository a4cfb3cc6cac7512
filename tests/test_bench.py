"""The benchmark helpers that need no GPU."""

import os

import pytest

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
