"""The model layer on the kernel tier: MambaLMHeadModel (Mamba1, Mamba2, hybrid with rotary
attention and an MLP) against the same weights on the torch tier (fp32: the conv op takes no
float64) — logits and every parameter's gradient — and generation: graph-captured decode scores equal a full forward,
greedy sequences equal with and without the graph, varlen prefill equals one prompt at a time."""

import copy

import pytest
import torch
from helpers import gpu_available

from mamba2_rocm.bench.timing import backend
from mamba2_rocm.models import MambaConfig, MambaLMHeadModel
from mamba2_rocm.models.generation import InferenceParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not gpu_available(), reason="needs a GPU (run on the device machine)"),
]

DEV = "cuda"
CONFIGS = {
    "mamba1": dict(ssm_cfg={"layer": "Mamba1", "d_state": 16}),
    "mamba2": dict(ssm_cfg={"layer": "Mamba2", "headdim": 32, "d_state": 64, "ngroups": 2,
                            "chunk_size": 64}),
    "hybrid": dict(ssm_cfg={"layer": "Mamba2", "headdim": 32, "d_state": 32, "chunk_size": 64},
                   attn_layer_idx=[1], d_intermediate=256,
                   attn_cfg={"num_heads": 8, "num_heads_kv": 4, "causal": True,
                             "rotary_emb_dim": 16}),
}  # fmt: skip


def _model(name: str, dtype=torch.float32, **over) -> MambaLMHeadModel:
    cfg = MambaConfig(d_model=256, n_layer=3, vocab_size=997, pad_vocab_size_multiple=16,
                      **{**CONFIGS[name], **over})  # fmt: skip
    torch.manual_seed(11)
    return MambaLMHeadModel(cfg, device=DEV, dtype=dtype)


def _tokens(batch: int, seqlen: int, seed: int = 3) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randint(0, 997, (batch, seqlen), device=DEV, generator=g)


def _loss_and_grads(model, x):
    model.zero_grad(set_to_none=True)
    logits = model(x).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                             x[:, 1:].flatten())  # fmt: skip
    loss.backward()
    return logits.detach(), {n: p.grad.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_kernel_tier_matches_the_torch_tier(name):
    """Forward and backward of the whole model, fp32 on the kernels against the torch tier with
    the same weights (fused add+norm and the mixers' fused training paths)."""
    model = _model(name)
    ref = copy.deepcopy(model)
    x = _tokens(2, 151)
    logits, grads = _loss_and_grads(model, x)
    with backend("torch"):
        ref_logits, ref_grads = _loss_and_grads(ref, x)
    scale = ref_logits.abs().max()
    assert (logits - ref_logits).abs().max() <= 2e-3 * scale
    for n, g in grads.items():
        r = ref_grads[n]
        err = (g - r).abs().max() / r.abs().max().clamp_min(1e-12)
        assert err <= 5e-3, (n, float(err))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_graph_decode_scores_equal_a_full_forward(name, dtype):
    model = _model(name, dtype)
    x = _tokens(3, 40)
    with torch.inference_mode():
        full = model(x).logits
    prompt = 17
    out = model.generate(x[:, :prompt], max_length=40, output_scores=True,
                         return_dict_in_generate=True, cg=True, teacher_outputs=x)  # fmt: skip
    scores = torch.stack(out.scores, dim=1)
    assert scores.shape == full[:, prompt - 1 : -1].shape
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    err = (scores.float() - full[:, prompt - 1 : -1].float()).abs().max()
    assert err <= tol * full.float().abs().max(), float(err)
    assert torch.equal(out.sequences, x)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_sequences_with_and_without_the_graph(name):
    model = _model(name)
    prompt = _tokens(2, 9, seed=8)
    eager = model.generate(prompt, max_length=30, cg=False)
    graph = model.generate(prompt, max_length=30, cg=True)
    again = model.generate(prompt, max_length=30, cg=True)  # the captured graph, replayed again
    assert eager.shape == (2, 30)
    assert torch.equal(eager, graph) and torch.equal(graph, again)


def test_varlen_prefill_equals_one_prompt_at_a_time():
    """Mamba2 prefill of packed prompts (seq_idx + cu_seqlens) into InferenceParams, then
    decode, against each prompt decoded alone."""
    model = _model("mamba2")
    lens = [37, 5, 64]
    xs = [_tokens(1, n + 6, seed=20 + i) for i, n in enumerate(lens)]
    alone = [torch.stack(model.generate(x[:, :n], max_length=n + 6, output_scores=True,
                                        return_dict_in_generate=True, teacher_outputs=x).scores, 1)
             for x, n in zip(xs, lens, strict=True)]  # fmt: skip
    packed = torch.cat([x[:, :n] for x, n in zip(xs, lens, strict=True)], dim=1)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEV, dtype=torch.int32)
    seq_idx = torch.repeat_interleave(torch.arange(3, device=DEV, dtype=torch.int32),
                                      torch.tensor(lens, device=DEV))[None]  # fmt: skip
    params = InferenceParams(max_seqlen=128, max_batch_size=3)
    with torch.inference_mode():
        logits = model(packed, inference_params=params, seq_idx=seq_idx, cu_seqlens=cu).logits
        scores = [logits[0, cu[1:] - 1][:, None]]
        for i in range(5):
            params.seqlen_offset += 1
            tok = torch.stack([x[0, n + i] for x, n in zip(xs, lens, strict=True)])[:, None]
            scores.append(model(tok, inference_params=params, num_last_tokens=1).logits)
    got = torch.cat(scores, dim=1)
    want = torch.cat([a[:, :6] for a in alone], dim=0)
    assert (got - want).abs().max() <= 1e-3 * want.abs().max()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_replayed_graph_reads_weights_updated_in_place(name):
    """The decode graph outlives a generate call; weights updated in place afterwards (an
    optimizer step, load_state_dict) are what the next replay reads -- A_log's decay rates
    included -- so graph decode still equals eager decode of the new weights."""
    model = _model(name)
    prompt = _tokens(2, 9, seed=5)
    model.generate(prompt, max_length=30, cg=True)  # captures the step
    callables = dict(model._decoding_cache.callables)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("A_log"):
                p.add_(0.7)
            elif n.endswith("dt_bias") or n.endswith("D"):
                p.mul_(1.5)
    graph = model.generate(prompt, max_length=30, cg=True, output_scores=True,
                           return_dict_in_generate=True)  # fmt: skip
    assert model._decoding_cache.callables == callables  # replayed, not captured again
    eager = model.generate(prompt, max_length=30, cg=False, output_scores=True,
                           return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(graph.sequences, eager.sequences)
    for g, e in zip(graph.scores, eager.scores, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-3, atol=1e-3)
