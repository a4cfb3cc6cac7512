"""Nox sessions for mamba2-rocm. See the sessions with `nox -l`.

Tags: `tests` (CPU suite), `lint`. The build pipeline sessions (`build-<target>`, ...) come
from recipes/ once it exists. Logic lives in the package, not here.
"""

import nox

nox.needs_version = ">=2024.3.2"
nox.options.default_venv_backend = "venv"
nox.options.sessions = ["lint", "tests"]


@nox.session
def tests(session: nox.Session) -> None:
    """Run the CPU test suite (pass pytest arguments after --)."""
    session.install("torch==2.13.0")
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", "-m", "not gpu", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install("ruff")
    session.run("ruff", "check", "mamba2_rocm", "tests", "noxfile.py")
    session.run("ruff", "format", "--check", "mamba2_rocm", "tests", "noxfile.py")
