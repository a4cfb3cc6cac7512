"""Training through the kernels on the GPU: forward on the kernel tier, backward by the ops'
autograd formula (recomputation through the PyTorch tier), against autograd through float64
references: the plain recurrence for the scan, the tap loop for the conv, the norm in float64.
fp32 and bf16 inputs, fp32 parameters as mamba_ssm callers pass them."""

import pytest
import torch
from helpers import gpu_available, seeded

from mamba2_rocm import (
    causal_conv1d_fn,
    causal_conv1d_update,
    layernorm_fn,
    mamba_chunk_scan_combined,
    mamba_split_conv1d_scan_combined,
    selective_state_update,
)
from mamba2_rocm.reference.conv1d import causal_conv1d_eager
from mamba2_rocm.reference.ssd import rmsnorm_ref, ssd_sequential

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not gpu_available(), reason="needs a GPU (run on the device machine)"),
]

DEV = "cuda"
#: gradient tolerance per input dtype (relative to the float64 reference)
GTOL = {torch.float32: 2e-3, torch.bfloat16: 6e-2}


def _leaves(t: dict, dtype=None) -> dict:
    out = {}
    for k, v in t.items():
        if v is None:
            out[k] = None
            continue
        v = v.detach().clone()
        if dtype is not None:
            v = v.to(dtype)
        out[k] = v.requires_grad_()
    return out


def _grads(outs, leaves, cot):
    names = [k for k, v in leaves.items() if v is not None]
    got = torch.autograd.grad(outs, [leaves[k] for k in names], cot, allow_unused=True)
    return dict(zip(names, got, strict=True))


def _close(ours, ref, tol):
    for k, g in ours.items():
        assert g is not None, k
        scale = ref[k].abs().max().item() + 1e-6
        err = (g.double() - ref[k]).abs().max().item()
        assert err <= tol * scale, f"d{k}: max error {err:.3g} > {tol} * {scale:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("layout", ["contiguous", "channel_last"])
