"""decode_linear (mamba2_rocm/ops/linear.py): which calls the kernel takes and what it is told.

The kernel tier is stood in for on the CPU (launches recorded); tests/gpu/test_linear_gpu.py
runs the kernel."""

from __future__ import annotations

import contextlib
import re

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from helpers import stand_in_kernels  # noqa: E402

from mamba2_rocm.kernels import LINEAR_FORMS, SOURCES  # noqa: E402
from mamba2_rocm.ops import linear as ops  # noqa: E402
from mamba2_rocm.params import LinearParams  # noqa: E402


def _fields(params) -> dict:
    """A recorded launch's parameter tuple by LinearParams' field names."""
    names = [name for name, _ in LinearParams._fields_]
    assert len(params) == len(names)
    return dict(zip(names, params, strict=True))


@pytest.fixture
def fake_kernels(monkeypatch):
    ops.clear_plan_cache()
    kset = stand_in_kernels(monkeypatch, ops)
    yield kset
    ops.clear_plan_cache()


def _operands(rows, in_f=64, out_f=24, dtype=torch.bfloat16, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_f, generator=g).to(dtype)
    w = torch.randn(out_f, in_f, generator=g).to(dtype)
    b = torch.randn(out_f, generator=g).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_off_the_kernel_tier_it_is_f_linear(dtype):
    x, w, b = _operands(3, dtype=dtype)
    assert torch.equal(ops.decode_linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(ops.decode_linear(x, w), F.linear(x, w))


@pytest.mark.parametrize("rows", range(1, ops.MAX_ROWS + 1))
@pytest.mark.parametrize("dtype,name", [(torch.float32, "f32"), (torch.float16, "f16"),
                                        (torch.bfloat16, "bf16")])  # fmt: skip
def test_launch_names_the_row_tier_and_passes_the_operands(rows, dtype, name, fake_kernels):
    x, w, b = _operands(rows, in_f=96, out_f=37, dtype=dtype)
    y = ops.decode_linear(x, w, b)
    assert y.shape == (rows, 37) and y.dtype == dtype
    ((kname, params, grid),) = fake_kernels.launches
    tier = ops.row_tier(rows)
    assert tier >= rows and (tier == 1 or tier // 2 < rows)
    per_group, unroll = LINEAR_FORMS[tier]
    assert kname == f"m2r_linear_{name}_m{tier}_r{per_group}_u{unroll}"
    assert kname in SOURCES["linear"].kernels
    f = _fields(params)
    tpg = f["group_threads"]
    assert tpg in ops.GROUP_THREADS
    assert (f["x"], f["weight"], f["bias"], f["y"]) == (x.data_ptr(), w.data_ptr(), b.data_ptr(),
                                                        y.data_ptr())  # fmt: skip
    assert (f["x_row_stride"], f["y_row_stride"], f["rows"], f["out_features"],
            f["in_features"]) == (96, 37, rows, 37, 96)  # fmt: skip
    assert f["conv_state"] == 0 and f["conv_channels"] == 0
    groups = -(-37 // per_group)
    assert grid == (-(-groups // (ops.THREADS // tpg)), 1, 1)
    assert fake_kernels.blocks == [(ops.THREADS, 1, 1)]


def test_leading_dims_and_strided_rows(fake_kernels):
    base = torch.randn(2, 1, 160).bfloat16()
    x = base[..., 32:96]  # rows 160 apart, 64 wide
    w = torch.randn(24, 64).bfloat16()
    y = ops.decode_linear(x, w)
    assert y.shape == (2, 1, 24)
    ((_, params, _),) = fake_kernels.launches
    f = _fields(params)
    assert f["x"] == x.data_ptr() and f["bias"] == 0
    assert f["x_row_stride"] == 160 and f["rows"] == 2


def _fallback_cases():
    x, w, b = _operands(2)
    wide = torch.randn(3, 80).bfloat16()
    return {
        "too many rows": (torch.randn(ops.MAX_ROWS + 1, 64).bfloat16(), w, b),
        "float64": (x.double(), w.double(), b.double()),
        "width not whole vectors": (
            torch.randn(3, 60).bfloat16(),
            torch.randn(24, 60).bfloat16(),
            b,
        ),
        "row stride not whole vectors": (wide[:2, 4:68], w, b),
        "transposed weight": (x, torch.randn(64, 24).bfloat16().t(), b),
        "strided bias": (x, w, torch.randn(48).bfloat16()[::2]),
        "misaligned x": (torch.randn(2 * 64 + 1).bfloat16()[1:].view(2, 64), w, b),
        "no rows": (torch.randn(0, 64).bfloat16(), w, b),
        "no outputs": (x, torch.randn(0, 64).bfloat16(), None),
        "columns not unit stride": (torch.randn(64, 3).bfloat16().t(), w, b),
    }


@pytest.mark.parametrize("case", list(_fallback_cases()))
def test_layouts_the_kernel_does_not_read_go_to_f_linear(case, fake_kernels):
    x, w, b = _fallback_cases()[case]
    y = ops.decode_linear(x, w, b)
    assert fake_kernels.launches == []
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=0, atol=0)


def test_autograd_autocast_and_tracing_go_to_f_linear(fake_kernels):
    x, w, b = _operands(2)
    wg = w.float().requires_grad_()
    y = ops.decode_linear(x.float(), wg, b.float())
    y.sum().backward()
    assert wg.grad is not None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ops.decode_linear(x.float(), w.float(), b.float())
    compiled = torch.compile(ops.decode_linear, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, w, b), F.linear(x, w, b))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fx, fw = mode.from_tensor(x), mode.from_tensor(w)
        assert ops.decode_linear(fx, fw).shape == (2, 24)
    assert fake_kernels.launches == []


def _bad_args(bad: str) -> tuple:
    """F.linear arguments that are wrong in one way (``bad``)."""
    x, w, b = _operands(2)
    return {
        "width": (x, torch.randn(24, 72).bfloat16(), b),
        "bias length": (x, w, torch.randn(23).bfloat16()),
        "weight dims": (x, torch.randn(2, 24, 64).bfloat16(), None),
        "mixed dtypes": (x, w.float(), b),
        "bias dtype": (x, w, b.float()),
    }[bad]


@pytest.mark.parametrize("bad", ["width", "bias length", "weight dims", "mixed dtypes",
                                 "bias dtype"])  # fmt: skip
def test_bad_shapes_raise_torch_errors_without_a_launch(bad, fake_kernels):
    args = _bad_args(bad)
    with pytest.raises((RuntimeError, ValueError, NotImplementedError)):
        ops.decode_linear(*args)
    assert fake_kernels.launches == []


def test_plans_are_cached_per_layout(fake_kernels, monkeypatch):
    calls = []
    real = ops._kernel_layout
    monkeypatch.setattr(ops, "_kernel_layout", lambda *a: calls.append(1) or real(*a))
    x, w, b = _operands(2)
    for _ in range(3):
        ops.decode_linear(x, w, b)
    ops.decode_linear(torch.randn(2, 64).double(), w.double())  # a refused layout, cached too
    ops.decode_linear(torch.randn(2, 64).double(), w.double())
    assert len(calls) == 2 and len(fake_kernels.launches) == 3


def test_group_threads_fill_the_gpu():
    # many features: the fewest threads a group; few features: more threads each
    assert ops.group_threads(8512, 4, 132) == 64  # mamba2-1.3b's in_proj on the H100
    assert ops.group_threads(2048, 4, 132) == 128  # its out_proj
    assert ops.group_threads(768, 4, 132) == 256  # mamba2-130m's out_proj
    assert ops.group_threads(1, 1, 132) == 256
    assert ops.group_threads(5, 1, 0) == 64  # no GPU (CPU stand-in): the smallest


def test_step_linear_keeps_other_modules():
    plain = torch.nn.Linear(64, 8)
    x = torch.randn(2, 64)
    torch.testing.assert_close(ops.step_linear(plain, x), plain(x))

    class Scaled(torch.nn.Linear):
        def forward(self, inp):
            return 2 * super().forward(inp)

    sub = Scaled(64, 8)
    torch.testing.assert_close(ops.step_linear(sub, x), sub(x))


def test_every_row_tier_has_a_kernel_per_dtype():
    names = set(SOURCES["linear"].kernels)
    for tier, (r, u) in LINEAR_FORMS.items():
        for dt in ("f32", "f16", "bf16"):
            assert f"m2r_linear_{dt}_m{tier}_r{r}_u{u}" in names
    assert tuple(sorted(LINEAR_FORMS)) == ops.ROW_TIERS and max(LINEAR_FORMS) == ops.MAX_ROWS


def test_step_linear_runs_a_hooked_module_as_it_is(fake_kernels):
    lin = torch.nn.Linear(64, 8, dtype=torch.bfloat16)
    seen = []
    handle = lin.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    with torch.no_grad():
        ops.step_linear(lin, torch.randn(1, 64).bfloat16())
    assert seen == [(1, 8)] and fake_kernels.launches == []
    handle.remove()
    with torch.no_grad():
        ops.step_linear(lin, torch.randn(1, 64).bfloat16())
    assert [name for name, _, _ in fake_kernels.launches] == ["m2r_linear_bf16_m1_r4_u2"]


def _routed(monkeypatch, module):
    """The (module or weight) each decode projection of ``module``'s step went through."""
    seen = []
    if hasattr(module, "step_linear"):
        real = module.step_linear
        monkeypatch.setattr(module, "step_linear", lambda m, x: seen.append(m) or real(m, x))
    if hasattr(module, "in_proj_conv_step"):
        real_c = module.in_proj_conv_step
        monkeypatch.setattr(module, "in_proj_conv_step",
                            lambda x, w, *a: seen.append(w) or real_c(x, w, *a))  # fmt: skip
    if hasattr(module, "decode_linear"):
        real_d = module.decode_linear
        monkeypatch.setattr(module, "decode_linear",
                            lambda x, w, b=None: seen.append(w) or real_d(x, w, b))  # fmt: skip
    return seen


def test_models_decode_steps_take_their_projections_through_the_kernels(monkeypatch):
    from mamba2_rocm.models import lm, mamba1, mamba2

    torch.manual_seed(0)
    m2 = mamba2.Mamba2(64, d_state=16, headdim=16)
    seen = _routed(monkeypatch, mamba2)
    conv, ssm = m2.allocate_inference_cache(2, 1)
    with torch.no_grad():
        m2.step(torch.randn(2, 1, 64), conv, ssm)
    assert seen == [m2.in_proj.weight, m2.out_proj]  # (in_proj with the conv: one launch)

    m1 = mamba1.Mamba(32, d_state=8)
    seen = _routed(monkeypatch, mamba1)
    conv, ssm = m1.allocate_inference_cache(2, 1)
    with torch.no_grad():
        m1.step(torch.randn(2, 1, 32), conv, ssm)
    assert seen == [m1.in_proj, m1.x_proj, m1.dt_proj.weight, m1.out_proj]

    model = lm.MambaLMHeadModel(lm.MambaConfig(d_model=32, n_layer=1, vocab_size=64,
                                               ssm_cfg={"layer": "Mamba2", "headdim": 16}))  # fmt: skip
    seen = _routed(monkeypatch, lm)
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 3)), num_last_tokens=1)
    assert seen == [model.lm_head]


