from pathlib import Path

import pytest
from helpers import require_tool

from mamba2_rocm.pipeline import images
from mamba2_rocm.pipeline.recipes import get_recipe

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def toolchain_image():
    try:
        images.docker_check()
    except images.DockerError as exc:
        require_tool(str(exc))
    tag = images.toolchain_image(get_recipe("gfx1030"))
    if images.image_id(tag) is None:  # building it needs Debian's mirror: never from a test
        require_tool(f"toolchain image {tag} is missing: run `nox -s toolchain` first")
    return tag


@pytest.fixture(scope="session")
def built_gfx1030(toolchain_image, tmp_path_factory):
    """gfx1030 code objects compiled in the toolchain container from this checkout."""
    out = tmp_path_factory.mktemp("gfx1030-build")
    proc = images.run_in_image(
        toolchain_image,
        ["python3", "-m", "mamba2_rocm", "build", "--arch", "gfx1030", "--out", "/out"],
        REPO,
        out,
    )
    assert proc.returncode == 0, proc.stderr
    return out / "gfx1030"


def pytest_collection_modifyitems(items):
    for item in items:
        if "built_gfx1030" in getattr(item, "fixturenames", ()) or "toolchain_image" in getattr(
            item, "fixturenames", ()
        ):
            item.add_marker(pytest.mark.docker)


RELEASE_TARGETS = ("gfx1030", "gfx1101")  # one gpu_gate "required", one "compile-only"


@pytest.fixture(scope="session")
def release_wheels(toolchain_image, tmp_path_factory):
    """wheels/ of a real build of two targets (one compile group: ~20 s warm), for the
    publish/pull round trip. Tests copy it before changing anything in it."""
    from mamba2_rocm.pipeline import stages

    root = tmp_path_factory.mktemp("release") / "wheels"
    stages.build_targets([get_recipe(t) for t in RELEASE_TARGETS], root)
    return root
