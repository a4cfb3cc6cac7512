"""Docker images of the pipeline: the Debian base rootfs and the pinned ROCm toolchain.

Base image, in order: a local image of that name; ``docker pull debian:<suite>-slim`` (users with
Docker Hub); else a rootfs bootstrapped from Debian's archive with ``mmdebstrap`` and
``SOURCE_DATE_EPOCH`` (bit-reproducible) and ``docker import``-ed. Our machines reach no
registry, so the last path is the one that runs here.

Toolchain image: ``docker/toolchain.Dockerfile`` on that base with a recipe's pinned packages;
tagged by the pins' hash, so recipes sharing pins share one image, and Docker's layer cache
makes a second build instant.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from mamba2_rocm.pipeline import guard
from mamba2_rocm.pipeline.recipes import Recipe

__all__ = [
    "DockerError",
    "base_image",
    "docker_check",
    "ensure_base",
    "ensure_toolchain",
    "image_id",
    "require_image",
    "run_container",
    "run_in_image",
    "toolchain_image",
]

DEFAULT_MIRROR = "http://deb.debian.org/debian"
#: Fixed timestamp of the bootstrapped rootfs (2025-11-21), for a bit-reproducible tarball.
ROOTFS_EPOCH = "1763683200"
DOCKERFILE = Path(__file__).resolve().parents[2] / "docker" / "toolchain.Dockerfile"
_START_HINT = (
    "start the engine, e.g. `dockerd --iptables=false --bridge=none >/tmp/dockerd.log 2>&1 &` "
    "(install it with `apt-get install docker.io mmdebstrap`), or `sudo systemctl start docker`"
)


class DockerError(RuntimeError):
    """Docker is missing, not running, or a docker step failed; the message says what to do."""


def _docker(*args: str, check: bool = True, capture: bool = True, timeout: float | None = None) -> subprocess.CompletedProcess:  # fmt: skip
    if shutil.which("docker") is None:
        raise DockerError(f"the docker client is not installed; {_START_HINT}")
    proc = subprocess.run(["docker", *args], capture_output=capture, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        tail = "\n".join(((proc.stderr or "") + (proc.stdout or "")).strip().splitlines()[-30:])
        raise DockerError(
            f"`docker {' '.join(args[:3])} ...` failed (exit {proc.returncode}):\n{tail}"
        )
    return proc


def docker_check() -> str:
    """The server version; raises DockerError with how to start it when it is not reachable."""
    proc = _docker("version", "--format", "{{.Server.Version}}", check=False, timeout=60)
    if proc.returncode != 0:
        raise DockerError(
            f"Docker is not reachable ({(proc.stderr or '').strip()[:200]}); {_START_HINT}"
        )
    return proc.stdout.strip()


def image_id(image: str) -> str | None:
    proc = _docker("image", "inspect", "--format", "{{.Id}}", image, check=False)
    return proc.stdout.strip() if proc.returncode == 0 else None


def base_image(suite: str) -> str:
    return f"mamba2-rocm-base:{suite}"


def ensure_base(suite: str = "unstable", mirror: str | None = None, log=print) -> str:
    """The base image tag, creating it (pull, else bootstrap) when it is not local."""
    tag = base_image(suite)
    if image_id(tag):
        return tag
    pulled = _docker("pull", f"debian:{suite}-slim", check=False, timeout=600)
    if pulled.returncode == 0:
        _docker("tag", f"debian:{suite}-slim", tag)
        log(f"base image: pulled debian:{suite}-slim as {tag}")
        return tag
    if shutil.which("mmdebstrap") is None:
        raise DockerError(
            f"no base image {tag}, `docker pull debian:{suite}-slim` failed and mmdebstrap is not "
            "installed to bootstrap one (apt-get install mmdebstrap)"
        )
    mirror = mirror or os.environ.get("DEBIAN_MIRROR", DEFAULT_MIRROR)
    log(f"base image: no registry; bootstrapping Debian {suite} from {mirror} with mmdebstrap")
    with tempfile.TemporaryDirectory() as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        env = dict(os.environ, SOURCE_DATE_EPOCH=ROOTFS_EPOCH)
        cmd = ["mmdebstrap", "--variant=minbase", "--aptopt=Acquire::Check-Valid-Until \"false\"",
               "--format=tar", suite, str(rootfs), mirror]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise DockerError(f"mmdebstrap failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        _docker("import", str(rootfs), tag)
    return tag


def toolchain_image(recipe: Recipe) -> str:
    """Tag from the recipe's pins and the Dockerfile: a change to either builds a new image."""
    import hashlib

    key = hashlib.sha256(recipe.toolchain_key.encode() + DOCKERFILE.read_bytes()).hexdigest()[:12]
    return f"mamba2-rocm-toolchain:{key}"


