"""A NaN or inf stays in its own sequence, at and after its own position: the torch and eager
tiers (CPU), property-based over shapes, dtypes, sequence layouts, positions and values.
The same cases run on the kernel tier in tests/gpu/test_nonfinite_gpu.py."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nonfinite import BAD_VALUES, SSD_TARGETS, ConvCase, SsdCase, check_conv, check_ssd

SETTINGS = settings(
    max_examples=40, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)  # fmt: skip


@st.composite
def ssd_cases(
    draw, dtypes=(torch.float32, torch.float16, torch.bfloat16), max_seqlen=200,
    headdims=(3, 8, 64), dstates=(4, 16, 64),
):  # fmt: skip
    seqlen = draw(st.integers(1, max_seqlen))
    nstarts = draw(st.integers(0, min(4, seqlen - 1)))
    starts = (
        tuple(
            sorted(
                draw(
                    st.sets(st.integers(1, max(1, seqlen - 1)), min_size=nstarts, max_size=nstarts)
                )
            )
        )
        if seqlen > 1
        else ()
    )
    ngroups = draw(st.sampled_from([1, 2]))
    target = draw(st.sampled_from(SSD_TARGETS))
    values = (math.nan, math.inf) if target == "dt" else BAD_VALUES
    return SsdCase(
        seqlen=seqlen, nheads=ngroups * draw(st.integers(1, 2)), headdim=draw(st.sampled_from(headdims)),
        ngroups=ngroups, dstate=draw(st.sampled_from(dstates)),
        chunk_size=draw(st.sampled_from([64, 128, 256])), starts=starts, target=target,
        seq=draw(st.integers(0, len(starts))), where=draw(st.floats(0, 0.999)),
        value=draw(st.sampled_from(values)), varlen=draw(st.booleans()),
        dtype=draw(st.sampled_from(dtypes)), seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


@st.composite
def conv_cases(draw, dtypes=(torch.float32, torch.float16, torch.bfloat16)):
    seqlen = draw(st.integers(2, 300))
    nstarts = draw(st.integers(0, min(3, seqlen - 1)))
    starts = tuple(
        sorted(draw(st.sets(st.integers(1, seqlen - 1), min_size=nstarts, max_size=nstarts)))
    )
    return ConvCase(
        dim=draw(st.sampled_from([1, 7, 64])), seqlen=seqlen, width=draw(st.integers(2, 4)),
        starts=starts, seq=draw(st.integers(0, len(starts))), where=draw(st.floats(0, 0.999)),
        value=draw(st.sampled_from(BAD_VALUES)), silu=draw(st.booleans()),
        channel_last=draw(st.booleans()), dtype=draw(st.sampled_from(dtypes)),
        seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


@pytest.mark.parametrize("tier", ["torch", "eager"])
@SETTINGS
@given(case=ssd_cases(max_seqlen=130))
def test_ssd_nonfinite_stays_in_its_sequence(backend, tier, case):
    backend(tier)
    check_ssd(case, "cpu")


@pytest.mark.parametrize("tier", ["torch", "eager"])
@SETTINGS
@given(case=conv_cases())
def test_conv1d_nonfinite_stays_in_its_sequence(backend, tier, case):
    backend(tier)
    check_conv(case, "cpu")


@pytest.mark.parametrize("tier", ["torch", "eager"])
@pytest.mark.parametrize("value", BAD_VALUES)
def test_measured_case_nan_at_token_10_boundary_at_32(backend, tier, value):
    """The case the issue measured: one bad x at token 10 of sequence 0, boundary at token 32,
    64 tokens. Sequence 1 (tokens 32..63) and tokens 0..9 must be exactly the clean result."""
    backend(tier)
    for target in SSD_TARGETS:
        if target == "dt" and value < 0:
            continue
        case = SsdCase(
            seqlen=64, nheads=2, headdim=8, ngroups=1, dstate=16, chunk_size=64, starts=(32,),
            target=target, seq=0, where=10 / 32, value=value, varlen=False, dtype=torch.float32,
            seed=7,
        )  # fmt: skip
        assert case.position() == 10
        check_ssd(case, "cpu")
