"""Generation for the Mamba language models (mamba_ssm's ``utils.generation``): the decode
cache ``InferenceParams``, sampling (greedy, top-k, top-p, min-p, temperature, repetition
penalty), ``decode`` and ``GenerationMixin.generate``, and the graph-captured decode step
(``cg=True``: a CUDA graph, which is a HIP graph under ROCm PyTorch, captured once per batch
size and replayed for every token).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from mamba2_rocm.models import _init

__all__ = [
    "DecodingCGCache",
    "GenerationMixin",
    "GenerationOutput",
    "InferenceParams",
    "capture_graph",
    "decode",
    "modify_logit_for_repetition_penalty",
    "modify_logits_for_min_p_filtering",
    "modify_logits_for_top_k_filtering",
    "modify_logits_for_top_p_filtering",
    "sample",
    "update_graph_cache",
]


@dataclass
class InferenceParams:
    """The decode state of one generation: each layer's cache in ``key_value_memory_dict``
    (by ``layer_idx``), the tokens already processed (``seqlen_offset``) and, for graph
    replay, the per-sequence lengths on the device (``lengths_per_sample``)."""

    max_seqlen: int
    max_batch_size: int
    seqlen_offset: int = 0
    batch_size_offset: int = 0
    key_value_memory_dict: dict = field(default_factory=dict)
    lengths_per_sample: Tensor | None = None

    def reset(self, max_seqlen: int, max_batch_size: int) -> None:
        self.max_seqlen, self.max_batch_size = max_seqlen, max_batch_size
        self.seqlen_offset = 0
        if self.lengths_per_sample is not None:
            self.lengths_per_sample.zero_()


@dataclass
class GenerationOutput:
    """What ``generate(..., return_dict_in_generate=True)`` returns: ``sequences`` (batch,
    length) and ``scores`` (one (batch, vocab) tensor a generated token, or None) — the
    fields of transformers' ``GenerateDecoderOnlyOutput`` that mamba_ssm fills."""

    sequences: Tensor
    scores: tuple[Tensor, ...] | None = None


# ---- sampling (each filter works in place on (batch, vocab) logits) --------------------------


def modify_logits_for_top_k_filtering(logits: Tensor, top_k: int) -> None:
    """Keep the ``top_k`` largest logits of each row; the rest become -inf."""
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    logits.masked_fill_(logits < kth, float("-inf"))


def modify_logits_for_top_p_filtering(logits: Tensor, top_p: float) -> None:
    """Keep the smallest set of tokens whose probability reaches ``top_p``; no-op outside (0, 1)."""
    if top_p <= 0.0 or top_p >= 1.0:
        return
    ordered, order = torch.sort(logits, descending=False)
    drop_sorted = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
    logits.masked_fill_(drop_sorted.scatter(1, order, drop_sorted), float("-inf"))


def modify_logits_for_min_p_filtering(logits: Tensor, min_p: float) -> None:
    """Drop tokens whose probability is below ``min_p`` times the row's largest; no-op
    outside (0, 1)."""
    if min_p <= 0.0 or min_p >= 1.0:
        return
    probs = logits.softmax(dim=-1)
    floor = probs.max(dim=-1, keepdim=True).values * min_p
    logits.masked_fill_(probs < floor, float("-inf"))


def modify_logit_for_repetition_penalty(logits: Tensor, prev_output_tokens: Tensor,
                                        repetition_penalty: float = 1.0) -> Tensor:  # fmt: skip
    """CTRL's penalty (arXiv:1909.05858) on every token already in the sequence: positive
    logits divided by the penalty, negative ones multiplied. In place; returns ``logits``."""
    if repetition_penalty == 1.0:
        return logits
    seen = torch.gather(logits, 1, prev_output_tokens)
    seen = torch.where(seen < 0, seen * repetition_penalty, seen / repetition_penalty)
    logits.scatter_(1, prev_output_tokens, seen)
    return logits


def _check_sampling(top_k: int, top_p: float, min_p: float, temperature: float) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0: no limit, 1: greedy), got {top_k!r}")
    if not 0.0 <= top_p <= 1.0:
        raise ValueError(f"top_p must be in [0, 1], got {top_p!r}")
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {min_p!r}")
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")


def sample(logits: Tensor, top_k: int = 1, top_p: float = 0.0, min_p: float = 0.0,
           temperature: float = 1.0) -> Tensor:  # fmt: skip
    """One token a row of (batch, vocab) logits: the argmax with ``top_k == 1``; otherwise a
    draw after temperature, top-k (0: all tokens), min-p and top-p filtering."""
    _check_sampling(top_k, top_p, min_p, temperature)
    return _draw(logits, top_k, top_p, min_p, temperature)


def _draw(logits: Tensor, top_k: int, top_p: float, min_p: float, temperature: float) -> Tensor:
    """``sample`` on checked arguments (decode checks them once, not every token)."""
    if top_k == 1:
        return logits.argmax(dim=-1)
    scaled = logits.float() / temperature
    if top_k > 0:
        top, index = torch.topk(scaled, min(top_k, scaled.shape[-1]), dim=-1)
    else:
        top, index = scaled.clone(), None
    modify_logits_for_min_p_filtering(top, min_p)
    modify_logits_for_top_p_filtering(top, top_p)
    pick = torch.multinomial(top.softmax(dim=-1), num_samples=1).squeeze(-1)
    if index is None:
        return pick
    return index.gather(-1, pick[:, None]).squeeze(-1)


