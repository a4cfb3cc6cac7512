"""The release targets: the kernel packages we publish (``mamba2-rocm-<target>``).

The pipeline's recipes (``recipes/<target>.toml``) are the source of truth once they exist; this
list is what the host package knows about at run time, for install hints and extras.
"""

from __future__ import annotations

RELEASE_TARGETS: tuple[str, ...] = (
    "gfx1030",
    "gfx1100",
    "gfx1101",
    "gfx1102",
    "gfx1103",
    "gfx1150",
    "gfx1151",
    "gfx1200",
    "gfx1201",
    "gfx90a",
    "gfx942",
    "gfx950",
    "gfx10-3-generic",
    "gfx11-generic",
    "gfx12-generic",
    "gfx9-4-generic",
)


def release_targets() -> tuple[str, ...]:
    return RELEASE_TARGETS
