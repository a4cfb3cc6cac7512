"""conv1d benchmark: our kernel vs the vectorized PyTorch tier vs ``F.conv1d``.

Prints, per case, the median device-event time of one call (launch included), the time per
call inside a CUDA graph (kernel only), and the achieved bandwidth over the bytes that must move
(inputs read once, outputs written once), as a fraction of the measured copy bandwidth.

Cases: b4 d4096 l4096 (every implementation, channel-last too) and a 64-row decode update; then
the grid of the models people run, width 4 with SiLU: the conv channels of every Mamba2
checkpoint (d_inner + 2 ngroups dstate: 1792 / 2304 / 3328 / 4352 / 5376 for 130m … 2.7b), of
the hybrids (Codestral-Mamba-7B / Nemotron-H-8B 10240, Bamba-9B 8448, Falcon-H1-7B 3584) and
mamba-2.8b's d_inner 5120, each at (batch, seqlen) (8, 512), (4, 2048), (1, 8192), (1, 16384)
against ``F.conv1d``, and ours again on the channel-last layout a Mamba2 block passes (the input
projection's (batch, seqlen, channels) output seen as (batch, channels, seqlen)); the decode
update at batch 1 / 16 / 64 / 256 for 1.3b's and Codestral's widths in three conv_state layouts
(UPDATE_CACHES), each against a copy of the same bytes (a decode step moves 0.1-42 MB, where a
copy itself runs below the 1 GB copy rate). A summary gives the worst fraction of copy bandwidth
over the cases that move at least 64 MB (issue #17's target: 90%; the seqlen-contiguous and the
channel-last kernels apart), the update's worst fraction of its same-size copy (overall and at
batch 256) and the worst ratio to cuDNN.

``--backward`` (:func:`run_backward`): training instead, forward + backward through autograd
(gradients of x, weight and bias) at the conv of the two Mamba2 shapes of ``bench ssd`` and of
every Mamba2 checkpoint at (4, 2048), channel-last as a Mamba2 block passes it, and of two Mamba1
checkpoints seqlen-contiguous (" rows") as a Mamba1 block passes it: our kernels vs
the torch tier vs cuDNN, time per step, bandwidth over the bytes that must move (forward: read x,
write out; backward: read x and dout, write dx) and the peak memory above the inputs. Each step
is timed eagerly and inside a CUDA graph (forward and autograd's backward captured together);
bandwidth and the summary's ratios take the better, the graph time wherever host time dominates.
"""

from __future__ import annotations

from mamba2_rocm._torch import require_torch
from mamba2_rocm.bench.timing import (
    backend,
    bandwidth_row,
    copy_bandwidth_gbs,
    peak_mb,
    time_calls,
    time_graph,
)

#: model -> conv channels (Mamba2: d_inner + 2 * ngroups * dstate; Mamba1: d_inner)
CONV_MODELS = {
    "mamba2-130m": 1792,
    "mamba2-370m": 2304,
    "mamba2-780m": 3328,
    "mamba2-1.3b": 4352,
    "mamba2-2.7b": 5376,
    "codestral-7b": 10240,
    "bamba-9b": 8448,
    "falcon-h1-7b": 3584,
    "mamba-2.8b": 5120,
}
POINTS = ((8, 512), (4, 2048), (1, 8192), (1, 16384))  # (batch, seqlen)
DECODE_GRID = ((("mamba2-1.3b", 4352), ("codestral-7b", 10240)), (1, 16, 64, 256))
#: the decode update's conv_state layouts, by the case's suffix: causal-conv1d's (batch, dim,
#: width - 1), transformers' Mamba2 cache (batch, dim, width), mamba_ssm's Mamba2 cache (batch,
#: width, dim) seen as (batch, dim, width)
UPDATE_CACHES = {
    "": lambda torch, b, d, w, dt: torch.randn(b, d, w - 1, device="cuda", dtype=dt),
    " hf-cache": lambda torch, b, d, w, dt: torch.randn(b, d, w, device="cuda", dtype=dt),
    " ssm-cache": lambda torch, b, d, w, dt: torch.randn(
        b, w, d, device="cuda", dtype=dt
    ).transpose(1, 2),
}
COPY = "copy of the same bytes"
KERNEL, KERNEL_CL = "mamba2-rocm kernel", "mamba2-rocm kernel (channel-last)"
LARGE_BYTES = 64 << 20  # the "large shapes" the copy-bandwidth target applies to
CUDNN = "F.conv1d (cuDNN) + silu"