# ---- decoding ----------------------------------------------------------------------------------


@torch.inference_mode()
def decode(
    input_ids: Tensor, model, max_length: int, top_k: int = 1, top_p: float = 0.0,
    min_p: float = 0.0, temperature: float = 1.0, repetition_penalty: float = 1.0,
    eos_token_id: int | None = None, teacher_outputs: Tensor | None = None,
    vocab_size: int | None = None, cg: bool = False, enable_timing: bool = False,
    output_scores: bool = False, streamer=None,
) -> GenerationOutput:  # fmt: skip
    """Generate from ``input_ids`` (batch, prompt) up to ``max_length`` tokens in all.

    The prompt runs once (prefill), then one token at a time through the models' decode
    step. ``teacher_outputs`` (batch, >= max_length) supplies the tokens instead of sampling
    (for tests). ``cg=True`` replays the decode step as a graph (GPU only). ``streamer``:
    any object with ``put(tokens)`` / ``end()`` (transformers' TextStreamer)."""
    _check_sampling(top_k, top_p, min_p, temperature)
    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise ValueError(
            f"input_ids must be (batch, prompt_len >= 1), got {tuple(input_ids.shape)}"
        )
    batch, prompt = input_ids.shape
    if max_length <= prompt:
        raise ValueError(f"max_length={max_length} must exceed the prompt's {prompt} tokens")
    if streamer is not None:
        streamer.put(input_ids.cpu())
    if cg:
        _require_graphs(model)
        model._decoding_cache = update_graph_cache(
            model, getattr(model, "_decoding_cache", None), batch, prompt, max_length
        )
        params = model._decoding_cache.inference_params
        params.reset(max_length, batch)
    else:
        params = InferenceParams(max_seqlen=max_length, max_batch_size=batch)
    taught = teacher_outputs.shape[1] if teacher_outputs is not None else 0

    def logits_of(tokens: Tensor) -> Tensor:
        if params.seqlen_offset == 0:
            out = model(tokens, inference_params=params, num_last_tokens=1).logits
        else:
            position_ids = torch.full((batch, 1), params.seqlen_offset, dtype=torch.long,
                                      device=tokens.device)  # fmt: skip
            if cg:
                out = model._decoding_cache.run(tokens, position_ids, params.seqlen_offset)
            else:
                out = model(tokens, position_ids=position_ids, inference_params=params,
                            num_last_tokens=1).logits  # fmt: skip
        out = out.squeeze(1)
        return out[..., :vocab_size] if vocab_size is not None else out

    def finished(last: Tensor) -> bool:
        if params.seqlen_offset == 0:
            return False
        if eos_token_id is not None and bool((last == eos_token_id).all()):
            return True
        return params.seqlen_offset >= max_length - 1

    started = time.perf_counter()
    scores, pieces, seen = [], [input_ids], input_ids
    while not finished(pieces[-1]):
        logits = logits_of(pieces[-1])
        if output_scores:
            scores.append(logits.clone())
        params.seqlen_offset += pieces[-1].shape[1]
        if repetition_penalty != 1.0:
            logits = modify_logit_for_repetition_penalty(logits, seen, repetition_penalty)
        if taught > params.seqlen_offset:
            token = teacher_outputs[:, params.seqlen_offset]
        else:
            token = _draw(logits, top_k, top_p, min_p, temperature)
        token = token.unsqueeze(1)
        if repetition_penalty != 1.0:
            seen = torch.cat([seen, token], dim=1)
        pieces.append(token)
        if streamer is not None:
            streamer.put(token.cpu())
    if streamer is not None:
        streamer.end()
    if enable_timing:
        if input_ids.is_cuda:
            torch.cuda.synchronize(input_ids.device)
        print(f"Prompt processing + decoding time: {(time.perf_counter() - started) * 1e3:.0f}ms")
    return GenerationOutput(sequences=torch.cat(pieces, dim=1), scores=tuple(scores))


class GenerationMixin:
    """``generate`` for models with ``forward(input_ids, position_ids=None,
    inference_params=None, num_last_tokens=0)`` and ``allocate_inference_cache``."""

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype=None, **kwargs):
        raise NotImplementedError

    def generate(self, input_ids: Tensor, max_length: int, top_k: int = 1, top_p: float = 0.0,
                 min_p: float = 0.0, temperature: float = 1.0,
                 return_dict_in_generate: bool = False, output_scores: bool = False,
                 **kwargs):  # fmt: skip
        """The sequences (batch, up to max_length), or a ``GenerationOutput`` with
        ``return_dict_in_generate`` (scores only with ``output_scores``). Other keywords go
        to ``decode`` (``cg``, ``teacher_outputs``, ``repetition_penalty``, ``eos_token_id``,
        ``streamer``, ``vocab_size``, ``enable_timing``)."""
        out = decode(input_ids, self, max_length, top_k=top_k, top_p=top_p, min_p=min_p,
                     temperature=temperature, output_scores=output_scores, **kwargs)  # fmt: skip
        if not output_scores:
            out.scores = None
        return out if return_dict_in_generate else out.sequences


