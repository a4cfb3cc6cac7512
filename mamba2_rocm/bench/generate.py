"""mamba_ssm's model layer, end to end: ``python -m mamba2_rocm bench generate``.

Our ``mamba2_rocm.models.MambaLMHeadModel`` against upstream's
``mamba_ssm.models.mixer_seq_simple.MambaLMHeadModel`` on its Triton path (when a real
mamba_ssm is importable: the "beside upstream" setup, where causal-conv1d's CUDA extension is
not built, so its conv is ours), with the same weights (upstream's model loads our
``state_dict``), random init, at the shapes of state-spaces/mamba2-130m (d_model 768, 24 layers)
and mamba2-1.3b (2048, 48): Mamba2 mixers with headdim 64, d_state 128, RMSNorm, the fp32
residual stream, fused add + norm, tied embeddings.

Measured in one process, each the median of a few repeats (CUDA events around the whole call,
host time included), metric by metric with the two sides taking turns (ours, upstream, ours,
...): a drift of the GPU's clocks or memory rate over a run of several minutes reaches both
sides alike. (Host-bound decode figures of one tree moved by 40% between two runs 15 minutes
apart on an H100: records/bench/20261206T202158Z-*-model.json and its commit's message.)

- prefill: batch 1, 4096 tokens, the last token's logits (as ``generate`` prefills);
- training step: batch 4, 2048 tokens, forward, the cross-entropy of every position and
  backward (no optimizer: its cost is the same on both sides);
- decode: greedy ``generate`` at batch 1 and 16 from a 16-token prompt, with ``cg=True`` (the
  decode step captured once in a graph and replayed) and without; tokens per second are
  ``batch * n / (t(generate n + 1) - t(generate 1))`` (the prefill cancels out), the median
  of that difference over ``DECODE_PAIRS`` pairs timed back to back (``model.per_token_ms``).

Goals (issue #70): prefill and training step ≥ 1.5x upstream, graph decode ≥ 1.2x, eager
decode ≥ 1.5x. ``--breakdown`` adds each side's prefill and training-step device time by
kernel family (ours, GEMM, Triton, PyTorch's own) and the ratio our kernels could reach at
best, against the goal (:mod:`mamba2_rocm.bench.breakdown`).
"""

from __future__ import annotations

import statistics
import sys
import time

from mamba2_rocm.bench.breakdown import format_rows, format_top
from mamba2_rocm.bench.model import (
    DECODE_PAIRS,
    _time_once_ms,
    interleaved_per_token,
    real_mamba_ssm_root,
)

SHAPES = {"130m": dict(d_model=768, n_layer=24), "1.3b": dict(d_model=2048, n_layer=48)}
COMMON = dict(
    vocab_size=50277, d_intermediate=0, rms_norm=True, residual_in_fp32=True, fused_add_norm=True,
    pad_vocab_size_multiple=16, tie_embeddings=True,
    ssm_cfg={"layer": "Mamba2", "d_state": 128, "headdim": 64, "expand": 2, "chunk_size": 256},
)  # fmt: skip
PREFILL = (1, 4096)
TRAIN = (4, 2048)
DECODE_BATCHES = (1, 16)
PROMPT_TOKENS = 16
NEW_TOKENS = 64
SIDES = ("ours", "upstream")
#: (key, label, higher is better, goal of ours / upstream)
METRICS = (
    ("prefill_ms", f"prefill b{PREFILL[0]} l{PREFILL[1]} (ms)", False, 1.5),
    ("train_ms", f"train step b{TRAIN[0]} l{TRAIN[1]} (ms)", False, 1.5),
    *(
        (f"decode_b{b}{cg}_tok_s", f"decode b{b} {name} (tok/s)", True, goal)
        for b in DECODE_BATCHES
        for cg, name, goal in (("_cg", "graph", 1.2), ("", "eager", 1.5))
    ),
)


def config_kwargs(shape: str) -> dict:
    return {**COMMON, **SHAPES[shape], "ssm_cfg": dict(COMMON["ssm_cfg"])}


