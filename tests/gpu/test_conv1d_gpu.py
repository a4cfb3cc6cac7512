"""conv1d kernels on a GPU against the float64 reference: every layout, poisoned outputs, graphs.

Run with ``pytest -m gpu`` on a machine with a GPU and kernels (a kernel package, a build in
``MAMBA2_ROCM_KERNEL_PATH``, or a compiler for the just-in-time path).
"""

import pytest
import torch
from helpers import (
    DTYPES,
    TOL,
    gpu_available,
    make_seq_idx,
    make_x,
    poison_allocator,
    seeded,
    strided_view,
)

from mamba2_rocm import causal_conv1d_fn, causal_conv1d_update
from mamba2_rocm.reference.conv1d import causal_conv1d_torch, causal_conv1d_update_eager

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not gpu_available(), reason="needs a GPU (run on the device machine)"),
]

DEV = "cuda"
LAYOUTS = ["contiguous", "channel_last", "sliced", "channel_last_sliced"]


def _ref(x, w, b, seq_idx=None, init=None, silu=False):
    return causal_conv1d_torch(x, w, b, seq_idx, init, silu, compute_dtype=torch.float64)


def _gen(*key):
    return seeded(*key, device=DEV)


def launched(monkeypatch) -> list[str]:
    """The names of the conv1d kernels launched from here on (the list fills as they run)."""
    import mamba2_rocm.ops.conv1d as ops

    names = []
    real = ops.launch

    def spy(launcher, *args):
        names.append(launcher.name)
        return real(launcher, *args)

    monkeypatch.setattr(ops, "launch", spy)
    return names


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seqlen", [1, 2, 129, 151, 1134, 4096])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [2, 3, 4])
def test_fwd_kernel(width, dtype, seqlen, layout):
    g = _gen(width, str(dtype), seqlen, layout)
    dim = 4128 if (seqlen + width) % 3 == 0 else 64
    has_bias, silu = seqlen % 2 == 1, width != 3
    x = make_x(2, dim, seqlen, dtype, layout, device=DEV, gen=g)
    w = torch.randn(dim, width, device=DEV, generator=g).to(dtype if width != 2 else torch.float32)
    b = torch.randn(dim, device=DEV, generator=g).to(dtype) if has_bias else None
    poison_allocator(x.numel() * x.element_size())
    out = causal_conv1d_fn(x, w, b, activation="silu" if silu else None)
    ref, _ = _ref(x, w, b, silu=silu)
    assert not out.isnan().any(), "unwritten output elements"
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seqlen", [1, 2, 3, 151, 1134])
@pytest.mark.parametrize("width", [2, 3, 4])
def test_fwd_states(width, seqlen, layout):
    g = _gen("states", width, seqlen, layout)
    dtype = torch.bfloat16
    x = make_x(3, 136, seqlen, dtype, layout, device=DEV, gen=g)
    w = torch.randn(136, width, device=DEV, generator=g).to(dtype)
    init = torch.randn(3, width - 1, 136, device=DEV, generator=g).to(dtype).transpose(1, 2)
    fin = torch.full((3, 136, width - 1), float("nan"), device=DEV, dtype=dtype)
    out, fin_out = causal_conv1d_fn(
        x, w, None, initial_states=init, return_final_states=True, final_states_out=fin
    )
    ref, ref_fin = _ref(x, w, None, init=init)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    assert fin_out is fin and torch.equal(fin, ref_fin)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [2, 3, 4])
def test_fwd_seq_idx(width, dtype, layout):
    g = _gen("seq", width, str(dtype), layout)
    x = make_x(4, 264, 1134, dtype, layout, device=DEV, gen=g)
    w = torch.randn(264, width, device=DEV, generator=g).to(dtype)
    b = torch.randn(264, device=DEV, generator=g).to(dtype)
    seq = make_seq_idx(4, 1134, device=DEV)
    out = causal_conv1d_fn(x, w, b, seq_idx=seq, activation="silu")
    ref, _ = _ref(x, w, b, seq_idx=seq, silu=True)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    pad = (seq < 0).unsqueeze(1).expand_as(out)  # padding tokens: exactly 0
    assert pad.any() and not out[pad].any()


