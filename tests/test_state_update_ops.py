"""selective_state_update through the public op on the CPU: tiers, registration, both forms."""

import pytest
import torch
from helpers import RecordingKernels, seeded, stand_in_kernels

from mamba2_rocm import selective_state_update
from mamba2_rocm.ops import state_update as ops
from mamba2_rocm.ops._launch import KERNEL_DTYPE, as_kernel_float
from mamba2_rocm.ops.checks import StateUpdateDims
from mamba2_rocm.params import SsuParams
from mamba2_rocm.reference.ssd import selective_state_update_ref


def _inputs(g, b=3, h=4, p=8, n=16, groups=2, heads=True, pool=None):
    pool = pool or b
    if not heads:
        d = h * p
        return dict(
            state=torch.randn(pool, d, n, generator=g), x=torch.randn(b, d, generator=g),
            dt=torch.rand(b, d, generator=g), A=-torch.rand(d, n, generator=g),
            B=torch.randn(b, n, generator=g), C=torch.randn(b, n, generator=g),
        )  # fmt: skip
    return dict(
        state=torch.randn(pool, h, p, n, generator=g), x=torch.randn(b, h, p, generator=g),
        dt=torch.rand(b, h, p, generator=g), A=-torch.rand(h, p, n, generator=g),
        B=torch.randn(b, groups, n, generator=g), C=torch.randn(b, groups, n, generator=g),
        D=torch.randn(h, p, generator=g), z=torch.randn(b, h, p, generator=g),
        dt_bias=torch.randn(h, p, generator=g),
    )  # fmt: skip


