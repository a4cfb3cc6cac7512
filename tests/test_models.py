"""The model layer on the CPU (torch tier): structural parity with mamba_ssm (state_dict keys,
shapes and seeded weights recorded from upstream's own modules), the checkpoint format,
forward / backward / generate, the modules' alternative paths against each other, and the
errors a user meets."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import mamba2_rocm.models as models
from mamba2_rocm.models import Mamba, Mamba2, MambaConfig, MambaLMHeadModel
from mamba2_rocm.models.generation import (
    InferenceParams,
    modify_logit_for_repetition_penalty,
    modify_logits_for_min_p_filtering,
    modify_logits_for_top_k_filtering,
    modify_logits_for_top_p_filtering,
    sample,
)

REPO = Path(__file__).resolve().parents[1]
RECORD = json.loads((REPO / "tests" / "data" / "upstream_state_dicts.json").read_text())
sys.path.insert(0, str(REPO / "scripts"))
from upstream_state_dicts import SEED, build, weights_digest  # noqa: E402

sys.path.remove(str(REPO / "scripts"))


@pytest.mark.parametrize("name", sorted(RECORD["models"]))
def test_state_dict_matches_upstream(name):
    """Every key and shape of upstream's module built the same way (checkpoints load with
    strict=True); at the record's seed, the same weights too (same draws in the same order)."""
    rec = RECORD["models"][name]
    torch.manual_seed(SEED)
    sd = build(rec["kind"], rec["kwargs"], models).state_dict()
    assert {k: list(v.shape) for k, v in sd.items()} == rec["state_dict"]
    if torch.__version__ == RECORD["torch"]:  # the CPU generator's draws are torch's
        assert weights_digest(sd) == rec["seeded_weights_sha256"]


def _config(layer: str, **over) -> MambaConfig:
    ssm = {"Mamba1": {"layer": "Mamba1", "d_state": 8},
           "Mamba2": {"layer": "Mamba2", "headdim": 16, "d_state": 16, "ngroups": 2,
                      "chunk_size": 16}}[layer]  # fmt: skip
    kw = dict(d_model=64, n_layer=2, vocab_size=101, ssm_cfg=ssm, pad_vocab_size_multiple=8)
    kw.update(over)
    return MambaConfig(**kw)


HYBRID = dict(attn_layer_idx=[1], d_intermediate=80,
              attn_cfg={"num_heads": 4, "num_heads_kv": 2, "causal": True, "rotary_emb_dim": 8,
                        "d_conv": 3, "mlp_dim": 32})  # fmt: skip
CASES = {
    "mamba1": ("Mamba1", {}),
    "mamba2": ("Mamba2", {}),
    "hybrid": ("Mamba2", HYBRID),
    "unfused-layernorm": ("Mamba1", {"fused_add_norm": False, "rms_norm": False,
                                     "residual_in_fp32": False}),
}  # fmt: skip


def _model(case: str, dtype=torch.float32) -> MambaLMHeadModel:
    layer, over = CASES[case]
    torch.manual_seed(4)
    return MambaLMHeadModel(_config(layer, **over), dtype=dtype)


