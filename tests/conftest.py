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


@pytest.fixture(autouse=True)
def _pinned_scan_chunk(request, monkeypatch):
    """The SSD kernel tier runs the chunk size its rule picks for a call's work
    (``ops.ssd.scan_chunk_size``), which for most test shapes is 64 whatever the test asks for.
    Tests run the size they pass (rounded up to a kernel size, as the torch tiers do), so every
    kernel chunk size stays covered; tests marked ``chunk_rule`` run the rule itself."""
    if request.node.get_closest_marker("chunk_rule") is None:
        try:
            from mamba2_rocm.ops import ssd as ssd_ops
        except ImportError:  # no torch here: nothing runs the scan
            pass
        else:
            monkeypatch.setattr(ssd_ops, "scan_chunk_size", lambda chunk_size, *_, **__: chunk_size)
    yield