@pytest.mark.parametrize("heads", [True, False])
@pytest.mark.parametrize("tier", ["auto", "torch", "eager"])
def test_public_op_matches_reference(heads, tier, backend):
    backend(tier)
    args = _inputs(seeded("ssu", heads, tier), heads=heads)
    ref_state = args["state"].clone()
    ref = selective_state_update_ref(
        **{**args, "state": ref_state}, dt_softplus=True, compute_dtype=torch.float64
    )
    out = selective_state_update(**args, dt_softplus=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(args["state"], ref_state, rtol=1e-5, atol=1e-5)


def test_errors_name_the_value():
    args = _inputs(seeded("err"))
    with pytest.raises(
        ValueError,
        match=r"C must have shape \(batch, ngroups, dstate\) like B = \(3, 3, 16\), got \(3, 2, 16\)",
    ):
        selective_state_update(**{**args, "B": torch.randn(3, 3, 16)})
    with pytest.raises(ValueError, match="divisible"):
        selective_state_update(**{**args, "B": torch.randn(3, 3, 16), "C": torch.randn(3, 3, 16)})


def test_opcheck():
    args = _inputs(seeded("opcheck"))
    idx = torch.tensor([2, -1, 0], dtype=torch.int32)
    for extra in [(False, None), (True, idx)]:
        a = [args[k] for k in ("state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias")]
        torch.library.opcheck(ops.selective_state_update_op, (*a, *extra))


def test_torch_compile_fullgraph():
    args = _inputs(seeded("compile"))
    ref_state = args["state"].clone()
    ref = selective_state_update(**{**args, "state": ref_state})

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(**kw):
        return selective_state_update(**kw)

    torch.testing.assert_close(step(**args), ref)
    torch.testing.assert_close(args["state"], ref_state)


# --- the validated-signature cache of the kernel path ------------------------------------------

_ORDER = ("state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias")


def _pos(args, softplus=True, idx=None):
    return (*(args.get(k) for k in _ORDER), softplus, idx)


@pytest.fixture
def fresh_plans():
    ops.clear_plan_cache()
    yield
    ops.clear_plan_cache()


@pytest.fixture
def fake_kernels(monkeypatch, fresh_plans):
    kset = stand_in_kernels(monkeypatch, ops)
    # the general kernels' index check (m2r_state_rows) is a separate launch with its own
    # tests; here the indices pass through as they are, so the expected struct holds their
    # address (the contiguous-layout kernels read the caller's indices and check them)
    monkeypatch.setattr(ops, "checked_state_rows", lambda kset, idx, pool: idx)
    return kset


def _expected_launch(state, x, dt, A, B, C, D, z, dt_bias, softplus, idx, out):
    """The parameter struct, kernel name and grid as the uncached code computed them."""
    from mamba2_rocm.ops._launch import DTYPE_CODE

    if x.dim() == 2:  # Mamba1: one head
        state, x, dt, A, B, C, out = (t.unsqueeze(d) for t, d in zip(
            (state, x, dt, A, B, C, out), (1, 1, 1, 0, 1, 1, 1), strict=True))  # fmt: skip
        D, z = (None if D is None else D.unsqueeze(0)), (None if z is None else z.unsqueeze(1))
        dt_bias = None if dt_bias is None else dt_bias.unsqueeze(0)
    b, h, p = x.shape
    n, g = state.shape[-1], B.shape[1]

    def ptr(t):
        return 0 if t is None else t.data_ptr()

    def st(t, k):
        return (0,) * k if t is None else tuple(t.stride())

    params = (
        *(ptr(t) for t in (state, x, dt, A, B, C, D, z, dt_bias, out, idx)),
        *state.stride(),
        *x.stride(),
        *dt.stride(),
        *A.stride(),
        *B.stride(),
        *C.stride(),
        *st(D, 2),
        *st(z, 3),
        *st(dt_bias, 2),
        *out.stride(),
        0 if idx is None else idx.stride(0),
        b,
        h,
        p,
        n,
        h // g,
        state.shape[0],
        int(softplus),
        DTYPE_CODE[dt.dtype],
        DTYPE_CODE[A.dtype],
        DTYPE_CODE[D.dtype] if D is not None else 0,
        DTYPE_CODE[dt_bias.dtype] if dt_bias is not None else 0,
        int(idx is not None and idx.dtype == torch.int64),
        0,
        0,
    )  # fmt: skip  (the caller's indices, read and checked by the kernel: a small batch)
    tier = next(t for t in (32, 64, 128, 256) if n <= t)
    vec = 16 // state.element_size()  # a lane's 16 bytes of state
    b_align = 16 if vec * B.element_size() == 16 else 8
    layout = (
        n == tier and tier * state.element_size() <= 512  # a row: at most 32 lanes of 16 bytes
        and state.stride(-1) == 1 and B.stride(-1) == 1 and C.stride(-1) == 1
        and (A.stride(-1) == 1 or (A.stride(-1) == 0 and A.stride(-2) == 0))
        and all(s % vec == 0 for s in state.stride()[:-1]) and state.data_ptr() % 16 == 0
        and all(s * t.element_size() % b_align == 0 and t.data_ptr() % b_align == 0
                for t in (B, C) for s in t.stride()[:-1])
    )  # fmt: skip
    fits = ops.int32_offsets(state, x, dt, A, B, C, D, z, dt_bias, out)
    rows_pass = ops._THREADS // (tier // vec)
    wide = -(-p // (ops.SSU_ROWS_PER_WIDE * rows_pass))
    # _std: a Mamba2 block's parameters (tied float32 A, float32 D / dt_bias, dt as x)
    std = fits and (A.stride(-1) == 0 and A.stride(-2) == 0 and dt.dtype == x.dtype
                    and all(t is None or t.dtype == torch.float32 for t in (A, D, dt_bias)))  # fmt: skip
    wide_from = ops.STD_WIDE_KERNEL_MIN_BLOCKS if std else ops.WIDE_KERNEL_MIN_BLOCKS
    if layout and (wide * h * b >= wide_from or not fits):
        suffix, grid = "_contig", (wide, h, b)
    elif layout:
        suffix, grid = "_rows_std" if std else "_rows", (-(-p // rows_pass), h, b)
    else:
        suffix, grid = "", (-(-p // (ops._THREADS // 32)), h, b)
    bcz = "_f32bcz" if B.dtype != x.dtype else ""
    name = f"m2r_ssu_{KERNEL_DTYPE[state.dtype]}_{KERNEL_DTYPE[x.dtype]}{bcz}_n{tier}"
    return name + suffix, params, grid


def _tied(g, b=3, h=4, p=8, n=32, groups=2, dtype=torch.bfloat16):
    """Decode inputs as HF transformers passes them: stride-0 A/dt/dt_bias/D views."""
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(
        state=r(b, h, p, n).to(dtype), x=r(b, h, p).to(dtype), z=r(b, h, p).to(dtype),
        dt=torch.rand(b, h, generator=g).to(dtype)[:, :, None].expand(b, h, p),
        A=(-torch.rand(h, generator=g))[:, None, None].expand(h, p, n),
        dt_bias=r(h)[:, None].expand(h, p), D=r(h)[:, None].expand(h, p),
        B=r(b, groups, n).to(dtype), C=r(b, groups, n).to(dtype),
    )  # fmt: skip


def _misaligned(t):
    """t's values at an address one element past an aligned one (same shape and strides)."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype)[1:]
    return flat.view(t.shape).copy_(t)


_LAYOUTS = {
    "plain": lambda g: (_inputs(g, n=32), None),
    "tied": lambda g: (_tied(g), None),
    "no optionals": lambda g: (
        {k: v for k, v in _inputs(g).items() if k not in ("D", "z", "dt_bias")},
        None,
    ),
    "mamba1": lambda g: (_inputs(g, heads=False), None),
    "pool": lambda g: (_inputs(g, pool=5, n=32), torch.tensor([4, 0, 2], dtype=torch.int32)),
    # dstate 128: a lane's 16 bytes of B, so B one element off its alignment rules them out
    "misaligned B": lambda g: ({**(a := _tied(g, n=128)), "B": _misaligned(a["B"])}, None),
    # state rows 132 elements apart: 8-byte aligned, not the 16 bytes a lane moves
    "8-byte state rows": lambda g: (
        {**(a := _tied(g, n=128)), "state": _padded_rows(a["state"], 4)},
        None,
    ),
    # float32 B / C with bf16 state: a lane's 8 elements are 32 bytes, read 8 bytes at a time
    "float32 B, C": lambda g: (
        {**(a := _tied(g, n=64)), "B": a["B"].float(), "C": a["C"].float(), "z": a["z"].float()},
        None,
    ),
}
#: Which layouts the contiguous-layout kernels take (_contig at block threshold 0, else _rows).
_CONTIGUOUS = {"plain": True, "tied": True, "no optionals": False, "mamba1": False, "pool": True,
             "misaligned B": False, "8-byte state rows": False, "float32 B, C": True}  # fmt: skip


def _padded_rows(t, pad):
    """t's values in a buffer whose last dimension is pad elements longer."""
    buf = torch.zeros(*t.shape[:-1], t.shape[-1] + pad, dtype=t.dtype)
    view = buf[..., : t.shape[-1]]
    return view.copy_(t)


@pytest.mark.parametrize("blocks", [0, 1 << 40], ids=["wide kernel", "per-row kernel"])
@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_cached_launch_matches_uncached_formula(layout, blocks, fake_kernels, monkeypatch):
    """Every call, cached or not, launches what the per-call code computed (new addresses)."""
    monkeypatch.setattr(ops, "WIDE_KERNEL_MIN_BLOCKS", blocks)
    monkeypatch.setattr(ops, "STD_WIDE_KERNEL_MIN_BLOCKS", blocks)
    for step in range(3):  # the first call builds the plan, the others reuse it
        args, idx = _LAYOUTS[layout](seeded("plan", layout, step))
        out = ops.selective_state_update(**args, dt_softplus=step != 1, state_batch_indices=idx)
        assert out.shape == args["x"].shape and out.dtype == args["x"].dtype
        assert out.is_contiguous()
        expected = _expected_launch(*_pos(args, step != 1, idx), out)
        assert fake_kernels.launches[-1] == expected
        assert expected[0].endswith("_contig") == (blocks == 0 and _CONTIGUOUS[layout])
        assert ("_rows" in expected[0]) == (blocks != 0 and _CONTIGUOUS[layout])
    assert len(fake_kernels.launches) == 3


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("form", ["wide", "rows", "general", "large batch"])
def test_pool_indices_cost_one_launch_where_the_kernel_checks_them(form, index_dtype,
                                                                   fresh_plans, monkeypatch):  # fmt: skip
    """Issue #72's "one launch per op where two run now": at small batches the contiguous-layout
    kernels read the caller's int32 / int64 indices (strided: every other element here) and
    check range and duplicates themselves (csrc/state_rows.h), one launch a call; the general
    kernel (inside it, the check spilled on AMD) and batches above
    SSU_CHECK_IN_KERNEL_MAX_BATCH read the int32 copy m2r_state_rows checks first."""
    from mamba2_rocm.ops import _launch

    kset = stand_in_kernels(monkeypatch, ops)
    monkeypatch.setattr(_launch, "launch", lambda launcher, x, p, grid, threads:
                        launcher(p, grid, (threads, 1, 1), 0))  # fmt: skip
    for name in ("WIDE_KERNEL_MIN_BLOCKS", "STD_WIDE_KERNEL_MIN_BLOCKS"):
        monkeypatch.setattr(ops, name, 0 if form == "wide" else 1 << 40)
    batch = ops.SSU_CHECK_IN_KERNEL_MAX_BATCH + 1 if form == "large batch" else 3
    args = _inputs(seeded("pool launches", form), b=batch, pool=batch + 2, n=32)
    if form == "general":  # B with a non-unit dstate stride: only the general kernel reads it
        args["B"] = torch.stack([args["B"], args["B"]], -1)[..., 0]
    rows = torch.randperm(batch + 2, generator=seeded("pool rows", form))[:batch]
    idx = torch.stack([rows, rows + 100]).T.flatten().to(index_dtype)[::2]  # a strided view
    ops.selective_state_update(**args, dt_softplus=True, state_batch_indices=idx)
    names = [name for name, _, _ in kset.launches]
    fields = dict(zip((f for f, _ in SsuParams._fields_), kset.launches[-1][1], strict=True))
    if form in ("general", "large batch"):
        assert names[0] == "m2r_state_rows" and len(names) == 2
        assert (form == "general") == ("_rows" not in names[1] and "_contig" not in names[1])
        rows_params = kset.launches[0][1]  # (in, out, in_stride, batch, num_states, in_int64)
        assert rows_params[0] == idx.data_ptr() and rows_params[2] == 2
        assert rows_params[5] == int(index_dtype == torch.int64)
        assert fields["state_indices"] == rows_params[1]  # the checked int32 copy
        assert (fields["indices_stride"], fields["indices_int64"], fields["indices_checked"]) == (
            1,
            0,
            1,
        )
    else:
        assert len(names) == 1 and names[0].endswith("_contig" if form == "wide" else "_rows")
        assert fields["state_indices"] == idx.data_ptr()
        assert (fields["indices_stride"], fields["indices_checked"]) == (2, 0)
        assert fields["indices_int64"] == int(index_dtype == torch.int64)
    assert fields["batch"] == batch and fields["num_states"] == batch + 2


@pytest.mark.parametrize("x_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "dtypes",
    [("x", "x", "x"), ("f32", "f32", "f32"), ("f32", "x", None), ("x", "x", "f32"),
     ("f64", "f32", "bf16"), ("bf16", "f16", "x")],
)  # fmt: skip
def test_kernels_read_b_c_z_unrounded(x_dtype, dtypes, fake_kernels):
    """mamba_ssm reads float32 B / C / z as float32 with half x: then the _f32bcz kernel is
    handed the caller's float32 tensors as they are, and the other operands in float32
    (exact); only when all three have x's dtype does the plain kernel read them in it."""
    named = {"x": x_dtype, "f32": torch.float32, "f64": torch.float64,
             "bf16": torch.bfloat16, "f16": torch.float16}  # fmt: skip
    args = _inputs(seeded("unrounded", x_dtype, dtypes), n=32)
    for k in ("state", "x", "dt"):
        args[k] = args[k].to(x_dtype)
    for k, d in zip(("B", "C", "z"), dtypes, strict=True):
        args[k] = None if d is None else args[k].to(named[d])
    for _ in range(2):  # the call that builds the plan, then one from the cache
        ops.selective_state_update(**args)
        name, params, _ = fake_kernels.launches[-1]
        fields = dict(zip((f for f, _ in SsuParams._fields_), params, strict=True))
        given = [args[k] for k in ("B", "C", "z") if args[k] is not None]
        plain = x_dtype == torch.float32 or all(t.dtype == x_dtype for t in given)
        xd = KERNEL_DTYPE[x_dtype]
        assert name.startswith(f"m2r_ssu_{xd}_{xd}_n" if plain else f"m2r_ssu_{xd}_{xd}_f32bcz_n")
        read_as = x_dtype if plain else torch.float32
        for k in ("B", "C", "z"):
            t = args[k]
            if t is not None:  # the caller's tensor itself exactly when it already is what is read
                assert (fields[k] == t.data_ptr()) == (t.dtype == read_as), k
    assert len(fake_kernels.launches) == 2


@pytest.mark.parametrize("x_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bcz", [("x", "x", "x"), ("f32", "f32", None), ("f32", "x", "x"),
                                 ("bf16", "f16", "x"), ("x", "x", None)])  # fmt: skip
@pytest.mark.parametrize("params", [("f32", "f32", "f32", "f32"), ("x", "f32", None, None),
                                    ("f64", "f32", "f32", "f32"), ("f32", "f32", "f64", None)])  # fmt: skip
def test_operands_as_is_is_what_the_conversions_do(x_dtype, bcz, params):
    """The cached plan skips bcz_operands / as_kernel_float exactly when both would hand back
    every operand itself, for any dtype mix."""
    named = {"x": x_dtype, "f32": torch.float32, "f64": torch.float64,
             "bf16": torch.bfloat16, "f16": torch.float16}  # fmt: skip
    x = torch.zeros(2, 3, 4, dtype=x_dtype)
    B, C, z = (None if d is None else torch.zeros(2, 1, 8, dtype=named[d]) for d in bcz)
    dt, A, D, dt_bias = (None if d is None else torch.zeros(3, dtype=named[d]) for d in params)
    converted = (*ops.bcz_operands(x, B, C, z), *(as_kernel_float(t) for t in (dt, A, D, dt_bias)))
    unchanged = all(a is b for a, b in zip(converted, (B, C, z, dt, A, D, dt_bias), strict=True))
    assert ops.operands_as_is(x, dt, A, B, C, D, z, dt_bias) == unchanged


def test_layouts_with_equal_shapes_get_their_own_plans(fake_kernels):
    """Same shapes and dtypes, different strides: each call launches with its own strides."""
    plain = _inputs(seeded("same shapes"), n=32)
    h, p, n = plain["A"].shape
    tied = {
        **plain,
        "A": plain["A"][:, :1, :1].expand(h, p, n),
        "dt": plain["dt"][:, :, :1].expand(plain["dt"].shape),
        "D": plain["D"][:, :1].expand(h, p),
        "dt_bias": plain["dt_bias"][:, :1].expand(h, p),
        "z": torch.randn(3, 2 * h, p)[:, ::2],
    }
    for name in ("A", "dt", "D", "dt_bias", "z"):
        one = {**plain, name: tied[name]}
        for args in (plain, one, tied, one, plain):
            out = ops.selective_state_update(**args)
            assert fake_kernels.launches[-1] == _expected_launch(*_pos(args, False), out)
    assert len(ops._PLANS) == 7


def test_hits_skip_the_checks(fake_kernels, monkeypatch):
    """What the cache is for: a repeated layout runs neither the checks nor the planning."""
    calls = []

    def counted(fn):
        return lambda *a, **k: calls.append(fn.__name__) or fn(*a, **k)

    for name in ("check_state_update_args", "_kernel_plan"):
        monkeypatch.setattr(ops, name, counted(getattr(ops, name)))
    for step in range(4):
        ops.selective_state_update(**_tied(seeded("hits", step)), dt_softplus=True)
    assert calls == ["check_state_update_args", "_kernel_plan"]
    assert len(fake_kernels.launches) == 4


@pytest.mark.parametrize("std", [True, False], ids=["Mamba2 parameters", "bfloat16 D"])
def test_head_kernel_threshold_is_read_per_call(std, fake_kernels, monkeypatch):
    """Each per-row kernel has its own threshold, read per call; the other one does not move it."""
    args = _tied(seeded("threshold"))
    if not std:
        args["D"] = args["D"].bfloat16()
    mine, other = ("STD_WIDE_KERNEL_MIN_BLOCKS", "WIDE_KERNEL_MIN_BLOCKS")[:: 1 if std else -1]
    rows = "_rows_std" if std else "_rows"
    for blocks, suffix in ((0, "_contig"), (1 << 40, rows), (0, "_contig")):
        monkeypatch.setattr(ops, mine, blocks)
        monkeypatch.setattr(ops, other, 1 << 40 if blocks == 0 else 0)
        ops.selective_state_update(**args)
        assert fake_kernels.launches[-1][0] == "m2r_ssu_bf16_bf16_n32" + suffix


def _meta_step(h=3, h_stride=None, x_batch_stride=None):
    """A decode step's tensors on the meta device (shapes and strides only, no memory): batch 2,
    headdim 4, dstate 32, bf16, the state's heads h_stride elements apart."""
    b, p, n = 2, 4, 32
    h_stride = p * n if h_stride is None else h_stride
    meta = lambda shape, stride, dtype=torch.bfloat16: torch.empty_strided(  # noqa: E731
        shape, stride, dtype=dtype, device="meta"
    )
    x = meta((b, h, p), (h * p if x_batch_stride is None else x_batch_stride, p, 1))
    args = dict(
        state=meta((b, h, p, n), (h * h_stride, h_stride, n, 1)), x=x, dt=meta((b, h, p), (h, 1, 0)),
        A=meta((h, p, n), (1, 0, 0), torch.float32), B=meta((b, 1, n), (n, n, 1)),
        C=meta((b, 1, n), (n, n, 1)), D=meta((h, p), (1, 0), torch.float32),
        z=meta((b, h, p), (h * p, p, 1)), dt_bias=meta((h, p), (1, 0), torch.float32),
    )  # fmt: skip
    dims = StateUpdateDims(
        batch=b, nheads=h, headdim=p, dstate=n, ngroups=1, pool=b, has_heads=True
    )
    return args, dims, torch.empty_like(x)


#: the state's head stride at which its last element of a batch row is exactly INT32_OFFSET_MAX
#: (3 heads: 2 strides + 3 rows of 32 + 31; a multiple of the 8 elements a lane moves)
_EDGE = (ops.INT32_OFFSET_MAX - 3 * 32 - 31) // 2


@pytest.mark.parametrize("case, fits", [
    ("at the int32 edge", True), ("one lane past it", False),
    ("a huge stride of a size-1 dim", True), ("a huge batch stride", True),
])  # fmt: skip
def test_rows_kernel_only_where_offsets_fit_int32(case, fits):
    """The _rows kernels index within a batch row in 32 bits: a layout whose offsets there pass
    INT32_OFFSET_MAX takes the _contig kernel (64-bit offsets) at every batch instead, checked
    without allocating (meta tensors)."""
    assert _EDGE % 8 == 0 and 2 * _EDGE + 3 * 32 + 31 == ops.INT32_OFFSET_MAX
    args, dims, out = {
        "at the int32 edge": lambda: _meta_step(h_stride=_EDGE),
        "one lane past it": lambda: _meta_step(h_stride=_EDGE + 8),
        "a huge stride of a size-1 dim": lambda: _meta_step(h=1, h_stride=1 << 40),
        "a huge batch stride": lambda: _meta_step(x_batch_stride=1 << 40),
    }[case]()
    plan = ops._kernel_plan(*args.values(), True, dims, out)
    assert plan.contig[0] == "m2r_ssu_bf16_bf16_n32_contig"
    assert plan.rows == (
        (plan.contig[0][: -len("_contig")] + "_rows_std", (1, dims.nheads, 2))
        if fits
        else plan.contig
    )


@pytest.mark.parametrize("sdt, kernel", [
    (torch.bfloat16, "m2r_ssu_bf16_bf16_n256_rows_std"), (torch.float16, "m2r_ssu_f16_bf16_n256_rows_std"),
    (torch.float32, "m2r_ssu_f32_bf16_n256"),
])  # fmt: skip
def test_dstate_256_contiguous_for_16_bit_states(sdt, kernel, fake_kernels):
    """dstate 256 (Falcon-H1) takes the contiguous-layout kernels with 16-bit states (a row's 32
    lanes of 16 bytes), the general kernel with float32 ones (64 lanes)."""
    args = _tied(seeded("n256", str(sdt)), n=256)
    args["state"] = args["state"].to(sdt)
    out = ops.selective_state_update(**args, dt_softplus=True)
    assert fake_kernels.launches[-1][0] == kernel
    assert fake_kernels.launches[-1] == _expected_launch(*_pos(args), out)


@pytest.mark.parametrize("change, std", [
    ("none", True), ("no D, no dt_bias", True), ("float32 x and dt", True),
    ("A per headdim row", False), ("A per element", False), ("bfloat16 A", False),
    ("bfloat16 D", False), ("float16 dt_bias", False), ("float32 dt", False),
])  # fmt: skip
def test_rows_std_kernel_only_for_mamba2_parameters(change, std, fake_kernels, monkeypatch):
    """The per-row kernel with the parameters' dtypes fixed (_rows_std) runs exactly where they
    are a Mamba2 block's: A one float32 value per head, float32 D / dt_bias, dt in x's dtype."""
    monkeypatch.setattr(ops, "WIDE_KERNEL_MIN_BLOCKS", 1 << 40)
    args = _tied(seeded("std", change))
    h, p, n = args["A"].shape
    changed = {
        "none": {},
        "no D, no dt_bias": {"D": None, "dt_bias": None},
        "float32 x and dt": {k: args[k].float() for k in ("x", "dt", "z", "B", "C")},
        "A per headdim row": {"A": -torch.rand(h, p, 1).expand(h, p, n)},
        "A per element": {"A": -torch.rand(h, p, n)},
        "bfloat16 A": {"A": args["A"].bfloat16()},
        "bfloat16 D": {"D": args["D"].bfloat16()},
        "float16 dt_bias": {"dt_bias": args["dt_bias"].half()},
        "float32 dt": {"dt": args["dt"].float()},
    }[change]
    args = {**args, **changed}
    out = ops.selective_state_update(**args, dt_softplus=True)
    assert fake_kernels.launches[-1] == _expected_launch(*_pos(args), out)
    assert fake_kernels.launches[-1][0].endswith("_rows_std" if std else "_rows")


def _base():
    return _inputs(seeded("sig"))


def _variants():
    """(name, args) that differ from _base() in one thing the checks or the launch depend on."""
    base = _base()
    x = base["x"]
    yield "shape", {**base, "x": torch.randn(3, 4, 9)}
    yield "stride", {**base, "x": torch.randn(3, 8, 4).transpose(1, 2)}
    yield "stride of a tied view", {**base, "A": base["A"][:, :1].expand(base["A"].shape)}
    yield "dtype", {**base, "x": x.double()}
    yield "stride of an optional", {**base, "dt_bias": base["dt_bias"][:, :1].expand(4, 8)}
    yield "dtype of an optional", {**base, "D": base["D"].half()}
    yield "device", {**base, "x": x.to("meta")}
    yield "device of an optional", {**base, "dt_bias": base["dt_bias"].to("meta")}
    yield "type", {**base, "x": x.as_subclass(torch.nn.Parameter)}
    for k in ("D", "z", "dt_bias"):
        yield f"{k} absent", {**base, k: None}


@pytest.mark.parametrize("name", [n for n, _ in _variants()])
def test_signature_changes_with_layout(name):
    args = dict(_variants())[name]
    assert ops._signature(*_pos(args)) != ops._signature(*_pos(_base()))


def test_signature_changes_with_flags_and_indices():
    base = _pos(_base())
    assert ops._signature(*base) == ops._signature(*_pos(_base()))  # new tensors, same layouts
    assert ops._signature(*base[:-2], False, None) != ops._signature(*base)
    idx = torch.tensor([0, 1, 2], dtype=torch.int32)
    with_idx = ops._signature(*base[:-1], idx)
    assert with_idx != ops._signature(*base)
    assert with_idx != ops._signature(*base[:-1], idx.long())
    assert with_idx != ops._signature(*base[:-1], idx.to("meta"))
    assert with_idx != ops._signature(*base[:-1], torch.tensor([0, 1, 2, 0], dtype=torch.int32))


def _bad_inputs():
    """(name, args, state_batch_indices): each fails check_state_update_args."""
    a = _base()
    b, h, p, n = a["state"].shape
    yield "x not a tensor", {**a, "x": a["x"].tolist()}, None
    yield "D not a tensor", {**a, "D": a["D"].tolist()}, None
    yield "x dtype", {**a, "x": a["x"].int()}, None
    yield "x dims", {**a, "x": a["x"][0]}, None
    yield "x empty", {**a, "x": a["x"][:0]}, None
    yield "state device", {**a, "state": a["state"].to("meta")}, None
    yield "state empty", {**a, "state": a["state"][..., :0]}, None
    yield "state inner shape", {**a, "state": torch.randn(b, h, p + 1, n)}, None
    yield "headdim limit", {**a, **_inputs(seeded("big p"), p=129)}, None
    yield "dstate limit", {**a, **_inputs(seeded("big n"), n=257)}, None
    yield "dt shape", {**a, "dt": a["dt"][:, :, :1]}, None
    yield "dt dtype", {**a, "dt": a["dt"].to(torch.int64)}, None
    yield "A shape", {**a, "A": a["A"][..., :1]}, None
    yield "B dims", {**a, "B": a["B"][0]}, None
    yield "C like B", {**a, "C": torch.randn(b, 1, n)}, None
    yield "h % g", {**a, "B": torch.randn(b, 3, n), "C": torch.randn(b, 3, n)}, None
    yield "D shape", {**a, "D": a["D"][:, :1]}, None
    yield "dt_bias dtype", {**a, "dt_bias": a["dt_bias"].int()}, None
    yield "dt_bias device", {**a, "dt_bias": a["dt_bias"].to("meta")}, None
    yield "z shape", {**a, "z": a["z"][:1]}, None
    yield "pool without indices", {**a, "state": torch.randn(b + 2, h, p, n)}, None
    yield "indices dtype", a, torch.zeros(b)
    yield "indices shape", a, torch.zeros(b + 1, dtype=torch.int32)
    yield "indices device", a, torch.zeros(b, dtype=torch.int32, device="meta")


def _error(fn):
    with pytest.raises(Exception) as info:
        fn()
    return type(info.value), str(info.value)


@pytest.mark.parametrize("tier", ["kernel", "torch"])
@pytest.mark.parametrize("name", [n for n, *_ in _bad_inputs()])
def test_cache_never_skips_a_check(name, tier, backend, fresh_plans, monkeypatch):
    """The full checker and the op agree on bad inputs, before and after valid calls are cached."""
    from mamba2_rocm.ops.checks import check_state_update_args

    if tier == "kernel":
        kset = RecordingKernels()
        monkeypatch.setattr(ops, "choose", lambda device: ("kernel", kset))
        monkeypatch.setattr(ops, "launch", lambda *a: None)
    else:
        backend("torch")
    args, idx = dict((n, (a, i)) for n, a, i in _bad_inputs())[name]
    # the op's rules: the full checker as the op calls it (an empty batch is accepted)
    expected = _error(lambda: check_state_update_args(*_pos(args)[:-2], idx, allow_empty=True))

    def call():
        return ops.selective_state_update(**args, dt_softplus=True, state_batch_indices=idx)

    assert _error(call) == expected  # nothing cached yet
    good = _base()
    ops.selective_state_update(**good, dt_softplus=True)  # a valid signature, cached
    ops.selective_state_update(**good, dt_softplus=True)
    assert _error(call) == expected
    assert _error(call) == expected  # a failed signature is never cached
    assert ops._signature(*_pos(good)) in ops._PLANS


@pytest.mark.parametrize("key", ["x", "state"])
def test_float64_takes_the_torch_tier_on_the_kernel_tier_too(key, fake_kernels, backend):
    """float64 passes the shared checks (the references take it) and no kernel reads it: on the
    kernel tier such a call runs the torch tier in float64 (it used to raise a TypeError there
    only), every time, also once its signature is cached."""
    args = _base()
    args[key] = args[key].double()
    if key == "x":
        args.update({k: args[k].double() for k in ("B", "C", "z")})
    from mamba2_rocm.reference.ssd import selective_state_update_ref

    state = args["state"].clone()
    pos = {**args, "state": state}
    ref = selective_state_update_ref(*_pos(pos, softplus=False)[:-1], None, torch.float64)
    for _ in range(2):  # the fake kernel set answers choose()
        got_state = args["state"].clone()
        out = ops.selective_state_update(**{**args, "state": got_state})
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_state, state, rtol=1e-6, atol=1e-6)
    assert not fake_kernels.launches


def test_grid_limit_survives_the_cache(fake_kernels, monkeypatch):
    monkeypatch.setattr(ops, "GRID_YZ_MAX", 2)
    args = _base()
    for _ in range(2):
        with pytest.raises(ValueError, match="batch and nheads <= 2, got 3, 4"):
            ops.selective_state_update(**args)
    assert not fake_kernels.launches


def test_plan_cache_is_bounded(fake_kernels, monkeypatch):
    monkeypatch.setattr(ops, "PLAN_CACHE_SIZE", 4)
    for b in range(1, 11):
        ops.selective_state_update(**_inputs(seeded("bound", b), b=b))
        assert 1 <= len(ops._PLANS) <= 4
    assert len(fake_kernels.launches) == 10


def test_kernel_set_is_chosen_per_call(fake_kernels, monkeypatch):
    """The plan caches layouts, never the kernel set: a reset loader or a backend switch holds."""
    args = _base()
    ops.selective_state_update(**args)
    other = RecordingKernels()
    monkeypatch.setattr(ops, "choose", lambda device: ("kernel", other))
    ops.selective_state_update(**args)
    assert len(fake_kernels.launches) == 1 and len(other.launches) == 1
    monkeypatch.setattr(ops, "choose", lambda device: ("torch", None))
    ref_state = args["state"].clone()
    ref = selective_state_update_ref(**{**args, "state": ref_state}, compute_dtype=torch.float32)
    torch.testing.assert_close(ops.selective_state_update(**args), ref)


def test_written_state_that_overlaps_itself_is_refused():
    """An expanded (stride-0) state: one row's update would overwrite another's (#19)."""
    args = _inputs(seeded("overlap"))
    args["state"] = args["state"][:1].expand_as(args["state"])
    with pytest.raises(ValueError, match="state is written in place but its elements overlap"):
        ops.selective_state_update(**args)
    args = _inputs(seeded("overlap2"))
    s = args["state"]
    args["state"] = s.as_strided(s.shape, (s.stride(0), s.stride(1), 1, 1))  # p and n interleave
    with pytest.raises(ValueError, match="overlap"):
        ops.selective_state_update(**args)


@pytest.mark.parametrize("tier", ["torch", "eager"])
def test_int64_indices_on_the_torch_tiers(backend, tier):
    backend(tier)
    g = seeded("int64 idx")
    args = _inputs(g, pool=5)
    outs = []
    for dt in (torch.int32, torch.int64):
        a = {**args, "state": args["state"].clone()}
        outs.append(
            (
                ops.selective_state_update(
                    **a, state_batch_indices=torch.tensor([3, -1, 0], dtype=dt)
                ),
                a["state"],
            )
        )
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("x_dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("state_dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bc_dtype", [torch.float32, torch.float64])
def test_tiers_accept_the_same_inputs(x_dtype, state_dtype, bc_dtype, backend, monkeypatch):
    """#19.4: what the torch tier accepts, the kernel tier accepts (float64 x or state, which no
    kernel reads, run there on the torch tier in float64), with the same result."""
    g = seeded("tiers-accept", x_dtype, state_dtype, bc_dtype)
    b, h, p, n = 2, 4, 8, 16
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    args = dict(x=r(b, h, p).to(x_dtype), dt=r(b, h, p), A=-torch.rand(h, p, n, generator=g),
                B=r(b, 1, n).to(bc_dtype), C=r(b, 1, n).to(bc_dtype), D=r(h, p).double(),
                dt_bias=r(h, p), dt_softplus=True)  # fmt: skip
    state0 = r(b, h, p, n).to(state_dtype)
    backend("torch")
    ref_state = state0.clone()
    ref = ops.selective_state_update(ref_state, **args)
    kset = RecordingKernels()
    monkeypatch.setattr(ops, "choose", lambda device: ("kernel", kset))
    monkeypatch.setattr(ops, "launch", lambda *a: kset.launches.append(a))
    state = state0.clone()
    out = ops.selective_state_update(state, **args)  # never a TypeError
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if torch.float64 in (x_dtype, state_dtype):  # computed on the torch tier: the same numbers
        assert kset.launches == []
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state, ref_state, rtol=1e-5, atol=1e-5)
    else:
        assert len(kset.launches) == 1