@pytest.mark.parametrize("seq", [False, True], ids=["plain", "seq_idx"])
@pytest.mark.parametrize("seqlen", [40, 704, 2104])  # 16-bit rows: a multiple of 8 tokens
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [2, 3, 4])
def test_fwd_kernels_agree_bit_for_bit(monkeypatch, width, dtype, seqlen, seq):
    """The same inputs through the seqlen-contiguous kernels (vec_m / vec_s / vec by seqlen), the
    channel-last one in both block orders (cl_vec, cl_cf) and the any-strides one give the same
    bits: one tap order, one SiLU (silu_fast) in all, so a caller's memory layout never changes
    its outputs. dim 600: several channel blocks, the last one partial (256 16-bit or 128 float32
    channels a block)."""
    import mamba2_rocm.ops.conv1d as ops

    names = launched(monkeypatch)
    g = _gen("agree", width, str(dtype), seqlen, seq)
    batch, dim = 2, 600
    x = torch.randn(batch, dim, seqlen, device=DEV, generator=g).to(dtype)
    x_cl = x.transpose(1, 2).contiguous().transpose(1, 2)
    wide = torch.empty(batch, dim, seqlen + 1, device=DEV, dtype=dtype)
    x_odd = wide[:, :, 1:].copy_(x)  # one element past 16-byte alignment: the any-strides kernel
    w = torch.randn(dim, width, device=DEV, generator=g).to(dtype)
    b = torch.randn(dim, device=DEV, generator=g).to(dtype)
    seq_idx = make_seq_idx(batch, seqlen, device=DEV) if seq else None
    run = lambda v: causal_conv1d_fn(v, w, b, seq_idx=seq_idx, activation="silu")  # noqa: E731
    outs = [run(x)]
    rule = ops._cl_layout
    for sms in (10**9, 0):  # more multiprocessors than tiles: cl_vec; none: cl_cf (> 1 tile)
        monkeypatch.setattr(ops, "_cl_layout", lambda *a, sms=sms: rule(*a[:-1], sms))
        outs.append(run(x_cl))
    outs.append(run(x_odd))
    kinds = [n.split(f"_w{width}_")[1].removesuffix("_seq") for n in names]
    want = ["cl_vec", "cl_cf", "strided"]
    assert kinds[0] in ("vec_m", "vec_s", "vec") and kinds[1:] == want, names
    ref, _ = _ref(x, w, b, seq_idx=seq_idx, silu=True)
    torch.testing.assert_close(outs[0], ref, **TOL[dtype])
    for out in outs[1:]:
        assert torch.equal(outs[0], out)


