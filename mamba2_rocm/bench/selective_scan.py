"""Mamba1 selective-scan benchmark: ``selective_scan_fn``'s kernel vs its PyTorch tier, and
mamba_ssm's ``selective_scan_ref`` (pure PyTorch, when ``mamba_ssm`` is importable: its CUDA
``selective_scan_cuda`` does not build on ROCm, so the reference is what an AMD user of
mamba_ssm runs), and, where mamba_ssm's CUDA extension ``selective_scan_cuda`` is importable (a
build of it on the NVIDIA test machine), that kernel as the peer: the same inputs, with the
variable B / C in the input dtype as it requires (ours read them in fp32, 2x their bytes).

Every form of the kernel is timed (csrc/selective_scan.hip): the default (the channel form: a
thread per channel, the sequence cut into segments only where too few channels fill the GPU),
the segment form (parallel along the sequence), the per-token butterfly and the deferred
per-chunk sums. Shapes:
issue #16's (batch 8 x d_inner 4096 x 2048 tokens; one 8192-token sequence at d_inner 5120, as
mamba-2.8b) and mamba-130m's d_inner 1536 at batch 1, and (the forward only) the corners of
issue #72's narrow grid, d_inner 768 / 2048 at batch 1 / 8 (NARROW; a line of the table gives
the CUDA peer's worst ratio there), dstate 16,
variable B / C (b, 16, l) as the models pass them, D, z and
delta_bias with softplus: the call a Mamba1 layer makes in prefill. Reports the per-call
device-event median, the CUDA-graph time, the bytes that must move at least (u, delta, z read
once, out written once, B / C once) against the measured copy bandwidth, and the scan's
arithmetic rate over 6 FLOPs per (batch, dim, token, state) element (decay, exp, input, output
product and sum).

``--backward`` (:func:`run_backward`): training at the same shapes, forward + backward through
autograd with every input's gradient (the backward kernel, csrc/selective_scan_bwd.hip) vs the
PyTorch tier, mamba_ssm's reference (when importable; at mamba-130m's shape only: it loops over
the tokens under autograd) and mamba_ssm's CUDA forward + backward (``selective_scan_cuda``, where
it is built: issue #72's peer), with the bytes that must move at least and the peak memory of
one step. Each timing says on stderr what it starts, so that a cut run shows where it was.
"""

from __future__ import annotations

import functools
import sys
from contextlib import contextmanager

from mamba2_rocm._torch import require_torch
from mamba2_rocm.bench.timing import (
    backend,
    bandwidth_row,
    copy_bandwidth_gbs,
    format_rows,
    peak_mb,
    time_calls,
    time_graph,
)

#: (batch, dim, seqlen, dstate)
#: the two of issue #16 (Mamba1 at training batch; one long sequence) and mamba-130m at batch 1
SHAPES = ((8, 4096, 2048, 16), (1, 5120, 8192, 16), (1, 1536, 2048, 16))
#: the forward only: the corners of issue #72's narrow grid (d 768-2048, batch 1-8, 2048 tokens;
#: its goal, >= 1.0x mamba_ssm's CUDA scan there), mamba-130m's width above at its middle
NARROW = ((1, 768, 2048, 16), (8, 768, 2048, 16), (1, 2048, 2048, 16), (8, 2048, 2048, 16))
#: --backward times mamba_ssm's selective_scan_ref (a Python loop over the tokens, under
#: autograd) only up to this many (batch x dim x token) elements: mamba-130m's shape
REF_BACKWARD_MAX = 1 << 22
REF = "mamba_ssm selective_scan_ref"
CUDA_PEER = "mamba_ssm CUDA selective_scan"
DEFERRED = "kernel, deferred sums"
BUTTERFLY = "kernel, butterfly"
SEGMENTS = "kernel, segment form"
#: the other forms' rows (impl -> form); the "kernel" row runs the default form
FORMS = {SEGMENTS: "segments", BUTTERFLY: "butterfly", DEFERRED: "deferred"}