def _tokens(batch, seqlen, seed=0):
    return torch.randint(0, 101, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", sorted(CASES))
def test_generate_scores_equal_a_full_forward(case):
    """Prefill then one token at a time through the decode caches (conv, SSM, KV with rotary
    offsets) gives the logits of one forward over the whole sequence."""
    model = _model(case)
    x = _tokens(3, 23)
    full = model(x).logits
    out = model.generate(x[:, :9], max_length=23, output_scores=True, return_dict_in_generate=True,
                         teacher_outputs=x)  # fmt: skip
    assert torch.equal(out.sequences, x)
    assert len(out.scores) == 14
    torch.testing.assert_close(torch.stack(out.scores, 1), full[:, 8:-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", sorted(CASES))
def test_backward_reaches_every_parameter(case):
    model = _model(case, torch.float32)
    x = _tokens(2, 17)
    logits = model(x).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten()).backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
        assert p.grad.abs().max() > 0, n


def test_fused_and_unfused_add_norm_agree():
    a = _model("mamba2")
    cfg = _config("Mamba2", fused_add_norm=False)
    b = MambaLMHeadModel(cfg, dtype=torch.float32)
    b.load_state_dict(a.state_dict(), strict=True)
    x = _tokens(2, 19)
    torch.testing.assert_close(a(x).logits, b(x).logits, rtol=1e-5, atol=1e-5)


def test_mamba2_paths_agree():
    """Mamba2's fused training path, its unfused path and step decoding give the same output;
    D per channel and the MLP half (d_ssm < d_inner) included."""
    torch.manual_seed(1)
    fused = Mamba2(48, d_state=8, headdim=16, d_ssm=64, D_has_hdim=True, ngroups=2,
                   chunk_size=16, layer_idx=0, dtype=torch.float32)  # fmt: skip
    unfused = Mamba2(48, d_state=8, headdim=16, d_ssm=64, D_has_hdim=True, ngroups=2,
                     chunk_size=16, layer_idx=0, use_mem_eff_path=False, dtype=torch.float32)  # fmt: skip
    unfused.load_state_dict(fused.state_dict())
    u = torch.randn(2, 21, 48, dtype=torch.float32)
    want = fused(u)
    torch.testing.assert_close(unfused(u), want, rtol=1e-4, atol=1e-5)
    params = InferenceParams(max_seqlen=32, max_batch_size=2)
    steps = [fused(u[:, :5], inference_params=params)]
    for t in range(5, 21):
        params.seqlen_offset = t
        steps.append(fused(u[:, t : t + 1], inference_params=params))
    torch.testing.assert_close(torch.cat(steps, 1), want, rtol=1e-4, atol=1e-5)


def test_mamba2_sequence_parallel_layout():
    """u as (batch * seqlen, d_model) with ``seqlen`` given: the same rows as (batch, seqlen)."""
    torch.manual_seed(2)
    m = Mamba2(32, d_state=8, headdim=16, chunk_size=16, dtype=torch.float32)
    u = torch.randn(3, 11, 32, dtype=torch.float32)
    torch.testing.assert_close(
        m(u.reshape(33, 32), seqlen=11), m(u).reshape(33, 32), rtol=1e-5, atol=1e-6
    )


def test_mamba2_varlen_prefill_equals_each_sequence():
    """Packed prompts (seq_idx + cu_seqlens) prefilled into InferenceParams leave each
    sequence's conv and SSM states, as prefilling each alone does."""
    torch.manual_seed(3)
    m = Mamba2(32, d_state=8, headdim=16, chunk_size=16, layer_idx=0, use_mem_eff_path=False,
               dtype=torch.float32)  # fmt: skip
    lens = [7, 2, 12]
    xs = [torch.randn(1, n, 32, dtype=torch.float32) for n in lens]
    cu = torch.tensor([0, 7, 9, 21], dtype=torch.int32)
    seq_idx = torch.repeat_interleave(torch.arange(3, dtype=torch.int32), torch.tensor(lens))[None]
    params = InferenceParams(max_seqlen=32, max_batch_size=3)
    m(torch.cat(xs, 1), inference_params=params, seq_idx=seq_idx, cu_seqlens=cu)
    conv, ssm = params.key_value_memory_dict[0]
    for i, x in enumerate(xs):
        alone = InferenceParams(max_seqlen=32, max_batch_size=1)
        m(x, inference_params=alone)
        c, s = alone.key_value_memory_dict[0]
        torch.testing.assert_close(conv[i], c[0])
        torch.testing.assert_close(ssm[i], s[0], rtol=1e-4, atol=1e-5)


def test_mamba1_fast_and_slow_paths_agree():
    torch.manual_seed(5)
    fast = Mamba(32, d_state=8, bias=True, dtype=torch.float32)
    slow = Mamba(32, d_state=8, bias=True, use_fast_path=False, dtype=torch.float32)
    slow.load_state_dict(fast.state_dict())
    u = torch.randn(2, 13, 32, dtype=torch.float32)
    torch.testing.assert_close(slow(u), fast(u), rtol=1e-4, atol=1e-5)


def test_checkpoint_round_trip(tmp_path):
    """save_pretrained writes upstream's format (config.json + pytorch_model.bin);
    from_pretrained reads it back strictly, in another dtype when asked."""
    model = _model("hybrid", torch.float32)
    model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "pytorch_model.bin"]
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["attn_layer_idx"] == [1] and cfg["ssm_cfg"]["layer"] == "Mamba2"
    again = MambaLMHeadModel.from_pretrained(str(tmp_path))
    x = _tokens(1, 11)
    torch.testing.assert_close(again(x).logits, model(x).logits, rtol=0, atol=0)
    half = MambaLMHeadModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert half.lm_head.weight.dtype == torch.bfloat16


def test_mismatched_checkpoint_is_refused(tmp_path):
    _model("mamba2", torch.float32).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["d_model"] = 32
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RuntimeError, match="size mismatch"):
        MambaLMHeadModel.from_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").unlink()
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin not found"):
        MambaLMHeadModel.from_pretrained(tmp_path)


