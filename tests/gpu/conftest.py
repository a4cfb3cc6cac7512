import pytest


@pytest.fixture(autouse=True)
def kernel_backend(backend):
    """GPU tests use the kernel tier only: never silently the torch fallback."""
    backend("kernel")


@pytest.fixture(params=["chained", "chained_lds", "separate"])
def ssd_state_paths(request, monkeypatch):
    """The test runs three times: the SSD forward's chunk_state chained (the state passing in its
    blocks) with the link from the accumulators or through LDS, and followed by the separate
    state-passing kernel, whichever the GPU's size and the test's shapes would pick
    (mamba2_rocm.ops.ssd._chained, _lds_link)."""
    import mamba2_rocm.ops.ssd as ssd_ops

    chained = request.param != "separate"
    monkeypatch.setattr(ssd_ops, "_chained", lambda chains, chunks, sms: chained)
    monkeypatch.setattr(
        ssd_ops, "_lds_link", lambda chains, chunks, sms, x, B, cs: request.param == "chained_lds"
    )
    return request.param