@pytest.mark.parametrize("bad", ["width", "bias length", "weight dims", "mixed dtypes"])
def test_bad_inputs_raise_exactly_what_f_linear_raises(bad, fake_kernels):
    """decode_linear's errors are F.linear's own: the same type and the same message."""
    args = _bad_args(bad)
    with pytest.raises(Exception) as want:
        F.linear(*args)
    with pytest.raises(want.type, match=f"^{re.escape(str(want.value))}$"):
        ops.decode_linear(*args)
    assert fake_kernels.launches == []


def _conv_operands(rows=2, in_f=64, channels=40, start=16, extra=8, width=4, length=4,
                   dtype=torch.bfloat16, seed=1):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    out_f = start + channels + extra
    x = torch.randn(rows, in_f, generator=g).to(dtype)
    w = (torch.randn(out_f, in_f, generator=g) / 8).to(dtype)
    b = torch.randn(out_f, generator=g).to(dtype)
    # channel-last state, as the models allocate it
    state = torch.randn(rows, length, channels, generator=g).to(dtype).transpose(1, 2)
    cw = torch.randn(channels, 1, width, generator=g).to(dtype).squeeze(1)
    cb = torch.randn(channels, generator=g).to(dtype)
    return x, w, b, state, cw, cb, start, channels


