"""decode_linear's kernel (csrc/linear.hip) against float64 on fresh random inputs at odd sizes:
every row tier, every dtype, with and without bias, strided rows, each group size; outputs
poisoned before the call; the same bits on every run; never the F.linear fallback."""

import pytest
import torch
from helpers import assert_bit_identical_runs, gpu_available

from mamba2_rocm.ops import linear as ops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs a GPU")]
DEV = "cuda"
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


class _NoFallback:
    """ops.F while the test runs: F.linear refuses (the call must run the kernel)."""

    def __getattr__(self, name):
        raise AssertionError(f"decode_linear fell back to F.{name}")


@pytest.fixture
def kernel_only(monkeypatch):
    launched = []
    real = ops.launch
    monkeypatch.setattr(ops, "F", _NoFallback())
    monkeypatch.setattr(ops, "launch", lambda *a: launched.append(a[0]) or real(*a))
    ops.clear_plan_cache()
    yield launched
    ops.clear_plan_cache()


def _poison_allocator(nbytes: int) -> None:
    """Leave NaN in the caching allocator's free blocks: an output the kernel does not write
    keeps NaN."""
    t = torch.full((nbytes // 4 + 1024,), float("nan"), device=DEV)
    del t


def _check(x, w, b, y):
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    assert y.shape == ref.shape and y.dtype == x.dtype
    assert not y.isnan().any(), "unwritten (NaN) outputs"
    scale = (x.double().abs() @ w.double().abs().T).max().item() + 1e-6
    err = (y.double() - ref).abs().max().item()
    assert err <= TOL[x.dtype] * scale, f"max error {err:.3g} > {TOL[x.dtype]} * {scale:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", range(1, ops.MAX_ROWS + 1))
@pytest.mark.parametrize("in_f,out_f", [(8, 1), (136, 97), (1544, 771), (2048, 4099)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_float64(dtype, rows, in_f, out_f, bias, kernel_only):
    if dtype == torch.float32 and in_f % 4:
        pytest.skip("float32 rows of whole 16-byte vectors")
    gen = torch.Generator(device=DEV).manual_seed(rows * 1000 + in_f + out_f)
    x = torch.randn(rows, in_f, device=DEV, generator=gen).to(dtype)
    w = (torch.randn(out_f, in_f, device=DEV, generator=gen) / in_f**0.5).to(dtype)
    b = torch.randn(out_f, device=DEV, generator=gen).to(dtype) if bias else None
    _poison_allocator(rows * out_f * 4)
    y = ops.decode_linear(x, w, b)
    torch.cuda.synchronize()
    assert len(kernel_only) == 1
    _check(x, w, b, y)


@pytest.mark.parametrize("tpg", [64, 128, 256])
@pytest.mark.parametrize("rows", range(1, ops.MAX_ROWS + 1))
def test_every_group_size(tpg, rows, kernel_only, monkeypatch):
    monkeypatch.setattr(ops, "group_threads", lambda out_f, per_group, sms: tpg)
    gen = torch.Generator(device=DEV).manual_seed(tpg + rows)
    x = torch.randn(rows, 776, device=DEV, generator=gen).bfloat16()
    w = (torch.randn(333, 776, device=DEV, generator=gen) / 28).bfloat16()
    b = torch.randn(333, device=DEV, generator=gen).bfloat16()
    _poison_allocator(rows * 333 * 4)
    _check(x, w, b, ops.decode_linear(x, w, b))


def test_strided_rows_and_leading_dims(kernel_only):
    gen = torch.Generator(device=DEV).manual_seed(7)
    base = torch.randn(ops.MAX_ROWS, 1, 400, device=DEV, generator=gen).half()
    x = base[..., 64:320]  # rows 400 apart, 256 wide: a split of a wider projection
    w = (torch.randn(130, 256, device=DEV, generator=gen) / 16).half()
    y = ops.decode_linear(x, w)
    assert y.shape == (ops.MAX_ROWS, 1, 130)
    _check(x.reshape(-1, 256), w, None, y.reshape(-1, 130))


def test_bit_identical_runs(kernel_only):
    gen = torch.Generator(device=DEV).manual_seed(3)
    x = torch.randn(ops.MAX_ROWS, 2048, device=DEV, generator=gen).bfloat16()
    w = (torch.randn(3001, 2048, device=DEV, generator=gen) / 45).bfloat16()
    assert_bit_identical_runs(lambda: (ops.decode_linear(x, w),))


def _captured(fn, before_capture=lambda: None):
    """``(graph, output)``: fn warmed up once on a side stream (eager), then captured."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    before_capture()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def test_graph_replay_equals_eager(kernel_only):
    gen = torch.Generator(device=DEV).manual_seed(4)
    x = torch.randn(2, 1024, device=DEV, generator=gen).bfloat16()
    w = (torch.randn(700, 1024, device=DEV, generator=gen) / 32).bfloat16()
    g, got = _captured(lambda: ops.decode_linear(x, w))
    x.copy_(torch.randn(2, 1024, device=DEV, generator=gen).bfloat16())
    want = ops.decode_linear(x, w)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", range(1, ops.MAX_ROWS + 1))
@pytest.mark.parametrize("width,length", [(4, 4), (4, 3), (3, 3), (2, 4)])
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("conv_bias", [True, False])
def test_in_proj_conv_step_equals_the_two_kernels(dtype, rows, width, length, activation,
                                                  conv_bias, monkeypatch):  # fmt: skip
    """The one-launch projection + conv against decode_linear then causal_conv1d_update (both
    kernels): the same bits in y's other columns, the conv's outputs and the state."""
    from mamba2_rocm.ops.conv1d import causal_conv1d_update

    gen = torch.Generator(device=DEV).manual_seed(rows * 100 + width * 10 + length)
    in_f, start, ch, tail = 264, 72, 203, 17  # odd channel count, columns on both sides
    r = lambda *s: torch.randn(*s, device=DEV, generator=gen)  # noqa: E731
    x, w, b = (
        r(rows, in_f).to(dtype),
        (r(start + ch + tail, in_f) / 16).to(dtype),
        r(start + ch + tail).to(dtype),
    )
    state = r(rows, length, ch).to(dtype).transpose(1, 2)  # channel-last, as the models keep it
    cw, cb = r(ch, 1, width).to(dtype).squeeze(1), r(ch).to(dtype) if conv_bias else None
    ref_state = state.clone()
    launched = []
    real = ops.launch
    monkeypatch.setattr(ops, "launch", lambda *a: launched.append(a[0]) or real(*a))
    _poison_allocator(rows * (start + ch + tail) * 4)
    y, xbc = ops.in_proj_conv_step(x, w, b, state, cw, cb, start, ch, activation)
    assert len(launched) == 1, "one launch: the projection with the conv"
    y_ref = ops.decode_linear(x, w, b)
    xbc_ref = causal_conv1d_update(y_ref[:, start : start + ch], ref_state, cw, cb, activation)
    torch.cuda.synchronize()
    assert torch.equal(y[:, :start], y_ref[:, :start])
    assert torch.equal(y[:, start + ch :], y_ref[:, start + ch :])
    assert torch.equal(xbc, xbc_ref), (xbc.double() - xbc_ref.double()).abs().max()
    assert torch.equal(state, ref_state)


def test_mamba2_graph_decode_with_the_fused_conv_equals_the_forward():
    """A Mamba2 LM's cg decode (its in_proj + conv fused) scores what a full forward gives."""
    from mamba2_rocm.models import MambaConfig, MambaLMHeadModel

    torch.manual_seed(0)
    cfg = MambaConfig(d_model=256, n_layer=2, vocab_size=512,
                      ssm_cfg={"layer": "Mamba2", "headdim": 32, "d_state": 64})  # fmt: skip
    model = MambaLMHeadModel(cfg, device=DEV, dtype=torch.float32).eval()
    ids = torch.randint(0, 512, (1, 7), device=DEV)
    out = model.generate(ids, max_length=15, cg=True, top_k=1, output_scores=True,
                         return_dict_in_generate=True)  # fmt: skip
    with torch.no_grad():
        full = model(out.sequences[:, :-1]).logits[:, ids.shape[1] - 1 :]
    got = torch.stack(out.scores, dim=1)
    torch.testing.assert_close(got, full, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("start,nbytes", [(0, None), (992, 4096), (4128, None), (0, 32)])
def test_prefetch_in_a_graph_reads_and_writes_nothing(start, nbytes, kernel_only):
    """m2r_linear_prefetch forked into a captured graph: it launches on a side stream that is
    joined back, the weight and every other buffer keep their bits, and the replay's result
    of the work around it is unchanged."""
    gen = torch.Generator(device=DEV).manual_seed(7)
    w = torch.randn(1031, 1024, device=DEV, generator=gen).bfloat16()
    w0 = w.clone()
    x = torch.randn(1, 1024, device=DEV, generator=gen).bfloat16()
    sentinel = torch.full((4096,), float("nan"), device=DEV)
    assert ops.prefetch_beside(w) is None  # eager: no prefetch
    sides = []

    def step():
        sides.append(ops.prefetch_beside(w, start, nbytes))
        y = ops.decode_linear(x, w)
        ops.join_prefetch(sides[-1])
        return y

    g, got = _captured(step, before_capture=kernel_only.clear)
    assert sides[0] is None and sides[1] is not None and len(kernel_only) == 2
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(w, w0) and sentinel.isnan().all()
    assert torch.equal(got, ops.decode_linear(x, w))


def test_prefetch_only_for_the_streaming_kernels_rows(kernel_only):
    """In a capture, a product of more than PREFETCH_MAX_ROWS rows (the BLAS library's) gets no
    prefetch of its weight: nothing launched, None; at PREFETCH_MAX_ROWS one launch."""
    w = torch.randn(512, 1024, device=DEV).bfloat16()
    sides = []

    def step():
        sides.append(ops.prefetch_beside(w, rows=ops.PREFETCH_MAX_ROWS + 1))
        sides.append(ops.prefetch_beside(w, rows=ops.PREFETCH_MAX_ROWS))
        for side in sides[-2:]:
            ops.join_prefetch(side)
        return w

    _captured(step, before_capture=kernel_only.clear)
    assert sides[2] is None and sides[3] is not None and len(kernel_only) == 1


@pytest.mark.parametrize("ssm_cfg", [{"layer": "Mamba2", "headdim": 32, "d_state": 64},
                                     {"layer": "Mamba1", "d_state": 16}])  # fmt: skip
def test_graph_decode_with_the_prefetch_equals_without(ssm_cfg, monkeypatch):
    """A Mamba2 / Mamba1 LM's cg decode gives the same tokens and scores with the projections'
    weights prefetched beside the step (the default) and without (PREFETCH off), bit for bit."""
    from mamba2_rocm.models import MambaConfig, MambaLMHeadModel

    torch.manual_seed(0)
    cfg = MambaConfig(d_model=256, n_layer=3, vocab_size=512, ssm_cfg=dict(ssm_cfg))
    model = MambaLMHeadModel(cfg, device=DEV, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 512, (2, 7), device=DEV)
    launched = []
    real = ops.launch
    monkeypatch.setattr(ops, "launch", lambda *a: launched.append(a[0]) or real(*a))

    def decode():
        model._decoding_cache = None
        return model.generate(ids, max_length=15, cg=True, top_k=1, output_scores=True,
                              return_dict_in_generate=True)  # fmt: skip

    with_prefetch = decode()
    prefetches = sum(getattr(f, "name", "") == "m2r_linear_prefetch" for f in launched)
    monkeypatch.setattr(ops, "PREFETCH", False)
    without = decode()
    assert torch.equal(with_prefetch.sequences, without.sequences)
    for a, b in zip(with_prefetch.scores, without.scores, strict=True):
        assert torch.equal(a, b)
    assert prefetches >= cfg.n_layer  # one per layer in the captured step at least