def test_bad_configurations_say_what_is_wrong():
    with pytest.raises(NotImplementedError, match="Mamba3"):
        MambaLMHeadModel(_config("Mamba2", ssm_cfg={"layer": "Mamba3"}))
    with pytest.raises(ValueError, match="unknown ssm_cfg layer 'Mamba4'"):
        MambaLMHeadModel(_config("Mamba2", ssm_cfg={"layer": "Mamba4"}))
    with pytest.raises(ValueError, match="multiple of headdim"):
        Mamba2(48, headdim=40)
    with pytest.raises(ValueError, match="num_heads=6 must be a multiple of num_heads_kv=4"):
        models.MHA(48, 6, num_heads_kv=4)
    with pytest.raises(ValueError, match="needs a layer_idx"):
        Mamba2(32, d_state=8, headdim=16)(torch.randn(1, 3, 32),
                                          inference_params=InferenceParams(8, 1))  # fmt: skip


def test_graph_decoding_needs_a_gpu():
    model = _model("mamba2", torch.float32)
    with pytest.raises(ValueError, match="cg=True captures the decode step .* it is on cpu"):
        model.generate(_tokens(1, 4), max_length=8, cg=True)


@pytest.mark.parametrize("kwargs, match", [
    ({"top_k": -1}, "top_k must be an int >= 0"), ({"top_p": 1.5}, "top_p must be in"),
    ({"min_p": -0.1}, "min_p must be in"), ({"temperature": 0.0}, "temperature must be > 0"),
])  # fmt: skip
def test_bad_sampling_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _model("mamba1", torch.float32).generate(_tokens(1, 4), max_length=8, **kwargs)


def test_generation_stops_at_eos_and_streams():
    model = _model("mamba1", torch.float32)
    prompt = _tokens(2, 5)
    greedy = model.generate(prompt, max_length=12)
    eos = int(greedy[0, 6])
    seen = []

    class Streamer:
        def put(self, t):
            seen.append(t.clone())

        def end(self):
            seen.append(None)

    out = model.generate(prompt[:1], max_length=12, eos_token_id=eos, streamer=Streamer())
    assert out.shape[1] <= 7 and int(out[0, -1]) == eos
    assert seen[-1] is None and torch.equal(torch.cat(seen[:-1], 1), out)


