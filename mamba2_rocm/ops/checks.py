"""The ops' argument checks: every public op checks its call here once, before it picks a
tier; the references under ``mamba2_rocm.reference`` are pure math and check nothing.

Every check raises with a message that carries the offending value. Shape and dtype checks never
synchronize with the device; the few that read tensor values (``cu_seqlens`` contents, the
range of state indices: ``check_state_rows``) run only where the op reads those values anyway
(its torch tier), or behind ``inspect_values``.

By default the checks accept float64 as well as the kernel dtypes (the torch tier computes it)
and any power-of-two chunk size >= 16; ``dtypes=KERNEL_FLOATS`` and
``chunk_sizes=KERNEL_CHUNK_SIZES`` narrow them to what the kernels take.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection
from dataclasses import dataclass

import torch

__all__ = [
    "KERNEL_CHUNK_SIZES",
    "KERNEL_FLOATS",
    "MAX_DSTATE",
    "MAX_HEADDIM",
    "MAX_SCAN_DSTATE",
    "REFERENCE_FLOATS",
    "ChunkScanDims",
    "ScanDims",
    "StateUpdateDims",
    "check_chunk_scan_args",
    "check_chunk_scan_grads",
    "check_no_overlap",
    "check_rmsnorm_args",
    "check_selective_scan_args",
    "check_state_rows",
    "check_state_update_args",
    "kernel_chunk_size",
]

KERNEL_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
REFERENCE_FLOATS = (*KERNEL_FLOATS, torch.float64)
KERNEL_CHUNK_SIZES = (64, 128, 256)
MAX_HEADDIM = 128  # the kernels keep one head's (headdim, dstate) tile on chip
MAX_DSTATE = 256
_INDEX_DTYPES = (torch.int32, torch.int64)


def _dtype_name(dt) -> str:
    return str(dt).removeprefix("torch.")


def _tensor(name: str, t, *, dims: int, layout: str, dtypes, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions {layout}, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(_dtype_name(d) for d in dtypes)
        raise TypeError(f"{name} must be one of {names}, got {_dtype_name(t.dtype)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (the device of x)")


def _shape(name: str, t, layout: str, expected: tuple[int, ...]) -> None:
    if tuple(t.shape) != expected:
        raise ValueError(f"{name} must have shape {layout} = {expected}, got {tuple(t.shape)}")


def check_chunk_scan_grads(x, dims, dout, dfinal) -> None:
    """The output gradients the scan's backward takes: ``dout`` like x, ``dfinal`` (or None)
    (batch, nheads, headdim, dstate), float tensors on x's device."""
    b, _, h, p = x.shape
    _tensor("dout", dout, dims=4, layout="(batch, seqlen, nheads, headdim)",
            dtypes=REFERENCE_FLOATS, device=x.device)  # fmt: skip
    _shape("dout", dout, "x's shape", tuple(x.shape))
    if dfinal is not None:
        _tensor("dfinal", dfinal, dims=4, layout="(batch, nheads, headdim, dstate)",
                dtypes=REFERENCE_FLOATS, device=x.device)  # fmt: skip
        _shape("dfinal", dfinal, "(batch, nheads, headdim, dstate)", (b, h, p, dims.dstate))


