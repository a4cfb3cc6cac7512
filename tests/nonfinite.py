"""Non-finite containment cases shared by the CPU and the GPU tests.

The rule every op keeps, on every tier: a non-finite value (NaN, +inf, -inf) at token t of
sequence s affects only outputs of s at positions >= t (and states that end in s). Each check
runs an op twice on the same fresh random inputs, once clean and once with one value replaced,
and requires:

- every output outside the value's reach to be *identical* to the clean run (masks select;
  nothing is multiplied by a mask, so nothing else changes, not even in the last bit);
- the output at the bad value's own position to be non-finite (the value is not hidden).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# dt: -inf is clamped to dt_limit's floor (0) like any negative dt, so it is not poison
SSD_TARGETS = ("x", "dt", "B", "C", "z")
BAD_VALUES = (math.nan, math.inf, -math.inf)


class _Packed:
    """A row of packed sequences (seqlen, starts) and a position in sequence `seq`."""

    seqlen: int
    starts: tuple[int, ...]
    seq: int
    where: float

    def bounds(self) -> list[int]:
        return [0, *self.starts, self.seqlen]

    def position(self) -> int:
        b = self.bounds()
        s = min(self.seq, len(b) - 2)
        return b[s] + int(self.where * (b[s + 1] - b[s]))


@dataclass(frozen=True)
class SsdCase(_Packed):
    seqlen: int
    nheads: int
    headdim: int
    ngroups: int
    dstate: int
    chunk_size: int
    starts: tuple[int, ...]  # where sequences 1, 2, ... start in row 0 (sorted, in (0, seqlen))
    target: str  # which input gets the bad value
    seq: int  # in which sequence of row 0
    where: float  # how far into it, [0, 1)
    value: float
    varlen: bool  # batch 1, cu_seqlens and varlen states; else batch 2 and final states
    dtype: torch.dtype
    seed: int


def _seq_of(bounds: list[int], t: int) -> int:
    return max(i for i in range(len(bounds) - 1) if bounds[i] <= t)


def ssd_inputs(case: SsdCase, device) -> dict:
    g = torch.Generator().manual_seed(case.seed)
    batch = 1 if case.varlen else 2
    L, h, p, ng, n = case.seqlen, case.nheads, case.headdim, case.ngroups, case.dstate

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    seq_idx = torch.zeros(batch, L, dtype=torch.int32)
    b = case.bounds()
    for i in range(len(b) - 1):
        seq_idx[0, b[i] : b[i + 1]] = i
    return {
        "x": rnd(batch, L, h, p).to(case.dtype),
        "dt": rnd(batch, L, h, scale=0.5).to(case.dtype),
        "A": -torch.rand(h, generator=g).to(device) - 0.2,
        "B": rnd(batch, L, ng, n, scale=0.5).to(case.dtype),
        "C": rnd(batch, L, ng, n, scale=0.5).to(case.dtype),
        "D": rnd(h),
        "z": rnd(batch, L, h, p).to(case.dtype),
        "dt_bias": rnd(h, scale=0.1),
        "seq_idx": seq_idx.to(device),
        "cu_seqlens": torch.tensor(b, dtype=torch.int32, device=device),
    }


def run_ssd(case: SsdCase, inp: dict):
    """(out, states): final states (batch 2) or varlen states (batch 1)."""
    from mamba2_rocm import mamba_chunk_scan_combined

    kw = dict(D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"], seq_idx=inp["seq_idx"])
    kw["dt_softplus"] = True
    if case.varlen:
        out, states = mamba_chunk_scan_combined(
            inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], case.chunk_size,
            cu_seqlens=inp["cu_seqlens"], return_varlen_states=True, **kw,
        )  # fmt: skip
    else:
        out, states = mamba_chunk_scan_combined(
            inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], case.chunk_size,
            return_final_states=True, **kw,
        )  # fmt: skip
    return out, states


def poison_ssd(case: SsdCase, inp: dict) -> tuple[dict, tuple]:
    """A copy of the inputs with the bad value in place, and the index of the out entries at
    its own position that must be non-finite."""
    t = case.position()
    r = case.nheads // case.ngroups
    head, col, grp = case.seed % case.nheads, case.seed % case.headdim, case.seed % case.ngroups
    bad = dict(inp)
    target = inp[case.target].clone()
    if case.target in ("x", "z"):
        target[0, t, head, col] = case.value
        direct = (0, t, head, col)
    elif case.target == "dt":
        target[0, t, head] = case.value
        direct = (0, t, head)
    else:  # B, C: every head of the group
        target[0, t, grp, case.seed % case.dstate] = case.value
        direct = (0, t, slice(grp * r, (grp + 1) * r))
    bad[case.target] = target
    return bad, direct


def check_ssd(case: SsdCase, device) -> None:
    inp = ssd_inputs(case, device)
    out_c, states_c = run_ssd(case, inp)
    bad_inp, direct = poison_ssd(case, inp)
    out_b, states_b = run_ssd(case, bad_inp)
    t = case.position()
    bounds = case.bounds()
    s = _seq_of(bounds, t)
    reach = torch.zeros(out_c.shape[:2], dtype=torch.bool)
    reach[0, t : bounds[s + 1]] = True  # row 0, positions t .. end of sequence s
    reach = reach.to(out_c.device)
    outside = ~reach
    assert torch.equal(out_b[outside], out_c[outside]), (
        f"{case}: outputs outside the reach of the bad value changed at (b, t) "
        f"{(((out_b != out_c).flatten(2).any(-1)) & outside).nonzero()[:5].tolist()}"
    )
    assert not torch.isfinite(out_b[direct]).any(), f"{case}: the bad value vanished"
    if case.varlen:  # every other sequence's state is untouched
        others = [i for i in range(len(bounds) - 1) if i != s]
        assert torch.equal(states_b[others], states_c[others]), (
            f"{case}: other sequences' states changed"
        )
    else:
        assert torch.equal(states_b[1], states_c[1]), f"{case}: row 1's final state changed"
        if s != len(bounds) - 2:  # row 0's final state belongs to its last sequence
            assert torch.equal(states_b[0], states_c[0]), f"{case}: row 0's final state changed"


@dataclass(frozen=True)
class ConvCase(_Packed):
    dim: int
    seqlen: int
    width: int
    starts: tuple[int, ...]
    seq: int
    where: float
    value: float
    silu: bool
    channel_last: bool
    dtype: torch.dtype
    seed: int


def check_conv(case: ConvCase, device) -> None:
    from mamba2_rocm import causal_conv1d_fn

    g = torch.Generator().manual_seed(case.seed)
    batch, dim, L = 2, case.dim, case.seqlen
    if case.channel_last:
        x = torch.randn(batch, L, dim, generator=g).to(case.dtype).to(device).transpose(1, 2)
    else:
        x = torch.randn(batch, dim, L, generator=g).to(case.dtype).to(device)
    w = torch.randn(dim, case.width, generator=g).to(case.dtype).to(device)
    bias = torch.randn(dim, generator=g).to(case.dtype).to(device)
    b = case.bounds()
    seq_idx = torch.zeros(batch, L, dtype=torch.int32)
    for i in range(len(b) - 1):
        seq_idx[0, b[i] : b[i + 1]] = i
    seq_idx = seq_idx.to(device)
    act = "silu" if case.silu else None
    clean = causal_conv1d_fn(x, w, bias, seq_idx=seq_idx, activation=act)
    t, c = case.position(), case.seed % dim
    xb = x.clone()
    xb[0, c, t] = case.value
    out = causal_conv1d_fn(xb, w, bias, seq_idx=seq_idx, activation=act)
    s = _seq_of(b, t)
    reach = torch.zeros(batch, dim, L, dtype=torch.bool)
    reach[0, c, t : min(t + case.width, b[s + 1])] = True  # the taps that read x[t]
    reach = reach.to(device)
    assert torch.equal(out[~reach], clean[~reach]), f"{case}: outputs outside the reach changed"
    assert not torch.isfinite(out[0, c, t]), f"{case}: the bad value vanished"


def check_scan_nan_locality(scan, inputs: dict, b: int, d: int, t: int) -> None:
    """Mamba1's selective scan: a NaN in u at (b, d, t) makes exactly that channel's outputs
    from t on NaN; every other output equals the clean run's."""
    clean = scan(**inputs)
    u = inputs["u"].clone()
    u[b, d, t] = float("nan")
    out = scan(**{**inputs, "u": u})
    bad = torch.zeros_like(out, dtype=torch.bool)
    bad[b, d, t:] = True
    assert torch.isnan(out[bad]).all()
    assert torch.equal(out[~bad], clean[~bad])