#: Mamba1 checkpoints' d_inner (mamba_ssm's Mamba block convolves x seqlen-contiguous: the
#: in-projection's output rearranged to (batch, d_inner, seqlen))
MAMBA1_CONV = {"mamba-130m": 1536, "mamba-2.8b": 5120}


def backward_cases() -> list[tuple[str, int, int, int, str]]:
    """(label, batch, conv channels, seqlen, layout) of ``--backward``: the conv of ``bench
    ssd``'s two Mamba2 shapes (d_inner + 2 ngroups dstate) and of every Mamba2 checkpoint at
    (4, 2048), channel-last as a Mamba2 block passes it, then two Mamba1 checkpoints' at (4,
    2048), seqlen-contiguous as a Mamba1 block passes it."""
    from mamba2_rocm.bench.ssd import ISSUE_SHAPES

    cl, rows = "channel-last", "seqlen-contiguous"
    cases = [(f"ssd-issue h{h} g{g}", b, h * p + 2 * g * n, L, cl)
             for b, L, h, p, g, n, _cs in ISSUE_SHAPES]  # fmt: skip
    cases += [
        (name, 4, d, 2048, cl) for name, d in CONV_MODELS.items() if name.startswith("mamba2-")
    ]
    cases += [(name, 4, d, 2048, rows) for name, d in MAMBA1_CONV.items()]
    return cases


def run_backward(width=4, dtype="bfloat16") -> list[dict]:
    torch = require_torch()
    import torch.nn.functional as F

    from mamba2_rocm import causal_conv1d_fn

    dt = getattr(torch, dtype)
    elt = torch.tensor([], dtype=dt).element_size()
    dev = "cuda"
    copy = copy_bandwidth_gbs()
    rows: list[dict] = []

    for label, bt, d, L, layout in backward_cases():

        def make(bt=bt, d=d, L=L, layout=layout):
            if layout == "channel-last":
                return torch.randn(bt, L, d, device=dev, dtype=dt).transpose(1, 2)
            return torch.randn(bt, d, L, device=dev, dtype=dt)

        x = make().requires_grad_()
        w = torch.randn(d, width, device=dev, dtype=dt, requires_grad=True)
        b = torch.randn(d, device=dev, dtype=dt, requires_grad=True)
        dout = make()
        nbytes = 5 * x.numel() * elt  # forward 2 passes over x's size, backward 3
        case = f"{label} fwd+bwd b{bt} d{d} l{L}" + (" rows" if layout != "channel-last" else "")

        def ours(x=x, w=w, b=b, dout=dout):
            out = causal_conv1d_fn(x, w, b, activation="silu")
            return torch.autograd.grad(out, (x, w, b), dout)

        def cudnn(x=x, w=w, b=b, dout=dout, L=L):
            out = F.silu(F.conv1d(x, w.unsqueeze(1), b, padding=width - 1, groups=w.shape[0]))
            return torch.autograd.grad(out[..., :L], (x, w, b), dout)

        for impl, fn, tier in ((KERNEL, ours, "kernel"),
                               ("vectorized torch tier", ours, "torch"), (CUDNN, cudnn, "torch")):  # fmt: skip
            with backend(tier):
                t = time_calls(fn)
                g = time_graph(fn, replays=5, per_graph=5)
                mem = peak_mb(fn)
            # bandwidth and the summary's device time from the better of the two: an eager step
            # is mostly host time (autograd and its launches; the same kernels read 433-572 us
            # in one process and 423-734 in the next on an H200), the graph time compares kernels
            rows.append(
                bandwidth_row(
                    case, impl, t, g, nbytes, copy, iqr_us=t.iqr_us, bytes=nbytes, peak_mb=mem
                )
            )
        del x, dout
    for r in rows:
        r["copy_gbs"] = copy
    return rows


#: buffer pairs a same-size copy is timed on, each allocated anew; the best is kept (copy_of)
COPY_ROUNDS = 3


