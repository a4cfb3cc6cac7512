"""conv1d on the CPU: the vectorized tier against the eager float64 loop, and the public API."""

import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPES, TOL, make_seq_idx, make_x, seeded, stand_in_kernels

from mamba2_rocm import causal_conv1d_fn, causal_conv1d_update
from mamba2_rocm.params import ConvUpdateParams
from mamba2_rocm.reference.conv1d import (
    causal_conv1d_eager,
    causal_conv1d_torch,
    causal_conv1d_update_eager,
    causal_conv1d_update_torch,
)

SEQLENS = [1, 2, 129, 151, 1134, 4096]
LAYOUTS = ["contiguous", "channel_last", "sliced", "channel_last_sliced"]


def _gen(*key):
    return seeded(*key)


@pytest.mark.parametrize("seqlen", SEQLENS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [2, 3, 4])
def test_fn_matches_eager(width, dtype, seqlen):
    g = _gen(width, str(dtype), seqlen)
    layout = LAYOUTS[(width + seqlen) % len(LAYOUTS)]
    has_bias, silu = (seqlen % 2 == 1), (width != 3)
    x = make_x(2, 64, seqlen, dtype, layout, gen=g)
    w = torch.randn(64, width, generator=g).to(dtype)
    b = torch.randn(64, generator=g).to(dtype) if has_bias else None
    out = causal_conv1d_fn(x, w, b, activation="silu" if silu else None)
    ref, _ = causal_conv1d_eager(x, w, b, silu=silu)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seqlen", [129, 151])
def test_fn_wide_dim(dtype, seqlen):
    g = _gen("wide", str(dtype), seqlen)
    x = make_x(1, 4128, seqlen, dtype, "channel_last", gen=g)
    w = torch.randn(4128, 4, generator=g, dtype=torch.float32)  # fp32 weights with any x dtype
    b = torch.randn(4128, generator=g).to(torch.bfloat16)
    ref, _ = causal_conv1d_eager(x, w, b, silu=True)
    torch.testing.assert_close(causal_conv1d_fn(x, w, b, activation="swish"), ref, **TOL[dtype])


