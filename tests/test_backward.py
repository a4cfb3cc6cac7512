"""Training through the kernel tier (the interim backward of the training issue): the kernel
ops' autograd formula recomputes the forward through the PyTorch tier and differentiates it.

On the CPU the kernel tier is stood in for: ``choose`` answers "kernel" and each op's kernel
launch is replaced by the float64 reference writing the true result into the op's outputs, so
the public functions take exactly the path they take on a GPU (registered op, autograd formula).
Gradients are compared with autograd through independent float64 references (the plain
recurrence for the scan, the tap loop for the conv)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import seeded
from torch._subclasses.fake_tensor import is_fake

from mamba2_rocm import (
    causal_conv1d_fn,
    layernorm_fn,
    mamba_chunk_scan_combined,
    mamba_split_conv1d_scan_combined,
    rmsnorm_fn,
)
from mamba2_rocm.ops import _launch
from mamba2_rocm.ops import conv1d as conv_ops
from mamba2_rocm.ops import mamba2 as block_ops
from mamba2_rocm.ops import rmsnorm as norm_ops
from mamba2_rocm.ops import ssd as ssd_ops
from mamba2_rocm.reference.conv1d import causal_conv1d_bwd_torch, causal_conv1d_eager
from mamba2_rocm.reference.ssd import rmsnorm_bwd_ref, rmsnorm_ref, ssd_chunked_bwd, ssd_sequential


@pytest.fixture
def kernel_tier(monkeypatch):
    """The kernel tier on the CPU, with float64 references in place of the launches; records
    which kernels 'ran'."""
    ran = _Ran()
    kernel = lambda device: ("kernel", object())  # noqa: E731
    for mod in (_launch, conv_ops, norm_ops, ssd_ops, block_ops):
        monkeypatch.setattr(mod, "choose", kernel)

    def conv(kset, x, w, b, seq_idx, init, fin, silu, out):
        ran.append("conv")
        o, f = causal_conv1d_eager(x, w, b, seq_idx, init, silu, compute_dtype=torch.float64)
        out.copy_(o)
        if fin is not None:
            fin.copy_(f)

    def norm(kset, x, w, b, z, eps, gs, nbg, layer_norm, out):
        ran.append("norm")
        out.copy_(rmsnorm_ref(x.double(), w, b, z, eps, gs, nbg, is_rms_norm=not layer_norm))

    def scan(kset, x, dt, A, B, C, cs, D, z, dt_bias, init, seq_idx, cu, softplus, dims, fin,
             varlen):  # fmt: skip
        ran.append("scan")
        res = ssd_sequential(x, dt, A, B, C, D, z, dt_bias, init, seq_idx, cu, softplus,
                             dims.dt_limit, return_final_states=True,
                             return_varlen_states=varlen is not None)  # fmt: skip
        fin.copy_(res[1])
        if varlen is not None:
            varlen.copy_(res[2])
        b, L, h, p = x.shape  # the entering states, as the kernels lay them out (not computed)
        states = torch.empty(b, -(-L // cs), h, dims.dstate, p)
        ran.states.append(states)
        return res[0].to(x.dtype), states

    def scan_bwd(kset, x, dt, A, B, C, cs, D, z, dt_bias, init, seq_idx, softplus, dims, dout,
                 dfin, states=None):  # fmt: skip
        # the kernels' contract: every gradient in its input's dtype, None for absent inputs
        assert not is_fake(x), "a backward launch on fake tensors: traced into the kernel"
        ran.append("scan_bwd")
        ran.kept.append(states is not None)
        assert states is None or states is ran.states[-1], "states kept from another forward"
        d = lambda t: None if t is None else t.double()  # noqa: E731
        got = ssd_chunked_bwd(d(x), d(dt), d(A), d(B), d(C), cs, d(D), d(z), d(dt_bias), d(init),
                              seq_idx, softplus, dims.dt_limit, d(dout), d(dfin),
                              compute_dtype=torch.float64)  # fmt: skip
        like = (x, dt, A, B, C, D, z, dt_bias, init)
        return tuple(None if g is None else g.to(t.dtype) for g, t in zip(got, like, strict=True))

    def conv_bwd(kset, x, w, b, seq_idx, init, dout, dfin, silu, dx, dinit, dweight, dbias):
        # the launches' contract: dx and dinit written, and dweight / dbias (dbias None without
        # a bias) in their dtypes from fp32 partial rows summed in order (here one row per batch
        # row, as a one-tile-per-block grid)
        assert not is_fake(x), "a backward launch on fake tensors: traced into the kernel"
        ran.append("conv_bwd")
        rows = []
        for i in range(x.shape[0]):
            one = lambda t, i=i: None if t is None else t[i : i + 1].double()  # noqa: E731
            gx, gw, gb, gi = conv_ops._bwd_reference(
                one(x), w.double(), None if b is None else b.double(),
                None if seq_idx is None else seq_idx[i : i + 1], one(init), one(dout), one(dfin),
                silu,
            )  # fmt: skip
            dx[i].copy_(gx[0])
            if dinit is not None:
                dinit[i].copy_(gi[0])
            rows.append(
                torch.cat([gw, (gb if b is not None else gw.new_zeros(len(gw)))[:, None]], 1)
            )
        sums = torch.stack(rows).float().sum(0)
        dweight.copy_(sums[:, : w.shape[1]])
        if dbias is not None:
            dbias.copy_(sums[:, w.shape[1]])

    def norm_bwd(kset, x, w, b, z, eps, gs, nbg, layer_norm, dout):
        # the launches' contract: dx and dz in x's dtype and shape, dweight / dbias (dbias None
        # without a bias) new, in the dtypes the kernels read the parameters in
        assert not is_fake(x), "a backward launch on fake tensors: traced into the kernel"
        ran.append("norm_bwd")
        dx, dw, db, dz = rmsnorm_bwd_ref(x.double(), w.double(), None if b is None else b.double(),
                                         None if z is None else z.double(), eps, gs, nbg,
                                         not layer_norm, dout.double(),
                                         compute_dtype=torch.float64)  # fmt: skip
        kw, kb = norm_ops._kernel_params(w, b)
        return (dx.to(x.dtype), None if dz is None else dz.to(x.dtype), dw.to(kw.dtype),
                None if b is None else db.to(kb.dtype))  # fmt: skip

    monkeypatch.setattr(conv_ops, "_fwd_kernel", conv)
    monkeypatch.setattr(norm_ops, "_bwd_kernel", norm_bwd)
    monkeypatch.setattr(conv_ops, "_bwd_kernel", conv_bwd)
    monkeypatch.setattr(norm_ops, "_kernel", norm)
    monkeypatch.setattr(norm_ops, "_fast_plan", lambda *args: False)  # always through _kernel
    monkeypatch.setattr(ssd_ops, "_kernel", scan)
    monkeypatch.setattr(ssd_ops, "_bwd_kernel", scan_bwd)
    norm_ops.clear_plan_cache()
    yield ran
    norm_ops.clear_plan_cache()


class _Ran(list):
    """The kernels that 'ran'; ``states``: the entering states each forward returned, ``kept``:
    per scan backward, whether it was given the forward's states."""

    def __init__(self):
        super().__init__()
        self.states, self.kept = [], []


