"""Mamba1's selective-scan kernel against the
float64 ground truth: every dtype and dstate tier, fixed / variable / grouped B and C, long
sequences (the state carried across many chunks), outputs poisoned before the run, a non-finite
value kept in its channel, and training through it."""

import pytest
import torch
from helpers import gpu_available, poison_allocator, seeded
from nonfinite import check_scan_nan_locality

from mamba2_rocm import selective_scan_fn
from mamba2_rocm.reference.selective_scan import selective_scan_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not gpu_available(), reason="needs a GPU (run on the device machine)"),
]

DEV = "cuda"
TOL = {torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


@pytest.fixture(
    autouse=True,
    params=["butterfly", "deferred", "segments", "channels", "channels-3seg", "channels-whole",
            "channels-whole-3seg", "channels-quarter", "channels-quarter-3seg"],
)  # fmt: skip
def kernel_on(monkeypatch, request):
    """Every form of the kernel (csrc/selective_scan.hip) on every test; the channel form also
    with the sequence cut into 3 segments wherever it is longer than 64 tokens (two launches,
    the state carried from segment to segment through the maps), and with the whole-lane and the
    quarter-lane kernels forced ("whole", "quarter": at these sizes the host's own choice is
    the half-lane _ch2 or the quarter-lane _ch4)."""
    from mamba2_rocm.ops import selective_scan as ops

    monkeypatch.setenv("MAMBA2_ROCM_BACKEND", "kernel")  # never a silent torch fallback here
    form, *mods = request.param.split("-")
    monkeypatch.setattr(ops, "kernel_form", form)
    monkeypatch.setattr(ops, "channel_segments", 3 if "3seg" in mods else None)
    split = 1 if "whole" in mods else 4 if "quarter" in mods else None
    monkeypatch.setattr(ops, "channel_split", split)


def _inputs(g, b, d, L, n, bmode, cmode, dtype, groups=3):
    """delta and delta_bias >= 0, so the state decays also without softplus (a negative step
    grows it without bound over long sequences); groups must divide d."""
    r = lambda *s: torch.randn(*s, device=DEV, generator=g)  # noqa: E731
    shapes = {"fixed": (d, n), "var": (b, n, L), "grouped": (b, groups, n, L)}
    return dict(
        u=r(b, d, L).to(dtype), delta=(torch.rand(b, d, L, device=DEV, generator=g) * 0.5).to(dtype),
        A=-torch.rand(d, n, device=DEV, generator=g) * 2 - 0.1,
        B=r(*shapes[bmode]), C=r(*shapes[cmode]), D=r(d), z=r(b, d, L).to(dtype),
        delta_bias=r(d).abs() * 0.2,
    )  # fmt: skip


def _check(out, ref, dtype):
    scale = ref.abs().max().item() + 1e-6
    err = (out.double() - ref.double()).abs().max().item()
    assert err <= TOL[dtype] * scale, f"max error {err:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [1, 16, 17, 64, 100, 128, 256])
@pytest.mark.parametrize(
    "bmode, cmode", [("var", "var"), ("fixed", "grouped"), ("grouped", "fixed")]
)
@pytest.mark.parametrize("L", [301, 512])  # odd: element loads; 512: the 16-byte loads
def test_kernel_matches_ground_truth(dtype, n, bmode, cmode, L):
    g = seeded("gpu ss", dtype, n, bmode, cmode, L, device=DEV)
    a = _inputs(g, 2, 39, L, n, bmode, cmode, dtype)
    poison_allocator(1 << 24)
    out, last = selective_scan_fn(**a, delta_softplus=True, return_last_state=True)
    ref, rlast = selective_scan_ref(**a, delta_softplus=True, return_last_state=True)
    assert out.dtype == dtype and last.dtype == torch.float32
    _check(out, ref, dtype)
    _check(last, rlast, torch.float32 if dtype == torch.float32 else dtype)


@pytest.mark.parametrize("L", [1, 7, 8, 9, 63, 64, 65, 255, 256, 257, 1000, 2048, 16384])
def test_long_sequences_carry_the_state_across_chunks(L):
    """The state crosses a chunk boundary every 64 tokens (every 8 between the segment form's
    lanes, every 256 between its chunks, every 16 in the channel form and at its segments'
    ends): a wrong carry shows at the first token after one (the port bug class this kernel is
    built against)."""
    g = seeded("gpu ss long", L, device=DEV)
    a = _inputs(g, 1, 24, L, 16, "var", "var", torch.float32)
    a["delta"] = a["delta"].abs() * 0.05  # slow decay: the state remembers across chunks
    out, last = selective_scan_fn(**a, return_last_state=True)
    ref, rlast = selective_scan_ref(**a, return_last_state=True)
    _check(out, ref, torch.float32)
    _check(last, rlast, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_off_16_byte_alignment_take_the_element_loads(dtype):
    """Operands that are contiguous views starting one element into their storage (a caller's
    slice): the 16-byte loads must not be taken (misaligned) and the result stays right."""
    g = seeded("gpu ss misaligned", dtype, device=DEV)
    a = _inputs(g, 2, 13, 512, 16, "var", "var", dtype)

    def shifted(t):
        base = torch.empty(t.numel() + 1, dtype=t.dtype, device=DEV)
        v = base[1:].view(t.shape)
        v.copy_(t)
        return v

    s = {k: shifted(v) if v.dim() == 3 else v for k, v in a.items()}
    assert s["u"].is_contiguous() and s["u"].data_ptr() % 16 != 0
    out, last = selective_scan_fn(**s, delta_softplus=True, return_last_state=True)
    ref, rlast = selective_scan_ref(**a, delta_softplus=True, return_last_state=True)
    _check(out, ref, dtype)
    _check(last, rlast, torch.float32 if dtype == torch.float32 else dtype)


def test_a_nonfinite_value_stays_in_its_channel():
    a = _inputs(seeded("gpu ss nan", device=DEV), 2, 21, 200, 16, "var", "grouped", torch.float32)
    check_scan_nan_locality(selective_scan_fn, a, 1, 7, 90)


def test_gradients_through_the_kernel():
    g = seeded("gpu ss grad", device=DEV)
    a = _inputs(g, 2, 15, 130, 16, "var", "grouped", torch.float32)
    ours = {k: v.clone().requires_grad_() for k, v in a.items()}
    ref = {k: v.double().requires_grad_() for k, v in a.items()}
    out = selective_scan_fn(**ours, delta_softplus=True)
    rout = selective_scan_ref(**ref, delta_softplus=True)
    cot = torch.randn(out.shape, device=DEV, generator=g)
    out.backward(cot)
    rout.backward(cot.double())
    for k in ours:
        _check(ours[k].grad, ref[k].grad, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [4, 16, 17, 64])
@pytest.mark.parametrize("L", [301, 512])
def test_grouped_b_and_c_whose_groups_fill_whole_blocks(dtype, n, L, monkeypatch):
    """Groups of 64 channels: the channel form takes grouped B / C too (each block's channels
    read one group's columns); the other forms run it as before."""
    from mamba2_rocm.ops import selective_scan as ops

    forms = []
    real = ops._form
    monkeypatch.setattr(ops, "_form", lambda tier, dims=None: forms.append(real(tier, dims)) or
                        forms[-1])  # fmt: skip
    g = seeded("gpu ss grouped blocks", dtype, n, L, device=DEV)
    a = _inputs(g, 2, 192, L, n, "grouped", "grouped", dtype, groups=3)
    poison_allocator(1 << 24)
    out, last = selective_scan_fn(**a, delta_softplus=True, return_last_state=True)
    ref, rlast = selective_scan_ref(**a, delta_softplus=True, return_last_state=True)
    _check(out, ref, dtype)
    _check(last, rlast, torch.float32 if dtype == torch.float32 else dtype)
    if ops.kernel_form == "channels":
        assert forms == ["channels"]
