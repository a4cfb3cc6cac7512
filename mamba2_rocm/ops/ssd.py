"""``mamba_chunk_scan_combined``: the Mamba2 SSD chunked scan, as in mamba_ssm.

Tiers (``MAMBA2_ROCM_BACKEND``): the five-stage kernel pipeline of ``csrc/ssd_*.hip`` (a
source per stage); the vectorized chunked PyTorch form (``reference.ssd.ssd_chunked``, fp32);
the plain recurrence (``reference.ssd.ssd_sequential`` in fp32). Registered as
``torch.ops.mamba2_rocm.mamba_chunk_scan_combined``, which always returns
``(out, final_states, varlen_states)`` (varlen_states empty unless asked for); the Python
function applies mamba_ssm's return convention.

Inputs are mamba_ssm's: B, C and z may be float32 with fp16/bf16 x (the kernels read them in
x's type: converted once, the caller's tensors untouched), A, D, dt, dt_bias any float type;
``chunk_size`` any positive int: the scan's result does not depend on it (only rounding does). The
torch tiers run the kernels' size for it (``kernel_chunk_size``: 64, 128 or 256); the kernel tier
runs the size that is fastest for the call's work (``scan_chunk_size``; eager training's forward,
whose entering states the backward may reuse, and the backward take the training rule).
``cu_seqlens`` may hold empty sequences (equal offsets); their varlen state is zero (the initial
state for empty sequences at offset 0).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

from mamba2_rocm._torch import require_torch
from mamba2_rocm.kernels import SSD_SCAN_FORMS
from mamba2_rocm.ops._backend import choose
from mamba2_rocm.ops._launch import (
    DTYPE_CODE,
    GRID_YZ_MAX,
    KERNEL_DTYPE,
    as_kernel_float,
    entry,
    launch,
    like,
    placed_grads,
    ptr,
    recomputed_grads,
    register_training,
    save_inputs_kept,
    saved_inputs,
    sm_count,
    strides,
    traced,
    wants_grads,
)
from mamba2_rocm.ops.checks import (
    KERNEL_CHUNK_SIZES,
    check_chunk_scan_args,
    check_chunk_scan_grads,
    kernel_chunk_size,
)
from mamba2_rocm.params import SsdBwdParams
from mamba2_rocm.reference.ssd import (
    empty_varlen_states,
    ssd_chunked,
    ssd_chunked_bwd,
    ssd_sequential,
)

torch = require_torch()
Tensor = torch.Tensor

__all__ = ["mamba_chunk_scan_combined"]

# csrc/ssd_common.h and the forward's stage sources csrc/ssd_*.hip
_THREADS = 256
_CUMSUM_HEADS = 8  # kHeadsPerCumsum
_STATE_TILES = (64, 128)  # chunk_state: (headdim, dstate) per block (kStateP, kStateN)
_PASS_VEC = 4  # state_passing: elements per thread
_INT32_MAX = 2**31 - 1
# csrc/ssd_bwd_common.h and the backward's stage sources csrc/ssd_bwd_*.hip
_BWD_TILE = 64  # kTile: tokens / headdim / dstate per output tile
#: The dcb stage (csrc/ssd_bwd_dcb.hip) gives a block one (chunk, group, tile pair) and walks
#: the group's heads. Where too few blocks would run, the host splits each group's heads into
#: parts that the kernel takes for groups of their own (``heads_per_group / parts`` heads each,
#: every part's C·Bᵀ a copy of its group's), and sums the parts' gradients, in order, into the
#: group's: the kernel as it is, more blocks. ``DCB_PARTS`` forces the part count (1: none);
#: None (the default) lets :func:`dcb_parts` choose. Measured (H100, 2026-12-07,
#: scripts/tune_ssd_bwd_dcb.py, the whole backward, µs, parts 1 / 2 / 4 / 8): the 1.3b training
#: step's layer (b4 l2048 h64 g1) 1515 / 1436 / 1444 / 1466, 1409 as the rule picks (4); b2
#: l4096 h32 799 / 798 / 799 / 844; mamba2-130m b8 l512 h24 345 / 366 / 361 / 381, 3 parts
#: 351; g8 (8 heads a group) 2983 / 3387 / 3705 / 4617. A part shorter than DCB_MIN_HEADS heads
#: repeats the block's fixed cost and the sum for too little work: it never won.
DCB_PARTS: int | None = None
#: dcb_parts' model: blocks of the dcb kernel resident per multiprocessor (its register cap:
#: 2 on NVIDIA, csrc/ssd_bwd_dcb.hip), a block's fixed cost (its C·Bᵀ tile and mask, the
#: gradient's store) in heads' worth, and the fewest heads a part walks
DCB_RESIDENT_PER_SM = 2
DCB_BLOCK_COST_HEADS = 1
DCB_MIN_HEADS = 16


def dcb_parts(blocks: int, heads_per_group: int, sms: int, forced: int | None = None) -> int:
    """Parts the dcb stage splits a group's heads into (a divisor of ``heads_per_group``: every
    part walks as many heads), given ``blocks`` blocks of the one-part kernel on ``sms``
    multiprocessors: the count (each part at least DCB_MIN_HEADS heads) that minimises waves x
    (heads a part + a block's fixed cost), the fewest parts on a tie; 1 on a stand-in (no
    multiprocessors). ``forced`` wins, down to a divisor. At the 1.3b training step (320 blocks,
    64 heads, 132 multiprocessors): 4 parts, as mamba_ssm's Triton dcb."""
    divisors = [k for k in range(1, heads_per_group + 1) if heads_per_group % k == 0]
    if forced is not None:
        return max(k for k in divisors if k <= max(1, forced))
    if sms <= 0 or blocks <= 0:
        return 1
    slots = DCB_RESIDENT_PER_SM * sms

    def cost(parts: int) -> int:
        return -(-blocks * parts // slots) * (heads_per_group // parts + DCB_BLOCK_COST_HEADS)

    fits = [k for k in divisors if k == 1 or heads_per_group // k >= DCB_MIN_HEADS]
    return min(fits, key=lambda k: (cost(k), k))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _unit_last(t: Tensor | None) -> Tensor | None:
    """The kernels read rows with unit stride along the last dim; copy otherwise."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def _kernel(kset, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
            cu_seqlens, dt_softplus, dims, final, varlen, recompute=False, states=None):  # fmt: skip
    """The forward's five stages; ``(out, states)``, states the state entering each chunk
    (float32, (batch, nchunks, nheads, dstate, headdim)). With ``recompute`` (the backward's
    first step) only stages 1-4, and the workspaces the backward reads: (dt', dA_cs, seg, C·Bᵀ,
    states); stages 3-4 (chunk_state and the state passing, chained or not: ``_chained``) only
    when ``states`` (the forward's, kept for the backward: ``_kept_states``) is not given."""
    dt, A, D, dt_bias = (as_kernel_float(t) for t in (dt, A, D, dt_bias))
    initial_states = as_kernel_float(initial_states)
    x, B, C, z = (
        _unit_last(x),
        _unit_last(like(B, x)),
        _unit_last(like(C, x)),
        _unit_last(like(z, x)),
    )
    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate, cs = dims.ngroups, dims.dstate, chunk_size
    if batch > GRID_YZ_MAX or nheads > GRID_YZ_MAX:
        raise ValueError(
            f"mamba_chunk_scan_combined kernels take batch and nheads <= {GRID_YZ_MAX}, "
            f"got {batch}, {nheads}"
        )
    for name, t in (("x", x), ("B", B), ("C", C), ("z", z)):
        if t is not None and cs * t.stride(1) > _INT32_MAX:
            raise ValueError(
                f"{name}'s seqlen stride {t.stride(1)} is too large for the kernels' 32-bit "
                f"in-chunk offsets (chunk_size * stride must be < 2**31)"
            )
    nchunks = _cdiv(seqlen, cs)
    dev = x.device
    f32 = torch.float32
    dt_out = torch.empty(batch, nheads, nchunks, cs, dtype=f32, device=dev)
    dA_cs = torch.empty(batch, nheads, nchunks, cs, dtype=f32, device=dev)
    seg = torch.empty(batch, nchunks, cs, dtype=torch.int32, device=dev)
    cb = torch.empty(batch, nchunks, ngroups, cs, cs, dtype=f32, device=dev)
    given = states is not None  # (the backward's: the forward's, kept)
    if not given:
        states = torch.empty(batch, nchunks, nheads, dstate, headdim, dtype=f32, device=dev)
    state_tiles = _state_tiles(headdim, dstate)
    chains = batch * state_tiles * nheads  # (batch, state tile, head): see _chained
    path = "separate" if given else _state_path(chains, nchunks, sm_count(dev), x, B, cs)
    chained = path != "separate"
    # the chained chunk_state's ticket counter and flags (chunk_cumsum zeroes them)
    chain = torch.empty(1 + nchunks * chains, dtype=torch.int32, device=dev) if chained else None
    out = None if recompute else torch.empty(x.shape, dtype=x.dtype, device=dev)
    # (the kernels index cu_seqlens densely: a strided view is copied)
    cu = None if cu_seqlens is None else cu_seqlens.to(torch.int32).contiguous()
    if D is None:
        d_strides = (0, 0)
    elif D.dim() == 1:
        d_strides = (D.stride(0), 0)
    else:
        d_strides = tuple(D.stride())
    lo, hi = dims.dt_limit
    params = (
        x.data_ptr(),
        dt.data_ptr(),
        A.data_ptr(),
        B.data_ptr(),
        C.data_ptr(),
        ptr(D),
        ptr(z),
        ptr(dt_bias),
        ptr(initial_states),
        ptr(seq_idx),
        ptr(cu),
        ptr(out),
        ptr(final),
        ptr(varlen),
        dt_out.data_ptr(),
        dA_cs.data_ptr(),
        seg.data_ptr(),
        cb.data_ptr(),
        states.data_ptr(),
        ptr(chain),
        *x.stride()[:3],
        *strides(z, 4)[:3],
        *(x if out is None else out).stride()[:3],
        *B.stride()[:3],
        *C.stride()[:3],
        *dt.stride(),
        *strides(seq_idx, 2),
        *strides(initial_states, 4),
        A.stride(0),
        0 if dt_bias is None else dt_bias.stride(0),
        *d_strides,
        batch,
        seqlen,
        nheads,
        headdim,
        ngroups,
        dstate,
        cs,
        nchunks,
        nheads // ngroups,
        dims.num_seqs,
        int(dt_softplus),
        DTYPE_CODE[dt.dtype],
        DTYPE_CODE[A.dtype],
        DTYPE_CODE[D.dtype] if D is not None else 0,
        DTYPE_CODE[dt_bias.dtype] if dt_bias is not None else 0,
        DTYPE_CODE[initial_states.dtype] if initial_states is not None else 0,
        DTYPE_CODE[final.dtype] if final is not None else 0,
        lo,
        hi,
        0,
    )  # fmt: skip  (SsdParams, field order)
    dt_name = KERNEL_DTYPE[x.dtype]
    pairs = (cs // 64) * (cs // 64 + 1) // 2
    scan = _scan_form(cs, dt_name, kset.matrix_cores, headdim)
    rows, scan_threads, scan_cols = SSD_SCAN_FORMS[scan]
    if rows > cs:  # (only a forced form can: its grid would have no tiles)
        raise ValueError(f"chunk_scan form {scan} takes chunks of {rows} and more, not {cs}")
    scan_tiles = (cs // rows) * _cdiv(headdim, scan_cols)
    zs = "_z" if z is not None else ""
    run = lambda name, grid, threads=_THREADS: launch(kset.launcher(name), x, params, grid, threads)  # noqa: E731
    run("m2r_ssd_chunk_cumsum", (nchunks, _cdiv(nheads, _CUMSUM_HEADS), batch))
    run(f"m2r_ssd_bmm_{dt_name}", (nchunks * ngroups * pairs, 1, batch))
    if not given:
        stage = _STATE_STAGES[path]
        run(f"m2r_ssd_{stage}_{dt_name}", (nchunks * state_tiles * nheads, 1, batch))
        if not chained:
            run(
                "m2r_ssd_state_passing",
                (_cdiv(headdim * dstate, _THREADS * _PASS_VEC), nheads, batch),
            )
    if recompute:
        return dt_out, dA_cs, seg, cb, states
    if varlen is not None:
        run(f"m2r_ssd_varlen_state_{dt_name}", (dims.num_seqs * state_tiles * nheads, 1, 1))
    run(
        f"m2r_ssd_chunk_scan_{dt_name}_{scan}{zs}",
        (nchunks * scan_tiles * nheads, 1, batch),
        scan_threads,
    )
    return out, states


#: (least work per multiprocessor, chunk size), largest first: the kernel tier's chunk size for a
#: call (``scan_chunk_size``), 64 below the last step. Work is counted in tokens of one Mamba2
#: head (headdim 64, dstate 128): batch * nheads * seqlen * headdim * dstate / 8192. The scan's
#: result does not depend on the chunk size (only rounding does), so the kernels run the size
#: that is fastest for the call rather than the caller's: fewer, longer chunks pass fewer states
#: (each chunk's state is headdim x dstate floats, carried by a chain of dependent links), where
#: shorter ones cut the within-chunk product and its longest block's path, which decides a call
#: too small to fill the GPU. Measured on an H200 (132 multiprocessors; graph µs of the forward,
#: each size forced, two rounds; `bench ssd-paths` times it on the GPU at hand) over the grid of
#: `bench ssd` and 168 shorter calls (130m, 2.7b, Nemotron-H and Falcon-H1 layers at batch 1-8,
#: 40-1500 tokens): the rule's pick was 0.36% slower than the fastest size on (geometric) average,
#: at most 9.4% (Falcon-H1 b1 at 160-384 tokens, where 256 runs one or two chunks), against 4.4%
#: and 29% for the caller's chunk size. Against the caller's size it is 14-16% faster at
#: Falcon-H1-7B's chunk-128 grid points (b1 l8192 440.5 -> 385.6 µs), 5% at Nemotron-H b8 l512,
#: 11-24% at mamba2-130m b1 calls of 200-1500 tokens and 7-11% at mamba2-2.7b b1 calls of 300-512
#: (chunks of 64 or 128), and at most 3% slower anywhere (mamba2-130m b4 l160: 31.0 against 30.1
#: µs). Calibrated on NVIDIA
#: only, as the state path's tables. Training (forward + backward) takes no chunk shorter than the
#: caller's (``scan_chunk_size``'s ``training``): the backward recomputes the entering states
#: below chunk 256 (``_kept_states``) and pays per chunk more than the forward does, so a
#: shorter chunk lost there (H200, graph µs of a step through autograd: mamba2-130m b8 l160
#: 225.2 at the caller's 256 against 262.5 at the forward's pick of 128, b1 l1500 246.1 against
#: 255.7), where the longer one gains as in the forward (Falcon-H1-7B b8 l160 561.5 -> 423.3,
#: b1 l8192 1706.5 -> 1566.4; Nemotron-H b1 l8192 2838.5 -> 2632.1).
CHUNK_WORK_PER_SM = ((380.0, 256), (57.0, 128))


def scan_chunk_size(chunk_size: int, sizes, device, training: bool = False) -> int:
    """The chunk size the kernel tier runs a call of ``sizes`` (batch, seqlen, nheads, headdim,
    dstate) in: by its work per multiprocessor
    (``CHUNK_WORK_PER_SM``), never larger than the smallest of ``KERNEL_CHUNK_SIZES`` that holds
    the whole sequence (one chunk either way: a larger one only pads it), and with ``training``
    (eager training's forward, which may keep its entering states for the backward, and the
    backward) never shorter than ``chunk_size``. A compiled or fused-block forward takes the
    inference rule: its backward computes the states again at its own size.
    ``chunk_size`` (the caller's, as the op takes it: one of KERNEL_CHUNK_SIZES) where
    ``device`` is no GPU."""
    sms = sm_count(device)
    if not sms:
        return chunk_size
    batch, seqlen, nheads, headdim, dstate = sizes
    work = batch * nheads * seqlen * headdim * dstate / (64 * 128 * sms)
    chunk = next((c for least, c in CHUNK_WORK_PER_SM if work >= least), KERNEL_CHUNK_SIZES[0])
    if training:
        chunk = max(chunk, chunk_size)
    return min(chunk, kernel_chunk_size(max(seqlen, 1)))


def _state_tiles(headdim: int, dstate: int) -> int:
    """chunk_state's tiles per head (csrc/ssd_common.h: kStateP x kStateN)."""
    return _cdiv(headdim, _STATE_TILES[0]) * _cdiv(dstate, _STATE_TILES[1])


#: the forward's state passing -> its chunk_state kernel (the separate path then runs the
#: state-passing kernel)
_STATE_STAGES = {
    "separate": "chunk_state",
    "chained": "chunk_state_chain",
    "chained_lds": "chunk_state_chain_lds",
}


def _state_path(chains: int, chunks: int, sms: int, x: Tensor, B: Tensor, chunk_size: int) -> str:
    """How the forward passes the states along the chunks (a key of ``_STATE_STAGES``):
    chained where ``_chained`` says so, through LDS where ``_lds_link`` does too."""
    if not _chained(chains, chunks, sms):
        return "separate"
    return "chained_lds" if _lds_link(chains, chunks, sms, x, B, chunk_size) else "chained"


def _scan_form(chunk_size: int, dt_name: str, matrix_cores: bool, headdim: int) -> str:
    """chunk_scan's kernel form (a key of ``kernels.SSD_SCAN_FORMS``; csrc/ssd_chunk_scan.hip,
    kScanBlock128 / kScanP128 have the measurements). The 16-bit types on matrix cores: the
    64-row tile on 128 threads at every chunk size, 64 headdim columns a block; at headdim 128
    on NVIDIA all 128 a block on 256 threads (H200, Falcon-H1's shapes: chunk_scan 3-4% faster;
    on AMD its 37 KB of LDS would halve the blocks a CDNA compute unit holds: not taken there
    until an AMD runner measures it). The FMA path (fp32, and every dtype on gfx10.3): 256
    threads, the 64-row tile at chunk 64 and the 128-row one from 128."""
    if matrix_cores and dt_name != "f32":
        return "t64p128" if headdim == 128 and torch.version.hip is None else "t64b128"
    return "t64" if chunk_size == 64 else "t128"


# (most chunks, chains per multiprocessor): a forward whose chains have at most that many chunks
# takes the chained chunk_state (csrc/ssd_chunk_state.hip: Chain) from that many (batch, state tile, head)
# chains per multiprocessor on. Chained, chunk_state runs at 2 blocks per multiprocessor instead
# of 3 and each chain's links wait on each other; separate, the state-passing kernel reads and
# writes every state once more and walks the chunks in turn. So few chunks need many chains (the
# blocks the lost occupancy costs), and long chains few (the state-passing kernel grows with
# them). Measured on an H100 (132 SMs) with what is now `bench ssd-paths` (every point of
# `bench ssd`'s grid forced each way, graph µs), chained was faster by 2-6% from 256 chains of
# 2 chunks (mamba2-370m b8 l512; slower by 4% at 192, mamba2-130m), from 192 chains of 8
# (slower by 2-4% at 96 and 128), and from 64 chains of 64 chunks (b1 l16384 h64 g8: 815 vs
# 837 µs; slower by 1% at 48 chains, 4.5% at 64 chains of 16); at 24-32 chains of 32-64 chunks
# it was 20-35% slower. A second sweep, after the table was set, found its pick within 0.5% of
# the faster path at all 38 points. On an H200 (the sweep of 2026-11-29, commit 5c99e51) the
# pick is within 0.5% at 35 of 38 and 1.9-3.0% slower than the separate path at the three of
# 64 chains of 32-64 chunks (b1 l16384 h64 g8 769.0 vs 754.4 us, mamba2-1.3b b1 l8192 /
# l16384), where the H100 had chained 2.6% ahead: the two disagree at that step by about as
# much either way, so it stays. Calibrated on NVIDIA only; the AMD targets take the same rule
# untested (an AMD runner reruns the script to check it).
CHAIN_CHAINS_PER_SM = ((2, 1.6), (16, 1.2), (math.inf, 0.48))


# chunk size -> (most chunks, chains per multiprocessor): a chained forward whose chains have at
# most that many chunks passes the state through LDS from that many chains per multiprocessor on
# (m2r_ssd_chunk_state_chain_lds_*: the accumulators staged 64 rows at a time, then 16-byte loads
# of the entering state and stores of the next; 3 blocks per multiprocessor on NVIDIA instead of
# 2, but two round trips a link instead of one), else from the accumulators. Measured on an H100
# with `bench ssd-paths`: through LDS 2-11% faster from 384 chains of 2 chunks
# (mamba2-780m b8 l512 155.1 vs 157.9 µs; 4% slower at 256, mamba2-370m) and from 128 chains of
# more (Falcon-H1 b4 l2048, 384 of 16: 424.0 vs 474.5; Codestral b1 l8192, 128 of 32: 741.4 vs
# 772.9; mamba2-2.7b b4 l2048, 320 of 8: 455.6 vs 477.2), slower on fewer, longer chains (80-96
# chains of 32-128 chunks: 1-9%; b1 l16384 h64 g8 872.0 vs 820.5), where a link's latency is the
# chain's pace. Chunks of 128 (half a link's work) need more chains: Nemotron-H b1 (128 chains
# of 64-128 chunks of 128) lost 1-1.5% through LDS (780.9 vs 792.7 µs at l8192), where Codestral
# and Bamba b1 (128 chains of 32-64 chunks of 256) gained 2.5-4%; from 384 chains of 128-token
# chunks (Falcon-H1 and Nemotron-H at b4 / b8) it gained 3-11%. Chunks of 64 (not on the grid)
# take the 128 table. The FMA path (fp32; targets without matrix cores) has one link form: both
# names run it. NVIDIA only: on AMD the LDS form's registers give no more waves per SIMD than the
# register link's (gfx90a / gfx942: 176 VGPRs + 48 AGPRs against 148 + 32; gfx1100: 204 against
# 192; hipcc 7.0.2), so the occupancy that pays for its second round trip is not there, and a
# ROCm torch keeps the register link until an AMD runner's `bench ssd-paths` says
# otherwise (the GPU gate's run records it; it forces each form whatever this rule says).
CHAIN_LDS_CHAINS_PER_SM = {
    256: ((2, 2.5), (math.inf, 0.96)),
    128: ((2, 2.5), (math.inf, 1.5)),
}
_UINT32_MAX = 2**32 - 1


def _lds_link(chains: int, chunks: int, sms: int, x: Tensor, B: Tensor, chunk_size: int) -> bool:
    """Whether the chained chunk_state takes the LDS link (NVIDIA; enough chains of chunks this
    long for the occupancy to pay; x's and B's element offsets within 32 bits, which that kernel
    holds them in)."""
    if torch.version.hip is not None:  # AMD: see CHAIN_LDS_CHAINS_PER_SM
        return False
    return _enough_chains(
        CHAIN_LDS_CHAINS_PER_SM[256 if chunk_size >= 256 else 128], chains, chunks, sms
    ) and _lds_offsets_fit(x, B)


def _lds_offsets_fit(x: Tensor, B: Tensor) -> bool:
    """Whether every element offset of x's and B's views fits the 32 bits the LDS-link
    chunk_state holds them in (where they do not, that kernel must not run)."""

    def span(t: Tensor) -> int:
        return sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))

    return max(span(x), span(B)) <= _UINT32_MAX


def _chained(chains: int, chunks: int, sms: int) -> bool:
    """Whether chunk_state runs chained (the state passing in its blocks) for this many chains of
    this many chunks on this many multiprocessors (0: no GPU, as in the CPU tests: chained)."""
    return _enough_chains(CHAIN_CHAINS_PER_SM, chains, chunks, sms)


def _enough_chains(table, chains: int, chunks: int, sms: int) -> bool:
    """At least the chains per multiprocessor that ``table`` ((most chunks, chains per
    multiprocessor) steps) asks of chains this many chunks long."""
    per_sm = next(v for most, v in table if chunks <= most)
    return chains >= per_sm * sms


def _kept_states(x: Tensor, states: Tensor, chunk_size: int) -> Tensor | None:
    """``states`` (the forward's entering states) if training keeps them for the backward,
    else None (the backward computes them again from the inputs).

    They are kept when they take no more memory than what mamba_ssm keeps for its backward
    besides the inputs: ``out`` (x's size and dtype) and ``dA_cumsum`` (float32, one value per
    head and chunk position). For the Mamba2 models' dstate 128 with chunk 256 and 16-bit x
    that holds (the states are out's size), and the backward skips two of its stages
    (chunk_state and state_passing: about 7% of a training step's kernel time at
    b1 l16384 h64 g8 on the H200); a larger dstate or a smaller chunk recomputes instead."""
    batch, seqlen, nheads = x.shape[:3]
    positions = batch * nheads * _cdiv(seqlen, chunk_size) * chunk_size
    budget = x.numel() * x.element_size() + positions * 4
    return states if states.numel() * states.element_size() <= budget else None


def _empty_scan(x, initial_states, cu_seqlens, dims, return_varlen_states):
    """Batch 0 or seqlen 0, as torch ops treat empty inputs: an empty output; the final states
    are the entering states (initial_states, else zeros); each varlen state is its sequence's
    entering state (see empty_varlen_states)."""
    b, _, h, p = x.shape
    sd, n = dims.state_dtype, dims.dstate
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if initial_states is not None:
        final = initial_states.to(sd, copy=True).contiguous()
    else:
        final = torch.zeros(b, h, p, n, dtype=sd, device=x.device)
    if return_varlen_states:
        varlen = empty_varlen_states(cu_seqlens, initial_states, (h, p, n), sd)
    else:
        varlen = final.new_empty(0)
    return out, final, varlen


def _impl(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int, D: Tensor | None,
    z: Tensor | None, dt_bias: Tensor | None, initial_states: Tensor | None,
    seq_idx: Tensor | None, cu_seqlens: Tensor | None, dt_softplus: bool,
    dt_limit: Sequence[float], return_varlen_states: bool, state_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    if x.device.type == "meta":  # shapes only, as torch ops do on meta (values cannot be read)
        return _fake(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                     cu_seqlens, dt_softplus, dt_limit, return_varlen_states, state_dtype)  # fmt: skip
    return _scan(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
                 dt_softplus, dt_limit, return_varlen_states, state_dtype)  # fmt: skip


def _scan(
    x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus,
    dt_limit, return_varlen_states, state_dtype, torch_tier=False, keep=None,
):  # fmt: skip
    """``_impl``'s work; ``torch_tier`` runs the torch tier whatever the backend (the backward's
    recomputation, see ``_launch.recomputed_grads``). ``keep`` (eager training's context):
    gets ``keep.states``, the forward's entering states, where the kernel tier ran (else it
    gets nothing), or None where ``_kept_states`` does not keep them."""
    dims = check_chunk_scan_args(
        x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
        chunk_size=chunk_size, chunk_sizes=KERNEL_CHUNK_SIZES, dt_limit=tuple(dt_limit),
        return_varlen_states=return_varlen_states, state_dtype=state_dtype, allow_empty=True,
    )  # fmt: skip
    if x.shape[0] == 0 or x.shape[1] == 0:  # no tokens: nothing runs, states are the entering ones
        return _empty_scan(x, initial_states, cu_seqlens, dims, return_varlen_states)
    tier, kset = ("torch", None) if torch_tier else choose(x.device)
    args = (D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus, dims.dt_limit)
    if tier == "kernel" and x.dtype in KERNEL_DTYPE and dims.state_dtype in KERNEL_DTYPE:
        b, _, h, p = x.shape
        final = torch.empty(b, h, p, dims.dstate, dtype=dims.state_dtype, device=x.device)
        varlen = full = None
        if return_varlen_states:
            full = empty_varlen_states(cu_seqlens, initial_states, (h, p, dims.dstate),
                                       dims.state_dtype)  # fmt: skip
            cu = dims.offsets  # read by the value check above: no second host copy
            live = [i for i in range(dims.num_seqs) if cu[i + 1] > cu[i]]  # non-empty sequences
            if len(live) == dims.num_seqs:
                varlen = full
            else:  # the kernel takes non-empty sequences only: their end offsets, compacted
                ends = [cu[i + 1] for i in live]
                cu_seqlens = torch.tensor([0, *ends], dtype=torch.int32, device=x.device)
                dims = dataclasses.replace(dims, num_seqs=len(ends))
                varlen = torch.empty(len(ends), h, p, dims.dstate, dtype=dims.state_dtype,
                                     device=x.device)  # fmt: skip
            args = (*args[:5], cu_seqlens, *args[6:])
        cs = scan_chunk_size(
            chunk_size, (*x.shape, dims.dstate), x.device, training=keep is not None
        )
        out, states = _kernel(kset, x, dt, A, B, C, cs, *args[:-1], dims, final, varlen)
        if keep is not None:
            keep.states = _kept_states(x, states, cs)
        if full is not None and varlen is not full:
            full[live] = varlen
            varlen = full
    else:
        return _reference(x, dt, A, B, C, chunk_size, args, dims, return_varlen_states,
                          eager=tier == "eager")  # fmt: skip
    if varlen is None:
        varlen = final.new_empty(0)
    return out, final, varlen


def _reference(x, dt, A, B, C, chunk_size, args, dims, return_varlen_states, eager):
    """The torch tiers: the chunked form, or with ``eager`` the plain recurrence (fp32)."""
    kw = {"return_final_states": True, "return_varlen_states": return_varlen_states,
          "state_dtype": dims.state_dtype}  # fmt: skip
    if eager:
        res = ssd_sequential(x, dt, A, B, C, *args, compute_dtype=torch.float32, **kw)
    else:
        res = ssd_chunked(x, dt, A, B, C, chunk_size, *args, **kw)
    out, final = res[0].contiguous(), res[1]
    varlen = res[2] if return_varlen_states else final.new_empty(0)
    return out, final, varlen


def _torch_tier(*args):
    """What the torch tier computes for ``_impl``'s arguments (the backward's recomputation
    when the varlen states take a gradient)."""
    return _scan(*args, torch_tier=True)


mamba_chunk_scan_combined_op = torch.library.custom_op(
    "mamba2_rocm::mamba_chunk_scan_combined", _impl, mutates_args=()
)
# x, dt, A, B, C, D, z, dt_bias, initial_states
_DIFFERENTIABLE = (0, 1, 2, 3, 4, 6, 7, 8, 9)


def _bwd_kernel(kset, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                dt_softplus, dims, dout, dfinal, states=None):  # fmt: skip
    """The gradients on the kernel tier: the forward's stages 1-4 again (csrc/ssd_*.hip; 1-2
    only given the forward's ``states``), then the backward's (csrc/ssd_bwd_*.hip, which only
    reads ``states``); ``_bwd_impl``'s result."""
    dt_out, dA_cs, seg, cb, states = _kernel(
        kset, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, None,
        dt_softplus, dims, None, None, recompute=True, states=states,
    )  # fmt: skip
    batch, seqlen, nheads, headdim = x.shape
    g, n, cs = dims.ngroups, dims.dstate, chunk_size
    nchunks, dev, f32 = _cdiv(seqlen, cs), x.device, torch.float32
    xk = x.contiguous()
    Bk, Ck = like(B, x).contiguous(), like(C, x).contiguous()
    zk = None if z is None else like(z, x).contiguous()
    go = dout.to(x.dtype).contiguous()
    dtk = as_kernel_float(dt)
    A32 = A.to(f32).contiguous()
    D32 = None if D is None else D.to(f32).reshape(nheads, -1).expand(nheads, headdim).contiguous()
    bias32 = None if dt_bias is None else dt_bias.to(f32).contiguous()
    dfin = None if dfinal is None else dfinal.to(f32).contiguous()
    ptiles, ltiles, ntiles = _cdiv(headdim, _BWD_TILE), cs // _BWD_TILE, _cdiv(n, _BWD_TILE)
    pass_blocks = _cdiv(n, _THREADS * _PASS_VEC // headdim)  # (whole rows of the (n, p) state each)
    # the gated output gradient dout * silu(z), which the later stages read: without z it is
    # dout itself, so no x-sized copy is made (the dz stage writes it only with z)
    dout_g = go if z is None else torch.empty_like(xk)
    dx = torch.empty_like(xk)
    dz = None if z is None else torch.empty_like(xk)
    # the gradients of the chunks' states (fp32; the matrix-core builds' state passing writes them
    # over with 16-bit copies for the products: csrc/ssd_bwd_common.h, state_runs)
    dstates = torch.empty_like(states)
    dinit = None
    if initial_states is not None:
        dinit = torch.empty(batch, nheads, headdim, n, dtype=f32, device=dev)
    # dB / dC in B's / C's dtype when that is x's (the kernel rounds them once, as the
    # conversion of a float32 result would), else float32 then converted
    dbc_io = int(B.dtype == x.dtype) | int(C.dtype == x.dtype) << 1
    dB = torch.empty(batch, seqlen, g, n, dtype=x.dtype if dbc_io & 1 else f32, device=dev)
    dC = torch.empty(batch, seqlen, g, n, dtype=x.dtype if dbc_io & 2 else f32, device=dev)
    ddt = torch.empty(batch, seqlen, nheads, dtype=f32, device=dev)
    # per-token partials (csrc/ssd_bwd_common.h: tok_row), each written before it is read
    tok = torch.empty(
        ntiles + 2 * ptiles + 2 * ltiles, batch, nheads, nchunks, cs, dtype=f32, device=dev
    )
    # dD's partials with each column's together: their sum is over contiguous rows (as
    # (batch, nchunks, ltiles, nheads, headdim) torch's sum took 24 us at b1 l16384 h64)
    dD_part = torch.empty(nheads, headdim, batch, nchunks, ltiles, dtype=f32, device=dev)
    dA_last = torch.empty(batch, nheads, nchunks, pass_blocks, dtype=f32, device=dev)
    head_part = torch.empty(2, batch, nchunks, nheads, dtype=f32, device=dev)
    pairs = ltiles * (ltiles + 1) // 2
    parts = dcb_parts(nchunks * g * pairs * batch, nheads // g, sm_count(dev), DCB_PARTS)
    lo, hi = dims.dt_limit
    params = (
        xk.data_ptr(),
        Bk.data_ptr(),
        Ck.data_ptr(),
        ptr(zk),
        go.data_ptr(),
        dtk.data_ptr(),
        A32.data_ptr(),
        ptr(D32),
        ptr(bias32),
        dt_out.data_ptr(),
        dA_cs.data_ptr(),
        seg.data_ptr(),
        cb.data_ptr(),
        states.data_ptr(),
        ptr(dfin),
        dout_g.data_ptr(),
        ptr(dz),
        dx.data_ptr(),
        dstates.data_ptr(),
        ptr(dinit),
        dB.data_ptr(),
        dC.data_ptr(),
        ddt.data_ptr(),
        tok.data_ptr(),
        dD_part.data_ptr(),
        dA_last.data_ptr(),
        head_part.data_ptr(),
        *dtk.stride(),
        batch,
        seqlen,
        nheads,
        headdim,
        g,
        n,
        cs,
        nchunks,
        nheads // g,
        int(initial_states is not None),
        int(dt_softplus),
        DTYPE_CODE[dtk.dtype],
        pass_blocks,
        lo,
        hi,
        dbc_io,
    )  # fmt: skip  (SsdBwdParams, field order)
    dtn = KERNEL_DTYPE[x.dtype]
    run = lambda name, grid: launch(kset.launcher(name), x, params, grid, _THREADS)  # noqa: E731
    if z is not None:  # dz and the gated output gradient (without z nothing needs this stage)
        run(f"m2r_ssd_bwd_dz_{dtn}", (nchunks * ltiles * ptiles * nheads, 1, batch))
    run(f"m2r_ssd_bwd_dstates_{dtn}", (nchunks * _cdiv(ntiles, 2) * ptiles * nheads, 1, batch))
    run(f"m2r_ssd_bwd_state_passing_{dtn}", (pass_blocks, nheads, batch))
    run(f"m2r_ssd_bwd_dx_{dtn}", (nchunks * _cdiv(ltiles, 2) * ptiles * nheads, 1, batch))
    if parts == 1:
        run(f"m2r_ssd_bwd_dcb_{dtn}", (nchunks * g * pairs, 1, batch))
    else:  # part k of group j as group j * parts + k, then the parts' sum over cb (in order)
        cb_parts = cb.unsqueeze(3).expand(batch, nchunks, g, parts, cs, cs).contiguous()
        fields = dict(zip((k for k, _ in SsdBwdParams._fields_), params, strict=True))
        fields.update(cb=cb_parts.data_ptr(), ngroups=g * parts,
                      heads_per_group=nheads // g // parts)  # fmt: skip
        launch(kset.launcher(f"m2r_ssd_bwd_dcb_{dtn}"), x, tuple(fields.values()),
               (nchunks * g * parts * pairs, 1, batch), _THREADS)  # fmt: skip
        torch.sum(cb_parts, 3, out=cb)
    run(f"m2r_ssd_bwd_dc_{dtn}", (nchunks * ltiles * ntiles * g, 1, batch))
    run(f"m2r_ssd_bwd_db_{dtn}", (nchunks * ltiles * ntiles * g, 1, batch))
    run("m2r_ssd_bwd_cumsum", (nchunks, nheads, batch))
    # the partials, summed in a fixed order (deterministic)
    dD = None
    if D is not None:
        dD = dD_part.sum((2, 3, 4))
        dD = (dD.sum(-1) if D.dim() == 1 else dD).to(D.dtype)
    return (
        dx, ddt.to(dt.dtype),
        head_part[0].sum((0, 1)).to(A.dtype), dB.to(B.dtype), dC.to(C.dtype), dD,
        None if z is None else dz.to(z.dtype),
        None if dt_bias is None else head_part[1].sum((0, 1)).to(dt_bias.dtype),
        None if initial_states is None else dinit.to(initial_states.dtype),
    )  # fmt: skip


def _bwd_impl(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int, D: Tensor | None,
    z: Tensor | None, dt_bias: Tensor | None, initial_states: Tensor | None,
    seq_idx: Tensor | None, dt_softplus: bool, dt_limit: Sequence[float], dout: Tensor,
    dfinal: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """The gradients of ``out`` and the final states (``dout``, ``dfinal`` or None) for
    (x, dt, A, B, C, D, z, dt_bias, initial_states), each in its input's dtype; an empty
    tensor stands for an absent input. The kernel tier runs csrc/ssd_bwd_*.hip; the torch tiers
    the same steps written out in PyTorch (``reference.ssd.ssd_chunked_bwd``, fp32)."""
    return _bwd_run(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                    dt_softplus, dt_limit, dout, dfinal)  # fmt: skip


def _bwd_run(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus,
             dt_limit, dout, dfinal, states=None):  # fmt: skip
    """``_bwd_impl``, given the forward's entering states where eager training kept them
    (``_kept_states``; the kernel tier then skips computing them again)."""
    dims = check_chunk_scan_args(
        x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, None,
        chunk_size=chunk_size, chunk_sizes=KERNEL_CHUNK_SIZES, dt_limit=tuple(dt_limit),
        allow_empty=True,
    )  # fmt: skip
    check_chunk_scan_grads(x, dims, dout, dfinal)
    if x.device.type == "meta" or x.shape[0] == 0 or x.shape[1] == 0:
        grads = _bwd_empty(x, dt, A, B, C, D, z, dt_bias, initial_states, dfinal)
    else:
        tier, kset = choose(x.device)
        args = (x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus)
        if tier == "kernel" and x.dtype in KERNEL_DTYPE:
            # the training forward's chunk size (the kept states are in its chunks)
            cs = scan_chunk_size(chunk_size, (*x.shape, dims.dstate), x.device, training=True)
            grads = _bwd_kernel(kset, *args[:5], cs, *args[6:], dims, dout, dfinal, states)
        else:
            grads = ssd_chunked_bwd(*args, dims.dt_limit, dout, dfinal)
    return tuple(x.new_empty(0) if g is None else g for g in grads)  # type: ignore[return-value]


def _bwd_empty(x, dt, A, B, C, D, z, dt_bias, initial_states, dfinal):
    """No tokens: the final states are the initial ones, every other gradient is zero."""
    zero = lambda t: None if t is None else t.new_zeros(t.shape)  # noqa: E731  (contiguous)
    dinit = zero(initial_states)
    if initial_states is not None and dfinal is not None and x.device.type != "meta":
        dinit = dfinal.to(initial_states.dtype, copy=True)
    return (zero(x), zero(dt), zero(A), zero(B), zero(C), zero(D), zero(z), zero(dt_bias), dinit)


mamba_chunk_scan_combined_bwd = torch.library.custom_op(
    "mamba2_rocm::mamba_chunk_scan_combined_bwd", _bwd_impl, mutates_args=()
)


@mamba_chunk_scan_combined_bwd.register_fake
def _bwd_fake(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus,
              dt_limit, dout, dfinal):  # fmt: skip
    dims = check_chunk_scan_args(
        x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, None,
        chunk_size=chunk_size, chunk_sizes=KERNEL_CHUNK_SIZES, dt_limit=tuple(dt_limit),
        inspect_values=False, allow_empty=True,
    )  # fmt: skip
    check_chunk_scan_grads(x, dims, dout, dfinal)
    grads = _bwd_empty(x, dt, A, B, C, D, z, dt_bias, initial_states, None)
    return tuple(x.new_empty(0) if g is None else g.new_empty(g.shape) for g in grads)


def _scan_backward(ctx, dout, dfinal, dvarlen):
    """The scan's gradients through ``mamba_chunk_scan_combined_bwd`` (HIP kernels on the
    kernel tier; the inputs are saved and the forward's workspaces recomputed, as mamba_ssm
    does, but for the entering states that eager training may keep: ``_train_forward``). A
    gradient through the varlen states recomputes through the torch tier
    (``_launch.recomputed_grads``)."""
    inputs, kept = saved_inputs(ctx, extra=True)
    if not wants_grads(ctx, inputs, _DIFFERENTIABLE):
        return (None,) * len(inputs)
    if dvarlen is not None and dvarlen.numel():
        return recomputed_grads(ctx, inputs, _torch_tier, _DIFFERENTIABLE, (dout, dfinal, dvarlen))
    x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx = inputs[:11]
    dt_softplus, dt_limit = inputs[12], inputs[13]
    if dout is None:
        dout = torch.zeros_like(x)
    # the registered op while compiling (traced through its fake), else the function itself
    args = (x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus,
            dt_limit, dout, dfinal)  # fmt: skip
    if traced(x, dout):
        grads = mamba_chunk_scan_combined_bwd(*args)
    else:
        grads = _bwd_run(*args, states=kept[0] if kept else None)
    return placed_grads(ctx, inputs, _DIFFERENTIABLE, grads)


def _train_forward(ctx, *inputs):
    """Eager training's forward: ``_impl``, with the entering states on ``ctx.states`` where
    ``_kept_states`` says they are worth their memory, for ``_save_scan``."""
    if inputs[0].device.type == "meta":
        return _impl(*inputs)
    return _scan(*inputs, keep=ctx)


#: the scan's ``setup_context``: the inputs and the entering states eager training kept
_save_scan = functools.partial(save_inputs_kept, attr="states")


_train_scan = register_training(mamba_chunk_scan_combined_op, _impl, _save_scan, _scan_backward,
                                eager_forward=_train_forward)  # fmt: skip


@mamba_chunk_scan_combined_op.register_fake
def _fake(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
          dt_softplus, dt_limit, return_varlen_states, state_dtype):  # fmt: skip
    """Shapes and dtypes only, O(1) in the sizes (also what meta tensors get)."""
    dims = check_chunk_scan_args(
        x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
        chunk_size=chunk_size, chunk_sizes=KERNEL_CHUNK_SIZES, dt_limit=tuple(dt_limit),
        return_varlen_states=return_varlen_states, state_dtype=state_dtype, inspect_values=False,
        allow_empty=True,
    )  # fmt: skip
    b, _, h, p = x.shape
    sd, n = dims.state_dtype, dims.dstate
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    final = torch.empty(b, h, p, n, dtype=sd, device=x.device)
    if return_varlen_states:
        varlen = torch.empty(dims.num_seqs, h, p, n, dtype=sd, device=x.device)
    else:
        varlen = torch.empty(0, dtype=sd, device=x.device)
    return out, final, varlen


def mamba_chunk_scan_combined(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int,
    D: Tensor | None = None, z: Tensor | None = None, dt_bias: Tensor | None = None,
    initial_states: Tensor | None = None, seq_idx: Tensor | None = None,
    cu_seqlens: Tensor | None = None, dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf), return_final_states: bool = False,
    return_varlen_states: bool = False, state_dtype: torch.dtype | None = None,
):  # fmt: skip
    """The Mamba2 SSD scan over a sequence, mamba_ssm's ``mamba_chunk_scan_combined``.

    x (batch, seqlen, nheads, headdim); dt (batch, seqlen, nheads); A (nheads,); B, C (batch,
    seqlen, ngroups, dstate); D (nheads,) or (nheads, headdim); z like x; dt_bias (nheads,);
    initial_states (batch, nheads, headdim, dstate); seq_idx int32 (batch, seqlen);
    cu_seqlens (num_seqs + 1,) with batch 1. Returns out in x's dtype, then final_states
    (batch, nheads, headdim, dstate) if ``return_final_states``, then varlen_states
    (num_seqs, nheads, headdim, dstate) if ``return_varlen_states``; states are float32 unless
    ``state_dtype`` is given. Semantics: ``mamba2_rocm.reference.ssd``. Differentiable in x,
    dt, A, B, C, D, z, dt_bias and initial_states, through all three outputs (the backward:
    ``_scan_backward``).
    """
    op = entry(_impl, mamba_chunk_scan_combined_op, _train_scan, x, dt, A, B, C, D, z, dt_bias,
               initial_states)  # fmt: skip
    out, final, varlen = op(
        x, dt, A, B, C, kernel_chunk_size(chunk_size), D, z, dt_bias, initial_states, seq_idx,
        cu_seqlens,
        bool(dt_softplus), [float(dt_limit[0]), float(dt_limit[1])], bool(return_varlen_states),
        state_dtype,
    )  # fmt: skip
    if not return_varlen_states:
        return (out, final) if return_final_states else out
    return (out, final, varlen) if return_final_states else (out, varlen)
