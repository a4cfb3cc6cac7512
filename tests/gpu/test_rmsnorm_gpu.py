"""Gated RMSNorm kernel vs the float64 formula on a GPU."""

import pytest
import torch
from helpers import gpu_available, seeded
from test_rmsnorm_ops import _direct

from mamba2_rocm import rmsnorm_fn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs a GPU")]
DEV = "cuda"
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2), torch.bfloat16: (2e-2, 2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
# group sizes: 4096 / 1024 / 8 / 5120 / 8192 take the register-resident kernels (2, 1, 1, 3 and 4
# runs of 8 per thread; 1024 and 8: an item within a wavefront, the others across wavefronts),
# 250 (not whole runs) and 16384 (too many runs) the generic one; "unaligned" rows (1 element
# in) the generic one too
@pytest.mark.parametrize(
    "hidden_gs",
    [(4096, None), (8192, 1024), (1000, 250), (64, 8), (5120, None), (8192, None), (16384, None)],
)
@pytest.mark.parametrize("nbg", [True, False])
@pytest.mark.parametrize("layout", ["contiguous", "sliced_rows", "unaligned", "transposed"])
def test_kernel(dtype, hidden_gs, nbg, layout):
    hidden, gs = hidden_gs
    g = seeded("rmsgpu", str(dtype), hidden, gs, nbg, layout, device=DEV)
    if layout == "contiguous":
        x = torch.randn(3, 7, hidden, device=DEV, generator=g).to(dtype)
    elif layout == "sliced_rows":  # a slice of a wider buffer: row stride > hidden
        x = torch.randn(3, 7, hidden + 40, device=DEV, generator=g).to(dtype)[..., 16 : 16 + hidden]
    elif layout == "unaligned":  # rows start 1 element in: no 16-byte loads
        x = torch.randn(3, 7, hidden + 1, device=DEV, generator=g).to(dtype)[..., 1:]
    else:  # not unit stride along hidden: copied once
        x = torch.randn(hidden, 21, device=DEV, generator=g).to(dtype).t()
    z = torch.randn(x.shape, device=DEV, generator=g).to(dtype)
    w = torch.randn(hidden, device=DEV, generator=g)
    b = torch.randn(hidden, device=DEV, generator=g).to(dtype)
    torch.full(
        (x.numel() * 4 + 64,), float("nan"), device=DEV
    )  # leaves NaN blocks in the allocator
    out = rmsnorm_fn(x, w, b, z=z, eps=1e-5, group_size=gs, norm_before_gate=nbg)
    assert out.shape == x.shape and out.dtype == dtype and not out.isnan().any()
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(
        out.double(), _direct(x, w, b, z, 1e-5, gs or hidden, nbg), rtol=rtol, atol=atol
    )