@pytest.mark.parametrize("activation", [None, "silu"])
def test_in_proj_conv_step_is_the_two_ops_off_the_kernel_tier(activation):
    from mamba2_rocm.ops.conv1d import causal_conv1d_update

    x, w, b, state, cw, cb, start, ch = _conv_operands()
    want_state = state.clone()
    y_ref = F.linear(x, w, b)
    xbc_ref = causal_conv1d_update(y_ref[:, start : start + ch], want_state, cw, cb, activation)
    y, xbc = ops.in_proj_conv_step(x, w, b, state, cw, cb, start, ch, activation)
    assert torch.equal(y[:, :start], y_ref[:, :start]) and torch.equal(
        y[:, start + ch :], y_ref[:, start + ch :]
    )
    assert torch.equal(xbc, xbc_ref) and torch.equal(state, want_state)


@pytest.mark.parametrize("width,length", [(4, 4), (4, 3), (2, 2), (3, 4)])
@pytest.mark.parametrize("activation,silu", [(None, 0), ("silu", 1), ("swish", 1)])
def test_in_proj_conv_step_launches_one_conv_kernel(width, length, activation, silu, fake_kernels):
    x, w, b, state, cw, cb, start, ch = _conv_operands(width=width, length=length)
    y, xbc = ops.in_proj_conv_step(x, w, b, state, cw, cb, start, ch, activation)
    ((name, params, _),) = fake_kernels.launches
    assert name == f"m2r_linear_bf16_m2_r{ops.LINEAR_FORMS[2][0]}_u{ops.LINEAR_FORMS[2][1]}_conv"
    assert name in SOURCES["linear"].kernels
    f = _fields(params)
    assert (f["conv_state"], f["conv_weight"], f["conv_bias"], f["y"]) == (
        state.data_ptr(),
        cw.data_ptr(),
        cb.data_ptr(),
        y.data_ptr(),
    )
    assert (f["state_batch_stride"], f["state_c_stride"], f["state_l_stride"]) == state.stride()
    assert f["conv_weight_c_stride"] == width
    assert (
        f["conv_start"],
        f["conv_channels"],
        f["conv_width"],
        f["state_len"],
        f["conv_silu"],
    ) == (start, ch, width, length, silu)
    assert xbc.data_ptr() == y[:, start:].data_ptr() and xbc.shape == (2, ch)


