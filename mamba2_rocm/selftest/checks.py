"""The checks ``python -m mamba2_rocm selftest`` runs: every op family's kernel tier against its
torch tier in float64, the non-finite containment rules, a graph capture of a decode step, and a
short timing of each op.

A correctness check builds fresh random inputs at odd sizes, runs the op with
``MAMBA2_ROCM_BACKEND=kernel`` (so it fails loudly if no kernel serves the GPU, never quietly
falling back) in the check's dtype, then with ``MAMBA2_ROCM_BACKEND=torch`` on float64 copies,
and compares outputs (and, for the backward checks, the gradients of ``sum(out * g)``) as
``max |ours - ref| / max(max |ref|, 1)``, against a tolerance per dtype. The torch tier in
float64 is the ground truth the project's own GPU suite uses too.

``MAMBA2_ROCM_SELFTEST_FAULT=<family>`` perturbs that family's kernel output (tests: a wrong
result must fail and name its check).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mamba2_rocm.bench.timing import backend  # (MAMBA2_ROCM_BACKEND inside a block)

__all__ = ["FAMILIES", "FAULT_ENV", "Check", "CheckResult", "correctness_checks", "special_checks"]

FAULT_ENV = "MAMBA2_ROCM_SELFTEST_FAULT"
#: relative error allowed against the float64 torch tier, by the inputs' dtype
TOLERANCE = {"float32": 2e-3, "float16": 1e-2, "bfloat16": 4e-2}
FAMILIES = (
    "conv1d fwd", "conv1d update", "conv1d bwd", "ssd fwd", "ssd bwd", "decode step",
    "gated norm fwd", "gated norm bwd", "selective scan fwd", "selective scan bwd",
    "add+norm fwd", "add+norm bwd",
)  # fmt: skip


@dataclass
class CheckResult:
    name: str
    family: str
    ok: bool
    error: float | None = None
    tolerance: float | None = None
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "family": self.family, "ok": self.ok, "error": self.error,
                "tolerance": self.tolerance, "detail": self.detail}  # fmt: skip


@dataclass
class Check:
    """One check: ``run(device)`` returns its result (exceptions are caught by the runner)."""

    name: str
    family: str
    run: Callable[[Any], CheckResult]
    quick: bool = True
    tags: set[str] = field(default_factory=set)


def _rel_error(ours, ref) -> float:
    import torch

    ours, ref = ours.double(), ref.double()
    if ours.shape != ref.shape:
        return math.inf
    if not torch.isfinite(ours).all():
        return math.inf
    scale = max(ref.abs().max().item() if ref.numel() else 0.0, 1.0)
    return (ours - ref).abs().max().item() / scale if ref.numel() else 0.0


def _compare(name: str, family: str, dtype, pairs) -> CheckResult:
    tol = TOLERANCE[str(dtype).removeprefix("torch.")]
    worst, what = 0.0, ""
    for label, ours, ref in pairs:
        err = _rel_error(ours, ref)
        if err > worst:
            worst, what = err, label
    ok = worst <= tol
    return CheckResult(name, family, ok, worst, tol, "" if ok else f"{what} differs")


def _faulty(family: str, t):
    """The test hook: a wrong result for ``family``."""
    if os.environ.get(FAULT_ENV) == family:
        return t + 0.5 * t.abs().max().clamp(min=1.0)
    return t


def _as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _run_both(family, fn, inputs: dict, dtype, grads: tuple[str, ...] = (), ref=None):
    """Run ``fn(**inputs)`` on the kernel tier in ``dtype`` and on the torch tier in float64
    (``ref`` instead, for an op whose torch tier takes no float64); returns
    [(label, ours, ref), ...] for every output (and gradient of ``grads``)."""
    import torch

    def prepare(wide: bool):
        out = {}
        for k, v in inputs.items():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                v = v.double() if wide else (v.to(dtype) if k not in _KEEP_FP32 else v.float())
                if k in grads:
                    v = v.detach().requires_grad_(True)
            out[k] = v
        return out

    results = []
    for wide in (False, True):
        args = prepare(wide)
        with backend("torch" if wide else "kernel"):
            outs = _as_tuple((ref or fn)(**args) if wide else fn(**args))
        outs = tuple(o for o in outs if isinstance(o, torch.Tensor))
        if not wide:
            outs = (_faulty(family, outs[0]), *outs[1:])
        gs = ()
        if grads:
            g = torch.Generator(device=outs[0].device).manual_seed(7)
            seed = torch.randn(
                outs[0].shape, generator=g, device=outs[0].device, dtype=torch.float64
            )
            loss = (outs[0].double() * seed).sum()
            gs = torch.autograd.grad(loss, [args[k] for k in grads])
        results.append((outs, gs))
    (ours, ours_g), (ref, ref_g) = results
    pairs = [
        (f"output {i}", a.detach(), b.detach())
        for i, (a, b) in enumerate(zip(ours, ref, strict=True))
    ]
    pairs += [(f"d{k}", a, b) for k, a, b in zip(grads, ours_g, ref_g, strict=True)]
    return pairs


#: inputs kept in float32 whatever the check's dtype (as the models pass them)
_KEEP_FP32 = {"A", "D", "dt_bias", "delta_bias", "dt", "initial_states"}


def _gen(device, seed: int):
    import torch

    return torch.Generator(device=device).manual_seed(seed)


def _randn(g, device, *shape, scale=1.0):
    import torch

    return torch.randn(*shape, generator=g, device=device) * scale


def _rand(g, device, *shape):
    import torch

    return torch.rand(*shape, generator=g, device=device)


# ---- the families --------------------------------------------------------------------------------


def _conv_ref(x, weight, bias, activation):
    """The causal conv in float64: the torch tier's code at that precision (the op's torch tier
    takes no float64 inputs)."""
    from mamba2_rocm.reference.conv1d import causal_conv1d_torch

    return causal_conv1d_torch(x, weight, bias, silu=activation == "silu", compute_dtype=x.dtype)[0]


def _conv_update_ref(x, conv_state, weight, bias, activation):
    from mamba2_rocm.reference.conv1d import causal_conv1d_update_torch

    return causal_conv1d_update_torch(x[:, :, None], conv_state, weight, bias, silu=activation == "silu",
                                      compute_dtype=x.dtype)[:, :, 0]  # fmt: skip


def _conv_fwd(dtype, b, d, seqlen, w, seed, bwd=False):
    import mamba2_rocm

    family = "conv1d bwd" if bwd else "conv1d fwd"

    def run(device):
        g = _gen(device, seed)
        inputs = {"x": _randn(g, device, b, d, seqlen), "weight": _randn(g, device, d, w, scale=0.5),
                  "bias": _randn(g, device, d, scale=0.5), "activation": "silu"}  # fmt: skip
        pairs = _run_both(family, mamba2_rocm.causal_conv1d_fn, inputs, dtype,
                          ("x", "weight", "bias") if bwd else (), ref=_conv_ref)  # fmt: skip
        return _compare(_name(family, dtype, f"b{b} d{d} l{seqlen} w{w}"), family, dtype, pairs)

    return run


def _conv_update(dtype, b, d, w, seed):
    import mamba2_rocm

    family = "conv1d update"

    def run(device):
        g = _gen(device, seed)
        state = _randn(g, device, b, d, w - 1)
        x, weight, bias = (_randn(g, device, b, d), _randn(g, device, d, w, scale=0.5),
                           _randn(g, device, d, scale=0.5))  # fmt: skip
        outs = []
        for wide in (False, True):
            cast = (lambda t: t.double()) if wide else (lambda t: t.to(dtype))
            st = cast(state).clone()
            fn = _conv_update_ref if wide else mamba2_rocm.causal_conv1d_update
            with backend("torch" if wide else "kernel"):
                out = fn(cast(x), st, cast(weight), cast(bias), "silu")
            outs.append((_faulty(family, out) if not wide else out, st))
        pairs = [("out", outs[0][0], outs[1][0]), ("conv_state", outs[0][1], outs[1][1])]
        return _compare(_name(family, dtype, f"b{b} d{d} w{w}"), family, dtype, pairs)

    return run


def _ssd(dtype, b, seqlen, h, p, n, ng, chunk, seed, bwd=False):
    import mamba2_rocm

    family = "ssd bwd" if bwd else "ssd fwd"

    def run(device):
        g = _gen(device, seed)
        inputs = {
            "x": _randn(g, device, b, seqlen, h, p), "dt": _rand(g, device, b, seqlen, h) * 0.5,
            "A": -_rand(g, device, h) - 0.1, "B": _randn(g, device, b, seqlen, ng, n, scale=0.5),
            "C": _randn(g, device, b, seqlen, ng, n, scale=0.5), "chunk_size": chunk,
            "D": _randn(g, device, h), "z": _randn(g, device, b, seqlen, h, p),
            "dt_bias": _randn(g, device, h, scale=0.5), "dt_softplus": True,
            "return_final_states": True,
        }  # fmt: skip
        grads = ("x", "dt", "B", "C", "z") if bwd else ()
        pairs = _run_both(family, mamba2_rocm.mamba_chunk_scan_combined, inputs, dtype, grads)
        return _compare(_name(family, dtype, f"b{b} l{seqlen} h{h} p{p} n{n} g{ng} c{chunk}"),
                        family, dtype, pairs)  # fmt: skip

    return run


def _decode(dtype, b, h, p, n, ng, seed):
    import mamba2_rocm

    family = "decode step"

    def run(device):
        g = _gen(device, seed)
        state = _randn(g, device, b, h, p, n)
        A = (-_rand(g, device, h) - 0.1)[:, None, None].expand(h, p, n)
        dt = _rand(g, device, b, h)[:, :, None].expand(b, h, p)
        dt_bias = _randn(g, device, h, scale=0.5)[:, None].expand(h, p)
        D = _randn(g, device, h)[:, None].expand(h, p)
        x, z = _randn(g, device, b, h, p), _randn(g, device, b, h, p)
        B, C = _randn(g, device, b, ng, n, scale=0.5), _randn(g, device, b, ng, n, scale=0.5)
        outs = []
        for wide in (False, True):
            cast = (lambda t: t.double()) if wide else (lambda t: t.to(dtype))
            f32 = (lambda t: t.double()) if wide else (lambda t: t.float())
            st = cast(state).clone()
            with backend("torch" if wide else "kernel"):
                out = mamba2_rocm.selective_state_update(
                    st, cast(x), cast(dt), f32(A), cast(B), cast(C), f32(D), cast(z), f32(dt_bias),
                    dt_softplus=True,
                )  # fmt: skip
            outs.append((_faulty(family, out) if not wide else out, st))
        pairs = [("out", outs[0][0], outs[1][0]), ("state", outs[0][1], outs[1][1])]
        return _compare(_name(family, dtype, f"b{b} h{h} p{p} n{n} g{ng}"), family, dtype, pairs)

    return run


def _norm(dtype, rows, hidden, group, seed, bwd=False, fused=False):
    """The gated norm (``group`` elements a group, gate first), or with ``fused`` the residual
    add + RMSNorm (prenorm, an fp32 residual stream)."""
    import mamba2_rocm
    from mamba2_rocm.ops.add_norm import rms_norm_fn

    kind = "add+norm" if fused else "gated norm"
    family = f"{kind} {'bwd' if bwd else 'fwd'}"
    other = "residual" if fused else "z"  # the second row-shaped input

    def run(device):
        g = _gen(device, seed)
        inputs = {"x": _randn(g, device, rows, hidden), "weight": 1 + _randn(g, device, hidden, scale=0.1),
                  "bias": None, other: _randn(g, device, rows, hidden), "eps": 1e-5}  # fmt: skip
        if fused:
            inputs.update(prenorm=True, residual_in_fp32=True)
        else:
            inputs.update(group_size=group, norm_before_gate=False)
        fn = rms_norm_fn if fused else mamba2_rocm.rmsnorm_fn
        pairs = _run_both(family, fn, inputs, dtype, ("x", "weight", other) if bwd else ())
        shape = f"rows{rows} d{hidden}" + ("" if fused else f" group{group}")
        return _compare(_name(family, dtype, shape), family, dtype, pairs)

    return run


def _scan(dtype, b, d, seqlen, n, seed, bwd=False):
    import mamba2_rocm

    family = "selective scan bwd" if bwd else "selective scan fwd"

    def run(device):
        g = _gen(device, seed)
        inputs = {
            "u": _randn(g, device, b, d, seqlen), "delta": _rand(g, device, b, d, seqlen) * 0.5,
            "A": -_rand(g, device, d, n) - 0.1, "B": _randn(g, device, b, n, seqlen, scale=0.5),
            "C": _randn(g, device, b, n, seqlen, scale=0.5), "D": _randn(g, device, d),
            "z": _randn(g, device, b, d, seqlen), "delta_bias": _randn(g, device, d, scale=0.3),
            "delta_softplus": True,
        }  # fmt: skip
        grads = ("u", "delta", "B", "C", "z") if bwd else ()
        pairs = _run_both(family, mamba2_rocm.selective_scan_fn, inputs, dtype, grads)
        return _compare(_name(family, dtype, f"b{b} d{d} l{seqlen} n{n}"), family, dtype, pairs)

    return run


def _name(family: str, dtype, shape: str) -> str:
    return f"{family} {str(dtype).removeprefix('torch.')} {shape}"


def correctness_checks(quick: bool) -> list[Check]:
    """The kernel tier against the float64 torch tier, per family and dtype, at odd sizes."""
    import torch

    dtypes = [torch.bfloat16] if quick else [torch.float32, torch.float16, torch.bfloat16]
    out: list[Check] = []
    for i, dt in enumerate(dtypes):
        s = 100 * i
        cases = [
            ("conv1d fwd", _conv_fwd(dt, 2, 67, 301, 4, s + 1)),
            ("conv1d update", _conv_update(dt, 3, 67, 4, s + 2)),
            ("conv1d bwd", _conv_fwd(dt, 2, 67, 301, 4, s + 3, bwd=True)),
            ("ssd fwd", _ssd(dt, 2, 259, 6, 40, 32, 2, 64, s + 4)),
            ("ssd bwd", _ssd(dt, 1, 131, 4, 40, 32, 2, 64, s + 5, bwd=True)),
            ("decode step", _decode(dt, 3, 6, 40, 32, 2, s + 6)),
            ("gated norm fwd", _norm(dt, 37, 96, 48, s + 7)),
            ("gated norm bwd", _norm(dt, 37, 96, 48, s + 8, bwd=True)),
            ("selective scan fwd", _scan(dt, 2, 37, 129, 16, s + 9)),
            ("selective scan bwd", _scan(dt, 1, 21, 97, 16, s + 10, bwd=True)),
            ("add+norm fwd", _norm(dt, 37, 136, None, s + 11, fused=True)),
            ("add+norm bwd", _norm(dt, 37, 136, None, s + 12, bwd=True, fused=True)),
        ]
        if not quick:  # a second, larger shape per forward family
            cases += [
                ("conv1d fwd", _conv_fwd(dt, 1, 1031, 2049, 3, s + 21)),
                ("ssd fwd", _ssd(dt, 1, 1100, 8, 64, 128, 1, 256, s + 24)),
                ("decode step", _decode(dt, 17, 24, 64, 128, 1, s + 26)),
                ("gated norm fwd", _norm(dt, 513, 1536, 1536, s + 27)),
                ("selective scan fwd", _scan(dt, 2, 257, 515, 16, s + 29)),
            ]
        out += [Check(f"{fam} {str(dt).removeprefix('torch.')}", fam, fn) for fam, fn in cases]
    return out


# ---- non-finite containment and graph capture ----------------------------------------------------


def _nonfinite_ssd(device) -> CheckResult:
    """A NaN in one sequence of a packed row reaches no output of the sequence before it."""
    import torch

    import mamba2_rocm

    g = _gen(device, 31)
    b, seqlen, h, p, n = 1, 200, 4, 32, 32
    x = _randn(g, device, b, seqlen, h, p).bfloat16()
    dt = _rand(g, device, b, seqlen, h) * 0.5
    B = _randn(g, device, b, seqlen, 1, n, scale=0.5).bfloat16()
    C = _randn(g, device, b, seqlen, 1, n, scale=0.5).bfloat16()
    A = -_rand(g, device, h) - 0.1
    seq_idx = torch.zeros(b, seqlen, dtype=torch.int32, device=device)
    seq_idx[:, 120:] = 1
    x_bad = x.clone()
    x_bad[0, 150, 1, 3] = float("nan")
    with backend("kernel"):
        clean = mamba2_rocm.mamba_chunk_scan_combined(x, dt, A, B, C, 64, seq_idx=seq_idx)
        dirty = mamba2_rocm.mamba_chunk_scan_combined(x_bad, dt, A, B, C, 64, seq_idx=seq_idx)
    before = torch.equal(clean[:, :120], dirty[:, :120])
    # within the poisoned sequence: only its head's column, at or after the NaN
    reach = ~torch.isfinite(dirty[0, 120:])
    spread = reach.clone()
    spread[30:, 1, 3] = False  # (tokens 150.. of head 1, column 3 may be NaN)
    ok = before and not spread.any().item()
    detail = "" if ok else ("the NaN reached the sequence before it" if not before
                            else "the NaN reached other heads or columns")  # fmt: skip
    return CheckResult("non-finite ssd seq_idx bfloat16", "non-finite", ok, detail=detail)


def _nonfinite_conv(device) -> CheckResult:
    import torch

    import mamba2_rocm

    g = _gen(device, 32)
    x = _randn(g, device, 2, 40, 90).bfloat16()
    w = _randn(g, device, 40, 4, scale=0.5).bfloat16()
    x_bad = x.clone()
    x_bad[1, 7, 50] = float("inf")
    with backend("kernel"):
        clean = mamba2_rocm.causal_conv1d_fn(x, w, activation="silu")
        dirty = mamba2_rocm.causal_conv1d_fn(x_bad, w, activation="silu")
    other = dirty.clone()
    other[1, 7, 50:54] = clean[1, 7, 50:54]  # the only positions the inf may reach
    ok = torch.equal(other, clean)
    return CheckResult("non-finite conv1d bfloat16", "non-finite", ok,
                       detail="" if ok else "the inf reached other rows, channels or positions")  # fmt: skip


def _graph_decode(device) -> CheckResult:
    """A decode step (conv update, state update, gated norm) captured in a graph and replayed
    on new inputs gives what the eager calls give."""
    import torch

    import mamba2_rocm

    g = _gen(device, 33)
    b, h, p, n, w = 2, 4, 32, 64, 4
    d = h * p
    weight = _randn(g, device, d, w, scale=0.5).bfloat16()
    A = (-_rand(g, device, h) - 0.1)[:, None, None].expand(h, p, n)
    nw = torch.ones(d, device=device, dtype=torch.bfloat16)

    def step(x, conv_state, state, B, C, dt):
        xc = mamba2_rocm.causal_conv1d_update(x, conv_state, weight, None, "silu")
        y = mamba2_rocm.selective_state_update(state, xc.view(b, h, p), dt, A, B, C,
                                               dt_softplus=True)  # fmt: skip
        return mamba2_rocm.rmsnorm_fn(y.reshape(b, d), nw, None, eps=1e-5)

    def fresh(seed):
        gg = _gen(device, seed)
        return (_randn(gg, device, b, d).bfloat16(), _randn(gg, device, b, d, w - 1).bfloat16(),
                _randn(gg, device, b, h, p, n).bfloat16(), _randn(gg, device, b, 1, n).bfloat16(),
                _randn(gg, device, b, 1, n).bfloat16(),
                _rand(gg, device, b, h)[:, :, None].expand(b, h, p).contiguous().bfloat16())  # fmt: skip

    static = [t.clone() for t in fresh(1)]
    with backend("kernel"):
        s = torch.cuda.Stream(device)
        s.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(s):
            for _ in range(2):  # warm up (plans, modules) outside the capture
                warm = [t.clone() for t in static]
                step(*warm)
        torch.cuda.current_stream(device).wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step(*static)
        new = fresh(2)
        expect_states = [new[1].clone(), new[2].clone()]
        expect = step(new[0], expect_states[0], expect_states[1], *new[3:])
        for dst, src in zip(static, new, strict=True):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize(device)
    ok = (torch.equal(out, expect) and torch.equal(static[1], expect_states[0])
          and torch.equal(static[2], expect_states[1]))  # fmt: skip
    return CheckResult("graph capture decode step bfloat16", "graph capture", ok,
                       detail="" if ok else "the replay differs from the eager step")  # fmt: skip


def special_checks() -> list[Check]:
    return [Check("non-finite ssd", "non-finite", _nonfinite_ssd),
            Check("non-finite conv1d", "non-finite", _nonfinite_conv),
            Check("graph capture", "graph capture", _graph_decode)]  # fmt: skip
