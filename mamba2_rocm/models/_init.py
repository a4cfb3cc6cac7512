"""Parameter initializations the Mamba mixers share (mamba_ssm's, in its order of random draws,
so a seed gives the same weights as upstream's modules)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch


def dt_bias_init(n: int, dt_min: float, dt_max: float, dt_init_floor: float, device=None,
                 dtype=None) -> torch.Tensor:  # fmt: skip
    """A bias whose softplus is log-uniform in [dt_min, dt_max] (at least ``dt_init_floor``):
    softplus's inverse of such a draw."""
    if not 0 < dt_min <= dt_max:
        raise ValueError(f"need 0 < dt_min <= dt_max, got dt_min={dt_min}, dt_max={dt_max}")
    u = torch.rand(n, device=device, dtype=dtype)
    dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = dt.clamp(min=dt_init_floor)
    return dt + torch.log(-torch.expm1(-dt))


def a_log_init(n: int, a_range: tuple[float, float], device=None, dtype=None) -> torch.Tensor:
    """log(A) for A uniform in ``a_range`` (Mamba2's scalar-per-head decay)."""
    lo, hi = a_range
    if not 0 < lo <= hi:
        raise ValueError(f"A_init_range must be (low, high) with 0 < low <= high, got {a_range}")
    a = torch.empty(n, dtype=torch.float32, device=device).uniform_(lo, hi)
    return torch.log(a).to(dtype=dtype)


def no_weight_decay(*params: torch.nn.Parameter) -> None:
    """Mark parameters the way mamba_ssm's optimizer grouping reads (``_no_weight_decay``)."""
    for p in params:
        p._no_weight_decay = True


def layer_states(module, inference_params, make, initialize_states: bool = False):
    """The mixer's decode states in ``inference_params`` (made by ``make()`` on first use,
    zeroed with ``initialize_states``), keyed by the module's ``layer_idx``."""
    if module.layer_idx is None:
        raise ValueError(f"{type(module).__name__} needs a layer_idx to keep its states in "
                         "InferenceParams")  # fmt: skip
    cache = inference_params.key_value_memory_dict
    if module.layer_idx not in cache:
        cache[module.layer_idx] = make()
    elif initialize_states:
        for t in cache[module.layer_idx]:
            t.zero_()
    return cache[module.layer_idx]


#: set by :func:`graph_warmup` (a decode graph's warm-up steps, before its capture)
_GRAPH_WARMUP: ContextVar[bool] = ContextVar("m2r_graph_warmup", default=False)


@contextmanager
def graph_warmup() -> Iterator[None]:
    """Around the eager steps that warm a decode graph up before its capture (see
    ``generation.capture_graph``): what the captured step will need prepared outside the
    capture is prepared then, and only then, so that a plain eager step pays nothing for it."""
    token = _GRAPH_WARMUP.set(True)
    try:
        yield
    finally:
        _GRAPH_WARMUP.reset(token)


def _stream_capturing() -> bool:
    """Whether a CUDA / HIP graph is being captured on the current device's current stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _capturing(t: torch.Tensor) -> bool:
    """Whether a CUDA / HIP graph is being captured on ``t``'s device's current stream."""
    return t.is_cuda and _stream_capturing()


def decay_rates(module) -> torch.Tensor:
    """``-exp(A_log)`` in fp32 (an fp16 A_log would overflow to -inf). Where no gradient can flow
    to A_log (decoding under no_grad / inference_mode) the result is kept on the module and
    reused while A_log is the same tensor at the same version (an in-place update, as
    ``load_state_dict`` makes, recomputes it): a decode step otherwise launches the two small
    kernels of this line in every layer for every token.

    Not while a CUDA / HIP graph is captured: the graph would read the kept tensor on every
    replay, also after A_log is updated in place (an optimizer step, ``load_state_dict``; the
    decode graphs outlive ``generate`` calls), and decode with stale rates. There the rates are
    computed inside the graph, from A_log as it is at each replay."""
    a_log = module.A_log
    if torch.is_grad_enabled() and a_log.requires_grad:
        return -torch.exp(a_log.float())
    if _capturing(a_log):  # (the whole model's, from one launch: step_decay_rates)
        step = module.__dict__.get("_step_decay_rates")
        return step if step is not None else -torch.exp(a_log.float())
    key = (a_log.data_ptr(), a_log._version, a_log.device, torch.is_inference_mode_enabled())
    cached = module.__dict__.get("_decay_rates")
    if cached is None or cached[0] != key:
        cached = (key, -torch.exp(a_log.float()))
        module.__dict__["_decay_rates"] = cached
    return cached[1]


@contextmanager
def step_decay_rates(layers, inference_params) -> Iterator[None]:
    """Around one decode step of a whole model (``layers``: its blocks). Inside a graph capture
    every mixer's decay rates come from one launch (:mod:`mamba2_rocm.ops.decay`), handed out by
    :func:`decay_rates` for this step, where per layer they are two small kernels each; outside
    a capture the launch's table is prepared during a graph's warm-up (:func:`graph_warmup`), and
    a plain eager step does nothing here. Anything the launch does not take is left to
    :func:`decay_rates`."""
    if inference_params is None or inference_params.seqlen_offset <= 0:
        yield
        return
    warming = _GRAPH_WARMUP.get()
    mixers = []
    if warming or _stream_capturing():
        mixers = [b.mixer for b in layers
                  if isinstance(getattr(b.mixer, "A_log", None), torch.Tensor)]  # fmt: skip
    rates = None
    if mixers:
        from mamba2_rocm.ops import decay as decay_ops

        a_logs = [m.A_log for m in mixers]
        if not _capturing(a_logs[0]):
            decay_ops.prepare(a_logs)  # (warming: the capture follows)
        else:
            rates = decay_ops.decay_rates_of(a_logs)
    if rates is None:
        yield
        return
    for m, r in zip(mixers, rates, strict=True):
        m.__dict__["_step_decay_rates"] = r
    try:
        yield
    finally:
        for m in mixers:
            m.__dict__.pop("_step_decay_rates", None)