@pytest.mark.parametrize(
    ("seqlen", "layout16", "layout32"),
    [(8, "vec_m", "vec_m"), (24, "vec_m", "vec_m"), (256, "vec_m", "vec_m"),
     (264, "vec_m", "vec_s"), (504, "vec_m", "vec_s"), (512, "vec_m", "vec_s"),
     (520, "vec_s", "vec"), (1024, "vec_s", "vec"), (1032, "vec", "vec"), (2048, "vec", "vec"),
     (4104, "vec", "vec")],
)  # fmt: skip
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [2, 3, 4])
def test_fwd_seqlen_contiguous_tiles(monkeypatch, width, dtype, seqlen, layout16, layout32):
    """The seqlen-contiguous kernels (vec_m: 8 rows a block, vec_s, vec) at rows that fill their
    tiles, end inside them or span several, with initial and final states, then with seq_idx; 68
    channels leave vec_m's last block half empty. (The layouts above have odd seqlens, which
    these 16-byte kernels never see.) The layout that ran is checked: a float32 tile holds half
    the tokens of a 16-bit one."""
    import mamba2_rocm.ops.conv1d as ops

    names = launched(monkeypatch)
    g = _gen("tiles", width, str(dtype), seqlen)
    batch, dim = 3, 68
    x = make_x(batch, dim, seqlen, dtype, "contiguous", device=DEV, gen=g)
    w = torch.randn(dim, width, device=DEV, generator=g).to(dtype)
    b = torch.randn(dim, device=DEV, generator=g).to(dtype)
    init = torch.randn(batch, width - 1, dim, device=DEV, generator=g).to(dtype).transpose(1, 2)
    fin = torch.full((batch, dim, width - 1), float("nan"), device=DEV, dtype=dtype)
    poison_allocator(x.numel() * x.element_size())
    out, fin_out = causal_conv1d_fn(
        x,
        w,
        b,
        initial_states=init,
        return_final_states=True,
        final_states_out=fin,
        activation="silu",
    )
    ref, ref_fin = _ref(x, w, b, init=init, silu=True)
    assert not out.isnan().any(), "unwritten output elements"
    torch.testing.assert_close(out, ref, **TOL[dtype])
    assert fin_out is fin and torch.equal(fin, ref_fin)
    seq = make_seq_idx(batch, seqlen, device=DEV)
    poison_allocator(x.numel() * x.element_size())
    out = causal_conv1d_fn(x, w, b, seq_idx=seq, activation="silu")
    ref, _ = _ref(x, w, b, seq_idx=seq, silu=True)
    assert not out.isnan().any(), "unwritten output elements"
    torch.testing.assert_close(out, ref, **TOL[dtype])
    pad = (seq < 0).unsqueeze(1).expand_as(out)
    assert not out[pad].any()
    kernel = f"m2r_conv1d_fwd_{ops.KERNEL_DTYPE[dtype]}_w{width}_"
    kernel += layout32 if dtype == torch.float32 else layout16
    assert names == [kernel, kernel + "_seq"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("mode", ["shift", "shift_long_state", "circular", "circular view", "pool"])
@pytest.mark.parametrize("seqlen", [None, 1, 4])
def test_update_kernel(width, dtype, mode, seqlen):
    """The update against the eager reference in every state mode; "circular view": the cache
    lengths a strided view (every other element of a longer vector)."""
    g = _gen("upd", width, str(dtype), mode, seqlen)
    batch, dim = 5, 1032
    state_len = width - 1 + (3 if mode in ("shift_long_state", "circular", "circular view") else 0)
    pool = 9 if mode == "pool" else batch
    x = torch.randn(batch, dim, *(() if seqlen is None else (seqlen,)), device=DEV, generator=g).to(
        dtype
    )
    state = torch.randn(pool, dim, state_len, device=DEV, generator=g).to(dtype)
    w = torch.randn(dim, width, device=DEV, generator=g).to(dtype)
    b = torch.randn(dim, device=DEV, generator=g).to(dtype)
    cache = None
    if mode.startswith("circular"):
        cache = torch.tensor([0, 2, 5, 11, 3], dtype=torch.int32, device=DEV)
        if mode == "circular view":
            cache = strided_view(cache)
    idx = torch.tensor([7, -1, 0, 4, 2], dtype=torch.int32, device=DEV) if mode == "pool" else None
    ref_state = state.clone()
    poison_allocator(x.numel() * x.element_size())
    out = causal_conv1d_update(
        x, state, w, b, activation="silu", cache_seqlens=cache, conv_state_indices=idx
    )
    x3 = x if seqlen is not None else x.unsqueeze(-1)
    ref = causal_conv1d_update_eager(
        x3, ref_state, w, b, silu=True, cache_seqlens=cache, conv_state_indices=idx
    )
    ref = ref if seqlen is not None else ref.squeeze(-1)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **TOL[dtype])
    assert torch.equal(state, ref_state), "conv_state must be updated exactly"