def _leaves(tensors: dict) -> dict:
    return {k: v.detach().clone().requires_grad_() if v is not None else None
            for k, v in tensors.items()}  # fmt: skip


def _grads(outs, leaves: dict, cotangents) -> dict:
    names = [k for k, v in leaves.items() if v is not None]
    got = torch.autograd.grad(outs, [leaves[k] for k in names], cotangents, allow_unused=True)
    return dict(zip(names, got, strict=True))


def _close(ours: dict, ref: dict, tol: float) -> None:
    assert ours.keys() == ref.keys()
    for k in ours:
        assert ours[k] is not None, f"no gradient for {k}"
        torch.testing.assert_close(ours[k], ref[k].to(ours[k].dtype), rtol=tol, atol=tol,
                                   msg=lambda m, k=k: f"d{k}: {m}")  # fmt: skip


# (final states and seq_idx are not taken together, as in causal-conv1d)
@pytest.mark.parametrize(("final", "seq"), [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("width", [2, 4])
def test_conv1d(kernel_tier, width, final, seq):
    g = seeded("bwd conv", width, final, seq)
    b, d, L = 2, 24, 37
    t = dict(x=torch.randn(b, d, L, generator=g), weight=torch.randn(d, width, generator=g),
             bias=torch.randn(d, generator=g),
             initial_states=None if seq else torch.randn(b, d, width - 1, generator=g))  # fmt: skip
    seq_idx = None
    if seq:  # two sequences and padding tokens (negative ids: output 0)
        seq_idx = torch.zeros(b, L, dtype=torch.int32)
        seq_idx[:, 15:] = 1
        seq_idx[0, 30:] = -1
    ours, ref = _leaves(t), _leaves({k: None if v is None else v.double() for k, v in t.items()})
    res = causal_conv1d_fn(**ours, seq_idx=seq_idx, return_final_states=final, activation="silu")
    want = causal_conv1d_eager(ref["x"], ref["weight"], ref["bias"], seq_idx,
                               ref["initial_states"], True, compute_dtype=torch.float64)  # fmt: skip
    assert kernel_tier == ["conv"]
    outs = res if final else (res,)
    cot = [torch.randn(o.shape, generator=g) for o in outs]
    _close(_grads(outs, ours, cot), _grads(want[: len(outs)], ref, [c.double() for c in cot]), 1e-5)
    assert kernel_tier == ["conv", "conv_bwd"]  # the backward op took the kernel path


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize(
    ("width", "seqlen", "mode"),
    [(2, 1, "init"), (4, 2, "init"), (4, 2, "none"), (3, 37, "init"), (4, 37, "seq"),
     (2, 64, "seq"), (4, 19, "none")],
)  # fmt: skip
def test_conv1d_backward_formula(width, seqlen, mode, silu):
    """The written-out gradients (the torch tier's backward, run inside the custom op where
    autograd does not record) against autograd through the float64 tap loop: sequences
    shorter than the history (the final states reach into the initial ones), seq_idx with
    padding tokens, the final states' gradient."""
    g = seeded("bwd conv formula", width, seqlen, mode, silu)
    b, d = 3, 5
    t = dict(x=torch.randn(b, d, seqlen, generator=g), weight=torch.randn(d, width, generator=g),
             bias=torch.randn(d, generator=g),
             initial_states=torch.randn(b, d, width - 1, generator=g) if mode == "init" else None)  # fmt: skip
    seq_idx = None
    if mode == "seq":
        seq_idx = torch.zeros(b, seqlen, dtype=torch.int32)
        seq_idx[:, seqlen // 3 :] = 1
        seq_idx[0, seqlen // 2 :] = -1  # padding
        seq_idx[2, seqlen - 2 :] = 2
    ref = _leaves({k: None if v is None else v.double() for k, v in t.items()})
    out, fin = causal_conv1d_eager(ref["x"], ref["weight"], ref["bias"], seq_idx,
                                   ref["initial_states"], silu, compute_dtype=torch.float64)  # fmt: skip
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    dfin = torch.randn(fin.shape, generator=g, dtype=torch.float64) if seq_idx is None else None
    want = _grads([out, fin] if dfin is not None else [out], ref,
                  [dout, dfin] if dfin is not None else [dout])  # fmt: skip
    d = {k: v.detach() if v is not None else None for k, v in ref.items()}
    dx, dw, db, dinit = causal_conv1d_bwd_torch(d["x"], d["weight"], d["bias"], seq_idx,
                                                d["initial_states"], dout, dfin, silu,
                                                compute_dtype=torch.float64)  # fmt: skip
    got = {"x": dx, "weight": dw, "bias": db}
    if mode == "init":
        got["initial_states"] = dinit
    else:
        assert dinit is None
    _close(got, want, 1e-12)


def test_conv1d_final_states_out_buffer_is_on_the_graph(kernel_tier):
    x = torch.randn(2, 8, 9, requires_grad=True)
    w = torch.randn(8, 3, requires_grad=True)
    buf = torch.empty(2, 8, 2)
    _out, fin = causal_conv1d_fn(x, w, return_final_states=True, final_states_out=buf)
    assert fin is buf and torch.equal(buf, x.detach()[..., -2:])
    fin.sum().backward()
    assert torch.equal(x.grad[..., -2:], torch.ones(2, 8, 2)) and not x.grad[..., :-2].any()


@pytest.mark.parametrize("channel_last", [False, True])
def test_conv1d_outputs_can_be_modified_in_place(kernel_tier, channel_last):
    """causal-conv1d's tests add to ``out`` before the backward: the training op's outputs are
    tensors of their own (a returned view may not be modified in place), in x's layout."""
    g = seeded("bwd conv inplace", channel_last)
    x = torch.randn(2, 13, 8, generator=g).transpose(1, 2)  # (batch, dim 8, seqlen 13)
    x = (x if channel_last else x.contiguous()).requires_grad_()
    w = torch.randn(8, 4, generator=g, requires_grad=True)
    out, fin = causal_conv1d_fn(x, w, return_final_states=True, activation="silu")
    assert out._base is None and out.stride() == x.stride()
    out += fin.sigmoid().sum(-1, keepdim=True)
    out.sum().backward()
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    o, f = causal_conv1d_eager(xr, wr, None, None, None, True, compute_dtype=torch.float64)
    (o + f.sigmoid().sum(-1, keepdim=True)).sum().backward()
    _close({"x": x.grad, "w": w.grad}, {"x": xr.grad, "w": wr.grad}, 1e-5)


@pytest.mark.parametrize("is_rms", [True, False])
@pytest.mark.parametrize("gate", ["none", "before", "after"])
@pytest.mark.parametrize("group", [None, 16])
def test_gated_norm(kernel_tier, is_rms, gate, group):
    g = seeded("bwd norm", is_rms, gate, group)
    t = dict(x=torch.randn(5, 7, 64, generator=g) * 2 + 0.5, weight=torch.randn(64, generator=g),
             bias=torch.randn(64, generator=g),
             z=None if gate == "none" else torch.randn(5, 7, 64, generator=g))  # fmt: skip
    nbg = gate != "after"
    ours, ref = _leaves(t), _leaves({k: None if v is None else v.double() for k, v in t.items()})
    out = layernorm_fn(**ours, eps=1e-5, group_size=group, norm_before_gate=nbg, is_rms_norm=is_rms)
    want = rmsnorm_ref(ref["x"], ref["weight"], ref["bias"], ref["z"], 1e-5, group, nbg,
                       is_rms_norm=is_rms)  # fmt: skip
    assert kernel_tier == ["norm"]
    cot = torch.randn(out.shape, generator=g)
    _close(_grads([out], ours, [cot]), _grads([want], ref, [cot.double()]), 1e-5)
    assert kernel_tier == ["norm", "norm_bwd"]  # the backward op took the kernel path


def _scan_inputs(g, b=2, L=70, h=4, p=8, groups=2, n=16):
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(
        x=r(b, L, h, p), dt=r(b, L, h) - 1, A=-torch.rand(h, generator=g) - 0.1,
        B=r(b, L, groups, n), C=r(b, L, groups, n), D=r(h, p), z=r(b, L, h, p),
        dt_bias=r(h), initial_states=r(b, h, p, n),
    )  # fmt: skip


@pytest.mark.parametrize("limit", [(0.0, float("inf")), (0.05, 1.5)])
@pytest.mark.parametrize("with_seq_idx", [False, True])
def test_chunk_scan(kernel_tier, with_seq_idx, limit):
    g = seeded("bwd scan", with_seq_idx, limit)
    t = _scan_inputs(g)
    seq_idx = None
    if with_seq_idx:
        seq_idx = torch.zeros(2, 70, dtype=torch.int32)
        seq_idx[:, 40:] = 1
    ours, ref = _leaves(t), _leaves({k: v.double() for k, v in t.items()})
    kw = dict(seq_idx=seq_idx, dt_softplus=True, dt_limit=limit, return_final_states=True)
    out, fin = mamba_chunk_scan_combined(**ours, chunk_size=64, **kw)
    want = ssd_sequential(**ref, **kw)
    cot = [torch.randn(out.shape, generator=g), torch.randn(fin.shape, generator=g)]
    _close(_grads([out, fin], ours, cot), _grads(list(want), ref, [c.double() for c in cot]), 1e-4)
    assert kernel_tier == ["scan", "scan_bwd"]
    assert kernel_tier.kept == [True]  # the forward's entering states (ssd_ops._kept_states)


def test_chunk_scan_saves_kept_states_with_its_inputs(kernel_tier):
    """The forward's entering states reach the backward through save_for_backward (so
    saved-tensor hooks, as activation checkpointing and offloading use, see them), a second
    backward (retain_graph) too; states too large to keep are not kept."""
    packed = []

    def pack(t):
        packed.append(t)
        return t

    ours = _leaves(_scan_inputs(seeded("bwd scan kept")))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = mamba_chunk_scan_combined(**ours, chunk_size=64, dt_softplus=True)
    assert any(t is kernel_tier.states[-1] for t in packed)
    cot = torch.randn(out.shape, generator=seeded("bwd scan kept cot"))
    first = torch.autograd.grad([out], [ours["x"]], [cot], retain_graph=True)
    second = torch.autograd.grad([out], [ours["x"]], [cot])
    assert torch.equal(first[0], second[0])
    assert kernel_tier.kept == [True, True]
    # dstate 64 at chunk 64: the states would take more than out and dA_cumsum
    big = _leaves(_scan_inputs(seeded("bwd scan big"), n=64))
    packed.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = mamba_chunk_scan_combined(**big, chunk_size=64, dt_softplus=True)
    assert not any(t is kernel_tier.states[-1] for t in packed)
    torch.autograd.grad([out], [big["x"]], [torch.ones_like(out)])
    assert kernel_tier.kept == [True, True, False]


def test_chunk_scan_under_activation_checkpointing(kernel_tier):
    """torch.utils.checkpoint (non-reentrant) keeps nothing of the forward, the kept states
    included (they go through its saved-tensor hooks), and its backward runs the forward again
    and gets that run's states: the same gradients as without it."""
    t = _scan_inputs(seeded("bwd scan checkpoint"))
    cot = torch.randn(t["x"].shape, generator=seeded("bwd scan checkpoint cot"))

    def run(**kw):
        return mamba_chunk_scan_combined(**kw, chunk_size=64, dt_softplus=True)

    plain, ckpt = _leaves(t), _leaves(t)
    want = _grads([run(**plain)], plain, [cot])
    out = torch.utils.checkpoint.checkpoint(run, use_reentrant=False, **ckpt)
    assert len(kernel_tier.states) == 2  # (no backward yet: the checkpointed forward ran once)
    got = _grads([out], ckpt, [cot])
    assert len(kernel_tier.states) == 3 and kernel_tier.kept == [True, True]  # run again
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_varlen_states_gradient_under_activation_checkpointing(kernel_tier):
    """The varlen states' gradient (recomputed through the torch tier) reads the saved inputs
    once: checkpointing's hooks refuse a second unpack."""
    t = _scan_inputs(seeded("bwd varlen checkpoint"), b=1, L=90)
    del t["initial_states"]
    cu = torch.tensor([0, 30, 90], dtype=torch.int32)
    seq_idx = torch.repeat_interleave(torch.arange(2, dtype=torch.int32), cu.diff())[None]
    kw = dict(seq_idx=seq_idx, cu_seqlens=cu, dt_softplus=True, return_varlen_states=True)

    def run(**leaves):
        return mamba_chunk_scan_combined(**leaves, chunk_size=64, **kw)

    plain, ckpt = _leaves(t), _leaves(t)
    g = seeded("bwd varlen checkpoint cot")
    out, var = run(**plain)
    cot = [torch.randn(out.shape, generator=g), torch.randn(var.shape, generator=g)]
    want = _grads([out, var], plain, cot)
    got = _grads(
        list(torch.utils.checkpoint.checkpoint(run, use_reentrant=False, **ckpt)), ckpt, cot
    )
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


def test_chunk_scan_varlen_states_carry_gradients(kernel_tier):
    g = seeded("bwd varlen")
    t = _scan_inputs(g, b=1, L=90)
    del t["initial_states"]
    cu = torch.tensor([0, 30, 30, 90], dtype=torch.int32)  # an empty sequence in the middle
    seq_idx = torch.repeat_interleave(torch.arange(3, dtype=torch.int32), cu.diff())[None]
    ours, ref = _leaves(t), _leaves({k: v.double() for k, v in t.items()})
    kw = dict(seq_idx=seq_idx, cu_seqlens=cu, dt_softplus=True, return_varlen_states=True)
    out, var = mamba_chunk_scan_combined(**ours, chunk_size=64, **kw)
    want = ssd_sequential(**ref, **kw)
    cot = [torch.randn(out.shape, generator=g), torch.randn(var.shape, generator=g)]
    _close(_grads([out, var], ours, cot), _grads(list(want), ref, [c.double() for c in cot]), 1e-4)


def _block_inputs(g, norm, outproj=True, b=2, L=50, h=4, p=8, n=16, groups=2, width=4):
    dim = h * p
    conv_dim = dim + 2 * groups * n
    r = lambda *s: torch.randn(*s, generator=g) * 0.5  # noqa: E731
    t = dict(zxbcdt=r(b, L, 2 * dim + 2 * groups * n + h), conv1d_weight=r(conv_dim, width),
             conv1d_bias=r(conv_dim), dt_bias=r(h), A=-torch.rand(h, generator=g) - 0.1, D=r(h),
             rmsnorm_weight=r(dim) + 1 if norm else None,
             outproj_weight=r(24, dim) if outproj else None,
             outproj_bias=r(24) if outproj else None)  # fmt: skip
    return t, dict(chunk_size=64, headdim=p, ngroups=groups, dt_limit=(0.0, float("inf")))


@pytest.mark.parametrize(("norm", "outproj"), [(False, True), (True, True), (True, False),
                                               (False, False)])  # fmt: skip
def test_fused_block(kernel_tier, norm, outproj):
    """mamba_split_conv1d_scan_combined: every parameter gets its gradient through the kernel
    ops' backward implementations (conv, scan, norm: the checkpointing _FusedBlock) and agrees
    with the same block on the torch tier (plain autograd through the ops)."""
    g = seeded("bwd block", norm, outproj)
    t, kw = _block_inputs(g, norm, outproj)
    ours, plain = _leaves(t), _leaves(t)
    out = mamba_split_conv1d_scan_combined(**ours, **kw)
    assert sorted(set(kernel_tier)) == (["conv", "norm", "scan"] if norm else ["conv", "scan"])
    assert out.grad_fn.name() == "_FusedBlockBackward"
    kernel_tier.clear()
    with pytest.MonkeyPatch.context() as mp:  # the same block on the torch tier: plain autograd
        for mod in (_launch, conv_ops, norm_ops, ssd_ops, block_ops):
            mp.setattr(mod, "choose", lambda device: ("torch", None))
        want = mamba_split_conv1d_scan_combined(**plain, **kw)
    assert kernel_tier == []
    cot = torch.randn(out.shape, generator=g)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    _close(_grads([out], ours, [cot]), _grads([want], plain, [cot]), 1e-4)
    assert {"conv_bwd", "scan_bwd"} <= set(kernel_tier)  # the backward reached the kernels
    assert ("norm_bwd" in kernel_tier) == norm


def test_fused_block_saves_what_mamba_ssm_checkpointing_saves(kernel_tier):
    """Activation memory: the training block keeps zxbcdt, the parameters and the scan's output
    before the norm (mamba_ssm's checkpoint_lvl=1), not the conv's output nor the norm's."""
    g = seeded("bwd block memory")
    t, kw = _block_inputs(g, norm=True, L=64)
    leaves = _leaves(t)
    saved = {}

    def pack(x):
        saved[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        mamba_split_conv1d_scan_combined(**leaves, **kw)
    b, L = t["zxbcdt"].shape[:2]
    dim = t["rmsnorm_weight"].shape[0]
    allowed = sum(v.numel() for v in t.values() if v is not None) + b * L * dim
    assert sum(saved.values()) <= 4 * allowed, (sum(saved.values()), 4 * allowed)


def test_only_requested_gradients_are_computed(kernel_tier):
    x = torch.randn(3, 32, requires_grad=True)
    w = torch.randn(32)  # no gradient asked
    out = rmsnorm_fn(x, w, None)
    (gx,) = torch.autograd.grad(out.sum(), [x])
    ref = torch.autograd.functional.vjp(lambda v: rmsnorm_ref(v, w, None), x, torch.ones(3, 32))[1]
    torch.testing.assert_close(gx, ref)


def test_compiled_training_step_goes_through_the_op(kernel_tier):
    x = torch.randn(2, 16, 12, requires_grad=True)
    w = torch.randn(16, 4, requires_grad=True)

    def step(x, w):
        return F.silu(causal_conv1d_fn(x, w, activation="silu")).sum()

    eager = torch.autograd.grad(step(x, w), [x, w])
    compiled = torch.autograd.grad(torch.compile(step, backend="aot_eager")(x, w), [x, w])
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b)


def test_decode_steps_are_inference_only_and_say_so(kernel_tier, monkeypatch):
    """selective_state_update / causal_conv1d_update update a state in place: forward works
    with inputs that require grad, and a backward through them raises naming the op."""
    from mamba2_rocm import causal_conv1d_update, selective_state_update
    from mamba2_rocm.ops import state_update as ssu_ops

    class Kernels:
        def launcher(self, name):
            return None

    monkeypatch.setattr(ssu_ops, "choose", lambda device: ("kernel", Kernels()))
    monkeypatch.setattr(ssu_ops, "checked_state_rows", lambda kset, idx, pool: idx)
    monkeypatch.setattr(ssu_ops, "launch", lambda *a: None)
    monkeypatch.setattr(conv_ops, "_update_kernel", lambda *a: None)
    x = torch.randn(2, 4, 8, requires_grad=True)
    out = selective_state_update(torch.zeros(2, 4, 8, 16), x, torch.rand(2, 4, 8),
                                 -torch.rand(4, 8, 16), torch.randn(2, 1, 16),
                                 torch.randn(2, 1, 16))  # fmt: skip
    with pytest.raises(NotImplementedError, match="selective_state_update is inference-only"):
        out.sum().backward()
    w = torch.randn(8, 4, requires_grad=True)
    out = causal_conv1d_update(torch.randn(2, 8), torch.zeros(2, 8, 3), w)
    with pytest.raises(NotImplementedError, match="causal_conv1d_update is inference-only"):
        out.sum().backward()
    with torch.no_grad():  # under no_grad nothing is recorded: plain outputs
        assert causal_conv1d_update(torch.randn(2, 8), torch.zeros(2, 8, 3), w).grad_fn is None


def test_empty_inputs_backward_to_empty_gradients(kernel_tier):
    """No rows / no tokens: the backward gives empty gradients (the recomputation is skipped:
    there is nothing to differentiate) instead of raising."""
    x = torch.randn(0, 64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)
    rmsnorm_fn(x, w, None).sum().backward()
    assert x.grad.shape == (0, 64) and torch.equal(w.grad, torch.zeros(64))
    xs = torch.randn(2, 16, 0, requires_grad=True)
    causal_conv1d_fn(xs, torch.randn(16, 4), activation="silu").sum().backward()
    assert xs.grad.shape == (2, 16, 0)


def _assert_compiled_grads_equal_eager(loss, inputs) -> None:
    """The gradients of ``loss(*inputs)`` eager and under torch.compile(fullgraph=True)."""
    want = torch.autograd.grad(loss(*inputs), inputs)
    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend="aot_eager")(*inputs),
                              inputs)  # fmt: skip
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e)


def test_conv1d_training_compiles_without_graph_breaks(kernel_tier):
    """Under torch.compile the training conv is the registered op (its fake traces the forward,
    the backward op's fake the backward), and the gradients equal the eager ones (which take
    the same implementation without the dispatcher)."""
    g = seeded("bwd conv compile")
    x = torch.randn(2, 6, 29, generator=g).requires_grad_()
    w = torch.randn(6, 4, generator=g, requires_grad=True)
    b = torch.randn(6, generator=g, requires_grad=True)

    def loss(x, w, b):
        return (causal_conv1d_fn(x, w, b, activation="silu") ** 2).sum()

    _assert_compiled_grads_equal_eager(loss, (x, w, b))
    assert kernel_tier.count("conv_bwd") == 2  # eager and compiled backward both reach it


@pytest.mark.parametrize("is_rms", [True, False])
@pytest.mark.parametrize("gate", ["none", "before", "after"])
@pytest.mark.parametrize("group", [None, 8])
def test_gated_norm_backward_formula(is_rms, gate, group):
    """The written-out norm gradients (the torch tier's backward, run inside the custom op)
    against autograd through the float64 reference."""
    g = seeded("bwd norm formula", is_rms, gate, group)
    t = dict(x=torch.randn(3, 5, 32, generator=g, dtype=torch.float64) * 2 + 0.3,
             weight=torch.randn(32, generator=g, dtype=torch.float64),
             bias=torch.randn(32, generator=g, dtype=torch.float64),
             z=None if gate == "none" else torch.randn(3, 5, 32, generator=g, dtype=torch.float64))  # fmt: skip
    nbg = gate != "before"
    ref = _leaves(t)
    out = rmsnorm_ref(ref["x"], ref["weight"], ref["bias"], ref["z"], 1e-5, group, nbg,
                      is_rms_norm=is_rms)  # fmt: skip
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    want = _grads([out], ref, [dout])
    dx, dw, db, dz = rmsnorm_bwd_ref(t["x"], t["weight"], t["bias"], t["z"], 1e-5, group, nbg,
                                     is_rms, dout, compute_dtype=torch.float64)  # fmt: skip
    got = {"x": dx, "weight": dw, "bias": db} | ({"z": dz} if gate != "none" else {})
    assert (dz is None) == (gate == "none")
    _close(got, want, 1e-12)


def test_gated_norm_training_compiles_without_graph_breaks(kernel_tier):
    g = seeded("bwd norm compile")
    x = torch.randn(4, 7, 48, generator=g).requires_grad_()
    z = torch.randn(4, 7, 48, generator=g).requires_grad_()
    w = torch.randn(48, generator=g, requires_grad=True)

    def loss(x, z, w):
        return (rmsnorm_fn(x, w, None, z=z, group_size=16, norm_before_gate=False) ** 2).sum()

    _assert_compiled_grads_equal_eager(loss, (x, z, w))
    assert kernel_tier.count("norm_bwd") == 2


def test_chunk_scan_gradients_stay_finite_when_decays_overflow_above_the_diagonal(kernel_tier):
    """Large dt * |A| within a chunk: exp of the (masked-out) positive exponents above the
    diagonal overflows. The recomputation's gradients must stay finite (they were NaN: the
    product was masked after the exp, and 0 * inf in its backward is NaN; seen in training
    a transformers Mamba2 at step 58)."""
    g = seeded("bwd scan overflow")
    t = _scan_inputs(g, b=1, L=64, h=2, p=4, groups=1, n=8)
    del t["initial_states"]
    t["dt"] = torch.full_like(t["dt"], 30.0)  # softplus(30 + bias) ~ 30; with A ~ -5: 150/token
    t["A"] = torch.tensor([-5.0, -4.0])
    ours = _leaves(t)
    out = mamba_chunk_scan_combined(**ours, chunk_size=64, dt_softplus=True)
    got = _grads([out], ours, [torch.randn(out.shape, generator=g)])
    for k, v in got.items():
        assert torch.isfinite(v).all(), k


def _sequence_ids(b, L, cuts, first=0):
    s = torch.full((b, L), first, dtype=torch.int32)
    for c in cuts:
        s[:, c:] += 1
    return s


@pytest.mark.parametrize(
    "case",
    [
        dict(),
        dict(D2=True, z=False),
        dict(bare=True),  # no D, z, dt_bias, initial states nor final-state gradient
        dict(cuts=(10, 16, 17, 30)),  # restarts inside chunks and at a chunk's first token
        dict(cuts=(20,), first=1),  # the row starts in another sequence: no initial states
        dict(softplus=False, limit=(0.1, 0.9)),  # clamped both ways
        dict(L=16),
        dict(L=1),
        dict(groups=1, h=3),
        dict(L=64, cs=32, cuts=(31, 32)),
    ],
    ids=str,
)
def test_chunk_scan_backward_formula(case):
    """The written-out scan gradients (``ssd_chunked_bwd``: the torch tier's backward and the
    HIP kernels' steps) against autograd through the float64 recurrence."""
    c = dict(b=2, L=45, h=4, p=6, groups=2, n=5, cs=16, cuts=None, first=0, softplus=True,
             limit=(0.0, float("inf")), D2=False, z=True, bare=False) | case  # fmt: skip
    g = seeded("bwd scan formula", tuple(sorted(case.items())))
    t = {k: v.double() for k, v in _scan_inputs(g, c["b"], c["L"], c["h"], c["p"], c["groups"],
                                                   c["n"]).items()}  # fmt: skip
    t["dt"] = t["dt"] * 0.5 + 0.5
    if not c["D2"]:
        t["D"] = t["D"][:, 0].contiguous()
    if not c["z"] or c["bare"]:
        t["z"] = None
    if c["bare"]:
        t["D"] = t["dt_bias"] = t["initial_states"] = None
    seq = None if c["cuts"] is None else _sequence_ids(c["b"], c["L"], c["cuts"], c["first"])
    ref = _leaves(t)
    kw = dict(seq_idx=seq, dt_softplus=c["softplus"], dt_limit=c["limit"])
    out, fin = ssd_sequential(**ref, **kw, return_final_states=True, state_dtype=torch.float64)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    dfin = None if c["bare"] else torch.randn(fin.shape, generator=g, dtype=torch.float64)
    want = _grads([out] + ([fin] if dfin is not None else []), ref,
                  [dout] + ([dfin] if dfin is not None else []))  # fmt: skip
    got = ssd_chunked_bwd(*(t[k] for k in ("x", "dt", "A", "B", "C")), c["cs"], t["D"], t["z"],
                          t["dt_bias"], t["initial_states"], seq, c["softplus"], c["limit"], dout,
                          dfin, compute_dtype=torch.float64)  # fmt: skip
    names = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")
    assert [n for n, v in zip(names, got, strict=True) if v is not None] == list(want)
    _close({n: v for n, v in zip(names, got, strict=True) if v is not None}, want, 1e-10)


def test_chunk_scan_training_compiles_without_graph_breaks(kernel_tier):
    g = seeded("bwd scan compile")
    t = _scan_inputs(g, L=37)
    inputs = tuple(v.requires_grad_() for v in t.values())

    def loss(*args):
        kw = dict(zip(t, args, strict=True))
        out, fin = mamba_chunk_scan_combined(**kw, chunk_size=64, dt_softplus=True,
                                             return_final_states=True)  # fmt: skip
        return (out**2).sum() + fin.sum()

    _assert_compiled_grads_equal_eager(loss, inputs)
    assert kernel_tier.count("scan_bwd") == 2  # eager and compiled backward both reach it


def test_chunk_scan_ops_pass_opcheck():
    """The scan op with its autograd formula, and the backward op, on the torch tier."""
    g = seeded("bwd scan opcheck")
    t = _scan_inputs(g, L=21)
    args = (*(t[k] for k in ("x", "dt", "A", "B", "C")), 64, t["D"], t["z"], t["dt_bias"],
            t["initial_states"], None, None, True, [0.0, float("inf")], False, None)  # fmt: skip
    grad_args = tuple(a.clone().requires_grad_() if isinstance(a, torch.Tensor) else a
                      for a in args)  # fmt: skip
    torch.library.opcheck(ssd_ops.mamba_chunk_scan_combined_op, grad_args)
    dout = torch.randn(t["x"].shape, generator=g)
    dfin = torch.randn(t["initial_states"].shape, generator=g)
    bwd_args = (*args[:11], True, [0.0, float("inf")], dout, dfin)
    torch.library.opcheck(ssd_ops.mamba_chunk_scan_combined_bwd, bwd_args)


def test_chunk_scan_backward_without_tokens():
    """seqlen 0: the final states are the initial ones, so their gradient flows straight back;
    every other gradient is zero."""
    g = seeded("bwd scan empty")
    t = _leaves(_scan_inputs(g, L=0))
    _, fin = mamba_chunk_scan_combined(**t, chunk_size=64, return_final_states=True)
    dfin = torch.randn(fin.shape, generator=g)
    got = _grads([fin], t, [dfin])
    assert torch.equal(got["initial_states"], dfin)
    for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias"):
        assert got[k] is None or not got[k].any(), k


@pytest.mark.parametrize(
    ("which", "bad", "error", "match"),
    [
        ("dout", lambda t: t[:, :-1], ValueError,
         r"dout must have shape x's shape = \(2, 21, 4, 8\), got \(2, 20, 4, 8\)"),
        ("dout", lambda t: t[0], ValueError,
         r"dout must have 4 dimensions \(batch, seqlen, nheads, headdim\), got shape \(21, 4, 8\)"),
        ("dout", lambda t: t.to(torch.int32), TypeError, r"dout must be one of .*, got int32"),
        ("dfinal", lambda t: t[..., :-1], ValueError,
         r"dfinal must have shape \(batch, nheads, headdim, dstate\) = \(2, 4, 8, 16\), "
         r"got \(2, 4, 8, 15\)"),
    ],
)  # fmt: skip
def test_chunk_scan_backward_op_refuses_bad_gradients(which, bad, error, match):
    """The backward op (callable directly, and what compile traces) checks the output
    gradients it is handed, real and fake alike: a kernel would read past a short dout."""
    g = seeded("bwd scan bad grads")
    t = _scan_inputs(g, L=21)
    grads = {"dout": torch.randn(t["x"].shape, generator=g),
             "dfinal": torch.randn(t["initial_states"].shape, generator=g)}  # fmt: skip
    grads[which] = bad(grads[which])
    args = (*(t[k] for k in ("x", "dt", "A", "B", "C")), 64, t["D"], t["z"], t["dt_bias"],
            t["initial_states"], None, True, [0.0, float("inf")], grads["dout"], grads["dfinal"])  # fmt: skip
    with pytest.raises(error, match=match):
        ssd_ops.mamba_chunk_scan_combined_bwd(*args)
    with pytest.raises(error, match=match), torch._subclasses.FakeTensorMode() as mode:
        ssd_ops.mamba_chunk_scan_combined_bwd(*(mode.from_tensor(a) if isinstance(a, torch.Tensor)
                                                else a for a in args))  # fmt: skip
