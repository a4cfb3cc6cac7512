"""Model benchmark: a random-init transformers Mamba2 at real checkpoint shapes, end to end.

``python -m mamba2_rocm bench model``: prefill time (batch 1, 4096 tokens) and greedy
``generate`` decode throughput (batch 1 and 16) for the 130m and 1.3b shapes of
state-spaces/mamba2 (d_model 768 / 2048, 24 / 48 layers, headdim 64, d_state 128, ngroups 1,
expand 2, chunk 256), on three sides, each in its own process because transformers resolves
the ``mamba_ssm`` / ``causal_conv1d`` names when its model module is imported:

- ``ours``: the drop-in names on (our kernels for conv, scan and decode step);
- ``torch``: the names off: transformers' own PyTorch path;
- ``triton``: a real ``mamba_ssm`` on the path (its Triton scan and decode step), when one is
  importable; ``causal_conv1d``'s CUDA extension is not built there, so its conv is ours.

Each side proves what it ran: ours launched our scan, conv and decode kernels, the torch side
none of them, the Triton side our conv only and imported ``mamba_ssm`` from outside
mamba2-rocm. Decode throughput is ``batch * n / (t(generate n + 1) - t(generate 1))`` (the
prompt's prefill cancels out; the median of that difference over pairs timed back to back,
:func:`per_token_ms`). Ours also reports the share of decode wall time the GPU is busy
(torch.profiler): the rest is host time between kernels. Every side reports a decode step's
wall time (all layers, per token) and the host time spent inside the ops it reached through the
``mamba_ssm`` / ``causal_conv1d`` names, per owner (:mod:`mamba2_rocm.bench.hosttime`): what of
a host-bound step is ours, and what is the peer's launchers'. Host-bound numbers can differ
between processes by as much as the sides differ (2026-12-06, H100: the same conv update took
43-80 µs a call across the run's processes, and decode b16 read 631 / 741 / 912 tok/s for
ours / torch / Triton), so ``--rounds N`` runs the sides in turns N times, the order rotating,
and reports medians.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

#: Mamba2Config keywords of the state-spaces/mamba2 checkpoints (vocab padded to 16).
SHAPES = {
    "130m": dict(hidden_size=768, num_hidden_layers=24, num_heads=24),
    "1.3b": dict(hidden_size=2048, num_hidden_layers=48, num_heads=64),
}
COMMON = dict(
    head_dim=64, state_size=128, n_groups=1, expand=2, conv_kernel=4, chunk_size=256,
    vocab_size=50288, rms_norm=True, use_cache=True,
)  # fmt: skip
SIDES = ("ours", "torch", "triton")
PREFILL_TOKENS = 4096
DECODE_BATCHES = (1, 16)
PROMPT_TOKENS = 16
NEW_TOKENS = 64
#: kernel-name prefixes each side must have launched (None: no mamba2-rocm kernel at all)
EXPECTED_KERNELS = {
    "ours": ("m2r_conv1d", "m2r_ssd", "m2r_ssu"),
    "torch": None,
    "triton": ("m2r_conv1d",),
}


def config_kwargs(shape: str) -> dict:
    kw = {**COMMON, **SHAPES[shape]}
    assert kw["num_heads"] * kw["head_dim"] == kw["expand"] * kw["hidden_size"], shape
    return kw


def real_mamba_ssm_root() -> str | None:
    """The sys.path entry a real (not ours) ``mamba_ssm`` is imported from, if any."""
    from mamba2_rocm import dropin

    spec = dropin._real_spec("mamba_ssm")
    if spec is None or spec.origin is None:
        return None
    return str(Path(spec.origin).resolve().parents[1])


def side_problems(side: str, launched: list[str], mamba_ssm_file: str | None) -> list[str]:
    """Why a side's run did not run what its name says (empty: it did)."""
    want = EXPECTED_KERNELS[side]
    ours = [k for k in launched if k.startswith("m2r_")]
    problems = []
    if want is None:
        if ours:
            problems.append(f"the torch side launched mamba2-rocm kernels: {ours[:4]}")
        return problems
    for prefix in want:
        if not any(k.startswith(prefix) for k in ours):
            problems.append(f"the {side} side never launched {prefix}*")
    if side == "triton":
        if any(k.startswith(("m2r_ssd", "m2r_ssu")) for k in ours):
            problems.append("the triton side ran our scan / decode kernels")
        if mamba_ssm_file is None or "mamba2_rocm" in mamba_ssm_file:
            problems.append(f"mamba_ssm came from {mamba_ssm_file}, not a real mamba_ssm")
    return problems