def test_matches_torch_conv1d_float64():
    """An independent formula: F.conv1d with left padding, in float64."""
    g = _gen("conv")
    x = torch.randn(3, 11, 151, generator=g, dtype=torch.float64)
    w = torch.randn(11, 4, generator=g, dtype=torch.float64)
    b = torch.randn(11, generator=g, dtype=torch.float64)
    expect = F.conv1d(x, w.unsqueeze(1), b, padding=3, groups=11)[..., :151]
    got, _ = causal_conv1d_eager(x, w, b)
    torch.testing.assert_close(got, expect, rtol=1e-12, atol=1e-12)
    got_t, _ = causal_conv1d_torch(x, w, b, compute_dtype=torch.float64)
    torch.testing.assert_close(got_t, expect, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seqlen", [1, 2, 151])
@pytest.mark.parametrize("width", [2, 3, 4])
def test_initial_and_final_states(width, seqlen, layout):
    g = _gen("states", width, seqlen, layout)
    dtype = torch.float32
    x = make_x(3, 40, seqlen, dtype, layout, gen=g)
    w = torch.randn(40, width, generator=g)
    init = torch.randn(3, width - 1, 40, generator=g).transpose(1, 2)  # channel-last states too
    out, fin = causal_conv1d_fn(x, w, None, initial_states=init, return_final_states=True)
    ref, ref_fin = causal_conv1d_eager(x, w, None, initial_states=init)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    assert torch.equal(fin, ref_fin)  # a copy of inputs: exact
    # chunked prefill: running two halves with carried state equals one run
    if seqlen > 2:
        cut = seqlen // 3
        o1, f1 = causal_conv1d_fn(x[..., :cut], w, initial_states=init, return_final_states=True)
        o2 = causal_conv1d_fn(x[..., cut:], w, initial_states=f1)
        torch.testing.assert_close(torch.cat([o1, o2], -1), ref, **TOL[dtype])


def test_final_states_out_buffer_is_written():
    x = torch.randn(2, 8, 5)
    w = torch.randn(8, 4)
    buf = torch.full((2, 8, 3), float("nan"))
    _out, fin = causal_conv1d_fn(x, w, return_final_states=True, final_states_out=buf)
    assert fin is buf and torch.equal(buf, x[..., -3:])
    short = torch.randn(2, 8, 2)  # seqlen < width - 1: zero-padded on the left
    _, fin = causal_conv1d_fn(short, w, return_final_states=True)
    assert torch.equal(fin[..., 0], torch.zeros(2, 8)) and torch.equal(fin[..., 1:], short)


@pytest.mark.parametrize("layout", ["contiguous", "channel_last"])
@pytest.mark.parametrize("width", [2, 3, 4])
def test_seq_idx_with_padding(width, layout):
    g = _gen("seq", width, layout)
    x = make_x(4, 24, 151, torch.float32, layout, gen=g)
    w, b = torch.randn(24, width, generator=g), torch.randn(24, generator=g)
    seq = make_seq_idx(4, 151, gen=g)
    out = causal_conv1d_fn(x, w, b, seq_idx=seq, activation="silu")
    ref, _ = causal_conv1d_eager(x, w, b, seq_idx=seq, silu=True)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    # padding tokens (negative seq_idx) give 0, as in causal-conv1d
    pad = (seq < 0).unsqueeze(1).expand_as(out)
    assert pad.any() and not out[pad].any()
    # independent check: each sequence alone gives the same outputs
    for row in range(4):
        for sid in seq[row].unique().tolist():
            if sid < 0:
                continue
            mask = seq[row] == sid
            alone = causal_conv1d_fn(
                x[row : row + 1, :, mask].contiguous(), w, b, activation="silu"
            )
            torch.testing.assert_close(out[row : row + 1, :, mask], alone, **TOL[torch.float32])


def test_eager_backend_is_used(backend, monkeypatch):
    calls = []
    import mamba2_rocm.reference.conv1d as ref

    real = ref.causal_conv1d_eager
    monkeypatch.setattr(
        ref, "causal_conv1d_eager", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    backend("eager")
    causal_conv1d_fn(torch.randn(1, 4, 9), torch.randn(4, 3))
    assert calls == [1]


# ---- update ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("seqlen", [None, 1, 3])
@pytest.mark.parametrize("state_extra", [0, 2])
def test_update_shift_register(width, dtype, seqlen, state_extra):
    g = _gen("upd", width, str(dtype), seqlen, state_extra)
    batch, dim, state_len = 3, 72, width - 1 + state_extra
    x = torch.randn(batch, dim, *(() if seqlen is None else (seqlen,)), generator=g).to(dtype)
    state = torch.randn(batch, dim, state_len, generator=g).to(dtype)
    w, b = torch.randn(dim, width, generator=g).to(dtype), torch.randn(dim, generator=g).to(dtype)
    ref_state = state.clone()
    out = causal_conv1d_update(x, state, w, b, activation="silu")
    x3 = x if seqlen is not None else x.unsqueeze(-1)
    ref = causal_conv1d_update_eager(x3, ref_state, w, b, silu=True)
    assert out.shape == x.shape
    torch.testing.assert_close(out, ref if seqlen is not None else ref.squeeze(-1), **TOL[dtype])
    assert torch.equal(state, ref_state)


@pytest.mark.parametrize("seqlen", [1, 2, 7])
@pytest.mark.parametrize("width", [2, 4])
def test_update_circular_buffer(width, seqlen):
    g = _gen("circ", width, seqlen)
    batch, dim, state_len = 4, 16, 5
    x = torch.randn(batch, dim, seqlen, generator=g)
    state = torch.randn(batch, dim, state_len, generator=g)
    w = torch.randn(dim, width, generator=g)
    cache_seqlens = torch.tensor([0, 3, 4, 13], dtype=torch.int32)
    before = state.clone()
    ref_state = state.clone()
    out = causal_conv1d_update(x, state, w, None, cache_seqlens=cache_seqlens)
    ref = causal_conv1d_update_eager(x, ref_state, w, None, cache_seqlens=cache_seqlens)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    assert torch.equal(state, ref_state)
    # by hand: row 1's first output reads slots (3 - (width-1) + j) mod state_len, then x
    window = [before[1, :, (3 - (width - 1) + j) % state_len] for j in range(width - 1)] + [
        x[1, :, 0]
    ]
    expect = sum(w[:, k] * window[k] for k in range(width))
    torch.testing.assert_close(out[1, :, 0], expect, **TOL[torch.float32])
    last = max(t for t in range(seqlen) if (3 + t) % state_len == 3)  # later tokens win
    assert torch.equal(state[1, :, 3], x[1, :, last])


def test_update_circular_matches_decode_loop():
    """Token-by-token circular updates equal the forward conv over the whole sequence."""
    g = _gen("decode")
    dim, width, state_len, steps = 8, 4, 6, 20
    x = torch.randn(1, dim, steps, generator=g)
    w = torch.randn(dim, width, generator=g)
    full, _ = causal_conv1d_eager(x, w)
    state = torch.zeros(1, dim, state_len)
    outs = []
    for t in range(steps):
        outs.append(
            causal_conv1d_update(
                x[:, :, t], state, w, cache_seqlens=torch.tensor([t], dtype=torch.int32)
            )
        )
    torch.testing.assert_close(torch.stack(outs, -1), full)
    state2 = torch.zeros(1, dim, width - 1)
    outs2 = [causal_conv1d_update(x[:, :, t], state2, w) for t in range(steps)]
    torch.testing.assert_close(torch.stack(outs2, -1), full)


def test_update_pool_indices():
    g = _gen("pool")
    batch, dim, width, pool = 4, 16, 4, 7
    x = torch.randn(batch, dim, generator=g)
    state = torch.randn(pool, dim, width - 1, generator=g)
    w = torch.randn(dim, width, generator=g)
    idx = torch.tensor([5, -1, 0, 3], dtype=torch.int32)
    before = state.clone()
    out = causal_conv1d_update(x, state, w, conv_state_indices=idx)
    assert torch.equal(out[1], torch.zeros(dim))  # padding slot: zeros out
    untouched = [1, 2, 4, 6]
    assert torch.equal(state[untouched], before[untouched])  # rows not selected, or -1
    ref_state = before.clone()
    ref = causal_conv1d_update_eager(x.unsqueeze(-1), ref_state, w, conv_state_indices=idx).squeeze(
        -1
    )
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    assert torch.equal(state, ref_state)


def test_update_vectorized_matches_eager_long_circular():
    """seqlen > state_len in a circular buffer: later tokens win."""
    g = _gen("long")
    x = torch.randn(2, 8, 9, generator=g)
    s1 = torch.randn(2, 8, 4, generator=g)
    s2 = s1.clone()
    w = torch.randn(8, 3, generator=g)
    cs = torch.tensor([2, 7], dtype=torch.int32)
    a = causal_conv1d_update_torch(x, s1, w, cache_seqlens=cs)
    b = causal_conv1d_update_eager(x, s2, w, cache_seqlens=cs)
    torch.testing.assert_close(a, b, **TOL[torch.float32])
    assert torch.equal(s1, s2)
    assert torch.equal(s1[0, :, (2 + 8) % 4], x[0, :, 8])


# --- causal_conv1d_update's layout cache (decode calls repeat one layout every step) --------


@pytest.fixture
def update_kernels(monkeypatch):
    from mamba2_rocm.ops import conv1d as ops

    kset = stand_in_kernels(monkeypatch, ops)
    ops._UPDATE_PLANS.clear()
    yield kset
    ops._UPDATE_PLANS.clear()


def _update_args(g, layout="plain"):
    x = torch.randn(3, 40, generator=g)
    state = torch.randn(3, 40, 5, generator=g)
    if layout == "strided":  # the same shapes, another layout
        state = torch.randn(3, 5, 40, generator=g).transpose(1, 2)
    return x, state, torch.randn(40, 4, generator=g), torch.randn(40, generator=g)


def test_update_cached_launch_equals_a_fresh_one(update_kernels):
    from mamba2_rocm.ops import conv1d as ops

    for step in range(3):
        for layout in ("plain", "strided"):
            x, state, w, b = _update_args(_gen("upd", step, layout), layout)
            out = causal_conv1d_update(x, state, w, b, activation="silu")
            name, params, grid = update_kernels.launches[-1]
            fresh = ops._update_static(x.unsqueeze(-1), state, w, b, True, out.unsqueeze(-1))
            assert (name, grid) == fresh[:2]
            ptrs = (
                x.data_ptr(),
                state.data_ptr(),
                w.data_ptr(),
                b.data_ptr(),
                out.data_ptr(),
                0,
                0,
            )
            assert params == ptrs + fresh[2]
    assert len(ops._UPDATE_PLANS) == 2


@pytest.mark.parametrize(
    ("case", "kernel"),
    [("plain", "_vec_c3"), ("width slots", "_vec_c4"), ("width slots, unaligned x", "_vec_c4"),
     ("slot order", "_vec_s3"),
     ("slot order, width slots", "_vec_s4"), ("pool", "_vec_c3"),
     ("fp16, float32 taps", "_vec_c3"), ("tokens", "_tile"), ("odd dim", ""),
     ("unaligned x", "_tile"), ("x batch stride", "_tile"), ("long state", ""),
     ("circular", ""), ("slot order, odd slot stride", ""), ("unaligned", ""),
     ("odd row stride", "")],
)  # fmt: skip
def test_update_kernel_by_layout(update_kernels, case, kernel):
    """The _vec kernels (16 bytes a thread and access) need no circular cache, each batch row's
    states one (dim, width - 1 or width) block in channel or slot order a 16-byte multiple
    apart, x (and out) channel-contiguous with 16-byte multiples between rows, dim a multiple
    of 16 bytes' elements and 16-byte aligned addresses (checked per call: a cached layout may
    meet another buffer); else the _tile kernel (the block's states through LDS) needs exactly
    width - 1 slots in channel order, each batch row's states contiguous and a 16-byte multiple
    apart, and an aligned state; else the general kernel."""
    g = _gen("upd-kernel", case)
    dim, dtype = (42 if case == "odd dim" else 40), torch.float32
    if case.startswith("fp16"):
        dtype = torch.float16
    x = torch.randn(3, dim, generator=g).to(dtype)
    w, b = torch.randn(dim, 4, generator=g), torch.randn(dim, generator=g).to(dtype)
    w = w if "float32 taps" in case else w.to(dtype)
    state = torch.randn(3, dim, 3, generator=g).to(dtype)
    kw = {}
    if case.startswith("width slots"):  # a thread: one channel (16 bytes of float32 states)
        state = torch.randn(3, dim, 4, generator=g)
    elif case == "slot order":
        state = torch.randn(3, 3, dim, generator=g).transpose(1, 2)
    elif case == "slot order, width slots":
        state = torch.randn(3, 4, dim, generator=g).transpose(1, 2)
    elif case == "slot order, odd slot stride":  # slots 41 floats apart
        state = torch.randn(3, 3, 41, generator=g)[..., :40].transpose(1, 2)
    elif case == "tokens":
        x = torch.randn(3, dim, 2, generator=g)
    if case.endswith("unaligned x"):  # one float32 past an aligned start
        x = torch.randn(3 * dim + 1, generator=g)[1:].view(3, dim)
    elif case == "x batch stride":  # rows 41 floats apart
        x = torch.randn(3, 41, generator=g)[:, :40]
    elif case == "long state":
        state = torch.randn(3, dim, 5, generator=g)
    elif case == "circular":
        kw["cache_seqlens"] = torch.tensor([0, 4, 9], dtype=torch.int32)
    elif case == "unaligned":  # one float32 past an aligned start
        state = torch.randn(3 * dim * 3 + 1, generator=g)[1:].view(3, dim, 3)
    elif case == "odd row stride":  # rows 121 floats apart: not a 16-byte multiple
        state = torch.randn(3, 121, generator=g)[:, :120].view(3, dim, 3)
    elif case == "pool":
        state = torch.randn(5, dim, 3, generator=g)
        kw["conv_state_indices"] = torch.tensor([4, 0, 2], dtype=torch.int32)
    causal_conv1d_update(x, state, w, b, activation="silu", **kw)
    name, _, grid = update_kernels.launches[-1]
    prefix = f"m2r_conv1d_update_{'f16' if dtype == torch.float16 else 'f32'}_w4"
    assert name == prefix + kernel and grid == (1, 3, 1)


def test_update_vec_grid():
    """A _vec kernel's block covers 128 threads of _vec_channels channels each."""
    from mamba2_rocm.ops import conv1d as ops

    x = torch.empty(5, 10240, 1, dtype=torch.bfloat16)
    w = torch.empty(10240, 4, dtype=torch.bfloat16)
    for slots, order, per_thread in ((3, "c3", 4), (4, "c4", 2)):
        state = torch.empty(5, 10240, slots, dtype=torch.bfloat16)
        static = ops._update_static(x, state, w, None, True, torch.empty_like(x))
        vec, grid, run = static[4]
        assert static[1] == (80, 5, 1) and vec.endswith(f"_w4_vec_{order}")
        assert grid == (10240 // (128 * per_thread), 5, 1) and run == 2 * per_thread
    x32 = x.float()
    state = torch.empty(5, 10240, 3)
    static = ops._update_static(x32, state, w.float(), None, True, torch.empty_like(x32))
    assert static[4][1] == (40, 5, 1)  # 10240 / (128 * 2)


@pytest.mark.parametrize("elt", [2, 4])
def test_update_vec_channels(elt):
    """A thread's states in channel order are one 16-byte word where a channel's slots divide
    it, else (and in slot order) 8 bytes of each slot; its channels divide a word's elements
    (so a 16-byte multiple of dim always fits), and its runs are 2-, 4-, 8-byte or 16-byte
    multiples (the kernel's pieces)."""
    from mamba2_rocm.ops.conv1d import _VEC_BYTES, _vec_channels

    assert _VEC_BYTES == 8
    for slots in (1, 2, 3, 4):
        for order in "cs":
            n = _vec_channels(f"{order}{slots}", elt)
            assert (16 // elt) % n == 0
            if order == "c" and 16 % (slots * elt) == 0:
                assert n * slots * elt == 16
            else:
                assert n * elt == 8
            assert (n * slots * elt) in (2, 4, 8) or n * slots * elt % 8 == 0
    assert _vec_channels("c4", 2) == 2 and _vec_channels("c3", 2) == 4
    assert _vec_channels("s4", 2) == 4 and _vec_channels("s3", 4) == 2


def test_update_one_token_as_2d_launches_as_its_3d_view(update_kernels):
    """x (batch, dim) goes to the kernel as it is (no (batch, dim, 1) view, no squeeze of the
    result): the same kernel, grid and parameters as the (batch, dim, 1) call of the same
    tensors, under a layout of its own; out (batch, dim), contiguous, a tensor of its own."""
    from mamba2_rocm.ops import conv1d as ops

    for layout in ("plain", "strided"):
        x, state, w, b = _update_args(_gen("upd-2d", layout), layout)
        out2 = causal_conv1d_update(x, state, w, b, activation="silu")
        out3 = causal_conv1d_update(x.unsqueeze(-1), state, w, b, activation="silu")
        (n2, p2, g2), (n3, p3, g3) = update_kernels.launches[-2:]
        assert (n2, g2) == (n3, g3)
        fields = [f for f, _ in ConvUpdateParams._fields_]
        got2, got3 = (dict(zip(fields, p, strict=True)) for p in (p2, p3))
        assert got2["x"] == got3["x"] == x.data_ptr()
        assert got2["out"] == out2.data_ptr() and got3["out"] == out3.data_ptr()
        assert {k: v for k, v in got2.items() if k != "out"} == {
            k: v for k, v in got3.items() if k != "out"
        }
        assert out2.shape == x.shape and out2.is_contiguous() and out2._base is None
        assert out3.shape == (*x.shape, 1)
    assert len(ops._UPDATE_PLANS) == 4  # (batch, dim) and (batch, dim, 1), in two layouts


def test_update_2d_wrong_inputs_still_raise(update_kernels):
    """The (batch, dim) path checks as the 3-D one does (on its layout's first call)."""
    x, state, w, b = _update_args(_gen("upd-2d-bad"))
    with pytest.raises(ValueError, match="conv_state must have shape"):
        causal_conv1d_update(x[:, :39], state, w[:39], b[:39])
    with pytest.raises(ValueError, match="conv_state has 2 rows for a batch of 3"):
        causal_conv1d_update(x, state[:2], w, b)
    assert update_kernels.launches == []


def test_update_repeated_layout_skips_the_checks_but_never_a_bad_call(update_kernels, monkeypatch):
    from mamba2_rocm.ops import conv1d as ops

    calls = []
    real = ops._check_update
    monkeypatch.setattr(ops, "_check_update", lambda *a: calls.append(1) or real(*a))
    x, state, w, b = _update_args(_gen("upd-skip"))
    for _ in range(4):
        causal_conv1d_update(x, state, w, b)
    assert len(calls) == 1 and len(update_kernels.launches) == 4
    with pytest.raises(TypeError, match="conv_state must be one of"):  # another layout: checked
        causal_conv1d_update(x, state.double(), w, b)
    with pytest.raises(ValueError, match="conv_state has 2 rows for a batch of 3"):
        causal_conv1d_update(x, state[:2], w, b)
    assert len(update_kernels.launches) == 4


def test_update_passes_state_indices_as_given_to_the_kernel(update_kernels):
    """The kernel reads and checks the indices itself: their address, stride and width go into
    the struct, no copy and no second launch (a strided view stays a view)."""
    x, _state, w, b = _update_args(_gen("upd-idx"))
    pool = torch.randn(6, 40, 5, generator=_gen("upd-idx-pool"))
    holder = torch.tensor([[4, 9], [0, 9], [5, 9]], dtype=torch.int32)
    idx = holder[:, 0]  # stride 2
    out = causal_conv1d_update(x, pool, w, b, conv_state_indices=idx)
    assert len(update_kernels.launches) == 1
    _name, params, _ = update_kernels.launches[-1]
    fields = [f for f, _ in ConvUpdateParams._fields_]
    got = dict(zip(fields, params, strict=True))
    assert got["state_indices"] == idx.data_ptr() and got["indices_stride"] == 2
    assert got["indices_int64"] == 0 and got["num_states"] == 6 and got["batch"] == 3
    assert got["out"] == out.data_ptr()


@pytest.mark.parametrize(
    ("dtype", "seqlen", "dim", "layout", "grid", "threads"),
    [
        (torch.bfloat16, 8, 3, "vec_m", (1, 1, 2), 128),  # 8 rows a block, 3 of them used
        (torch.bfloat16, 512, 9, "vec_m", (1, 2, 2), 128),  # a row's 16 threads x 4 x 8 tokens
        (torch.bfloat16, 520, 3, "vec_s", (1, 3, 2), 64),  # one short block: 64 x 2 x 8 tokens
        (torch.bfloat16, 1024, 3, "vec_s", (1, 3, 2), 64),  # half the long tile: 64 x 4 x 8
        (torch.bfloat16, 1032, 3, "vec", (1, 3, 2), 64),  # past half: the long tile
        (torch.bfloat16, 2056, 3, "vec", (2, 3, 2), 64),
        (torch.bfloat16, 9000, 3, "vec", (5, 3, 2), 64),
        (torch.float32, 256, 5, "vec_m", (1, 1, 2), 128),  # 4 float32 a vector: 256-token rows
        (torch.float32, 264, 3, "vec_s", (1, 3, 2), 64),
        (torch.float32, 512, 3, "vec_s", (1, 3, 2), 64),  # 512 tokens a short block
        (torch.float32, 520, 3, "vec", (1, 3, 2), 64),
        (torch.float32, 1032, 3, "vec", (2, 3, 2), 64),
    ],
)
def test_forward_takes_the_short_row_kernels_where_a_long_block_would_idle(
    monkeypatch, dtype, seqlen, dim, layout, grid, threads
):
    """Seqlen-contiguous rows up to half the long kernel's tile (64 threads, four 16-byte vectors
    each) go to the short-row kernel (64 threads, two vectors each), and rows that fit an eighth
    of a 128-thread block to the multi-row kernel (8 rows of 16 threads, four vectors each), so
    fewer of a block's threads idle."""
    from mamba2_rocm.ops import conv1d as ops

    kset = stand_in_kernels(monkeypatch, ops)
    seen = []
    monkeypatch.setattr(ops, "launch", lambda launcher, x, p, grid, threads_: (
        seen.append(threads_), launcher(p, grid, None, 0)))  # fmt: skip
    x = torch.randn(2, dim, seqlen, dtype=dtype)
    causal_conv1d_fn(x, torch.randn(dim, 4, dtype=dtype), None, activation="silu")
    (name, _, got), = kset.launches  # fmt: skip
    assert name.endswith(f"_w4_{layout}") and got == grid and seen == [threads]


@pytest.mark.parametrize(
    ("dtype", "seqlen", "dim", "layout", "grid"),
    [
        (torch.bfloat16, 2112, 600, "cl_vec", (132, 3, 2)),  # 132 tiles of 16: one per SM
        (torch.bfloat16, 2113, 600, "cl_cf", (133 * 3, 1, 2)),  # more tiles than SMs
        (torch.bfloat16, 16384, 256, "cl_cf", (1024, 1, 2)),  # one channel block
        (torch.float32, 4096, 300, "cl_cf", (256 * 3, 1, 2)),  # 128 float32 channels a block
        (torch.float32, 100, 300, "cl_vec", (7, 3, 2)),
    ],
)
def test_channel_last_forward_block_order(monkeypatch, dtype, seqlen, dim, layout, grid):
    """Channel-last rows of more 16-position tiles than the GPU has multiprocessors take the
    kernel whose consecutive blocks walk the channel blocks (cl_cf, a 1-D grid); shorter ones
    the one walking positions (cl_vec, channel blocks in grid y)."""
    from mamba2_rocm.ops import conv1d as ops

    kset = stand_in_kernels(monkeypatch, ops)
    monkeypatch.setattr(ops, "sm_count", lambda device: 132)
    x = torch.randn(2, seqlen, dim, dtype=dtype).transpose(1, 2)
    causal_conv1d_fn(x, torch.randn(dim, 4, dtype=dtype), None, activation="silu")
    (name, _, got), = kset.launches  # fmt: skip
    assert name.endswith(f"_w4_{layout}") and got == grid


def test_backward_tiles_per_block():
    """One tile per block while the grid has at most BWD_BLOCKS_PER_SM blocks per
    multiprocessor; beyond that blocks walk more tiles (never more than a row has)."""
    from mamba2_rocm.ops.conv1d import BWD_BLOCKS_PER_SM, bwd_tiles_per_block

    sms = 132
    assert bwd_tiles_per_block(4, 10, sms) == 1  # few blocks: one tile each
    assert bwd_tiles_per_block(32, 68 * 8, sms) == 32 * 68 * 8 // (BWD_BLOCKS_PER_SM * sms)
    assert bwd_tiles_per_block(4, 10**6, sms) == 4  # at most the whole row
    assert bwd_tiles_per_block(100, 10**6, 0) == 1  # no GPU (stand-ins): one tile each


def _cl(b, d, L, dtype, width=None, start=0):
    """A channel-last (b, d, L) view: rows of ``width`` channels (default d) from ``start``."""
    big = torch.randn(b, L, width or d, dtype=dtype)
    return big[:, :, start : start + d].transpose(1, 2)


BF, F32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize(
    ("dtype", "x", "dout", "seq", "shape", "grid", "threads"),
    [
        # channel-last in whole words: the walking kernel, 128 threads x 2 channels a block;
        # 2048 positions, 32 tiles of 64, 2 channel blocks, batch 2: one tile a block
        (BF, lambda: _cl(2, 512, 2048, BF), "like", False, "walk", (32, 2, 2), 128),
        (BF, lambda: _cl(2, 512, 2048, BF), "like", True, "walk_seq", (32, 2, 2), 128),
        # 97 channels: rows half a word out of step (dx too); a slice from mid-word; dout rows
        (BF, lambda: _cl(2, 97, 300, BF), "like", False, "cl", (10, 2, 2), 256),
        (BF, lambda: _cl(2, 97, 300, BF, 130, 1), "like", False, "cl", (10, 2, 2), 256),
        (BF, lambda: _cl(2, 96, 300, BF), "rows", False, "cl", (10, 2, 2), 256),
        # a float is a word: mid-word slices walk too
        (F32, lambda: _cl(2, 97, 300, F32, 130, 1), "like", False, "walk", (5, 1, 2), 128),
        # seqlen-contiguous 16-byte rows: the rows walk, 4 channels a block, 256-position tiles
        (BF, lambda: torch.randn(2, 10, 1032, dtype=BF), "like", False, "rwalk", (5, 3, 2), 128),
        # ... but with seq_idx, or rows not 16-byte aligned: the LDS rows kernel
        (BF, lambda: torch.randn(2, 10, 1032, dtype=BF), "like", True, "rows_seq", (3, 3, 2), 256),
        (BF, lambda: torch.randn(2, 10, 1037, dtype=BF), "like", False, "rows", (3, 3, 2), 256),
    ],
)
def test_backward_kernel_choice(monkeypatch, dtype, x, dout, seq, shape, grid, threads):
    """Which backward kernel each layout takes (ops.conv1d.bwd_shape), its grid and block."""
    from mamba2_rocm.ops import conv1d as ops

    kset = stand_in_kernels(monkeypatch, ops)
    monkeypatch.setattr(ops, "sm_count", lambda device: 132)
    seen = []

    def launch(launcher, x, p, grid, threads):
        seen.append(threads)
        launcher(p, grid, (threads, 1, 1), 0)

    monkeypatch.setattr(ops, "launch", launch)
    x = x()
    b, d, L = x.shape
    g = x.clone() if dout == "like" else torch.randn(b, d, L, dtype=dtype)
    seq_idx = torch.zeros(b, L, dtype=torch.int32) if seq else None
    ops.causal_conv1d_bwd(x, torch.randn(d, 4, dtype=dtype), None, seq_idx, None, g, None, True)
    (name, _, got), (reduce, _, rgrid) = kset.launches  # fmt: skip
    assert name.endswith(f"_w4_{shape}") and got == grid and seen == [threads, 256]
    # then dweight / dbias from the partial rows: 16 (channel, tap or bias) columns a block
    assert reduce == "m2r_conv1d_bwd_reduce" and rgrid == (-(-d * 5 // 16), 1, 1)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("dtype", "pdtype"), [(BF, BF), (BF, F32), (F32, F32)], ids=str)
def test_backward_reduce_launch(monkeypatch, dtype, pdtype, bias):
    """The reduce launch gets the partial rows the backward kernel writes (batch x its grid's
    ranges), the width, and dweight / dbias as the op returns them: new, contiguous, in the
    parameters' dtypes (their dtype codes), dbias null without a bias."""
    from mamba2_rocm.ops import conv1d as ops
    from mamba2_rocm.params import DTYPE_CODES, ConvBwdParams

    kset = stand_in_kernels(monkeypatch, ops)
    monkeypatch.setattr(ops, "sm_count", lambda device: 4)
    x = _cl(3, 70, 900, dtype)
    w = torch.randn(70, 5, dtype=pdtype)[:, :3]  # (a strided weight: dweight is contiguous)
    b = torch.randn(140, dtype=pdtype)[::2] if bias else None  # (a strided bias)
    dx, dw, db, _ = ops.causal_conv1d_bwd(x, w, b, None, None, x.clone(), None, True)
    (_, p, grid), (_, q, _) = kset.launches  # fmt: skip
    assert p == q  # (one parameter struct for both launches)
    f = ConvBwdParams(*q)
    assert (f.width, f.dim, f.partial_rows) == (3, 70, 3 * grid[0])
    assert f.dweight == dw.data_ptr() and dw.shape == (70, 3) and dw.is_contiguous()
    assert f.weight_dtype == DTYPE_CODES[str(pdtype).removeprefix("torch.")] and dw.dtype == pdtype
    if bias:
        assert f.dbias == db.data_ptr() and db.shape == (70,) and db.is_contiguous()
        assert f.bias_dtype == f.weight_dtype and db.dtype == pdtype
    else:
        assert f.dbias is None and db.numel() == 0
    assert f.dx == dx.data_ptr() and len({f.dweight, f.dbias, f.partial, f.dx}) == 4  # distinct


@pytest.mark.parametrize("op", ["forward", "backward", "update"])
def test_strided_vectors_reach_the_kernels_dense(monkeypatch, op):
    """The kernels index the bias and the update's cache_seqlens as dense vectors (the parameter
    structs carry no stride for them): a strided view reaches every launch as a unit-stride
    copy of its values, a dense vector as it is (no copy)."""
    from mamba2_rocm.ops import conv1d as ops

    kset = stand_in_kernels(monkeypatch, ops)
    ops._UPDATE_PLANS.clear()
    seen = []
    real = ops._dense
    monkeypatch.setattr(ops, "_dense", lambda t: seen.append((t, real(t))) or seen[-1][1])
    g = torch.Generator().manual_seed(7)
    d = 40
    x, w = _cl(2, d, 33, BF), torch.randn(d, 4, generator=g).to(BF)
    wide = torch.randn(2 * d, generator=g).to(BF)
    lengths = torch.tensor([3, 9, 5, 9], dtype=torch.int32)
    for b, cache in ((wide[::2], lengths[::2]), (wide[:d], lengths[:2])):
        kset.launches.clear()
        seen.clear()
        if op == "forward":
            ops.causal_conv1d_fwd(x, w, b, None, None, None, True)
        elif op == "backward":
            ops.causal_conv1d_bwd(x, w, b, None, None, x.clone(), None, True)
        else:
            state = torch.randn(2, d, 3).to(BF)
            causal_conv1d_update(x[:, :, 0].clone(), state, w, b, "silu", cache_seqlens=cache)
        launched = kset.launches[0][1]
        for t in (b, cache) if op == "update" else (b,):
            dense = next(d for given, d in seen if given is t)
            assert dense.stride() == (1,) and torch.equal(dense, t)
            assert (dense is t) == (t.stride(0) == 1)
            assert dense.data_ptr() in launched
            assert t.stride(0) == 1 or t.data_ptr() not in launched
    ops._UPDATE_PLANS.clear()