def _refused_conv_cases():
    x, w, b, state, cw, cb, start, ch = _conv_operands()
    return {
        "state longer than 4": (x, w, b, torch.zeros(2, ch, 5).bfloat16(), cw, cb, start, ch),
        "state shorter than the window": (x, w, b, state[..., :2], cw, cb, start, ch),
        "width 5": (x, w, b, torch.zeros(2, ch, 4).bfloat16(), torch.zeros(ch, 5).bfloat16(), cb,
                    start, ch),
        "state dtype": (x, w, b, state.float(), cw, cb, start, ch),
        "weight dtype": (x, w, b, state, cw.float(), cb, start, ch),
        "bias dtype": (x, w, b, state, cw, cb.float(), start, ch),
        "state rows": (x, w, b, state[:1], cw, cb, start, ch),
        "columns past the end": (x, w, b, state, cw, cb, w.shape[0] - ch + 1, ch),
        "taps not unit stride": (x, w, b, state, torch.zeros(4, ch).bfloat16().t(), cb, start, ch),
        "x not 2-D": (x[:, None], w, b, state, cw, cb, start, ch),
    }  # fmt: skip


@pytest.mark.parametrize("case", list(_refused_conv_cases()))
def test_in_proj_conv_step_runs_the_two_ops_where_the_kernel_cannot(case, fake_kernels):
    args = _refused_conv_cases()[case]
    # (the separate conv op may refuse what the kernel cannot take either, with its own error)
    with contextlib.suppress(RuntimeError, ValueError, TypeError):
        ops.in_proj_conv_step(*args, "silu")
    assert all(not name.endswith("_conv") for name, _, _ in fake_kernels.launches)