def check_no_overlap(name: str, t) -> None:
    """Refuses a tensor that an op writes when two of its indices may share memory (an
    expanded, stride-0 view, or strides that interleave): one element's update would overwrite
    another's. Sufficient condition, from the strides alone (no device access): sorted by
    stride, each dim of size > 1 steps past everything the smaller dims span."""
    span = 0
    dims = sorted(((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz > 1))
    for stride, size in dims:
        if stride <= span:
            raise ValueError(
                f"{name} is written in place but its elements overlap in memory (shape "
                f"{tuple(t.shape)}, strides {tuple(t.stride())}; an expanded or stride-0 view?): "
                f"pass a tensor with its own storage per element, e.g. {name}.contiguous()"
            )
        span += stride * (size - 1)


def check_state_rows(name: str, indices, pool: int, batch: int) -> list[int]:
    """The state row of each batch entry (``indices`` read on the host: the torch tiers only;
    the kernels check on the device, see csrc/state_rows.h and .hip). -1 is a padded row; an index
    outside the pool raises IndexError, a row that two entries name raises ValueError."""
    if indices is None:
        return list(range(batch))
    rows = indices.tolist()
    seen: dict[int, int] = {}
    for b, row in enumerate(rows):
        if row < -1 or row >= pool:
            raise IndexError(f"{name}[{b}] = {row} is out of range for a state pool of {pool}")
        if row >= 0:
            if row in seen:
                raise ValueError(
                    f"{name}[{seen[row]}] and [{b}] are both {row}; each live row needs its own state"
                )
            seen[row] = b
    return rows


def _limits(headdim: int | None, dstate: int) -> None:
    if headdim is not None and headdim > MAX_HEADDIM:
        raise ValueError(f"headdim must be <= {MAX_HEADDIM}, got {headdim}")
    if dstate > MAX_DSTATE:
        raise ValueError(f"dstate must be <= {MAX_DSTATE}, got {dstate}")


def _positive_int(chunk_size) -> None:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def _check_chunk_size(chunk_size, chunk_sizes: Collection[int] | None) -> None:
    _positive_int(chunk_size)
    if chunk_sizes is not None:
        if chunk_size not in chunk_sizes:
            names = ", ".join(str(c) for c in chunk_sizes)
            raise ValueError(f"chunk_size must be one of {names}, got {chunk_size!r}")
        return
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(
            "chunk_size must be a power of two >= 16 (the kernels take 64, 128 or 256), "
            f"got {chunk_size!r}"
        )


def kernel_chunk_size(chunk_size) -> int:
    """The chunk size the ops run for a caller's ``chunk_size``: the smallest of
    ``KERNEL_CHUNK_SIZES`` that is >= it, at most the largest. The scan's result does not depend
    on the chunk size (only rounding does), so mamba_ssm callers may pass any positive int."""
    _positive_int(chunk_size)
    return next((c for c in KERNEL_CHUNK_SIZES if c >= chunk_size), KERNEL_CHUNK_SIZES[-1])


def _check_dt_limit(dt_limit) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in dt_limit)
    except (TypeError, ValueError):
        raise ValueError(f"dt_limit must be a pair (min, max), got {dt_limit!r}") from None
    if math.isnan(lo) or math.isnan(hi) or lo > hi:
        raise ValueError(f"dt_limit must be (min, max) with min <= max, got {dt_limit!r}")
    return lo, hi


@dataclass(frozen=True)
class ChunkScanDims:
    """The sizes a chunk-scan call derives from its arguments."""

    batch: int
    seqlen: int
    nheads: int
    headdim: int
    ngroups: int
    dstate: int
    num_seqs: int  # sequences in cu_seqlens; 0 without it
    dt_limit: tuple[float, float]
    state_dtype: torch.dtype  # dtype of the returned final / varlen states
    offsets: tuple[int, ...] | None = None  # cu_seqlens as read by the value check, if it ran

    @property
    def heads_per_group(self) -> int:
        return self.nheads // self.ngroups


