"""Input builders and tolerances shared by the tests: fresh random data in every layout."""

import os

import torch

# Per-dtype tolerances in one place (causal-conv1d's own test tolerances).
TOL = {
    torch.float32: {"rtol": 3e-4, "atol": 1e-3},
    torch.float16: {"rtol": 3e-3, "atol": 5e-3},
    torch.bfloat16: {"rtol": 1e-2, "atol": 5e-2},
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# SSD scans. float64: the chunked and sequential forms differ only in summation order.
# Lower precisions: the output's rounding dominates, so the conv1d tolerances apply.
SSD_TOL = {torch.float64: {"rtol": 1e-9, "atol": 1e-9}, **TOL}
# SSM states are fp32 (or state_dtype); fp32 states accumulate over many tokens.
SSD_STATE_TOL = {
    torch.float64: {"rtol": 1e-9, "atol": 1e-9},
    torch.float32: {"rtol": 1e-4, "atol": 1e-4},
    torch.float16: {"rtol": 1e-3, "atol": 1e-3},
    torch.bfloat16: {"rtol": 1e-2, "atol": 1e-2},
}


def gpu_available() -> bool:
    return torch.cuda.is_available() and os.environ.get("MAMBA2_ROCM_NO_GPU") != "1"


def make_x(batch, dim, seqlen, dtype, layout, device="cpu", gen=None):
    """x (batch, dim, seqlen) in 'contiguous', 'channel_last' or 'sliced' (non-contiguous) layout."""
    if layout == "contiguous":
        return torch.randn(batch, dim, seqlen, generator=gen, device=device).to(dtype)
    if layout == "channel_last":
        return (
            torch.randn(batch, seqlen, dim, generator=gen, device=device).to(dtype).transpose(1, 2)
        )
    if layout == "sliced":  # every other channel of a wider tensor, and an offset start
        big = torch.randn(batch, 2 * dim + 1, seqlen + 3, generator=gen, device=device).to(dtype)
        return big[:, 1::2, 3:]
    if layout == "channel_last_sliced":  # xBC-style: a channel slice of a wider channel-last tensor
        big = torch.randn(batch, seqlen, dim + 24, generator=gen, device=device).to(dtype)
        return big[:, :, 8 : 8 + dim].transpose(1, 2)
    raise ValueError(layout)


def make_seq_idx(batch, seqlen, device="cpu", gen=None, pad=True):
    """Several sequences per row, with -1 padding tokens at the end of some rows."""
    rows = []
    for b in range(batch):
        cuts = sorted(torch.randint(1, max(2, seqlen), (3,), generator=gen).tolist())
        row = torch.zeros(seqlen, dtype=torch.int32)
        for i, c in enumerate(cuts):
            row[c:] = i + 1
        if pad and b % 2 == 0 and seqlen > 4:
            row[seqlen - seqlen // 4 :] = -1
        rows.append(row)
    return torch.stack(rows).to(device)


def require_tool(reason: str):
    """A missing compiler or Docker: a skip on a developer's machine, a failure in CI
    (``.ci/run`` sets ``MAMBA2_ROCM_REQUIRE_TOOLCHAINS=1`` after installing them)."""
    import pytest

    if os.environ.get("MAMBA2_ROCM_REQUIRE_TOOLCHAINS") == "1":
        pytest.fail(f"required tool missing: {reason}")
    pytest.skip(reason)


def seeded(*key, device="cpu"):
    """A generator seeded from the test's key: the same inputs in every run and process (str hash()
    is randomized per process), different inputs for every case."""
    import zlib

    return torch.Generator(device=device).manual_seed(zlib.crc32(repr(key).encode()))


def poison_allocator(nbytes: int, device="cuda") -> None:
    """Leave NaN-filled blocks in torch's caching allocator so fresh outputs start as NaN."""
    blocks = [torch.full((nbytes // 4 + 64,), float("nan"), device=device) for _ in range(4)]
    del blocks


class RecordingKernels:
    """The kernel tier on the CPU: a kernel set whose launchers record each launch (kernel
    name, parameter tuple, grid; the block in ``blocks``) instead of running it.
    ``matrix_cores``: what the target's kernel dir would say (KernelDir.matrix_cores)."""

    def __init__(self, matrix_cores: bool = True):
        self.launches = []
        self.blocks = []
        self.matrix_cores = matrix_cores

    def launcher(self, name):
        def record(params, grid, block, stream):
            self.launches.append((name, params, grid))
            self.blocks.append(block)

        return record


def stand_in_kernels(monkeypatch, ops, matrix_cores: bool = True) -> RecordingKernels:
    """Put the ops module ``ops`` on the kernel tier on the CPU: ``choose`` (there and in
    ``_launch``) answers with a :class:`RecordingKernels`, and ``launch`` records instead of
    launching. Returns the kernel set, whose ``launches`` the test reads."""
    from mamba2_rocm.ops import _launch

    kset = RecordingKernels(matrix_cores)
    for mod in (ops, _launch):
        monkeypatch.setattr(mod, "choose", lambda device: ("kernel", kset))
    monkeypatch.setattr(
        ops, "launch", lambda launcher, x, p, grid, threads: launcher(p, grid, (threads, 1, 1), 0)
    )
    return kset


def refuse_fallback(monkeypatch, module, name: str) -> None:
    """Replace ``module.name`` (an op's torch-tier backward formula) by one that fails: a GPU
    test of a backward kernel then cannot pass through a silent fallback."""

    def refuse(*args, **kwargs):
        raise AssertionError("the backward fell back to the torch tier's formula")

    monkeypatch.setattr(module, name, refuse)


def check_grads(names, got, want, tol: float) -> None:
    """Kernel gradients ``got`` against float64 references ``want`` (None: the op returns an
    empty tensor for an absent input): written everywhere (no NaN left from poisoned memory),
    max error within ``tol`` times the largest reference value."""
    for name, g, r in zip(names, got, want, strict=True):
        if r is None:
            assert g.numel() == 0, name
            continue
        assert g.shape == r.shape, (name, g.shape, r.shape)
        assert not g.isnan().any(), f"{name}: unwritten (NaN) elements"
        scale = r.abs().max().item() + 1e-6
        err = (g.double() - r).abs().max().item()
        assert err <= tol * scale, f"{name}: max error {err:.3g} > {tol} * {scale:.3g}"


def assert_bit_identical_runs(run, runs: int = 5) -> None:
    """``run()`` (a tuple of tensors) gives bit-identical results ``runs`` times over, in
    torch's deterministic mode (as causal-conv1d's determinism tests run it)."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        results = [run() for _ in range(runs)]
    finally:
        torch.use_deterministic_algorithms(was)
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


def spy_scan_chunks(monkeypatch) -> list:
    """Record the chunk size of every run of the SSD kernel tier's stages
    (``mamba2_rocm.ops.ssd._kernel``, the forward and the backward's recomputation) in the
    returned list."""
    from mamba2_rocm.ops import ssd as ssd_ops

    ran = []
    kernel = ssd_ops._kernel

    def spy(*args, **kwargs):
        ran.append(args[6])  # (kset, x, dt, A, B, C, chunk_size, ...)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(ssd_ops, "_kernel", spy)
    return ran


def strided_view(t):
    """1-D ``t``'s values as a strided view: every other element of a vector twice as long (for
    the tests that a vector the kernels index densely may be passed as a view)."""
    wide = t.new_zeros(2 * t.numel())
    wide[::2] = t
    return wide[::2]


#: mamba_chunk_scan_combined's arguments that shape its token terms (ssd_term_magnitude's)
_TERM_ARGS = ("x", "dt", "A", "B", "C", "z", "dt_bias", "seq_idx", "dt_softplus", "dt_limit")


def assert_ssd_out_close(out, ref, args: dict, rtol: float, atol: float) -> None:
    """An SSD forward's out against its float64 reference ``ref``, element by element:
    |out - ref| <= atol + rtol |ref| + u M, with M the output's term magnitudes
    (``reference.ssd.ssd_term_magnitude``) and u the unit roundoff of 16-bit inputs (0 for
    fp32): the forward rounds each within-chunk weight once to x's dtype there, as mamba_ssm's
    Triton kernels do, and where the terms cancel that moves an output by more than a fixed
    tolerance allows -- by at most u M. ``args``: the call's keywords."""
    from mamba2_rocm.reference.ssd import ssd_term_magnitude

    assert out.shape == ref.shape, (out.shape, ref.shape)
    err = (out.double() - ref.double()).abs()
    allow = atol + rtol * ref.double().abs()
    if out.dtype in (torch.float16, torch.bfloat16):
        m = ssd_term_magnitude(**{k: v for k, v in args.items() if k in _TERM_ARGS})
        allow = allow + torch.finfo(out.dtype).eps / 2 * m
    bad = err > allow
    if bad.any():
        i = int(torch.argmax(torch.where(bad, err / allow, 0.0)))
        at = tuple(int(v) for v in torch.unravel_index(torch.tensor(i), out.shape))
        raise AssertionError(
            f"{int(bad.sum())} of {out.numel()} outputs off; worst at {at}: "
            f"{out[at].item():.6g} vs {ref[at].item():.6g}, allowed {allow[at].item():.3g}"
        )
