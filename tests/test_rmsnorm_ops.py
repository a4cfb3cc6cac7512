"""Gated RMSNorm through the public op and module on the CPU."""

import pytest
import torch
import torch.nn.functional as F
from helpers import seeded

from mamba2_rocm import RMSNorm, rmsnorm_fn
from mamba2_rocm.ops import rmsnorm as ops


def _direct(x, w, b, z, eps, gs, nbg):
    """The formula written out, in float64."""
    x, w = x.double(), w.double()
    if z is not None and not nbg:
        x = x * F.silu(z.double())
    g = x.reshape(*x.shape[:-1], -1, gs)
    y = (g / torch.sqrt((g * g).mean(-1, keepdim=True) + eps)).reshape(x.shape) * w
    if b is not None:
        y = y + b.double()
    if z is not None and nbg:
        y = y * F.silu(z.double())
    return y


@pytest.mark.parametrize("nbg", [True, False])
@pytest.mark.parametrize("gs", [None, 24])
@pytest.mark.parametrize("with_z", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
def test_fn_matches_formula(nbg, gs, with_z, with_bias):
    g = seeded("rms", nbg, gs, with_z, with_bias)
    x = torch.randn(3, 5, 96, generator=g)
    w = torch.randn(96, generator=g)
    b = torch.randn(96, generator=g) if with_bias else None
    z = torch.randn(3, 5, 96, generator=g) if with_z else None
    out = rmsnorm_fn(x, w, b, z=z, eps=1e-5, group_size=gs, norm_before_gate=nbg)
    torch.testing.assert_close(
        out.double(), _direct(x, w, b, z, 1e-5, gs or 96, nbg), rtol=1e-5, atol=1e-5
    )


def test_module():
    m = RMSNorm(64, eps=1e-5, group_size=16, norm_before_gate=False)
    assert m.bias is None and torch.equal(m.weight, torch.ones(64))
    g = seeded("module")
    x, z = torch.randn(2, 64, generator=g), torch.randn(2, 64, generator=g)
    expect = _direct(x, m.weight.detach(), None, z, 1e-5, 16, False)
    torch.testing.assert_close(m(x, z).double(), expect, rtol=1e-5, atol=1e-5)


def test_bad_inputs():
    x = torch.randn(2, 64)
    with pytest.raises(
        ValueError, match="group_size must divide hidden, got hidden=64, group_size=24"
    ):
        rmsnorm_fn(x, torch.ones(64), None, group_size=24)
    with pytest.raises(ValueError, match=r"weight must have shape \(hidden,\)"):
        rmsnorm_fn(x, torch.ones(63), None)


def test_opcheck_and_compile():
    x, w, z = torch.randn(4, 32), torch.randn(32), torch.randn(4, 32)
    torch.library.opcheck(ops.rmsnorm_fwd, (x, w, None, z, 1e-6, 8, True, True))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(x, z):
        return rmsnorm_fn(x, w, None, z=z, group_size=8)

    torch.testing.assert_close(f(x, z), rmsnorm_fn(x, w, None, z=z, group_size=8))


@pytest.mark.parametrize(
    "group_size, plan",
    [
        (8, (1, 1)),  # one run: a thread per (row, group), 256 groups per block
        (24, (4, 1)),  # 3 runs: the power of two above
        (1024, (128, 1)),
        (2048, (256, 1)),
        (4096, (256, 2)),
        (5120, (256, 3)),  # 2.5 runs per thread round up to the 3-run kernel
        (6152, (256, 4)),
        (8192, (256, 4)),
        (8200, None),  # more than kThreads * 4 runs: the generic kernel
        (250, None),  # not whole 8-element runs
    ],
)
def test_vec_plan(group_size, plan):
    assert ops.vec_plan(group_size, 2, (0, 4096, 16)) == plan


@pytest.mark.parametrize(
    "elem_size, addresses", [(4, (0,)), (2, (8,)), (2, (0, 16 * 3 + 2)), (2, (0, 32, 1))]
)
def test_vec_plan_needs_16_bit_elements_and_16_byte_alignment(elem_size, addresses):
    assert ops.vec_plan(1024, elem_size, addresses) is None
