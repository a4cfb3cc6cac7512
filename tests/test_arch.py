import pytest

from mamba2_rocm.arch import arch_info, generic_family, is_amd_arch, is_cuda_arch, split_arch_name


@pytest.mark.parametrize(
    ("arch", "family"),
    [
        ("gfx1030", "gfx10-3-generic"),
        ("gfx1031", "gfx10-3-generic"),
        ("gfx1103", "gfx11-generic"),
        ("gfx1151", "gfx11-generic"),
        ("gfx1201", "gfx12-generic"),
        ("gfx942", "gfx9-4-generic"),
        ("gfx950", "gfx9-4-generic"),
        ("gfx90a", None),
        ("gfx11-generic", None),
        ("sm_90", None),
    ],
)
def test_generic_family(arch, family):
    assert generic_family(arch) == family


def test_split_features():
    assert split_arch_name("gfx90a:sramecc+:xnack-") == (
        "gfx90a",
        {"sramecc": True, "xnack": False},
    )
    assert split_arch_name("gfx1100") == ("gfx1100", {})
    with pytest.raises(ValueError, match="malformed target feature 'xnack'"):
        split_arch_name("gfx90a:xnack")


@pytest.mark.parametrize(
    ("arch", "wave"),
    [
        ("gfx1030", 32),
        ("gfx1100", 32),
        ("gfx1201", 32),
        ("gfx90a", 64),
        ("gfx942", 64),
        ("gfx9-4-generic", 64),
        ("gfx11-generic", 32),
        ("gfx10-3-generic", 32),
        ("sm_90", 32),
    ],
)
def test_wavefront(arch, wave):
    assert arch_info(arch).wavefront_size == wave


def test_unknown_arch_names_the_value():
    with pytest.raises(ValueError, match="unknown GPU architecture 'gfx9999'"):
        arch_info("gfx9999")
    assert is_amd_arch("gfx90a:xnack-") and not is_amd_arch("sm_90")
    assert is_cuda_arch("sm_90") and is_cuda_arch("sm_90a") and not is_cuda_arch("gfx1030")