def test_sampling_filters():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    t = logits.clone()
    modify_logits_for_top_k_filtering(t, 2)
    assert torch.isinf(t).tolist() == [[True, False, False, True]]
    t = logits.clone()
    modify_logits_for_top_p_filtering(t, 0.6)  # softmax: 0.09, 0.67, 0.24, 0.03
    assert torch.isinf(t).tolist() == [[True, False, True, True]]
    t = logits.clone()
    modify_logits_for_min_p_filtering(t, 0.3)  # keep p >= 0.3 * 0.67
    assert torch.isinf(t).tolist() == [[True, False, False, True]]
    t = torch.tensor([[2.0, -2.0, 1.0]])
    modify_logit_for_repetition_penalty(t, torch.tensor([[0, 1]]), 2.0)
    assert t.tolist() == [[1.0, -4.0, 1.0]]
    assert sample(logits, top_k=1).tolist() == [1]
    torch.manual_seed(0)
    draws = {int(sample(logits, top_k=2, temperature=0.5)) for _ in range(50)}
    assert draws == {1, 2}
    draws = {int(sample(logits, top_k=0, top_p=0.6)) for _ in range(20)}
    assert draws == {1}


def test_decay_rates_are_cached_for_decoding_only():
    """decay_rates: -exp(A_log) computed once while no gradient can flow (decode steps), again
    after A_log changes in place (load_state_dict), never cached while A_log trains."""
    from mamba2_rocm.models._init import decay_rates
    from mamba2_rocm.models.mamba2 import Mamba2

    m = Mamba2(64, d_state=16, headdim=16)
    with torch.no_grad():
        a = decay_rates(m)
        assert decay_rates(m) is a
        torch.testing.assert_close(a, -torch.exp(m.A_log.float()))
        m.load_state_dict({**m.state_dict(), "A_log": m.A_log.detach() + 1.0})
        b = decay_rates(m)
        assert b is not a
        torch.testing.assert_close(b, -torch.exp(m.A_log.float()))
    trained = decay_rates(m)
    assert trained.requires_grad and trained is not b


def test_decay_rates_inside_a_graph_capture_are_computed_in_the_graph(monkeypatch):
    """While a graph is captured, decay_rates keeps nothing: the graph computes the rates from
    A_log at every replay (a kept tensor would be replayed stale after an in-place update)."""
    from mamba2_rocm.models import _init
    from mamba2_rocm.models.mamba2 import Mamba2

    m = Mamba2(64, d_state=16, headdim=16)
    monkeypatch.setattr(_init, "_capturing", lambda t: True)
    with torch.no_grad():
        a, b = _init.decay_rates(m), _init.decay_rates(m)
    assert a is not b and "_decay_rates" not in m.__dict__
    torch.testing.assert_close(a, -torch.exp(m.A_log.float()))


def test_amp_decorators_and_determinism_switch(monkeypatch):
    """mamba_ssm.utils.torch's decorators, bare and with keywords, on an autograd.Function;
    mamba_ssm.utils.determinism's switch: override, then MAMBA_DETERMINISTIC, then torch's."""
    from mamba2_rocm.models import compat

    class Double(torch.autograd.Function):
        @staticmethod
        @compat.custom_fwd(cast_inputs=torch.float32)
        def forward(ctx, x):
            return x * 2

        @staticmethod
        @compat.custom_bwd
        def backward(ctx, g):
            return g * 2

    x = torch.ones(3, requires_grad=True)
    Double.apply(x).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))

    monkeypatch.delenv("MAMBA_DETERMINISTIC", raising=False)
    assert compat.use_deterministic_mode() is torch.are_deterministic_algorithms_enabled()
    monkeypatch.setenv("MAMBA_DETERMINISTIC", "1")
    assert compat.use_deterministic_mode() is True
    compat.set_deterministic_mode(False)
    try:
        assert compat.use_deterministic_mode() is False
        with pytest.raises(TypeError, match="True, False or None"):
            compat.set_deterministic_mode("yes")
    finally:
        compat.set_deterministic_mode(None)
    assert compat.use_deterministic_mode() is True