def check_chunk_scan_args(
    x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
    cu_seqlens=None, *, chunk_size=None, dt_limit=(0.0, math.inf), return_varlen_states=False,
    state_dtype=None, chunk_sizes: Collection[int] | None = None, chunked: bool | None = None,
    dtypes=REFERENCE_FLOATS, inspect_values: bool = True, allow_empty: bool = False,
) -> ChunkScanDims:  # fmt: skip
    """Checks the arguments of ``mamba_chunk_scan_combined`` and returns the derived sizes.

    Shapes: x (batch, seqlen, nheads, headdim), dt (batch, seqlen, nheads), A (nheads,),
    B and C (batch, seqlen, ngroups, dstate), D (nheads,) or (nheads, headdim), z like x,
    dt_bias (nheads,), initial_states (batch, nheads, headdim, dstate), seq_idx (batch, seqlen)
    int32, cu_seqlens (num_seqs + 1,) int32/int64 with batch == 1.

    ``chunked`` (default: whether chunk_size is given) checks chunk_size; the sequential
    reference has no chunks.
    ``chunk_sizes=None`` accepts any power of two >= 16 (the reference), otherwise exactly those.
    ``allow_empty`` accepts batch 0 or seqlen 0 (the ops return empty results for them).
    ``inspect_values`` reads cu_seqlens (a device sync): it must be 0 = c0 <= c1 <= ... <= seqlen
    (equal offsets are an empty sequence, as batching code produces for an empty request).
    """
    _tensor("x", x, dims=4, layout="(batch, seqlen, nheads, headdim)", dtypes=dtypes, device=None)
    dev = x.device
    batch, seqlen, nheads, headdim = x.shape
    if nheads == 0 or headdim == 0:
        raise ValueError(f"x is empty (shape {tuple(x.shape)}); nheads and headdim must be >= 1")
    if x.numel() == 0 and not allow_empty:
        raise ValueError(
            f"x is empty (shape {tuple(x.shape)}); batch, seqlen, nheads and headdim must be >= 1"
        )
    _tensor("dt", dt, dims=3, layout="(batch, seqlen, nheads)", dtypes=dtypes, device=dev)
    _shape("dt", dt, "(batch, seqlen, nheads)", (batch, seqlen, nheads))
    _tensor("A", A, dims=1, layout="(nheads,)", dtypes=dtypes, device=dev)
    _shape("A", A, "(nheads,)", (nheads,))
    _tensor("B", B, dims=4, layout="(batch, seqlen, ngroups, dstate)", dtypes=dtypes, device=dev)
    ngroups, dstate = B.shape[2], B.shape[3]
    if ngroups == 0 or dstate == 0:
        raise ValueError(f"B is empty (shape {tuple(B.shape)}); ngroups and dstate must be >= 1")
    _shape("B", B, "(batch, seqlen, ngroups, dstate)", (batch, seqlen, ngroups, dstate))
    _tensor("C", C, dims=4, layout="(batch, seqlen, ngroups, dstate)", dtypes=dtypes, device=dev)
    _shape("C", C, "(batch, seqlen, ngroups, dstate) like B", tuple(B.shape))
    if nheads % ngroups:
        raise ValueError(
            f"nheads must be divisible by ngroups, got nheads={nheads}, ngroups={ngroups}"
        )
    _limits(headdim, dstate)
    if D is not None:
        d_dims = D.dim() if isinstance(D, torch.Tensor) else 1
        _tensor("D", D, dims=d_dims, layout="", dtypes=dtypes, device=dev)
        if tuple(D.shape) not in ((nheads,), (nheads, headdim)):
            raise ValueError(
                f"D must have shape (nheads,) = {(nheads,)} or (nheads, headdim) = "
                f"{(nheads, headdim)}, got {tuple(D.shape)}"
            )
    if z is not None:
        _tensor(
            "z", z, dims=4, layout="(batch, seqlen, nheads, headdim)", dtypes=dtypes, device=dev
        )
        _shape("z", z, "like x", tuple(x.shape))
    if dt_bias is not None:
        _tensor("dt_bias", dt_bias, dims=1, layout="(nheads,)", dtypes=dtypes, device=dev)
        _shape("dt_bias", dt_bias, "(nheads,)", (nheads,))
    if initial_states is not None:
        layout = "(batch, nheads, headdim, dstate)"
        _tensor("initial_states", initial_states, dims=4, layout=layout, dtypes=dtypes, device=dev)
        _shape("initial_states", initial_states, layout, (batch, nheads, headdim, dstate))
    if seq_idx is not None:
        _tensor(
            "seq_idx", seq_idx, dims=2, layout="(batch, seqlen)", dtypes=(torch.int32,), device=dev
        )
        _shape("seq_idx", seq_idx, "(batch, seqlen)", (batch, seqlen))
    num_seqs, offsets = 0, None
    if return_varlen_states and cu_seqlens is None:
        raise ValueError("return_varlen_states=True needs cu_seqlens")
    if cu_seqlens is not None:
        _tensor(
            "cu_seqlens", cu_seqlens, dims=1, layout="(num_seqs + 1,)", dtypes=_INDEX_DTYPES,
            device=dev,
        )  # fmt: skip
        if batch != 1:
            raise ValueError(
                f"cu_seqlens needs batch == 1 (sequences packed into one row), got batch={batch}"
            )
        num_seqs = cu_seqlens.shape[0] - 1
        if num_seqs < 1:
            raise ValueError(
                f"cu_seqlens must hold at least 2 offsets, got shape {tuple(cu_seqlens.shape)}"
            )
        if inspect_values:
            cu = cu_seqlens.tolist()
            offsets = tuple(cu)
            # tokens after the last offset are padding (mamba_ssm's varlen generation pads the
            # packed row so: cu_seqlens[-1] < seqlen, seq_idx -1 there)
            if cu[0] != 0 or cu[-1] > seqlen or any(a > b for a, b in itertools.pairwise(cu)):
                raise ValueError(
                    f"cu_seqlens must start at 0, never decrease and end at or before "
                    f"seqlen={seqlen}, got {cu}"
                )
    limit = _check_dt_limit(dt_limit)
    if chunked or (chunked is None and chunk_size is not None):
        _check_chunk_size(chunk_size, chunk_sizes)
    if state_dtype is None:
        state_dtype = torch.float32
    elif state_dtype not in dtypes:
        names = ", ".join(_dtype_name(d) for d in dtypes)
        raise TypeError(f"state_dtype must be one of {names}, got {state_dtype!r}")
    return ChunkScanDims(
        batch, seqlen, nheads, headdim, ngroups, dstate, num_seqs, limit, state_dtype, offsets
    )