@contextmanager
def kernel_form(form: str):
    """Run the kernel in ``form`` (mamba2_rocm.ops.selective_scan.KERNEL_FORMS) in the block."""
    from mamba2_rocm.ops import selective_scan as ops

    before, ops.kernel_form = ops.kernel_form, form
    try:
        yield
    finally:
        ops.kernel_form = before


def _mamba_ssm_ref():
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_ref
    except Exception:  # not importable here
        return None
    if selective_scan_ref.__module__.startswith("mamba2_rocm"):
        return None  # the drop-in's name is ours, not a peer
    return selective_scan_ref


def _cuda_extension():
    """mamba_ssm's compiled scan (module ``selective_scan_cuda``) where it is importable and is
    not the drop-in's facade of the same name (ours, beside the real pure-Python mamba_ssm)."""
    try:
        import selective_scan_cuda
    except Exception:  # only NVIDIA builds of mamba_ssm have it
        return None
    if getattr(selective_scan_cuda.fwd, "__module__", "").startswith("mamba2_rocm"):
        return None
    return selective_scan_cuda


def _peer_bc(u, B, C):
    """Variable B / C as mamba_ssm's wrapper passes them to its kernel: in the input dtype,
    grouped (batch, 1, dstate, seqlen)."""
    return tuple(t.to(u.dtype).unsqueeze(1).contiguous() if t.dim() == 3 else t for t in (B, C))


def _mamba_ssm_cuda():
    """mamba_ssm's CUDA forward where it is importable (:func:`_cuda_extension`): a function of
    selective_scan_fn's positional arguments returning a call of the kernel, the arguments
    converted as mamba_ssm's own wrapper converts them (:func:`_peer_bc`) and its result picked
    as the wrapper picks it (the gated output when z is given); None when it is not built here."""
    ext = _cuda_extension()
    if ext is None:
        return None

    def prepare(u, delta, A, B, C, D, z, delta_bias, softplus):
        B, C = _peer_bc(u, B, C)
        pick = 0 if z is None else 2  # (out, states, out_z): with z the gated output is third
        return lambda: ext.fwd(u, delta, A, B, C, D, z, delta_bias, softplus)[pick]

    return prepare


def _mamba_ssm_cuda_train():
    """mamba_ssm's CUDA training step where it is importable: a function of selective_scan_fn's
    positional arguments and the output gradient returning a call of its forward then its
    backward, as its autograd function makes them (``bwd(u, delta, A, B, C, D, z, delta_bias,
    dout, x, out, dz=None, softplus, recompute_out_z=False)``, every gradient); None without it."""
    ext = _cuda_extension()
    if ext is None:
        return None

    def prepare(u, delta, A, B, C, D, z, delta_bias, softplus, dout):
        B, C = _peer_bc(u, B, C)

        def step():
            out, x, *_ = ext.fwd(u, delta, A, B, C, D, z, delta_bias, softplus)
            return ext.bwd(u, delta, A, B, C, D, z, delta_bias, dout, x, out, None, softplus,
                           False)  # fmt: skip

        return step

    return prepare


def _layer_inputs(b, d, L, n, dt_):
    """A Mamba1 layer's prefill call (variable B / C, D, z, delta_bias), and an output gradient."""
    torch = require_torch()
    g = torch.Generator(device="cuda").manual_seed(d + L)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    u, z = r(b, d, L).to(dt_), r(b, d, L).to(dt_)
    delta = (torch.rand(b, d, L, device="cuda", generator=g) * 0.5).to(dt_)
    A = -torch.rand(d, n, device="cuda", generator=g) - 0.1
    B, C = r(b, n, L), r(b, n, L)
    D, delta_bias = r(d), torch.rand(d, device="cuda", generator=g) * 0.5
    return u, delta, A, B, C, D, z, delta_bias, r(b, d, L).to(dt_)


