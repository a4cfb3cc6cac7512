"""Decode-state row indices on the kernel tier, checked on the device (causal_conv1d_update and
selective_state_update's contiguous-layout kernels: inside the kernel, csrc/state_rows.h;
selective_state_update's general kernel: by m2r_state_rows before the update,
csrc/state_rows.hip; each kernel form pinned in turn): int64 is never truncated, a
duplicated or out-of-range row gives NaN and leaves every state alone, -1 padding gives zeros,
strided index views are read as views. Each case is compared with the same call on int32
indices and with the float64 reference on the valid rows."""

import pytest
import torch
from helpers import gpu_available

from mamba2_rocm import causal_conv1d_update, selective_state_update
from mamba2_rocm.reference.conv1d import causal_conv1d_update_eager
from mamba2_rocm.reference.ssd import selective_state_update_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs a GPU")]
DEV = "cuda"


def _ssu(pool=5, b=3, h=4, p=8, n=32, g=2, dtype=torch.float32, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=DEV, generator=gen)  # noqa: E731
    return dict(
        state=r(pool, h, p, n).to(dtype), x=r(b, h, p).to(dtype), dt=r(b, h, p).to(dtype),
        A=-torch.rand(h, p, n, device=DEV, generator=gen), B=r(b, g, n).to(dtype),
        C=r(b, g, n).to(dtype), D=r(h, p), z=r(b, h, p).to(dtype), dt_bias=r(h, p),
    )  # fmt: skip


#: The kernels each pinned form launches per call with pool indices: one (the contiguous
#: layout's, which checks the caller's indices itself: pinned here at every batch), or
#: m2r_state_rows' checked copy and then the kernel reading it (the general kernel always; the
#: contiguous layout's above SSU_CHECK_IN_KERNEL_MAX_BATCH, pinned by "rows checked first").
_LAUNCHES = {
    "wide": lambda name: [name + "_contig"],
    "rows": lambda name: [name + "_rows"],
    "rows checked first": lambda name: ["m2r_state_rows", name + "_rows"],
    "general": lambda name: ["m2r_state_rows", name],
}


def _force(kernel, args, monkeypatch):
    """args with selective_state_update's kernel pinned: the contiguous layout's wide (_contig)
    or per-row (_rows) kernel, or the general one (B given a non-unit dstate stride). Returns
    (args, launched): ``launched`` collects the kernel name of every launch from then on."""
    from mamba2_rocm.ops import _launch
    from mamba2_rocm.ops import state_update as ops

    for name in ("WIDE_KERNEL_MIN_BLOCKS", "STD_WIDE_KERNEL_MIN_BLOCKS"):
        monkeypatch.setattr(ops, name, 0 if kernel == "wide" else 1 << 40)
    in_kernel = 0 if kernel == "rows checked first" else 1 << 40  # (the batch limit pinned)
    monkeypatch.setattr(ops, "SSU_CHECK_IN_KERNEL_MAX_BATCH", in_kernel)
    if kernel == "general":  # B with a non-unit dstate stride: only the general kernel reads it
        args = {**args, "B": torch.stack([args["B"], args["B"]], -1)[..., 0]}
    launched = []

    def spy(launcher, *rest):
        launched.append(launcher.name)
        return real(launcher, *rest)

    real = ops.launch
    monkeypatch.setattr(ops, "launch", spy)
    monkeypatch.setattr(_launch, "launch", spy)  # (checked_state_rows launches from there)
    return args, launched


def _expect_launches(kernel, launched, calls):
    """The pinned form ran, ``calls`` times (_ssu's float32, dstate 32 kernels)."""
    assert launched == _LAUNCHES[kernel]("m2r_ssu_f32_f32_n32") * calls


KERNELS = ["wide", "rows", "rows checked first", "general"]


def _run_ssu(args, idx):
    state = args["state"].clone()
    out = selective_state_update(
        **{**args, "state": state}, dt_softplus=True, state_batch_indices=idx
    )
    torch.cuda.synchronize()
    return out, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [[3, -1, 0], [4, 0, 2], [-1, -1, 1]])