def _models(torch, shape: str, dtype):
    """Ours, and upstream's with the same weights (None without a real mamba_ssm)."""
    from mamba2_rocm.models import MambaConfig, MambaLMHeadModel

    torch.manual_seed(0)
    ours = MambaLMHeadModel(MambaConfig(**config_kwargs(shape)), device="cuda", dtype=dtype)
    if real_mamba_ssm_root() is None:
        return ours, None
    from mamba_ssm.models.config_mamba import MambaConfig as TheirConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel as Theirs

    theirs = Theirs(TheirConfig(**config_kwargs(shape)), device="cuda", dtype=dtype)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    return ours, theirs


def interleaved(time_ms, sides: dict, repeats: int) -> dict:
    """Each side's median of ``repeats`` timings (``time_ms(fn)``: one timed call), the sides
    taking turns: a clock or thermal drift over the run moves every side alike, not only the
    one that happened to run later."""
    times: dict = {name: [] for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            times[name].append(time_ms(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def _workloads(torch, model, repeats: int) -> dict:
    """The side's callables: key -> (warm-up, timed calls); decode keys time (long, short)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    vocab = model.config.vocab_size

    def ids(b, n):
        return torch.randint(0, vocab, (b, n), device="cuda", generator=g)

    prompt = ids(*PREFILL)

    def prefill():
        with torch.no_grad():
            model(prompt, num_last_tokens=1)

    tokens = ids(TRAIN[0], TRAIN[1] + 1)

    def train():
        model.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), tokens[:, 1:].flatten()
        )
        loss.backward()

    def train_done():  # the gradients freed before the other side runs
        train()
        model.zero_grad(set_to_none=True)

    work = {"prefill_ms": (prefill, prefill), "train_ms": (train, train_done)}
    for b in DECODE_BATCHES:
        start = ids(b, PROMPT_TOKENS)
        for cg in (True, False):

            def gen(n, start=start, cg=cg):
                with torch.no_grad():
                    model.generate(start, max_length=PROMPT_TOKENS + n, cg=cg, top_k=1)

            # warm: graph capture, autotune
            work[f"decode_b{b}{'_cg' if cg else ''}_tok_s"] = (
                lambda gen=gen: gen(NEW_TOKENS + 1),
                (lambda gen=gen: gen(NEW_TOKENS + 1), lambda gen=gen: gen(1)),
            )
    return work


def measure(torch, models: dict, repeats: int) -> dict:
    """Every side's numbers (``models``: side -> model), measured metric by metric with the
    sides taking turns. A side whose warm-up of a metric fails records the error there and
    sits that metric out; the others run."""
    out: dict = {side: {} for side in models}
    works = {side: _workloads(torch, model, repeats) for side, model in models.items()}
    time_ms = _time_once_ms(torch)
    for key in works[next(iter(works))]:
        ready = {}
        for side, work in works.items():
            warm, timed = work[key]
            try:
                warm()
                ready[side] = timed
            except Exception as exc:  # this side cannot run this measurement
                out[side][f"{key}_error"] = f"{type(exc).__name__}: {exc}"[:300]
            torch.cuda.empty_cache()
        if not ready:
            continue
        t0 = time.perf_counter()
        try:
            if key.endswith("_tok_s"):
                steps = interleaved_per_token(time_ms, ready, NEW_TOKENS,
                                              max(repeats, DECODE_PAIRS))  # fmt: skip
                batch = int(key.split("_")[1][1:])
                for side, step in steps.items():
                    out[side][key] = batch / (step / 1e3)
            else:
                for side, ms in interleaved(time_ms, ready, repeats).items():
                    out[side][key] = ms
        except Exception as exc:  # a failure mid-run: every side that took part records it
            for side in ready:
                out[side][f"{key}_error"] = f"{type(exc).__name__}: {exc}"[:300]
        for model in models.values():  # (the training step's gradients)
            model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        print(f"bench generate: {key} ({', '.join(ready)}) in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr, flush=True)  # fmt: skip
    return out


#: the metrics ``--breakdown`` profiles (device time by kernel family); a decode metric's
#: profile is one generate call of NEW_TOKENS (its prompt's prefill included), graph replays
#: traced kernel by kernel
BREAKDOWN_KEYS = ("prefill_ms", "train_ms", f"decode_b{DECODE_BATCHES[-1]}_cg_tok_s")


def breakdowns(torch, models: dict, repeats: int) -> dict:
    """``{side: {key_breakdown: {family: device µs}}}`` for :data:`BREAKDOWN_KEYS`: one
    profiled call of each side's workload after its warm-up (see
    :mod:`mamba2_rocm.bench.breakdown`)."""
    from mamba2_rocm.bench.breakdown import by_family, profile_kernels, top_kernels

    out: dict = {side: {} for side in models}
    for side, model in models.items():
        work = _workloads(torch, model, repeats)
        for key in BREAKDOWN_KEYS:
            warm, timed = work[key]
            if isinstance(timed, tuple):  # a decode metric: (long, short) calls
                timed = timed[0]
            try:
                warm()
                kernels = profile_kernels(torch, timed)
                out[side][f"{key}_breakdown"] = by_family(kernels)
                out[side][f"{key}_kernels"] = top_kernels(kernels)
            except Exception as exc:  # recorded; the timed metrics stand
                out[side][f"{key}_breakdown_error"] = f"{type(exc).__name__}: {exc}"[:300]
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
    return out


def run(dtype: str = "bfloat16", shapes=tuple(SHAPES), repeats: int = 3,
        breakdown: bool = False) -> list[dict]:  # fmt: skip
    import torch

    dt = getattr(torch, dtype)
    rows = []
    for shape in shapes:
        ours, theirs = _models(torch, shape, dt)
        models = {side: m for side, m in zip(SIDES, (ours, theirs), strict=True) if m is not None}
        results = measure(torch, models, repeats)
        if breakdown:
            for side, extra in breakdowns(torch, models, repeats).items():
                results[side].update(extra)
        for side, model in zip(SIDES, (ours, theirs), strict=True):
            row = {"shape": shape, "side": side, "dtype": dtype}
            if model is None:
                row["skipped"] = "no real mamba_ssm importable (run it beside upstream)"
            else:
                row.update(results[side])
            rows.append(row)
        del ours, theirs, models
        torch.cuda.empty_cache()
    return rows


def format_table(rows: list[dict]) -> str:
    """One block per shape: each metric for ours and upstream, the ratio (> 1: ours ahead)
    and the goal; then errors and skips."""
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        by = {r["side"]: r for r in rows if r["shape"] == shape}
        ours, up = by.get("ours", {}), by.get("upstream", {})
        out.append(f"MambaLMHeadModel {shape} (Mamba2, random init, {ours.get('dtype', '?')}): "
                   f"ours vs upstream mamba_ssm (Triton; our conv)")  # fmt: skip
        out.append(f"  {'metric':<30}{'ours':>10}{'upstream':>10}{'ours/up':>9}{'goal':>7}")
        for key, label, higher, goal in METRICS:
            a, b = ours.get(key), up.get(key)
            cells = "".join(f"{v:>10.1f}" if isinstance(v, float) else f"{'-':>10}" for v in (a, b))
            ratio = "-"
            if isinstance(a, float) and isinstance(b, float) and a > 0 and b > 0:
                ratio = f"{(a / b if higher else b / a):.2f}x"
            out.append(f"  {label:<30}{cells}{ratio:>9}{goal:>6.1f}x")
        for key, label, _higher, goal in METRICS:
            a, b = ours.get(f"{key}_breakdown"), up.get(f"{key}_breakdown")
            if isinstance(a, dict) and isinstance(b, dict):
                out.extend(format_rows(label, a, b, goal))
                for side, r in (("ours", ours), ("upstream", up)):
                    if isinstance(r.get(f"{key}_kernels"), list):
                        out.extend(format_top(side, r[f"{key}_kernels"]))
        for side, r in (("ours", ours), ("upstream", up)):
            if "skipped" in r:
                out.append(f"  {side}: skipped ({r['skipped']})")
            for k, v in r.items():
                if k.endswith("_error"):
                    out.append(f"  {side} {k[:-6]}: FAILED: {v}")
    return "\n".join(out)
