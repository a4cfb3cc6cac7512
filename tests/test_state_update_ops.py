"""selective_state_update through the public op on the CPU: tiers, registration, both forms."""

import pytest
import torch
from helpers import seeded

from mamba2_rocm import selective_state_update
from mamba2_rocm.ops import state_update as ops
from mamba2_rocm.reference.ssd import selective_state_update_ref


def _inputs(g, b=3, h=4, p=8, n=16, groups=2, heads=True, pool=None):
    pool = pool or b
    if not heads:
        d = h * p
        return dict(
            state=torch.randn(pool, d, n, generator=g), x=torch.randn(b, d, generator=g),
            dt=torch.rand(b, d, generator=g), A=-torch.rand(d, n, generator=g),
            B=torch.randn(b, n, generator=g), C=torch.randn(b, n, generator=g),
        )  # fmt: skip
    return dict(
        state=torch.randn(pool, h, p, n, generator=g), x=torch.randn(b, h, p, generator=g),
        dt=torch.rand(b, h, p, generator=g), A=-torch.rand(h, p, n, generator=g),
        B=torch.randn(b, groups, n, generator=g), C=torch.randn(b, groups, n, generator=g),
        D=torch.randn(h, p, generator=g), z=torch.randn(b, h, p, generator=g),
        dt_bias=torch.randn(h, p, generator=g),
    )  # fmt: skip


@pytest.mark.parametrize("heads", [True, False])
@pytest.mark.parametrize("tier", ["auto", "torch", "eager"])
def test_public_op_matches_reference(heads, tier, backend):
    backend(tier)
    args = _inputs(seeded("ssu", heads, tier), heads=heads)
    ref_state = args["state"].clone()
    ref = selective_state_update_ref(
        **{**args, "state": ref_state}, dt_softplus=True, compute_dtype=torch.float64
    )
    out = selective_state_update(**args, dt_softplus=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(args["state"], ref_state, rtol=1e-5, atol=1e-5)


def test_errors_name_the_value():
    args = _inputs(seeded("err"))
    with pytest.raises(
        ValueError,
        match=r"C must have shape \(batch, ngroups, dstate\) like B = \(3, 3, 16\), got \(3, 2, 16\)",
    ):
        selective_state_update(**{**args, "B": torch.randn(3, 3, 16)})
    with pytest.raises(ValueError, match="divisible"):
        selective_state_update(**{**args, "B": torch.randn(3, 3, 16), "C": torch.randn(3, 3, 16)})


def test_opcheck():
    args = _inputs(seeded("opcheck"))
    idx = torch.tensor([2, -1, 0], dtype=torch.int32)
    for extra in [(False, None), (True, idx)]:
        a = [args[k] for k in ("state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias")]
        torch.library.opcheck(ops.selective_state_update_op, (*a, *extra))


def test_torch_compile_fullgraph():
    args = _inputs(seeded("compile"))
    ref_state = args["state"].clone()
    ref = selective_state_update(**{**args, "state": ref_state})

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(**kw):
        return selective_state_update(**kw)

    torch.testing.assert_close(step(**args), ref)
    torch.testing.assert_close(args["state"], ref_state)