def test_ssu_int64_indices_equal_int32(rows, dtype):
    """The measured defect: [3, -1, 0] as int64 updated the wrong rows on the kernel path."""
    args = _ssu(dtype=dtype)
    out32, st32 = _run_ssu(args, torch.tensor(rows, dtype=torch.int32, device=DEV))
    out64, st64 = _run_ssu(args, torch.tensor(rows, dtype=torch.int64, device=DEV))
    assert torch.equal(out32, out64) and torch.equal(st32, st64)
    ref_state = args["state"].clone().double()
    ref_args = {k: v.double() for k, v in args.items() if k != "state"}
    ref = selective_state_update_ref(
        ref_state, **ref_args, dt_softplus=True,
        state_batch_indices=torch.tensor(rows, device=DEV), compute_dtype=torch.float64,
    )  # fmt: skip
    tol = dict(rtol=1e-2, atol=5e-2) if dtype == torch.bfloat16 else dict(rtol=3e-4, atol=1e-3)
    torch.testing.assert_close(out64.double(), ref, **tol)
    torch.testing.assert_close(st64.double(), ref_state, **tol)
    for b, row in enumerate(rows):
        if row == -1:
            assert not out64[b].any(), "a padded row's out is zeros"


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_ssu_duplicate_and_out_of_range_rows_are_nan_and_touch_nothing(dtype, kernel, monkeypatch):
    args, launched = _force(kernel, _ssu(pool=5, b=4), monkeypatch)
    rows = [2, 1, 2, 7]  # entries 0 and 2 name row 2; entry 3 is out of the pool
    out, state = _run_ssu(args, torch.tensor(rows, dtype=dtype, device=DEV))
    _expect_launches(kernel, launched, 1)
    for b in (0, 2, 3):
        assert out[b].isnan().all(), f"entry {b}"
    assert torch.equal(state[2], args["state"][2]), "a duplicated row's state was written"
    for untouched in (0, 3, 4):
        assert torch.equal(state[untouched], args["state"][untouched])
    assert not torch.equal(state[1], args["state"][1]) and out[1].isfinite().all()


@pytest.mark.parametrize("kernel", KERNELS)
def test_ssu_int64_index_beyond_int32_is_not_wrapped(kernel, monkeypatch):
    """2**32 truncated to int32 would be row 0: it must be out of range instead."""
    args, launched = _force(kernel, _ssu(pool=5, b=3), monkeypatch)
    out, state = _run_ssu(args, torch.tensor([2**32, 1, -1], dtype=torch.int64, device=DEV))
    _expect_launches(kernel, launched, 1)
    assert out[0].isnan().all()
    assert torch.equal(state[0], args["state"][0]) and torch.equal(state[2], args["state"][2])


@pytest.mark.parametrize("kernel", KERNELS)
def test_ssu_large_batch_duplicates_found_across_tiles(kernel, monkeypatch):
    """Duplicates 300 entries apart: the check compares across its 256-entry tiles."""
    args, launched = _force(kernel, _ssu(pool=700, b=600, h=2, p=4, n=32, g=1), monkeypatch)
    rows = torch.randperm(700, device=DEV)[:600].to(torch.int32)
    rows[550] = rows[250]
    out, state = _run_ssu(args, rows)
    _expect_launches(kernel, launched, 1)
    bad = out.isnan().flatten(1).all(1)
    assert bad.nonzero().flatten().tolist() == [250, 550]
    assert torch.equal(state[int(rows[250])], args["state"][int(rows[250])])


def _conv(pool=5, b=4, dim=64, width=4, state_len=3, dtype=torch.float32, seed=1):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=DEV, generator=gen)  # noqa: E731
    return (
        r(b, dim).to(dtype),
        r(pool, dim, state_len).to(dtype),
        r(dim, width).to(dtype),
        r(dim).to(dtype),
    )


