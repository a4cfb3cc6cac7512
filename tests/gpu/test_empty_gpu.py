"""On the GPU with MAMBA2_ROCM_BACKEND=kernel: empty batches and sequences give empty results
and write nothing (nothing is launched), float64 decode states take the torch tier in float64,
and every kernel module the suite loads passed the loader's ISA check (the code object's own
target equals its kernel dir's)."""

import pytest
import torch
from helpers import gpu_available

from mamba2_rocm import (
    causal_conv1d_fn,
    causal_conv1d_update,
    mamba_chunk_scan_combined,
    rmsnorm_fn,
    selective_state_update,
)
from mamba2_rocm.reference.ssd import selective_state_update_ref
from mamba2_rocm.runtime.loader import kernels_for_device

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs a GPU")]
DEV = "cuda"


@pytest.mark.parametrize(("b", "L"), [(0, 50), (2, 0)])
def test_empty_batches_and_sequences(b, L):
    h, p, n = 4, 64, 32
    r = lambda *s: torch.randn(*s, device=DEV)  # noqa: E731
    init = r(b, h, p, n)
    out, final = mamba_chunk_scan_combined(r(b, L, h, p), r(b, L, h), -torch.rand(h, device=DEV),
                                           r(b, L, 1, n), r(b, L, 1, n), chunk_size=128,
                                           initial_states=init, return_final_states=True)  # fmt: skip
    assert out.shape == (b, L, h, p) and torch.equal(final, init)
    cinit = r(b, 64, 3)
    out, cfin = causal_conv1d_fn(r(b, 64, L), r(64, 4), initial_states=cinit,
                                 return_final_states=True)  # fmt: skip
    assert out.shape == (b, 64, L) and torch.equal(cfin, cinit)
    conv_state = r(3, 64, 3)
    keep = conv_state.clone()
    idx = torch.zeros(0, dtype=torch.int32, device=DEV)
    assert causal_conv1d_update(r(0, 64), conv_state, r(64, 4), conv_state_indices=idx).shape == (
        0,
        64,
    )
    assert torch.equal(conv_state, keep)
    assert rmsnorm_fn(r(0, 256), r(256), None).shape == (0, 256)
    torch.cuda.synchronize()


def test_float64_decode_state_on_the_gpu():
    g = torch.Generator(device=DEV).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=DEV, generator=g)  # noqa: E731
    b, h, p, n = 3, 4, 64, 32
    args = dict(x=r(b, h, p), dt=r(b, h, p), A=-torch.rand(h, p, n, device=DEV, generator=g),
                B=r(b, 1, n), C=r(b, 1, n), D=r(h, p), dt_bias=r(h, p))  # fmt: skip
    state = r(b, h, p, n).double()
    ref_state = state.clone()
    out = selective_state_update(state, **args, dt_softplus=True)  # was a TypeError here
    ref = selective_state_update_ref(ref_state, **args, dt_softplus=True,
                                     compute_dtype=torch.float64)  # fmt: skip
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state, ref_state, rtol=1e-6, atol=1e-6)


def test_loaded_modules_passed_the_isa_check():
    causal_conv1d_fn(torch.randn(1, 64, 10, device=DEV), torch.randn(64, 4, device=DEV))
    kset = kernels_for_device(torch.cuda.current_device())
    assert kset is not None and kset._modules  # loaded: _check_arch read each code object