def _median_ms(torch, fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


#: decode timings take at least this many (long, short) pairs: a 1.3b graph decode's difference
#: of medians over 3 runs each once came out 1.6x off the eager profile's device time
DECODE_PAIRS = 7


def interleaved_per_token(time_ms, sides: dict, tokens: int, pairs: int = DECODE_PAIRS) -> dict:
    """:func:`per_token_ms` of every side (``sides``: name -> (run_long, run_short)), the sides
    taking turns pair by pair, so that a drift over the run reaches them alike."""
    diffs: dict = {name: [] for name in sides}
    for _ in range(pairs):
        for name, (run_long, run_short) in sides.items():
            diffs[name].append((time_ms(run_long) - time_ms(run_short)) / tokens)
    return {name: statistics.median(d) for name, d in diffs.items()}


def per_token_ms(time_ms, run_long, run_short, tokens: int, pairs: int = DECODE_PAIRS) -> float:
    """Milliseconds a decode step (``tokens`` of them: ``run_long`` decodes that many more than
    ``run_short``, whose prompt prefill is the same) takes: the median over ``pairs`` of the
    per-pair difference, long and short timed back to back (``time_ms(fn)``: one timed call),
    so a slow run of either side, or a drift in clocks, moves one pair and not the result."""
    return interleaved_per_token(time_ms, {"": (run_long, run_short)}, tokens, pairs)[""]


def _time_once_ms(torch):
    return lambda fn: _median_ms(torch, fn, 1)


def _gpu_busy_fraction(torch, fn) -> float:
    """Share of ``fn``'s wall time covered by GPU kernels (torch.profiler's device time)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
    wall_us = start.elapsed_time(end) * 1e3
    busy_us = sum(
        getattr(e, "self_device_time_total", 0)
        for e in prof.key_averages()
        if str(getattr(e, "device_type", "")).endswith("CUDA")
    )
    return busy_us / wall_us if wall_us else 0.0


def run_side(side: str, shape: str, dtype: str, repeats: int) -> dict:
    """In this process: build the model, time prefill and decode, report what ran."""
    import torch

    from mamba2_rocm.bench.hosttime import OpClock, owner_totals

    clock = OpClock().install()  # before transformers binds the op names (its model modules)
    import transformers

    dt = getattr(torch, dtype)
    config = transformers.Mamba2Config(**config_kwargs(shape))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=dt).cuda().eval()
    gen = torch.Generator(device="cuda").manual_seed(1)
    result: dict = {"side": side, "shape": shape, "dtype": dtype,
                    "transformers": transformers.__version__}  # fmt: skip
    with torch.no_grad():
        ids = torch.randint(3, config.vocab_size, (1, PREFILL_TOKENS), device="cuda", generator=gen)
        model(ids)  # warm-up (Triton compiles and autotunes here)
        result["prefill_ms"] = _median_ms(torch, lambda: model(ids), repeats)
        for b in DECODE_BATCHES:
            prompt = torch.randint(3, config.vocab_size, (b, PROMPT_TOKENS), device="cuda",
                                   generator=gen)  # fmt: skip

            def generate(n, prompt=prompt):
                return model.generate(prompt, max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, pad_token_id=0)  # fmt: skip

            generate(NEW_TOKENS + 1)  # warm-up
            step = per_token_ms(_time_once_ms(torch), lambda: generate(NEW_TOKENS + 1),
                                lambda: generate(1), NEW_TOKENS, max(repeats, DECODE_PAIRS))  # fmt: skip
            result[f"decode_b{b}_tok_s"] = b / max(step, 1e-9) * 1e3
            per_op = clock.per_token(
                lambda: (generate(NEW_TOKENS + 1), torch.cuda.synchronize()),
                lambda: (generate(1), torch.cuda.synchronize()),
                NEW_TOKENS,
            )
            result[f"decode_b{b}_host_ops"] = per_op
            result[f"decode_b{b}_host_us"] = owner_totals(per_op)
            if side == "ours":
                result[f"decode_b{b}_gpu_busy"] = _gpu_busy_fraction(
                    torch, lambda: generate(NEW_TOKENS + 1)
                )
    launched: list[str] = []
    if "mamba2_rocm.runtime.loader" in sys.modules:
        from mamba2_rocm.runtime.loader import kernels_for_device

        kset = kernels_for_device(0)
        launched = sorted(kset._launchers) if kset is not None else []
    mod = sys.modules.get("mamba_ssm")
    result["launched"] = launched
    result["mamba_ssm"] = getattr(mod, "__file__", None) if mod else None
    result["problems"] = side_problems(side, launched, result["mamba_ssm"])
    return result


def _side_code(side: str, hide: str | None, shape: str, dtype: str, repeats: int) -> str:
    return (
        "import json, sys\n"
        + (f"sys.path = [p for p in sys.path if p.rstrip('/') != {hide!r}]\n" if hide else "")
        + "import mamba2_rocm.dropin as d\n"
        f"{'d.deactivate()' if side == 'torch' else 'd.activate()'}\n"
        "from mamba2_rocm.bench.model import run_side\n"
        f"print('M2R-RESULT ' + json.dumps(run_side({side!r}, {shape!r}, {dtype!r}, {repeats})))\n"
    )


def _spawn(side: str, shape: str, dtype: str, repeats: int, real_root: str | None) -> dict:
    # ours and torch must not see a real mamba_ssm (the drop-in gives way to one); the
    # Triton side needs it
    hide = None if side == "triton" else real_root
    env = dict(os.environ, MAMBA2_ROCM_BACKEND="kernel")
    env["MAMBA2_ROCM_DROPIN"] = "0" if side == "torch" else "1"
    if hide:
        parts = env.get("PYTHONPATH", "").split(os.pathsep)
        env["PYTHONPATH"] = os.pathsep.join(p for p in parts if p.rstrip("/") != hide)
    proc = subprocess.run([sys.executable, "-c", _side_code(side, hide, shape, dtype, repeats)],
                          capture_output=True, text=True, env=env, timeout=1800)  # fmt: skip
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("M2R-RESULT ")), None)
    if proc.returncode != 0 or line is None:
        return {"side": side, "shape": shape, "error": proc.stderr.strip()[-1500:]}
    return json.loads(line.removeprefix("M2R-RESULT "))


def side_order(round_: int) -> tuple[str, ...]:
    """The sides' order in round ``round_``: rotated by one each round, so that no side always
    runs first (a cold machine) or last (a warm or throttled one)."""
    k = round_ % len(SIDES)
    return SIDES[k:] + SIDES[:k]


def merge_rounds(results: list[dict]) -> dict:
    """One side's row from its rounds (each a ``run_side`` row or an error row): every number
    at the top level the median over the rounds that ran (``<key>_rounds``: each round's, in
    order), the rest from the first that ran; an error row only if none ran."""
    ran = [r for r in results if "error" not in r]
    if not ran:
        return results[0]
    row = dict(ran[0])
    for key, value in ran[0].items():
        values = [r.get(key) for r in ran]
        if isinstance(value, (int, float)) and all(isinstance(v, (int, float)) for v in values):
            row[key] = statistics.median(values)
            if len(ran) > 1:
                row[f"{key}_rounds"] = values
    row["rounds"] = len(results)
    if len(ran) < len(results):
        row["rounds_failed"] = [r["error"][-300:] for r in results if "error" in r]
    return row


def run(dtype: str = "bfloat16", shapes=tuple(SHAPES), repeats: int = 3,
        rounds: int = 1) -> list[dict]:  # fmt: skip
    """Every side of every shape, each in its own process; with ``rounds`` > 1 the sides run
    in turns that many times (:func:`side_order`) and each metric is the median of its rounds
    (:func:`merge_rounds`): processes of one side differ by more than the sides do where the
    step is host-bound."""
    real_root = real_mamba_ssm_root()
    rows = []
    for shape in shapes:
        results: dict[str, list[dict]] = {side: [] for side in SIDES}
        for round_ in range(max(1, rounds)):
            for side in side_order(round_):
                if side == "triton" and real_root is None:
                    continue
                t0 = time.perf_counter()
                results[side].append(_spawn(side, shape, dtype, repeats, real_root))
                # progress (a whole run takes minutes): each side's numbers as they come
                print(f"bench model: {shape} {side} (round {round_ + 1}) in "
                      f"{time.perf_counter() - t0:.0f} s: "
                      + json.dumps({k: v for k, v in results[side][-1].items() if k != "launched"}),
                      file=sys.stderr, flush=True)  # fmt: skip
        for side in SIDES:
            if not results[side]:
                rows.append(
                    {"side": side, "shape": shape, "skipped": "no real mamba_ssm importable"}
                )
            else:
                rows.append(merge_rounds(results[side]))
    return rows


METRICS = (
    ("prefill_ms", f"prefill b1 l{PREFILL_TOKENS} (ms)", False),
    *((f"decode_b{b}_tok_s", f"decode b{b} (tok/s)", True) for b in DECODE_BATCHES),
)


def format_table(rows: list[dict]) -> str:
    """One block per shape: each metric per side, and ours' ratio to each other side
    (> 1: ours ahead). Errors, skips and a side that did not run what it claims are shown."""
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        by_side = {r["side"]: r for r in rows if r["shape"] == shape}
        ours = by_side.get("ours", {})
        out.append(f"Mamba2 {shape} (random init, {ours.get('dtype', '?')}, "
                   f"transformers {ours.get('transformers', '?')})")  # fmt: skip
        out.append(f"  {'metric':<26}" + "".join(f"{s:>12}" for s in SIDES)
                   + "".join(f"{'ours/' + s:>13}" for s in SIDES[1:]))  # fmt: skip
        for key, label, higher_better in METRICS:
            cells, ratios = [], []
            for s in SIDES:
                v = by_side.get(s, {}).get(key)
                cells.append(f"{v:>12.1f}" if isinstance(v, (int, float)) else f"{'-':>12}")
            for s in SIDES[1:]:
                a, b = ours.get(key), by_side.get(s, {}).get(key)
                if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a and b:
                    r = a / b if higher_better else b / a
                    ratios.append(f"{r:>12.2f}x")
                else:
                    ratios.append(f"{'-':>13}")
            out.append(f"  {label:<26}" + "".join(cells) + "".join(ratios))
        for b in DECODE_BATCHES:
            for side in SIDES:
                r = by_side.get(side, {})
                tok_s, host = r.get(f"decode_b{b}_tok_s"), r.get(f"decode_b{b}_host_us")
                if not isinstance(tok_s, (int, float)) or not tok_s:
                    continue
                wall = 1e6 * b / tok_s  # a step's time: b tokens
                split = ", ".join(f"{who} {us:.0f}" for who, us in (host or {}).items())
                out.append(f"  {side} decode b{b}: {wall:.0f} µs a step (all layers); host µs a "
                           f"step inside the named ops: {split or 'none called'}")  # fmt: skip
            busy = ours.get(f"decode_b{b}_gpu_busy")
            if isinstance(busy, float):
                out.append(f"  ours decode b{b}: GPU busy {busy:.0%} of wall time "
                           f"(the rest is host time between kernels)")  # fmt: skip
        for s in SIDES:
            r = by_side.get(s, {})
            if "error" in r:
                out.append(f"  {s}: FAILED: {r['error'].splitlines()[-1] if r['error'] else '?'}")
            elif "skipped" in r:
                out.append(f"  {s}: skipped ({r['skipped']})")
            for p in r.get("problems", []):
                out.append(f"  {s}: NOT VALID: {p}")
    return "\n".join(out)
