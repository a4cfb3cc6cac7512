"""Device-event timing and the copy-bandwidth ceiling the results are compared with."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

from mamba2_rocm._torch import require_torch


@dataclass
class Timing:
    median_us: float
    iqr_us: float  # spread: interquartile range of the per-call times
    calls: int


def time_calls(fn: Callable[[], object], warmup: int = 10, iters: int = 100) -> Timing:
    """Median of per-call device-event timings; each call is timed alone, launch included."""
    torch = require_torch()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends, strict=False):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends, strict=False))
    q = statistics.quantiles(times, n=4)
    return Timing(statistics.median(times), q[2] - q[0], iters)


def time_graph(fn: Callable[[], object], replays: int = 20, per_graph: int = 20) -> Timing:
    """Per-call time from CUDA-graph replays of ``per_graph`` calls: kernel time, no launch gaps."""
    torch = require_torch()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    timing = time_calls(graph.replay, warmup=3, iters=replays)
    return Timing(timing.median_us / per_graph, timing.iqr_us / per_graph, replays * per_graph)


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy rate, counting bytes read plus bytes written."""
    torch = require_torch()
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t = time_calls(lambda: dst.copy_(src), warmup=5, iters=30)
    return 2 * nbytes / (t.median_us * 1e-6) / 1e9