def run_backward(shapes=SHAPES, dtype="bfloat16") -> list[dict]:
    """Training rows: forward + backward of every input (u, delta, A, B, C, D, z, delta_bias)
    on the kernel tier and the PyTorch tier (and the peer's reference)."""
    torch = require_torch()
    from mamba2_rocm import selective_scan_fn

    dt_ = getattr(torch, dtype)
    copy = copy_bandwidth_gbs()
    peer, cuda_train = _mamba_ssm_ref(), _mamba_ssm_cuda_train()
    rows = []
    for b, d, L, n in shapes:
        u, delta, A, B, C, D, z, delta_bias, dout = _layer_inputs(b, d, L, n, dt_)
        cuda_step = None
        if cuda_train is not None:
            cuda_step = cuda_train(u, delta, A, B, C, D, z, delta_bias, True, dout)
        leaves = [t.requires_grad_() for t in (u, delta, A, B, C, D, z, delta_bias)]
        act = u.numel() * u.element_size()
        bc = (B.numel() + C.numel()) * 4
        # forward: u, delta, z, B, C read, out written; backward: u, delta, z, dout, B, C read,
        # du, ddelta, dz, dB, dC written
        nbytes = 4 * act + bc + 7 * act + 2 * bc
        case = f"sscan fwd+bwd b{b} d{d} l{L} n{n} {dtype}"
        impls = [("kernel", selective_scan_fn, dict(warmup=2, iters=10)),
                 ("torch", selective_scan_fn, dict(warmup=0, iters=2))]  # fmt: skip
        if peer is not None and b * d * L <= REF_BACKWARD_MAX:
            impls.append((REF, peer, dict(warmup=0, iters=2)))
        if cuda_step is not None:
            impls.append((CUDA_PEER, None, dict(warmup=2, iters=10)))

        def autograd_step(fn, leaves=leaves, dout=dout):
            return torch.autograd.grad(fn(*leaves, True), leaves, dout)

        for impl, fn, calls in impls:
            step = cuda_step if impl == CUDA_PEER else functools.partial(autograd_step, fn)
            print(f"  timing {case}: {impl}", file=sys.stderr, flush=True)  # (where a slow tier is)
            with backend("torch" if impl == REF else "kernel" if impl == CUDA_PEER else impl):
                row = bandwidth_row(case, impl, time_calls(step, **calls), None, nbytes, copy)
                row["peak_mb"] = peak_mb(step)
            row["tflops"] = 0.0
            if impl == CUDA_PEER:  # a peer that computes something else is no peer: its du
                with backend("kernel"):
                    (ours_du,) = torch.autograd.grad(selective_scan_fn(*leaves, True), leaves[0],
                                                     dout)  # fmt: skip
                diff = (step()[0].float() - ours_du.float()).abs().max().item()
                row["max_diff_vs_kernel"] = diff
                row["agrees"] = diff <= 0.05 * ours_du.float().abs().max().item()
            rows.append(row)
        del u, z, delta, B, C
    return rows


