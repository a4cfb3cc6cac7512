import pytest


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