@dataclass(frozen=True)
class StateUpdateDims:
    """Sizes of a ``selective_state_update`` call, in the multi-head form.

    The Mamba1 form (no head dim) reads as nheads = ngroups = 1, headdim = dim.
    """

    batch: int
    nheads: int
    headdim: int
    dstate: int
    ngroups: int
    pool: int  # rows of the state tensor
    has_heads: bool


def check_state_update_args(
    state, x, dt, A, B, C, D=None, z=None, dt_bias=None, state_batch_indices=None, *,
    dtypes=REFERENCE_FLOATS, allow_empty: bool = False,
) -> StateUpdateDims:  # fmt: skip
    """Checks the arguments of ``selective_state_update`` (both forms).

    Multi-head: state (pool, nheads, headdim, dstate), x/dt/z (batch, nheads, headdim),
    A (nheads, headdim, dstate), B/C (batch, ngroups, dstate), D/dt_bias (nheads, headdim).
    Mamba1: state (pool, dim, dstate), x/dt/z (batch, dim), A (dim, dstate), B/C (batch, dstate),
    D/dt_bias (dim,). ``pool`` may exceed batch only with state_batch_indices (batch,).
    Broadcast (stride-0) views are fine everywhere.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in (2, 3):
        raise ValueError(
            f"x must be (batch, dim) or (batch, nheads, dim), got shape {tuple(x.shape)}"
        )
    heads = x.dim() == 3
    xl = "(batch, nheads, headdim)" if heads else "(batch, dim)"
    _tensor("x", x, dims=x.dim(), layout=xl, dtypes=dtypes)
    dev = x.device
    if x.numel() == 0 and not (allow_empty and x.shape[0] == 0 and all(x.shape[1:])):
        raise ValueError(f"x is empty (shape {tuple(x.shape)})")
    batch, nheads, headdim = (*x.shape,) if heads else (x.shape[0], 1, x.shape[1])
    sl = "(batch, nheads, headdim, dstate)" if heads else "(batch, dim, dstate)"
    _tensor("state", state, dims=x.dim() + 1, layout=sl, dtypes=dtypes, device=dev)
    check_no_overlap("state", state)
    pool, dstate = state.shape[0], state.shape[-1]
    if tuple(state.shape[1:-1]) != tuple(x.shape[1:]) or dstate == 0 or (pool == 0 and batch > 0):
        inner = ", ".join(str(s) for s in x.shape[1:])
        raise ValueError(
            f"state must have shape {sl} = (pool, {inner}, dstate >= 1), got {tuple(state.shape)}"
        )
    _limits(headdim if heads else None, dstate)
    _tensor("dt", dt, dims=x.dim(), layout=xl, dtypes=dtypes, device=dev)
    _shape("dt", dt, "like x", tuple(x.shape))
    al = "(nheads, headdim, dstate)" if heads else "(dim, dstate)"
    _tensor("A", A, dims=x.dim(), layout=al, dtypes=dtypes, device=dev)
    _shape("A", A, al, (*x.shape[1:], dstate))
    bl = "(batch, ngroups, dstate)" if heads else "(batch, dstate)"
    _tensor("B", B, dims=x.dim(), layout=bl, dtypes=dtypes, device=dev)
    ngroups = B.shape[1] if heads else 1
    _shape("B", B, bl, (batch, ngroups, dstate) if heads else (batch, dstate))
    _tensor("C", C, dims=x.dim(), layout=bl, dtypes=dtypes, device=dev)
    _shape("C", C, f"{bl} like B", tuple(B.shape))
    if ngroups == 0 or nheads % ngroups:
        raise ValueError(
            f"nheads must be divisible by ngroups, got nheads={nheads}, ngroups={ngroups}"
        )
    dl = "(nheads, headdim)" if heads else "(dim,)"
    for name, t in (("D", D), ("dt_bias", dt_bias)):
        if t is not None:
            _tensor(name, t, dims=x.dim() - 1, layout=dl, dtypes=dtypes, device=dev)
            _shape(name, t, dl, tuple(x.shape[1:]))
    if z is not None:
        _tensor("z", z, dims=x.dim(), layout=xl, dtypes=dtypes, device=dev)
        _shape("z", z, "like x", tuple(x.shape))
    if state_batch_indices is not None:
        _tensor(
            "state_batch_indices", state_batch_indices, dims=1, layout="(batch,)",
            dtypes=_INDEX_DTYPES, device=dev,
        )  # fmt: skip
        _shape("state_batch_indices", state_batch_indices, "(batch,)", (batch,))
    elif pool != batch:
        raise ValueError(
            f"state has {pool} rows for a batch of {batch}; pass state_batch_indices to select rows"
        )
    return StateUpdateDims(batch, nheads, headdim, dstate, ngroups, pool, heads)


def check_rmsnorm_args(
    x,
    weight,
    bias=None,
    z=None,
    eps=1e-6,
    group_size=None,
    *,
    dtypes=REFERENCE_FLOATS,
    allow_empty: bool = False,
) -> tuple[int, int]:
    """Checks gated-RMSNorm arguments; returns (hidden, group_size)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError(
            f"x must have at least 1 dimension (..., hidden), got shape {tuple(x.shape)}"
        )
    _tensor("x", x, dims=x.dim(), layout="(..., hidden)", dtypes=dtypes)
    if x.numel() == 0 and not (allow_empty and x.shape[-1] > 0):  # no rows: fine for the ops
        raise ValueError(f"x is empty (shape {tuple(x.shape)})")
    hidden = x.shape[-1]
    _tensor("weight", weight, dims=1, layout="(hidden,)", dtypes=dtypes, device=x.device)
    _shape("weight", weight, "(hidden,)", (hidden,))
    if bias is not None:
        _tensor("bias", bias, dims=1, layout="(hidden,)", dtypes=dtypes, device=x.device)
        _shape("bias", bias, "(hidden,)", (hidden,))
    if z is not None:
        _tensor("z", z, dims=x.dim(), layout="like x", dtypes=dtypes, device=x.device)
        _shape("z", z, "like x", tuple(x.shape))
    if group_size is None:
        group_size = hidden
    # (a SymInt while torch.compile traces with dynamic shapes)
    if (
        isinstance(group_size, bool)
        or not isinstance(group_size, (int, torch.SymInt))
        or group_size < 1
    ):
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if hidden % group_size:
        raise ValueError(
            f"group_size must divide hidden, got hidden={hidden}, group_size={group_size}"
        )
    if not (isinstance(eps, (int, float)) and eps >= 0):
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")
    return hidden, group_size


