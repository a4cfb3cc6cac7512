import pytest


@pytest.fixture(autouse=True)
def kernel_backend(backend):
    """GPU tests use the kernel tier only: never silently the torch fallback."""
    backend("kernel")


@pytest.fixture(params=["chained", "separate"])
def ssd_state_paths(request, monkeypatch):
    """The test runs twice: the SSD forward's chunk_state chained (the state passing in its
    blocks) and followed by the separate state-passing kernel, whichever the GPU's size and the
    test's shapes would pick (mamba2_rocm.ops.ssd._chained)."""
    import mamba2_rocm.ops.ssd as ssd_ops

    chained = request.param == "chained"
    monkeypatch.setattr(ssd_ops, "_chained", lambda chains, chunks, sms: chained)
    return request.param
