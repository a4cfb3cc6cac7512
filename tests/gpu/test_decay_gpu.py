"""m2r_decay_rates (csrc/decay.hip) on the GPU: every layer's -exp(A_log) from one launch, the
same bits as torch's, and a graph decode that takes its rates from it."""

import pytest
import torch
from helpers import gpu_available, poison_allocator

from mamba2_rocm.ops import decay as ops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs a GPU")]
DEV = "cuda"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rates_are_torchs_bits(dtype):
    g = torch.Generator(device=DEV).manual_seed(2)
    shapes = [(64,), (1536, 16), (7,), (300,)]  # Mamba2 heads, Mamba1 (d_inner, d_state), odd
    a_logs = [(torch.randn(*s, device=DEV, generator=g) * 3).to(dtype) for s in shapes]
    a_logs[2][0] = 90.0  # exp overflows to inf: -inf, as torch's
    ops.clear_tables()
    assert ops.prepare(a_logs)
    poison_allocator(4 * sum(a.numel() for a in a_logs))
    with torch.no_grad():
        rates = ops.decay_rates_of(a_logs)
    torch.cuda.synchronize()
    for a, r in zip(a_logs, rates, strict=True):
        assert torch.equal(r, -torch.exp(a.float())), (dtype, a.shape)


def test_a_captured_step_makes_one_launch_for_every_layer(monkeypatch):
    """A Mamba2 LM's graph decode: the captured step launches m2r_decay_rates once (not per
    layer), and its scores equal eager decode's."""
    from mamba2_rocm.models import MambaConfig, MambaLMHeadModel

    launched = []
    real = ops.launch
    monkeypatch.setattr(ops, "launch", lambda *a: launched.append(a[0].name) or real(*a))
    torch.manual_seed(0)
    cfg = MambaConfig(d_model=256, n_layer=4, vocab_size=512,
                      ssm_cfg={"layer": "Mamba2", "headdim": 32, "d_state": 64})  # fmt: skip
    model = MambaLMHeadModel(cfg, device=DEV, dtype=torch.float32).eval()
    ids = torch.randint(0, 512, (2, 7), device=DEV)
    graph = model.generate(ids, max_length=15, cg=True, top_k=1, output_scores=True,
                           return_dict_in_generate=True)  # fmt: skip
    assert launched.count("m2r_decay_rates") == 1  # the capture; replays run no Python
    eager = model.generate(ids, max_length=15, cg=False, top_k=1, output_scores=True,
                           return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(graph.sequences, eager.sequences)
    for a, b in zip(graph.scores, eager.scores, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