# Mamba1's selective scan (semantics: mamba2_rocm.reference.selective_scan)

MAX_SCAN_DSTATE = 256


COMPLEX_WEIGHTS = (torch.complex64, torch.complex128)


@dataclass(frozen=True)
class ScanDims:
    batch: int
    dim: int
    seqlen: int
    dstate: int
    b_groups: int  # 0: fixed (dim, dstate); else groups of the variable B
    c_groups: int
    complex_a: bool = False


def _check_tensor(name, t, device, dtypes=REFERENCE_FLOATS) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = ", ".join(_dtype_name(d) for d in dtypes)
        raise TypeError(f"{name} must be one of {names}, got {_dtype_name(t.dtype)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (the device of u)")


def _bc_groups(name, t, batch, dim, seqlen, dstate, complex_a=False) -> int:
    """0 for a fixed (dim, dstate) B / C, else its number of groups (1 for (batch, dstate, L));
    with complex A a variable one holds (real, imaginary) pairs: 2 * seqlen values a row."""
    shape = tuple(t.shape)
    if complex_a:
        want = COMPLEX_WEIGHTS if t.dim() == 2 else REFERENCE_FLOATS
        if t.dtype not in want:
            kind = "fixed (complex)" if t.dim() == 2 else "variable (real pairs)"
            raise TypeError(f"with complex A, {name} {kind} must be one of "
                            f"{', '.join(_dtype_name(d) for d in want)}, got "
                            f"{_dtype_name(t.dtype)}")  # fmt: skip
    elif t.is_complex():
        raise TypeError(f"{name} is complex ({_dtype_name(t.dtype)}) but A is real")
    steps, what = (2 * seqlen, "2 * seqlen") if complex_a else (seqlen, "seqlen")
    if t.dim() == 2:
        if shape != (dim, dstate):
            raise ValueError(f"{name} fixed must be (dim={dim}, dstate={dstate}), got {shape}")
        return 0
    if t.dim() == 3:
        if shape != (batch, dstate, steps):
            raise ValueError(
                f"{name} variable must be (batch={batch}, dstate={dstate}, {what}={steps}), "
                f"got {shape}"
            )
        return 1
    if t.dim() == 4:
        groups = shape[1]
        if shape != (batch, groups, dstate, steps) or groups < 1 or dim % groups:
            raise ValueError(
                f"{name} grouped must be (batch={batch}, groups, dstate={dstate}, "
                f"{what}={steps}) with groups dividing dim={dim}, got {shape}"
            )
        return groups
    raise ValueError(
        f"{name} must be (dim, dstate), (batch, dstate, seqlen) or (batch, groups, dstate, "
        f"seqlen), got shape {shape}"
    )


