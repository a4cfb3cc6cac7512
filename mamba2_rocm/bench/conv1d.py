"""conv1d benchmark: our kernel vs the vectorized PyTorch tier vs ``F.conv1d``.

Prints, per case, the median device-event time of one call (launch included), the time per
call inside a CUDA graph (kernel only), and the achieved bandwidth over the bytes that must move
(inputs read once, outputs written once), as a fraction of the measured copy bandwidth.
"""

from __future__ import annotations

from mamba2_rocm._torch import require_torch
from mamba2_rocm.bench.timing import backend, copy_bandwidth_gbs, time_calls, time_graph


def run(
    batch=4, dim=4096, seqlen=4096, width=4, decode_batch=64, decode_dim=8192, dtype="bfloat16"
) -> list[dict]:
    torch = require_torch()
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
        best = min(t.median_us, g.median_us) if g else t.median_us
        gbs = nbytes / (best * 1e-6) / 1e9
        rows.append({
            "case": case, "impl": impl, "us": t.median_us, "iqr_us": t.iqr_us,
            "graph_us": g.median_us if g else None, "gbs": gbs, "copy_frac": gbs / copy,
        })  # fmt: skip

    x = torch.randn(batch, dim, seqlen, device=dev, dtype=dt)
    x_cl = torch.randn(batch, seqlen, dim, device=dev, dtype=dt).transpose(1, 2)
    w = torch.randn(dim, width, device=dev, dtype=dt)
    b = torch.randn(dim, device=dev, dtype=dt)
    fwd_bytes = 2 * x.numel() * elt + w.numel() * elt + b.numel() * elt
    case = f"fwd b{batch} d{dim} l{seqlen} w{width} {dtype}"
    add(case, "mamba2-rocm kernel", lambda: causal_conv1d_fn(x, w, b, activation="silu"), fwd_bytes)
    add(case + " channel-last", "mamba2-rocm kernel (channel-last)",
        lambda: causal_conv1d_fn(x_cl, w, b, activation="silu"), fwd_bytes)  # fmt: skip
    add(
        case,
        "vectorized torch tier",
        lambda: causal_conv1d_fn(x, w, b, activation="silu"),
        fwd_bytes,
    )
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
        "mamba2-rocm kernel",
        lambda: causal_conv1d_update(xs, state, wd, bd, activation="silu"),
        upd_bytes,
    )
    add(case, "vectorized torch tier",
        lambda: causal_conv1d_update(xs, state, wd, bd, activation="silu"), upd_bytes, graph=False)  # fmt: skip
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
    lines = [
        f"{'case':44} {'implementation':34} {'median us':>10} {'graph us':>9} {'GB/s':>7} {'% copy':>7}"
    ]
    for r in rows:
        graph = f"{r['graph_us']:.1f}" if r["graph_us"] is not None else "-"
        lines.append(
            f"{r['case']:44} {r['impl']:34} {r['us']:10.1f} {graph:>9} {r['gbs']:7.0f} {100 * r['copy_frac']:6.1f}%"
        )
    by_case: dict[str, dict[str, float]] = {}
    for r in rows:
        by_case.setdefault(r["case"].replace(" channel-last", ""), {})[r["impl"]] = r["us"]
    for case, impls in by_case.items():
        ours = impls.get("mamba2-rocm kernel")
        others = ", ".join(
            f"{k}: {v / ours:.1f}x" for k, v in impls.items() if ours and k != "mamba2-rocm kernel"
        )
        lines.append(f"speed-up of the kernel, {case}: {others}")
    return head + "\n".join(lines)
