"""A pypiserver on 127.0.0.1 for the tests that need a real index (never the network)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest


def pip_env(**extra: str) -> dict[str, str]:
    """No pip or twine config of this machine (its find-links hold a real torch); loopback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "TWINE_"))}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1",
               NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost", **extra)  # fmt: skip
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def pypiserver(packages: Path, log_file: Path, *args: str) -> Iterator[str]:
    """Serve ``packages`` (extra pypiserver ``args``: passwords, hashes); yields the base URL
    (``<base>/simple/`` to install from, ``<base>/`` to upload to)."""
    pytest.importorskip("pypiserver")
    packages.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    with open(log_file, "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "pypiserver", "run", "-i", "127.0.0.1", "-p", str(port),
             "--disable-fallback", "--backend", "simple-dir", *args, str(packages)],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(base + "/simple/", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    server.kill()
                    pytest.fail(f"pypiserver did not start: {log_file.read_text()}")
                time.sleep(0.2)
        try:
            yield base
        finally:
            server.terminate()
            server.wait(10)
