"""The tier switch ``MAMBA2_ROCM_BACKEND``: read from the process environment on every call."""

import os

import pytest

from mamba2_rocm.ops._backend import BACKEND_ENV, requested_backend


def test_every_way_of_setting_the_environment_is_seen_at_once(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert requested_backend() == "auto"
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert requested_backend() == "torch"
    os.environ[BACKEND_ENV] = " Eager "
    assert requested_backend() == "eager"
    if os.supports_bytes_environ:
        os.environb[BACKEND_ENV.encode()] = b"kernel"
        assert requested_backend() == "kernel"
    del os.environ[BACKEND_ENV]
    assert requested_backend() == "auto"
    os.environ.update({BACKEND_ENV: ""})
    assert requested_backend() == "auto"


def test_a_bad_value_is_named(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match="MAMBA2_ROCM_BACKEND='cuda' is not one of"):
        requested_backend()


def test_an_explicit_mapping_is_read_instead_of_the_process(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert requested_backend({}) == "auto"
    assert requested_backend({BACKEND_ENV: "eager"}) == "eager"