# ---- graph-captured decode step -----------------------------------------------------------------


@dataclass
class DecodingCGCache:
    """The captured decode steps of one model: per (batch, tokens) a replay function, the
    states they read and write (``inference_params``), and the graphs' memory pool."""

    max_batch_size: int = 0
    max_seqlen: int = 0
    device: torch.device | None = None
    dtype: torch.dtype | None = None
    callables: dict = field(default_factory=dict)
    mempool: object = None
    inference_params: InferenceParams | None = None
    run: Callable | None = None


def _require_graphs(model) -> None:
    device = next(iter(model.parameters())).device
    if device.type != "cuda":
        raise ValueError(f"cg=True captures the decode step in a CUDA / HIP graph, which needs "
                         f"the model on a GPU; it is on {device}. Use cg=False.")  # fmt: skip


@torch.inference_mode()
def update_graph_cache(model, cache: DecodingCGCache | None, batch_size: int, seqlen_og: int,
                       max_seqlen: int, decoding_seqlens: tuple[int, ...] = (1,), dtype=None,
                       n_warmups: int = 2) -> DecodingCGCache:  # fmt: skip
    """The model's graph cache for this batch size and length: states allocated and steps
    captured anew when the device, dtype, batch size or a longer ``max_seqlen`` asks for it."""
    _require_graphs(model)
    cache = DecodingCGCache() if cache is None else cache
    param = next(iter(model.parameters()))
    device, dtype = param.device, param.dtype if dtype is None else dtype
    if ((device, dtype) != (cache.device, cache.dtype) or batch_size != cache.max_batch_size
            or max_seqlen > cache.max_seqlen):  # fmt: skip
        cache.callables, cache.mempool, cache.inference_params = {}, None, None
        gc.collect()
        cache.device, cache.dtype = device, dtype
        cache.max_batch_size, cache.max_seqlen = batch_size, max_seqlen
        if not hasattr(model, "allocate_inference_cache"):
            raise TypeError("graph decoding needs the model's allocate_inference_cache()")
        states = model.allocate_inference_cache(batch_size, max_seqlen, dtype)
        lengths = torch.full((batch_size,), seqlen_og, dtype=torch.int32, device=device)
        cache.inference_params = InferenceParams(
            max_seqlen=max_seqlen, max_batch_size=batch_size, seqlen_offset=seqlen_og,
            key_value_memory_dict=states, lengths_per_sample=lengths,
        )  # fmt: skip
        cache.mempool = torch.cuda.graphs.graph_pool_handle()
    for tokens in decoding_seqlens:
        if (batch_size, tokens) not in cache.callables:
            cache.callables[batch_size, tokens] = capture_graph(
                model, cache.inference_params, batch_size, max_seqlen, decoding_seqlen=tokens,
                mempool=cache.mempool, n_warmups=n_warmups,
            )  # fmt: skip

    def run(input_ids: Tensor, position_ids: Tensor, seqlen: int) -> Tensor:
        return cache.callables[tuple(input_ids.shape[:2])](input_ids, position_ids, seqlen)

    cache.run = run
    cache.inference_params.seqlen_offset = 0
    return cache


def capture_graph(model, inference_params: InferenceParams, batch_size: int, max_seqlen: int,
                  decoding_seqlen: int = 1, mempool=None, n_warmups: int = 2):  # fmt: skip
    """Capture one decode step of ``decoding_seqlen`` tokens; returns ``run(input_ids,
    position_ids, seqlen) -> logits`` that copies its inputs into the graph's and replays it."""
    device = next(iter(model.parameters())).device
    input_ids = torch.zeros((batch_size, decoding_seqlen), dtype=torch.long, device=device)
    position_ids = torch.zeros((batch_size, decoding_seqlen), dtype=torch.long, device=device)
    saved_offset = inference_params.seqlen_offset
    # any offset > 0 selects the decode path; the real lengths come through lengths_per_sample
    inference_params.seqlen_offset = max_seqlen - decoding_seqlen
    inference_params.lengths_per_sample[:] = inference_params.seqlen_offset

    def step():
        return model(input_ids, position_ids=position_ids, inference_params=inference_params,
                     num_last_tokens=decoding_seqlen).logits  # fmt: skip

    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    # warm-up outside the capture: plans, workspaces, autotuning, the decay launch's table
    with torch.cuda.stream(side), _init.graph_warmup():
        for _ in range(n_warmups):
            step()
        side.synchronize()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=mempool):
        logits = step()

    def run(new_input_ids: Tensor, new_position_ids: Tensor, seqlen: int) -> Tensor:
        inference_params.lengths_per_sample[:] = seqlen
        input_ids.copy_(new_input_ids)
        position_ids.copy_(new_position_ids)
        graph.replay()
        return logits.clone()

    inference_params.seqlen_offset = saved_offset
    return run