def test_in_proj_conv_step_refuses_an_unknown_activation():
    x, w, b, state, cw, cb, start, ch = _conv_operands()
    with pytest.raises(ValueError, match="activation"):
        ops.in_proj_conv_step(x, w, b, state, cw, cb, start, ch, "relu")


def test_prefetch_params_cover_whole_sectors_of_the_weight():
    """m2r_linear_prefetch's fields: the weight's bytes [start, start + nbytes) as whole 32-byte
    sectors from a sector boundary, rows 1 (its guarded store stays off), no output."""
    w = torch.zeros(24, 64, dtype=torch.bfloat16)  # 3072 bytes: 96 sectors
    f = _fields(ops._prefetch_params(w, 0, None))
    assert f["weight"] == w.data_ptr() and f["in_features"] == 96 and f["rows"] == 1
    assert f["y"] == f["x"] == f["bias"] == f["conv_state"] == 0
    assert list(f).index("in_features") == ops._SECTORS_FIELD
    f = _fields(ops._prefetch_params(w, 1000, 512))  # from byte 992: 16 sectors
    assert f["weight"] == w.data_ptr() + 992 and f["in_features"] == 16
    assert _fields(ops._prefetch_params(w, 3000, None))["in_features"] == 3  # from byte 2976
    assert ops._prefetch_params(w, 3072, None) is None  # nothing left
    assert ops._prefetch_params(w, 0, 31) is None  # no whole sector
    assert ops._prefetch_params(w.t(), 0, None) is None  # not contiguous
    assert ops._prefetch_params(w.view(-1)[8:], 0, None) is None  # not sector-aligned
    # a model's weight is a Parameter: taken as the tensor it wraps; other subclasses are not
    p = torch.nn.Parameter(w, requires_grad=False)
    assert _fields(ops._prefetch_params(p, 0, None))["in_features"] == 96

    class Sub(torch.Tensor):
        pass

    assert ops._prefetch_params(w.as_subclass(Sub), 0, None) is None
    from mamba2_rocm.build.driver import csrc_dir

    text = (csrc_dir() / "linear.hip").read_text()
    assert int(re.search(r"kSectorBytes = (\d+);", text).group(1)) == ops._SECTOR
    assert "m2r_linear_prefetch" in SOURCES["linear"].kernels


def test_prefetch_beside_launches_nothing_outside_a_graph_capture(fake_kernels):
    """An eager step (host-bound) and CPU tensors get no prefetch: None, no launch; so does
    a capture with PREFETCH off."""
    w = torch.zeros(24, 64, dtype=torch.bfloat16)
    assert ops.prefetch_beside(w) is None
    ops.join_prefetch(None)  # (nothing to join)
    assert fake_kernels.launches == []
