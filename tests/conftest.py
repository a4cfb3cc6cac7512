import os

import pytest

torch = pytest.importorskip("torch")

# Per-dtype tolerances in one place (causal-conv1d's own test tolerances).
TOL = {
    torch.float32: {"rtol": 3e-4, "atol": 1e-3},
    torch.float16: {"rtol": 3e-3, "atol": 5e-3},
    torch.bfloat16: {"rtol": 1e-2, "atol": 5e-2},
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _clean_backend_env(monkeypatch):
    """Tests choose the tier explicitly; never inherit one from the caller's shell."""
    monkeypatch.delenv("MAMBA2_ROCM_BACKEND", raising=False)
    yield


@pytest.fixture
def backend(monkeypatch):
    def set_backend(name: str):
        monkeypatch.setenv("MAMBA2_ROCM_BACKEND", name)

    return set_backend


def gpu_available() -> bool:
    return torch.cuda.is_available() and os.environ.get("MAMBA2_ROCM_NO_GPU") != "1"