def test_conv1d(dtype, width, layout):
    g = seeded("gpu bwd conv", dtype, width, layout, device=DEV)
    b, d, L = 2, 96, 301
    x = torch.randn(b, d, L, device=DEV, generator=g)
    if layout == "channel_last":
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    t = dict(x=x, weight=torch.randn(d, width, device=DEV, generator=g),
             bias=torch.randn(d, device=DEV, generator=g),
             initial_states=torch.randn(b, d, width - 1, device=DEV, generator=g))  # fmt: skip
    ours = _leaves(t)
    for k in ("x", "initial_states"):  # activations in the model's dtype, parameters fp32
        ours[k] = ours[k].detach().to(dtype).requires_grad_()
    ref = _leaves({k: v.detach().double() for k, v in ours.items()})
    out, fin = causal_conv1d_fn(**ours, return_final_states=True, activation="silu")
    want = causal_conv1d_eager(ref["x"], ref["weight"], ref["bias"], None, ref["initial_states"],
                               True, compute_dtype=torch.float64)  # fmt: skip
    cot = [torch.randn(o.shape, device=DEV, generator=g) for o in (out, fin)]
    _close(_grads([out, fin], ours, [c.to(dtype) for c in cot]),
           _grads(list(want), ref, [c.double() for c in cot]), GTOL[dtype])  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "rms, gate, group",
    [(True, "before", None), (True, "after", 256), (False, "none", None), (False, "before", 128)],
)
def test_gated_norm(dtype, rms, gate, group):
    g = seeded("gpu bwd norm", dtype, rms, gate, group, device=DEV)
    t = dict(x=torch.randn(67, 1024, device=DEV, generator=g) * 2 + 0.3,
             weight=torch.randn(1024, device=DEV, generator=g),
             bias=torch.randn(1024, device=DEV, generator=g),
             z=None if gate == "none" else torch.randn(67, 1024, device=DEV, generator=g))  # fmt: skip
    ours = _leaves(t)
    for k in ("x", "z"):
        if ours[k] is not None:
            ours[k] = ours[k].detach().to(dtype).requires_grad_()
    ref = _leaves({k: None if v is None else v.detach().double() for k, v in ours.items()})
    nbg = gate != "after"
    out = layernorm_fn(**ours, eps=1e-5, group_size=group, norm_before_gate=nbg, is_rms_norm=rms)
    want = rmsnorm_ref(ref["x"], ref["weight"], ref["bias"], ref["z"], 1e-5, group, nbg,
                       is_rms_norm=rms)  # fmt: skip
    cot = torch.randn(out.shape, device=DEV, generator=g)
    _close(_grads([out], ours, [cot.to(dtype)]), _grads([want], ref, [cot.double()]), GTOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seq", [False, True])
def test_chunk_scan(dtype, seq):
    g = seeded("gpu bwd scan", dtype, seq, device=DEV)
    b, L, h, p, groups, n = 2, 200, 4, 64, 2, 64
    r = lambda *s: torch.randn(*s, device=DEV, generator=g)  # noqa: E731
    t = dict(x=r(b, L, h, p), dt=r(b, L, h) - 1, A=-torch.rand(h, device=DEV, generator=g) - 0.1,
             B=r(b, L, groups, n), C=r(b, L, groups, n), D=r(h), z=r(b, L, h, p),
             dt_bias=r(h) * 0.3, initial_states=r(b, h, p, n))  # fmt: skip
    ours = _leaves(t)
    for k in ("x", "B", "C", "z"):
        ours[k] = ours[k].detach().to(dtype).requires_grad_()
    ref = _leaves({k: v.detach().double() for k, v in ours.items()})
    seq_idx = None
    if seq:
        seq_idx = torch.zeros(b, L, dtype=torch.int32, device=DEV)
        seq_idx[:, 130:] = 1
    kw = dict(seq_idx=seq_idx, dt_softplus=True, dt_limit=(0.0, float("inf")),
              return_final_states=True)  # fmt: skip
    out, fin = mamba_chunk_scan_combined(**ours, chunk_size=64, **kw)
    want = ssd_sequential(**ref, **kw)
    cot = [torch.randn(o.shape, device=DEV, generator=g) for o in (out, fin)]
    _close(_grads([out, fin], ours, [cot[0].to(dtype), cot[1]]),
           _grads(list(want), ref, [c.double() for c in cot]), GTOL[dtype])  # fmt: skip


def test_fused_block_parameters_all_get_gradients():
    g = seeded("gpu bwd block", device=DEV)
    b, L, h, p, n, groups = 2, 130, 8, 64, 64, 1
    dim, conv_dim = h * p, h * p + 2 * groups * n
    r = lambda *s: torch.randn(*s, device=DEV, generator=g) * 0.3  # noqa: E731
    t = dict(zxbcdt=r(b, L, 2 * dim + 2 * groups * n + h), conv1d_weight=r(conv_dim, 4),
             conv1d_bias=r(conv_dim), dt_bias=r(h), A=-torch.rand(h, device=DEV, generator=g) - 0.1,
             D=r(h), rmsnorm_weight=r(dim) + 1, outproj_weight=r(256, dim), outproj_bias=r(256))  # fmt: skip
    ours = _leaves(t)
    out = mamba_split_conv1d_scan_combined(**ours, chunk_size=64, headdim=p, ngroups=groups)
    out.square().mean().backward()
    for k, v in ours.items():
        assert v.grad is not None and torch.isfinite(v.grad).all() and v.grad.abs().sum() > 0, k


def test_decode_steps_refuse_gradients_by_name():
    w = torch.randn(64, 4, device=DEV, requires_grad=True)
    out = causal_conv1d_update(torch.randn(2, 64, device=DEV), torch.zeros(2, 64, 3, device=DEV), w)
    with pytest.raises(NotImplementedError, match="causal_conv1d_update is inference-only"):
        out.sum().backward()
    x = torch.randn(2, 4, 64, device=DEV, requires_grad=True)
    out = selective_state_update(
        torch.zeros(2, 4, 64, 32, device=DEV), x, torch.rand(2, 4, 64, device=DEV),
        -torch.rand(4, 64, 32, device=DEV), torch.randn(2, 1, 32, device=DEV),
        torch.randn(2, 1, 32, device=DEV),
    )  # fmt: skip
    with pytest.raises(NotImplementedError, match="selective_state_update is inference-only"):
        out.sum().backward()