@pytest.mark.parametrize("mode", ["plain", "pool", "float32 taps and bias", "no bias"])
@pytest.mark.parametrize("slots", ["width - 1", "width"])
@pytest.mark.parametrize("order", ["c", "s"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [2, 3, 4])
def test_update_vec_kernels(monkeypatch, width, dtype, order, slots, mode):
    """The _vec kernels at the models' decode layouts: x a channel slice of a wider projection
    (as a Mamba2 block's xBC), states in channel order (transformers' (batch, dim, width)
    cache) or slot order (mamba_ssm's transposed (batch, width, dim) one) of width - 1 or
    width slots; dim 2056 leaves each kernel's last block a few threads; float32 taps and
    bias with 16-bit x (their element-wise loads); the pool with a padded row (zeros) and a
    row out of range (NaN), neither touching a state. The kernel that ran is checked."""
    import mamba2_rocm.ops.conv1d as ops

    names = launched(monkeypatch)
    g = _gen("upd-vec", width, str(dtype), order, slots, mode)
    batch, dim = 6, 2056
    n_slots = width - 1 if slots == "width - 1" else width
    pool = 9 if mode == "pool" else batch
    proj = torch.randn(batch, dim + 136, device=DEV, generator=g).to(dtype)
    x = proj[:, 128 : 128 + dim]  # a 256-byte (16-bit) / 512-byte offset into each row
    if order == "c":
        state = torch.randn(pool, dim, n_slots, device=DEV, generator=g).to(dtype)
    else:
        state = torch.randn(pool, n_slots, dim, device=DEV, generator=g).to(dtype).transpose(1, 2)
    w = torch.randn(dim, width, device=DEV, generator=g)
    b = None if mode == "no bias" else torch.randn(dim, device=DEV, generator=g)
    if mode != "float32 taps and bias":
        w, b = w.to(dtype), None if b is None else b.to(dtype)
    idx = (
        torch.tensor([7, -1, 0, 4, 2, 9], dtype=torch.int32, device=DEV) if mode == "pool" else None
    )
    ref_state = state.clone()
    poison_allocator(x.numel() * x.element_size())
    out = causal_conv1d_update(x, state, w, b, activation="silu", conv_state_indices=idx)
    order = "c" if n_slots == 1 else order  # (one slot: the two orders are one layout)
    assert names == [f"m2r_conv1d_update_{ops.KERNEL_DTYPE[dtype]}_w{width}_vec_{order}{n_slots}"]
    ref_idx = None if idx is None else torch.where(idx < 9, idx, -1)  # (the reference raises)
    ref = causal_conv1d_update_eager(
        x.unsqueeze(-1), ref_state, w, b, silu=True, conv_state_indices=ref_idx
    ).squeeze(-1)
    if mode == "pool":
        assert not out[1].any() and out[5].isnan().all()
        keep = [0, 2, 3, 4]
        out, ref = out[keep], ref[keep]
    assert not out.isnan().any(), "unwritten output elements"
    torch.testing.assert_close(out, ref, **TOL[dtype])
    assert torch.equal(state, ref_state), "conv_state must be updated exactly"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_update_vec_channel_order_two_channels_a_thread(monkeypatch, dtype):
    """transformers' (batch, dim, 4) cache at width 4: a thread of the _vec kernel owns the
    channels of one 16-byte word of states (2 for 16-bit, 1 for float32), so dim 1030 (not a
    multiple of 8) still takes it, its last block partly idle."""
    import mamba2_rocm.ops.conv1d as ops

    names = launched(monkeypatch)
    g = _gen("upd-vec-c4", str(dtype))
    batch, dim = 3, 1030
    x = torch.randn(batch, dim, device=DEV, generator=g).to(dtype)
    state = torch.randn(batch, dim, 4, device=DEV, generator=g).to(dtype)
    w = torch.randn(dim, 4, device=DEV, generator=g).to(dtype)
    b = torch.randn(dim, device=DEV, generator=g).to(dtype)
    ref_state = state.clone()
    out = causal_conv1d_update(x, state, w, b, activation="silu")
    assert names == [f"m2r_conv1d_update_{ops.KERNEL_DTYPE[dtype]}_w4_vec_c4"]
    ref = causal_conv1d_update_eager(x.unsqueeze(-1), ref_state, w, b, silu=True).squeeze(-1)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    assert torch.equal(state, ref_state)


def test_update_out_of_range_index_is_loud():
    x = torch.randn(2, 64, device=DEV)
    state = torch.randn(3, 64, 3, device=DEV)
    before = state.clone()
    w = torch.randn(64, 4, device=DEV)
    out = causal_conv1d_update(
        x, state, w, conv_state_indices=torch.tensor([1, 3], dtype=torch.int32, device=DEV)
    )
    assert out[1].isnan().all() and not out[0].isnan().any()
    assert torch.equal(state[[0, 2]], before[[0, 2]])


def test_graph_capture_and_replay():
    g = _gen("graph")
    dtype = torch.bfloat16
    x = torch.randn(2, 256, 300, device=DEV, generator=g).to(dtype)
    w = torch.randn(256, 4, device=DEV, generator=g).to(dtype)
    b = torch.randn(256, device=DEV, generator=g).to(dtype)
    xs = torch.randn(2, 256, device=DEV, generator=g).to(dtype)
    state = torch.randn(2, 256, 3, device=DEV, generator=g).to(dtype)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up loads the modules outside capture
        causal_conv1d_fn(x, w, b, activation="silu")
        causal_conv1d_update(xs, state.clone(), w, b)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = causal_conv1d_fn(x, w, b, activation="silu")
        upd = causal_conv1d_update(xs, state, w, b)
    for _ in range(2):  # new data in the static inputs, then replay
        x.copy_(torch.randn(x.shape, device=DEV, generator=g))
        xs.copy_(torch.randn(xs.shape, device=DEV, generator=g))
        ref_state = state.clone()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, _ref(x, w, b, silu=True)[0], **TOL[dtype])
        ref = causal_conv1d_update_eager(xs.unsqueeze(-1), ref_state, w, b).squeeze(-1)
        torch.testing.assert_close(upd, ref, **TOL[dtype])
        assert torch.equal(state, ref_state)


