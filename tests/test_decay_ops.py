"""ops.decay (mamba2_rocm/ops/decay.py): a model's decay rates from one launch, what the launch
is told, and when it is not made. The kernel tier is stood in for on the CPU (launches
recorded); tests/gpu/test_models_gpu.py runs the kernel."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from helpers import stand_in_kernels  # noqa: E402

from mamba2_rocm.kernels import SOURCES  # noqa: E402
from mamba2_rocm.ops import decay as ops  # noqa: E402
from mamba2_rocm.params import DecayParams  # noqa: E402


@pytest.fixture
def fake_kernels(monkeypatch):
    ops.clear_tables()
    kset = stand_in_kernels(monkeypatch, ops)
    yield kset
    ops.clear_tables()


def _a_logs(dtype=torch.float32, shapes=((24,), (24,), (24,))):
    return [torch.nn.Parameter(torch.randn(*s).to(dtype), requires_grad=True) for s in shapes]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_one_launch_over_a_table_built_beforehand(dtype, fake_kernels):
    a_logs = _a_logs(dtype, shapes=((24,), (1536, 16), (7,)))
    with torch.no_grad():
        assert ops.decay_rates_of(a_logs) is None  # no table yet: the caller goes per layer
        assert ops.prepare(a_logs) and fake_kernels.launches == []
        rates = ops.decay_rates_of(a_logs)
    ((name, params, grid),) = fake_kernels.launches
    assert name == "m2r_decay_rates" and grid == (3, 1, 1)
    assert fake_kernels.blocks == [(ops.THREADS, 1, 1)]
    f = dict(zip([n for n, _ in DecayParams._fields_], params, strict=True))
    assert f["layers"] == 3 and f["a_dtype"] == {torch.float32: 0, torch.float16: 1,
                                                 torch.bfloat16: 2}[dtype]  # fmt: skip
    table, total = next(iter(ops._TABLES.values()))
    assert f["table"] == table.data_ptr() and total == 24 + 1536 * 16 + 7
    assert table.tolist() == [[a_logs[0].data_ptr(), 24, 0],
                              [a_logs[1].data_ptr(), 1536 * 16, 24],
                              [a_logs[2].data_ptr(), 7, 24 + 1536 * 16]]  # fmt: skip
    assert [r.shape for r in rates] == [a.shape for a in a_logs]
    assert all(r.dtype == torch.float32 for r in rates)
    base = rates[0].data_ptr()
    assert f["out"] == base and rates[1].data_ptr() == base + 4 * 24
    assert rates[2].data_ptr() == base + 4 * (24 + 1536 * 16)


def test_calls_the_kernel_does_not_take(fake_kernels):
    a_logs = _a_logs()
    assert ops.prepare(a_logs)
    assert ops.decay_rates_of(a_logs) is None  # a gradient to record (grad mode on)
    with torch.no_grad():
        assert ops.prepare([*a_logs[:2], a_logs[2].double()]) is False  # mixed dtypes
        assert ops.prepare([torch.randn(4, 6).t()]) is False  # not contiguous
        assert ops.prepare([torch.randn(4).double()]) is False  # no float64 kernel
        assert ops.prepare([]) is False and ops.prepare([torch.empty(0)]) is False
        moved = [a.detach().clone() for a in a_logs]  # other addresses: another table
        assert ops.decay_rates_of(moved) is None
    assert fake_kernels.launches == []


def test_off_the_kernel_tier_nothing_is_prepared_or_launched():
    ops.clear_tables()
    a_logs = _a_logs()
    with torch.no_grad():
        assert ops.prepare(a_logs) is False and ops.decay_rates_of(a_logs) is None
    assert "m2r_decay_rates" in SOURCES["decay"].kernels


def test_a_captured_decode_step_hands_each_mixer_its_rates(monkeypatch, fake_kernels):
    """MixerModel's decode step: a plain eager step does nothing; a graph's warm-up prepares the
    table and decay_rates keeps its own; inside a capture one launch serves every mixer, and
    the step's views are gone afterwards."""
    from mamba2_rocm.models import MambaConfig, MambaLMHeadModel, _init
    from mamba2_rocm.models.generation import InferenceParams

    cfg = MambaConfig(d_model=64, n_layer=3, vocab_size=64,
                      ssm_cfg={"layer": "Mamba2", "headdim": 16, "d_state": 16})  # fmt: skip
    model = MambaLMHeadModel(cfg).eval()
    mixers = [b.mixer for b in model.backbone.layers]
    params = InferenceParams(max_seqlen=8, max_batch_size=1)
    params.seqlen_offset = 3
    with torch.no_grad(), _init.step_decay_rates(model.backbone.layers, params):
        pass  # a plain eager step: no table, nothing launched
    assert ops._TABLES == {} and fake_kernels.launches == []
    with torch.no_grad(), _init.graph_warmup(), _init.step_decay_rates(model.backbone.layers,
                                                                          params):  # fmt: skip
        pass  # a graph's warm-up: the table is made, nothing launched
    assert len(ops._TABLES) == 1 and fake_kernels.launches == []
    assert not _init._GRAPH_WARMUP.get()
    monkeypatch.setattr(_init, "_capturing", lambda t: True)
    monkeypatch.setattr(_init, "_stream_capturing", lambda: True)
    seen = []
    with torch.no_grad(), _init.step_decay_rates(model.backbone.layers, params):
        seen = [_init.decay_rates(m) for m in mixers]
    assert len(fake_kernels.launches) == 1
    assert [r.data_ptr() for r in seen] == [seen[0].data_ptr() + 4 * m.A_log.numel() * i
                                            for i, m in enumerate(mixers)]  # fmt: skip
    assert all("_step_decay_rates" not in m.__dict__ for m in mixers)
    params.seqlen_offset = 0  # a prefill: nothing
    with torch.no_grad(), _init.step_decay_rates(model.backbone.layers, params):
        pass
    assert len(fake_kernels.launches) == 1
