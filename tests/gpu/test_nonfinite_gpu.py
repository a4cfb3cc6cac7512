"""A NaN or inf stays in its own sequence, at and after its own position: the kernel tier, on
the cases tests/test_nonfinite.py runs on the CPU tiers (property-based; the kernel-size tiles:
headdim 64 and 128, dstate up to 128, every chunk size, all three dtypes)."""

import math

import pytest
import torch
from helpers import gpu_available
from hypothesis import HealthCheck, given, settings
from nonfinite import SsdCase, check_conv, check_ssd
from test_nonfinite import conv_cases, ssd_cases

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs a GPU")]
SETTINGS = settings(
    max_examples=150, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)  # fmt: skip


@SETTINGS
@given(case=ssd_cases(max_seqlen=600, headdims=(3, 64, 80, 128), dstates=(16, 64, 128)))
@pytest.mark.usefixtures("ssd_state_paths")
def test_ssd_kernel_nonfinite_stays_in_its_sequence(case):
    check_ssd(case, "cuda")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("col", [5, 40, 70, 127])  # each mark word of both column tiles
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.usefixtures("ssd_state_paths")
def test_ssd_headdim_128_nonfinite_x(dtype, col, varlen):
    """A non-finite x in either 32-column half of either of chunk_scan's 64-column tiles
    (headdim 128) reaches its own column of its own sequence only."""
    case = SsdCase(seqlen=390, nheads=4, headdim=128, ngroups=2, dstate=64, chunk_size=128,
                   starts=(100, 250), target="x", seq=1, where=0.3, value=math.nan,
                   varlen=varlen, dtype=dtype, seed=col + 128 * 3)  # fmt: skip
    check_ssd(case, "cuda")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("chunk", [64, 256])
@pytest.mark.usefixtures("ssd_state_paths")
def test_ssd_dt_run_nonfinite(dtype, value, chunk):
    """A non-finite dt read through chunk_cumsum's 16-byte runs (16 heads) stays in its head's
    sequence."""
    case = SsdCase(seqlen=300, nheads=16, headdim=32, ngroups=2, dstate=32, chunk_size=chunk,
                   starts=(90, 200), target="dt", seq=1, where=0.5, value=value,
                   varlen=False, dtype=dtype, seed=13)  # fmt: skip
    check_ssd(case, "cuda")


@SETTINGS
@given(case=conv_cases())
def test_conv1d_kernel_nonfinite_stays_in_its_sequence(case):
    check_conv(case, "cuda")