def test_side_stream_ordering():
    """Launches go to torch's current stream: work queued before them on it is seen."""
    s = torch.cuda.Stream()
    x = torch.zeros(1, 64, 4096, device=DEV)
    w = torch.randn(64, 4, device=DEV)
    with torch.cuda.stream(s):
        torch.cuda._sleep(1_000_000)  # ~ms of GPU time before the fill
        x.fill_(1.0)
        out = causal_conv1d_fn(x, w)
    s.synchronize()
    torch.testing.assert_close(out[..., 10:], w.sum(1).view(1, 64, 1).expand(1, 64, 4086))


def test_torch_compile_traces_the_kernel_op():
    x = torch.randn(2, 64, 151, device=DEV)
    w = torch.randn(64, 4, device=DEV)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(x, w):
        return causal_conv1d_fn(x, w, activation="silu") * 2

    torch.testing.assert_close(
        f(x, w), 2 * _ref(x, w, None, silu=True)[0].float(), **TOL[torch.float32]
    )


def test_kernel_tier_is_really_used(monkeypatch):
    """Guard against a test suite that silently exercises the torch fallback."""
    import mamba2_rocm.reference.conv1d as ref

    def boom(*a, **k):
        raise AssertionError("fallback used")

    monkeypatch.setattr(ref, "causal_conv1d_torch", boom)
    monkeypatch.setattr(ref, "causal_conv1d_update_torch", boom)
    causal_conv1d_fn(torch.randn(1, 8, 32, device=DEV), torch.randn(8, 4, device=DEV))
    causal_conv1d_update(
        torch.randn(1, 8, device=DEV),
        torch.randn(1, 8, 3, device=DEV),
        torch.randn(8, 4, device=DEV),
    )


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_bias(dtype, layout):
    """A strided bias view (every other element of a longer vector) gives the same bits as its
    dense copy in the forward (each layout's kernel), the backward (every gradient, the bias's
    too) and the decode update: the kernels index the bias densely and get a copy of it."""
    g = _gen("strided bias", str(dtype), layout)
    dim, seqlen = 300, 151
    x = make_x(2, dim, seqlen, dtype, layout, device=DEV, gen=g)
    w = torch.randn(dim, 4, device=DEV, generator=g).to(dtype)
    wide = torch.randn(2 * dim, device=DEV, generator=g).to(dtype)
    state0 = torch.randn(2, dim, 3, device=DEV, generator=g).to(dtype)
    runs = []
    for dense in (False, True):
        xg, wg, bg = (t.detach().clone().requires_grad_() for t in (x, w, wide))
        b = bg[::2].contiguous() if dense else bg[::2]  # (the gradient reaches bg either way)
        out = causal_conv1d_fn(xg, wg, b, activation="silu")
        out.backward(torch.ones_like(out))
        state = state0.clone()
        upd = causal_conv1d_update(x[:, :, 0].contiguous(), state, w, b.detach(), activation="silu")
        runs.append((out, xg.grad, wg.grad, bg.grad, upd, state))
    ref, _ = _ref(x, w, wide[::2], silu=True)
    torch.testing.assert_close(runs[0][0], ref, **TOL[dtype])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)
