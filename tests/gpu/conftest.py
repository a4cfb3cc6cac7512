import pytest


@pytest.fixture(autouse=True)
def kernel_backend(backend):
    """GPU tests use the kernel tier only: never silently the torch fallback."""
    backend("kernel")