def copy_elements(nbytes: int) -> int:
    """The 2-byte elements of copy_of's buffers: nbytes / 4, from 2^18 of them cut to whole
    4096-element (8 KB) runs (copy_of says why)."""
    n = nbytes // 4
    return n - n % 4096 if n >= 1 << 18 else n


def copy_of(nbytes: int):
    """A device copy that moves ``nbytes`` (read plus written; up to 16 KB less, copy_elements):
    torch's copy of 2-byte elements, the copy the 1 GB reference (``copy_bandwidth_gbs``)
    times; rows take the better of its eager and graph times, ``run`` the best of COPY_ROUNDS
    pairs. From 2^18 elements the count is cut to whole 4096-element (8 KB) runs: torch's copy of
    another count took a slower path on the H200 (29,364,608 elements: 45.0 µs graph-timed, 37.8
    eager; 29,364,224: 29.7 / 32.4), which the forward's cases, whose bytes include the taps and
    bias, had hit, and which had put the kernels at 106% of a "copy" that was itself slow. (A
    uint8 copy, which this bench took before, ran slower than the conv itself: 29.6 against 23.8
    µs at 72 MB on the H200.)"""
    torch = require_torch()
    src = torch.empty(copy_elements(nbytes), device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def run(
    batch=4, dim=4096, seqlen=4096, width=4, decode_batch=64, decode_dim=8192, dtype="bfloat16",
    grid=True, backward=False,
) -> list[dict]:  # fmt: skip
    torch = require_torch()
    if backward:
        if not torch.cuda.is_available():
            raise RuntimeError("bench conv1d needs a GPU")
        return run_backward(width, dtype)
    import torch.nn.functional as F

    from mamba2_rocm import causal_conv1d_fn, causal_conv1d_update

    if not torch.cuda.is_available():
        raise RuntimeError("bench conv1d needs a GPU")
    dt = getattr(torch, dtype)
    elt = torch.tensor([], dtype=dt).element_size()
    dev = "cuda"
    rows: list[dict] = []
    copy = copy_bandwidth_gbs()

    def add(case, impl, fn, nbytes, graph=True):
        with backend("kernel" if impl.startswith("mamba2-rocm kernel") else "torch"):
            t = time_calls(fn)
            g = time_graph(fn) if graph else None
        record(case, impl, t, g, nbytes)

    def add_copy(case, nbytes):  # the best of COPY_ROUNDS buffer pairs (copy_of)
        runs = []
        for _ in range(COPY_ROUNDS):
            fn = copy_of(nbytes)  # (the previous pair is freed as fn is rebound)
            runs.append((time_calls(fn), time_graph(fn)))
        record(case, COPY, *min(runs, key=lambda tg: min(tg[0].median_us, tg[1].median_us)), nbytes)

    def record(case, impl, t, g, nbytes):
        best = min(t.median_us, g.median_us) if g else t.median_us
        gbs = nbytes / (best * 1e-6) / 1e9
        rows.append({
            "case": case, "impl": impl, "us": t.median_us, "iqr_us": t.iqr_us,
            "graph_us": g.median_us if g else None, "gbs": gbs, "copy_frac": gbs / copy,
            "best_us": best, "bytes": nbytes,
        })  # fmt: skip

    x = torch.randn(batch, dim, seqlen, device=dev, dtype=dt)
    x_cl = torch.randn(batch, seqlen, dim, device=dev, dtype=dt).transpose(1, 2)
    w = torch.randn(dim, width, device=dev, dtype=dt)
    b = torch.randn(dim, device=dev, dtype=dt)
    fwd_bytes = 2 * x.numel() * elt + w.numel() * elt + b.numel() * elt
    case = f"fwd b{batch} d{dim} l{seqlen} w{width} {dtype}"
    add(case, KERNEL, lambda: causal_conv1d_fn(x, w, b, activation="silu"), fwd_bytes)
    add(case + " channel-last", KERNEL_CL,
        lambda: causal_conv1d_fn(x_cl, w, b, activation="silu"), fwd_bytes)  # fmt: skip
    add(
        case,
        "vectorized torch tier",
        lambda: causal_conv1d_fn(x, w, b, activation="silu"),
        fwd_bytes,
    )
    add_copy(case, fwd_bytes)
    wc = w.unsqueeze(1)
    add(case, "F.conv1d (cuDNN) + silu",
        lambda: F.silu(F.conv1d(x, wc, b, padding=width - 1, groups=dim)[..., :seqlen]), fwd_bytes)  # fmt: skip

    xs = torch.randn(decode_batch, decode_dim, device=dev, dtype=dt)
    state = torch.randn(decode_batch, decode_dim, width - 1, device=dev, dtype=dt)
    wd = torch.randn(decode_dim, width, device=dev, dtype=dt)
    bd = torch.randn(decode_dim, device=dev, dtype=dt)
    upd_bytes = (2 * xs.numel() + 2 * state.numel() + wd.numel() + bd.numel()) * elt
    case = f"update b{decode_batch} d{decode_dim} w{width} {dtype}"
    add(
        case,
        KERNEL,
        lambda: causal_conv1d_update(xs, state, wd, bd, activation="silu"),
        upd_bytes,
    )
    add(case, "vectorized torch tier",
        lambda: causal_conv1d_update(xs, state, wd, bd, activation="silu"), upd_bytes, graph=False)  # fmt: skip
    if grid:
        for name, d in CONV_MODELS.items():
            w, b = torch.randn(d, width, device=dev, dtype=dt), torch.randn(d, device=dev, dtype=dt)
            wc = w.unsqueeze(1)
            for bt, L in POINTS:
                x = torch.randn(bt, d, L, device=dev, dtype=dt)
                nbytes = (2 * x.numel() + w.numel() + b.numel()) * elt
                case = f"{name} fwd b{bt} d{d} l{L}"
                if nbytes >= LARGE_BYTES:  # what the target's fraction is taken against too
                    add_copy(case, nbytes)
                add(case, KERNEL,
                    lambda x=x, w=w, b=b: causal_conv1d_fn(x, w, b, activation="silu"), nbytes)  # fmt: skip
                add(case, CUDNN, lambda x=x, wc=wc, b=b, L=L: F.silu(
                    F.conv1d(x, wc, b, padding=width - 1, groups=wc.shape[0])[..., :L]), nbytes)  # fmt: skip
                del x
                x = torch.randn(bt, L, d, device=dev, dtype=dt).transpose(1, 2)
                add(case + " channel-last", KERNEL_CL,
                    lambda x=x, w=w, b=b: causal_conv1d_fn(x, w, b, activation="silu"), nbytes)  # fmt: skip
                del x
        models, batches = DECODE_GRID
        for name, d in models:
            wd, bd = (
                torch.randn(d, width, device=dev, dtype=dt),
                torch.randn(d, device=dev, dtype=dt),
            )
            for bt in batches:
                xs = torch.randn(bt, d, device=dev, dtype=dt)
                for cache, make in UPDATE_CACHES.items():
                    state = make(torch, bt, d, width, dt)
                    nbytes = (2 * xs.numel() + 2 * state.numel() + wd.numel() + bd.numel()) * elt
                    case = f"{name} update b{bt} d{d}{cache}"
                    add(case, KERNEL,
                        lambda xs=xs, state=state, wd=wd, bd=bd: causal_conv1d_update(
                            xs, state, wd, bd, activation="silu"), nbytes)  # fmt: skip
                    add_copy(case, nbytes)
    for r in rows:
        r["copy_gbs"] = copy
    return rows


def format_table(rows: list[dict]) -> str:
    from mamba2_rocm._torch import require_torch

    torch = require_torch()
    head = (
        f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
        f"copy bandwidth {rows[0]['copy_gbs']:.0f} GB/s (read+write)\n"
    )
    mem = any("peak_mb" in r for r in rows)
    lines = [
        f"{'case':44} {'implementation':34} {'median us':>10} {'graph us':>9} {'GB/s':>7} {'% copy':>7}"
        + (f" {'peak MB':>8}" if mem else "")
    ]
    for r in rows:
        graph = f"{r['graph_us']:.1f}" if r["graph_us"] is not None else "-"
        lines.append(
            f"{r['case']:44} {r['impl']:34} {r['us']:10.1f} {graph:>9} {r['gbs']:7.0f} {100 * r['copy_frac']:6.1f}%"
            + (f" {r['peak_mb']:8.1f}" if mem else "")
        )
    by_case: dict[str, dict[str, float]] = {}
    for r in rows:
        by_case.setdefault(r["case"].replace(" channel-last", ""), {})[r["impl"]] = r["us"]
    for case, impls in by_case.items():
        ours = impls.get(KERNEL)
        others = ", ".join(
            f"{k}: {v / ours:.1f}x"
            for k, v in impls.items()
            if ours and k not in (KERNEL, KERNEL_CL, COPY)  # (the copy: in the summary)
        )
        if others:
            lines.append(f"speed-up of the kernel, {case}: {others}")
    return head + "\n".join(lines + summary(rows))


def summary(rows: list[dict]) -> list[str]:
    """The worst fraction of copy bandwidth of our kernel over the cases moving at least
    LARGE_BYTES, forward, update and training apart (and the channel-last forward apart from the
    seqlen-contiguous one); the worst fraction of a copy of the same bytes (the large forward
    cases, every update); and the worst device-time ratio to cuDNN (and, for training, the worst
    peak-memory ratio to it)."""
    lines = []
    for impl, layout in ((KERNEL, ""), (KERNEL_CL, " channel-last")):
        ours = [r for r in rows if r["impl"] == impl and r["bytes"] >= LARGE_BYTES]
        for kind in ("fwd", "update", "fwd+bwd"):
            sel = [r for r in ours if f" {kind} " in f" {r['case']} "]
            if sel:
                worst = min(sel, key=lambda r: r["copy_frac"])
                lines.append(f"worst {kind}{layout} at >= {LARGE_BYTES >> 20} MB: "
                             f"{100 * worst['copy_frac']:.1f}% of copy ({worst['case']}; target 90%)")  # fmt: skip
    best = {(r["case"], r["impl"]): r["best_us"] for r in rows}
    # against a copy of the same bytes, timed the same way (a 64 MB copy itself runs below the
    # 1 GB rate the fractions above are of): the forward's large cases (a channel-last case
    # shares its seqlen-contiguous twin's copy) and every update
    for impl, layout, kind in ((KERNEL, "", "fwd"), (KERNEL_CL, " channel-last", "fwd"),
                               (KERNEL, "", "update")):  # fmt: skip
        twin = {c: (c.removesuffix(" channel-last"), COPY) for c, i in best if i == impl}
        to_copy = [(best[twin[c]] / us, c) for (c, i), us in best.items()
                   if i == impl and f" {kind} " in f" {c} " and twin[c] in best]  # fmt: skip
        if not to_copy:
            continue
        low = min(to_copy)
        if kind == "fwd":
            lines.append(f"worst fwd{layout} against a copy of its bytes (device time), at >= "
                         f"{LARGE_BYTES >> 20} MB: {100 * low[0]:.1f}% ({low[1]}; target 90%)")  # fmt: skip
            continue
        big = [t for t in to_copy if " b256 " in f"{t[1]} "]
        lines.append(f"worst update against a copy of its bytes (device time): {100 * low[0]:.1f}%"
                     f" ({low[1]})" + (f"; at batch 256: {100 * min(big)[0]:.1f}% ({min(big)[1]})"
                                       if big else ""))  # fmt: skip
    ratios = [(best[(c, CUDNN)] / us, c) for (c, impl), us in best.items()
              if impl == KERNEL and (c, CUDNN) in best]  # fmt: skip
    if ratios:
        low = min(ratios)
        lines.append(f"worst ratio to cuDNN (device time): {low[0]:.2f}x ({low[1]})")
    mem = {(r["case"], r["impl"]): r["peak_mb"] for r in rows if "peak_mb" in r}
    mem_ratios = [(us / mem[(c, CUDNN)], c) for (c, impl), us in mem.items()
                  if impl == KERNEL and mem.get((c, CUDNN))]  # fmt: skip
    if mem_ratios:
        high = max(mem_ratios)
        lines.append(f"highest peak memory relative to cuDNN: {high[0]:.2f}x ({high[1]})")
    return lines