def check_selective_scan_args(u, delta, A, B, C, D=None, z=None, delta_bias=None) -> ScanDims:
    """Shapes, dtypes and devices of a selective-scan call; raises naming the argument."""
    if not isinstance(u, torch.Tensor):
        raise TypeError(f"u must be a torch.Tensor, got {type(u).__name__}")
    if u.dim() != 3:
        raise ValueError(f"u must be (batch, dim, seqlen), got shape {tuple(u.shape)}")
    device = u.device
    _check_tensor("u", u, device)
    batch, dim, seqlen = u.shape
    if dim == 0:
        raise ValueError(f"u is empty along dim (shape {tuple(u.shape)}); dim must be >= 1")
    _check_tensor("delta", delta, device)
    if tuple(delta.shape) != tuple(u.shape):
        raise ValueError(f"delta must have u's shape {tuple(u.shape)}, got {tuple(delta.shape)}")
    _check_tensor("A", A, device, (*REFERENCE_FLOATS, *COMPLEX_WEIGHTS))
    complex_a = A.is_complex()
    if A.dim() != 2 or A.shape[0] != dim:
        raise ValueError(f"A must be (dim={dim}, dstate), got shape {tuple(A.shape)}")
    dstate = A.shape[1]
    if not 1 <= dstate <= MAX_SCAN_DSTATE:
        raise ValueError(f"dstate must be 1..{MAX_SCAN_DSTATE}, got {dstate}")
    bc_types = (*REFERENCE_FLOATS, *COMPLEX_WEIGHTS)  # which of them: _bc_groups, by A's kind
    _check_tensor("B", B, device, bc_types)
    _check_tensor("C", C, device, bc_types)
    b_groups = _bc_groups("B", B, batch, dim, seqlen, dstate, complex_a)
    c_groups = _bc_groups("C", C, batch, dim, seqlen, dstate, complex_a)
    for name, t, shape in (("D", D, (dim,)), ("delta_bias", delta_bias, (dim,)),
                           ("z", z, tuple(u.shape))):  # fmt: skip
        if t is not None:
            _check_tensor(name, t, device)
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    return ScanDims(batch, dim, seqlen, dstate, b_groups, c_groups, complex_a)