def ensure_toolchain(
    recipe: Recipe, mirror: str | None = None, refresh: bool = False, log=print
) -> str:
    """Build (or reuse) the toolchain image for ``recipe``'s pins; returns its tag."""
    tag = toolchain_image(recipe)
    if image_id(tag) and not refresh:
        return tag
    docker_check()
    base = ensure_base(recipe.toolchain_suite, mirror, log)
    mirror = mirror or os.environ.get("DEBIAN_MIRROR", DEFAULT_MIRROR)
    pins = " ".join(f"{name}={ver}" for name, ver in recipe.toolchain_packages.items())
    args = ["build", "--network", "host", "-f", str(DOCKERFILE), "-t", tag,
            "--build-arg", f"BASE_IMAGE={base}", "--build-arg", f"DEBIAN_MIRROR={mirror}",
            "--build-arg", f"DEBIAN_SUITE={recipe.toolchain_suite}", "--build-arg", f"PACKAGES={pins}"]  # fmt: skip
    if refresh:
        args.append("--no-cache")
    log(f"toolchain image {tag}: {pins}")
    proc = _docker(*args, str(DOCKERFILE.parent), check=False, timeout=3600)
    if proc.returncode != 0:
        out = (proc.stdout or "") + (proc.stderr or "")
        pinned = [
            ln
            for ln in out.splitlines()
            if "not available from" in ln or "snapshot.debian.org" in ln
        ]
        detail = "\n".join(pinned) if pinned else "\n".join(out.strip().splitlines()[-30:])
        raise DockerError(f"building {tag} failed:\n{detail}")
    return tag


def require_image(image: str, recipe: Recipe, log=print) -> None:
    """``image`` must still exist when a stage runs it (another process may have deleted it
    since the build began: ``docker run`` would then try a registry and fail obscurely); a
    missing toolchain image is built again from ``recipe``'s pins."""
    if image_id(image) is not None:
        return
    log(f"toolchain image {image} is gone (deleted since this build began?): building it again")
    rebuilt = ensure_toolchain(recipe, log=log)
    if rebuilt != image:
        raise DockerError(f"rebuilding {image} gave {rebuilt}: the recipe changed during the build")


def run_container(args: Sequence[str], timeout: float | None = 3600) -> subprocess.CompletedProcess:
    """``docker run --rm <args>`` as a named, labelled container with an init process; stopped
    when the call is interrupted (a signal, a timeout), not left running (guard)."""
    name = guard.container_name()
    try:
        return _docker("run", "--rm", *guard.container_args(name), *args, check=False,
                       timeout=timeout)  # fmt: skip
    except BaseException:
        guard.stop_container(name)
        raise


def dpkg_versions(image: str, packages: Sequence[str]) -> dict[str, str]:
    """Installed versions of ``packages`` inside ``image`` (for the build manifest)."""
    fmt = "${Package} ${Version}\\n"
    proc = run_container(["--network", "none", image, "dpkg-query", "-W", f"-f={fmt}", *packages])
    if proc.returncode != 0:
        raise DockerError(f"dpkg-query in {image} failed: {(proc.stderr or '').strip()[-500:]}")
    return dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)


def run_in_image(image: str, command: Sequence[str], source: Path, out: Path,
                 env: dict[str, str] | None = None, timeout: float = 3600) -> subprocess.CompletedProcess:  # fmt: skip
    """Run ``command`` with no network, the source read-only at /src and ``out`` at /out."""
    out.mkdir(parents=True, exist_ok=True)
    args = ["--network", "none", "--user", f"{os.getuid()}:{os.getgid()}",
            "-v", f"{source.resolve()}:/src:ro", "-v", f"{out.resolve()}:/out", "-w", "/src",
            "-e", "HOME=/tmp"]  # fmt: skip
    for key, value in (env or {}).items():
        args += ["-e", f"{key}={value}"]
    return run_container([*args, image, *command], timeout=timeout)