def test_conv_update_duplicate_and_out_of_range_rows_are_nan_and_touch_nothing():
    x, state, w, bias = _conv()
    work = state.clone()
    rows = torch.tensor([0, 3, 0, 9], dtype=torch.int32, device=DEV)
    out = causal_conv1d_update(x, work, w, bias, "silu", conv_state_indices=rows)
    torch.cuda.synchronize()
    for b in (0, 2, 3):
        assert out[b].isnan().all(), f"entry {b}"
    for untouched in (0, 1, 2, 4):
        assert torch.equal(work[untouched], state[untouched])
    ref_state = state.clone().double()
    ref = causal_conv1d_update_eager(
        x[1:2].double().unsqueeze(-1), ref_state, w.double(), bias.double(), True,
        conv_state_indices=torch.tensor([3], dtype=torch.int32, device=DEV),
    )  # fmt: skip
    torch.testing.assert_close(out[1].double(), ref[0, :, 0], rtol=3e-4, atol=1e-3)
    torch.testing.assert_close(work[3].double(), ref_state[3])


def test_conv_update_padding_row_is_zero_even_for_nan_input():
    x, state, w, bias = _conv(b=2)
    x[0] = float("nan")
    work = state.clone()
    out = causal_conv1d_update(
        x,
        work,
        w,
        bias,
        None,
        conv_state_indices=torch.tensor([-1, 2], dtype=torch.int32, device=DEV),
    )
    torch.cuda.synchronize()
    assert not out[0].any() and out[1].isfinite().all()
    assert torch.equal(work[[0, 1, 3, 4]], state[[0, 1, 3, 4]])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("heads", [True, False])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_ssu_strided_indices_read_as_given(dtype, heads, kernel, monkeypatch):
    """A strided view of indices (every other entry of a buffer) selects the same rows as its
    contiguous copy, duplicates included, on each of the three update kernels."""
    args, launched = _force(kernel, _ssu(pool=9, b=5), monkeypatch)
    if not heads:  # Mamba1 form
        args = {k: v[:, 0] if k in ("state", "x", "dt", "z") else v for k, v in args.items()}
        args.update(A=args["A"][0], B=args["B"][:, 0], C=args["C"][:, 0], D=args["D"][0],
                    dt_bias=args["dt_bias"][0])  # fmt: skip
    for rows in ([7, 0, -1, 3, 8], [7, 0, 3, 3, 1]):
        buf = torch.tensor([[r, 99] for r in rows], dtype=dtype, device=DEV)
        out_v, st_v = _run_ssu(args, buf[:, 0])
        out_c, st_c = _run_ssu(args, buf[:, 0].contiguous())
        assert torch.equal(out_v.nan_to_num(7.0), out_c.nan_to_num(7.0)) and torch.equal(st_v, st_c)
        assert out_v[3].isnan().all() == (rows[2] == rows[3])
    _expect_launches(kernel, launched, 4)


def test_conv_update_strided_and_large_batch_indices():
    """Strided int32 indices, and a batch wider than the update kernel's 128-thread block with
    one duplicate pair far apart."""
    x, state, w, bias = _conv(pool=400, b=300, dim=40)
    rows = torch.randperm(400, device=DEV)[:300].to(torch.int32)
    rows[290] = rows[10]
    buf = torch.stack([rows, torch.full_like(rows, 5)], 1)
    outs = []
    for idx in (buf[:, 0], rows.clone()):
        work = state.clone()
        outs.append((causal_conv1d_update(x, work, w, bias, "silu", conv_state_indices=idx), work))
    torch.cuda.synchronize()
    (out_v, st_v), (out_c, st_c) = outs
    assert torch.equal(out_v.nan_to_num(7.0), out_c.nan_to_num(7.0)) and torch.equal(st_v, st_c)
    bad = out_v.isnan().all(1)
    assert bad.nonzero().flatten().tolist() == [10, 290]
    assert torch.equal(st_v[int(rows[10])], state[int(rows[10])])