def run(shapes=None, dtype="bfloat16", backward=False) -> list[dict]:
    """Forward rows at SHAPES and NARROW (``backward``: :func:`run_backward`, at SHAPES)."""
    if backward:
        return run_backward(SHAPES if shapes is None else shapes, dtype)
    shapes = SHAPES + NARROW if shapes is None else shapes
    torch = require_torch()
    from mamba2_rocm import selective_scan_fn
    from mamba2_rocm.ops import selective_scan as ops

    if not torch.cuda.is_available():
        raise RuntimeError("bench selective-scan needs a GPU")
    dt_ = getattr(torch, dtype)
    copy = copy_bandwidth_gbs()
    peer, cuda_peer = _mamba_ssm_ref(), _mamba_ssm_cuda()
    rows = []
    for b, d, L, n in shapes:
        u, delta, A, B, C, D, z, delta_bias, _ = _layer_inputs(b, d, L, n, dt_)
        args = (u, delta, A, B, C, D, z, delta_bias, True)
        elt = u.element_size()
        nbytes = 4 * u.numel() * elt + (B.numel() + C.numel() + A.numel()) * 4
        flops = 6 * b * d * L * n
        case = f"sscan b{b} d{d} l{L} n{n} {dtype}"
        impls = [("kernel", selective_scan_fn, dict(warmup=3, iters=30), True),
                 (SEGMENTS, selective_scan_fn, dict(warmup=3, iters=30), True),
                 (BUTTERFLY, selective_scan_fn, dict(warmup=3, iters=30), True),
                 (DEFERRED, selective_scan_fn, dict(warmup=3, iters=30), True),
                 ("torch", selective_scan_fn, dict(warmup=1, iters=3), False)]  # fmt: skip
        if peer is not None:
            impls.append((REF, peer, dict(warmup=1, iters=3), False))
        if cuda_peer is not None:
            impls.append((CUDA_PEER, cuda_peer(*args), dict(warmup=3, iters=30), True))
            ours = selective_scan_fn(*args)  # what the peer's output is checked against
        for impl, fn, calls, graph in impls:
            call = fn if impl == CUDA_PEER else functools.partial(fn, *args)
            tier = (
                "torch" if impl == REF else "kernel" if impl in FORMS or impl == CUDA_PEER else impl
            )
            form = FORMS.get(impl, ops.kernel_form)
            with backend(tier), kernel_form(form):
                t = time_calls(call, **calls)
                gr = time_graph(call, replays=5, per_graph=5) if graph else None
            row = bandwidth_row(case, impl, t, gr, nbytes, copy)
            row["tflops"] = flops / (row["best_us"] * 1e-6) / 1e12
            if impl == CUDA_PEER:  # a peer that computes something else is no peer
                diff = (call().float() - ours.float()).abs().max().item()
                row["max_diff_vs_kernel"] = diff
                row["agrees"] = diff <= 0.05 * ours.float().abs().max().item()
            rows.append(row)
    return rows


def _narrow_case(case: str) -> bool:
    """Whether a case (``sscan b<B> d<D> ...``, forward) lies in issue #72's narrow grid."""
    fields = dict((f[0], f[1:]) for f in case.split()[1:3])
    try:
        b, d = int(fields["b"]), int(fields["d"])
    except (KeyError, ValueError):
        return False
    return "fwd+bwd" not in case and 1 <= b <= 8 and 768 <= d <= 2048


def format_table(rows: list[dict]) -> str:
    extra = [("TFLOP/s", "tflops", ".2f")]
    if any("peak_mb" in r for r in rows):  # --backward
        extra = [("peak MB", "peak_mb", ".1f")]
    lines = [format_rows(rows, 34, 28, extra=extra)]
    by_case: dict[str, dict[str, float]] = {}
    for r in rows:
        by_case.setdefault(r["case"], {})[r["impl"]] = r["best_us"]
    worst = None
    for case, impls in by_case.items():
        ours = impls.get("kernel")
        if ours is None:
            continue
        for impl, form in FORMS.items():
            if impl in impls:
                lines.append(f"{case}: the default form is {impls[impl] / ours:.2f}x as fast as "
                             f"the {form} form")  # fmt: skip
        ratios = {k: v / ours for k, v in impls.items() if k != "kernel" and k not in FORMS}
        lines.append(f"{case}: kernel is " + ", ".join(f"{v:.1f}x faster than {k}"
                                                        for k, v in ratios.items()))  # fmt: skip
        if ratios:
            low = min(ratios.values())
            worst = low if worst is None else min(worst, low)
    if worst is not None:
        lines.append(f"worst ratio over all cases: {worst:.1f}x")
    peer = [impls[CUDA_PEER] / impls["kernel"] for case, impls in by_case.items()
            if _narrow_case(case) and CUDA_PEER in impls and "kernel" in impls]  # fmt: skip
    if peer:
        lines.append(f"narrow grid (d 768-2048, batch 1-8; goal >= 1.0x): {CUDA_PEER} / kernel "
                     f"{min(peer):.2f}x at worst over {len(peer)} cases")  # fmt: skip
    for r in rows:
        if "agrees" in r and not r["agrees"]:
            lines.append(f"{r['case']}: {CUDA_PEER} DISAGREES with the kernel (max |diff| "
                         f"{r['max_diff_vs_kernel']:.3g}): its timing is not comparable")  # fmt: skip
    return "\n".join(lines)
