"""The matrix-core self-test's host side: which path each target should take, and the probe's
argument errors (no GPU needed; the kernel runs in tests/gpu/test_mma_probe_gpu.py)."""

import pytest
import torch

from mamba2_rocm.arch import EMULATION_PATHS, MMA_PATHS, expected_mma_path
from mamba2_rocm.build.driver import EMULATIONS
from mamba2_rocm.ops.mma_probe import run_mma_probe
from mamba2_rocm.pipeline.recipes import load_recipes


@pytest.mark.parametrize(
    ("target", "path"),
    [("sm_90", 1), ("sm_80", 1), ("sm_75", 0), ("gfx1030", 0), ("gfx10-3-generic", 0),
     ("gfx1100", 3), ("gfx1151", 3), ("gfx11-generic", 3), ("gfx1200", 4), ("gfx12-generic", 4),
     ("gfx90a", 2), ("gfx942", 2), ("gfx950", 2), ("gfx9-4-generic", 2)],
)  # fmt: skip
def test_expected_path_per_target(target, path):
    assert expected_mma_path(target) == path


def test_every_recipe_target_and_emulation_has_a_known_path():
    for recipe in load_recipes().values():
        for arch in recipe.archs:
            assert expected_mma_path(arch) in MMA_PATHS
    assert set(EMULATION_PATHS) == set(EMULATIONS)
    assert expected_mma_path("sm_90", "gfx11") == 3 and expected_mma_path("sm_90", "gfx9") == 2


def test_probe_argument_errors():
    h = torch.zeros(16, 16, dtype=torch.float16)
    c = torch.zeros(16, 16)
    with pytest.raises(ValueError, match="a must be a \\(16, 16\\) tensor"):
        run_mma_probe(torch.zeros(8, 16, dtype=torch.float16), h, c)
    with pytest.raises(ValueError, match="must be on a GPU"):
        run_mma_probe(h, h, c)
    meta = dict(device="meta")
    with pytest.raises(ValueError, match="must be on a GPU, got meta"):
        run_mma_probe(torch.zeros(16, 16, dtype=torch.float16, **meta), h, c)
    with pytest.raises(ValueError, match="a_in_registers builds A without LDS"):
        run_mma_probe(h, h, c, a_in_registers=True, a_k_major=True)
