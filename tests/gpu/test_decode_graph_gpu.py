"""A whole Mamba2 decode step under one CUDA graph, as serving stacks run it: the conv update,
the state update and the gated norm captured together (with pool indices and a padded row),
replayed with new inputs, against the same step on the torch tier."""

import pytest
import torch
from helpers import gpu_available, seeded

from mamba2_rocm import causal_conv1d_update, rmsnorm_fn, selective_state_update
from mamba2_rocm.bench.timing import backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not gpu_available(), reason="needs a GPU (run on the device machine)"),
]

DEV = "cuda"
B, H, P, G, N, W, POOL = 4, 8, 16, 2, 16, 4, 7
D_INNER, CONV = H * P, H * P + 2 * G * N


def _step(t):
    """One decode step of a Mamba2 layer after the input projection; writes the states."""
    xbc = causal_conv1d_update(t["xbc"], t["conv_state"], t["conv_w"], t["conv_b"],
                               activation="silu", conv_state_indices=t["idx"])  # fmt: skip
    x, b_, c_ = torch.split(xbc, [D_INNER, G * N, G * N], dim=-1)
    y = selective_state_update(
        t["ssm_state"], x.reshape(B, H, P), t["dt"][:, :, None].expand(B, H, P),
        t["A"][:, None, None].expand(H, P, N), b_.reshape(B, G, N), c_.reshape(B, G, N),
        D=t["D"][:, None].expand(H, P), dt_bias=t["dt_bias"][:, None].expand(H, P),
        dt_softplus=True, state_batch_indices=t["idx"],
    )  # fmt: skip
    return rmsnorm_fn(y.reshape(B, D_INNER), t["norm_w"], None, z=t["z"], group_size=D_INNER // G,
                      norm_before_gate=False)  # fmt: skip


def _inputs(g):
    r = lambda *s, dt=torch.bfloat16: torch.randn(*s, device=DEV, generator=g).to(dt)  # noqa: E731
    return dict(
        xbc=r(B, CONV), z=r(B, D_INNER), dt=r(B, H), conv_state=r(POOL, CONV, W - 1),
        ssm_state=r(POOL, H, P, N, dt=torch.float32), conv_w=r(CONV, W), conv_b=r(CONV),
        A=-torch.rand(H, device=DEV, generator=g) - 0.1, D=r(H, dt=torch.float32),
        dt_bias=r(H, dt=torch.float32), norm_w=r(D_INNER),
        idx=torch.tensor([5, 0, -1, 3], dtype=torch.int32, device=DEV),  # row 2 is padding
    )  # fmt: skip


def test_decode_step_of_three_ops_replays_under_a_graph():
    g = seeded("decode graph", device=DEV)
    t = _inputs(g)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (plan caches, lazy loads)
        _step({**t, "conv_state": t["conv_state"].clone(), "ssm_state": t["ssm_state"].clone()})
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _step(t)
    for replay in range(3):
        fresh = _inputs(seeded("decode graph inputs", replay, device=DEV))
        for k in ("xbc", "z", "dt"):  # new tokens; the states carry over from the last replay
            t[k].copy_(fresh[k])
        ref = {**t, "conv_state": t["conv_state"].clone(), "ssm_state": t["ssm_state"].clone()}
        with backend("torch"):
            want = _step(ref)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out[[0, 1, 3]], want[[0, 1, 3]], rtol=2e-2, atol=2e-2)
        assert torch.equal(out[2], torch.zeros_like(out[2]))  # padded row: zeros through the norm
        torch.testing.assert_close(t["conv_state"], ref["conv_state"], rtol=0, atol=0)
        torch.testing.assert_close(t["ssm_state"], ref["ssm_state"], rtol=1e-3, atol=1e-3)
