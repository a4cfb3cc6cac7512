"""``selective_scan_fn``: Mamba1's selective scan, mamba_ssm's signature and semantics.

Semantics and the references: :mod:`mamba2_rocm.reference.selective_scan`. Tiers as for the
other ops (``MAMBA2_ROCM_BACKEND``): the GPU kernel (``csrc/selective_scan.hip``: B / C / A in
float32, the host converts) where code objects serve the device; the PyTorch tier elsewhere,
which steps through time with all (batch, dim, dstate) elements at once in float32 and
differentiates as plain PyTorch code; ``eager`` runs the float64 ground truth (cast back). On
the kernel tier the op is ``torch.ops.mamba2_rocm.selective_scan``; its backward is
``torch.ops.mamba2_rocm.selective_scan_bwd`` (csrc/selective_scan_bwd.hip: the states recomputed
from the saved inputs as mamba_ssm does, every reduction in a fixed order: bit-identical runs).
Complex A runs on the PyTorch tier (mamba_ssm's conventions, see the reference module), forward
and backward; the kernels take real A.
"""

from __future__ import annotations

import functools
import math

from mamba2_rocm._torch import require_torch
from mamba2_rocm.kernels import SELECTIVE_SCAN_DSTATE_TIERS, SELECTIVE_SCAN_SEGMENT_TIERS
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
    resident_blocks,
    save_inputs_kept,
    saved_inputs,
    sm_count,
    traced,
    wants_grads,
)
from mamba2_rocm.ops.checks import check_selective_scan_args
from mamba2_rocm.reference.selective_scan import (
    last_state_dtype,
    selective_scan_ref,
    selective_scan_torch,
)

torch = require_torch()
Tensor = torch.Tensor

__all__ = ["selective_scan_fn"]

_THREADS = 128  # csrc/selective_scan.hip: kThreads
#: Which form of the kernel runs (csrc/selective_scan.hip): "channels" (a thread walks a whole
#: channel's tokens with its state in registers, u / steps / B / C staged in LDS; dstate <= 64
#: with variable B and C, the sequence cut into segments when there are too few channels to fill
#: the GPU; the default), "segments" (parallel along the sequence: a lane per run of tokens, the
#: state carried by a scan over the lanes; dstate <= 64), "butterfly" (one channel per 16 lanes
#: walking the tokens, the per-token cross-lane sum) or "deferred" (the butterfly's sums once per
#: chunk). Where the chosen form does not take the call, the next in that order does (channels,
#: segments, butterfly). All pass the GPU tests; tests and the benchmark set it.
KERNEL_FORMS = {"butterfly": "", "deferred": "_dr", "segments": "_sp", "channels": "_ch"}
kernel_form = "channels"
_SEGMENT_LANES = 32  # csrc/selective_scan.hip: kSeg, lanes per channel in the segment form
_CH_THREADS = 64  # csrc/selective_scan.hip: kChThreads, threads per block of the channel form
_CH_SEG_ALIGN = 64  # segment lengths: a multiple of every chunk length (kChT) the build may use
_CH_MIN_SEG = 128  # the shortest segment worth its second pass
#: The channel form cuts the sequence into segments (each costing its exps twice) only while
#: fewer than CH_FULL_PER_SM blocks per multiprocessor would run, and then into enough for
#: CH_SEG_PER_SM blocks per multiprocessor (measured on the H100, scripts/tune_selective_scan.py: one 5120-channel
#: sequence of 8192 tokens ran 1699 us whole, 614-600 us in 12-16 segments; 8 x 4096 channels
#: ran fastest whole). Tests and bench set ``channel_segments`` to force a count.
CH_FULL_PER_SM = 3
CH_SEG_PER_SM = 8
channel_segments: int | None = None


_CH_PER = 16  # csrc/selective_scan.hip: M2R_SSCAN_PER, state elements per lane
#: The channel form's _ch2 / _ch4 kernels give a lane half / a quarter of the state elements
#: (2 / 4 times the lanes a channel, as many times fewer channels a block): more blocks where
#: the whole-lane kernels cannot fill the GPU. A lane's fewer elements cost more per element
#: (the same per-token loads and sums for less work: 1.04x at 8, 1.5x at 4 on a full GPU), and
#: segments cost their exps twice. Measured (H100, 2026-12-07, scripts/tune_selective_scan.py
#: with SPLIT=1 / 2 / 4, the host's segments, graph µs): b1 d768 l2048 60 / 41 / 36, b1 d1536
#: 80 / 58 / 60, b1 d2048 93 / 74 / 79, b2 d1536 124 / 100 / 122, b4 d768 125 / 100 / 122, b4
#: d1536 194 / 190 / 213, b4 d2048 248 / 242 / 257, b2 d4096 250 / 241 / 256, b8 d768
#: 195 / 190 / 213, b8 d1536 360 / 328 / 312, b8 d2048 421 / 352 / 391, b1 d768 l8192
#: 220 / 113 / 121, b1 d5120 l8192 576 / 588 / 688. The rule (channel_lane_split) picks the
#: fastest at all of them but the last (2% off). Tests and bench set ``channel_split`` (1, 2 or
#: 4) to force the choice.
channel_split: int | None = None
#: Quarters need this many blocks a multiprocessor to beat halves cut into segments (b8 d1536:
#: 768 blocks won, b4 d2048's 512 did not); and where halves, cut into the most segments the
#: sequence allows, still make fewer, quarters win (b1 d768 l2048: 384 blocks).
CH_QUARTER_FILL_PER_SM = 4.5
CHANNEL_SPLITS = {1: "_ch", 2: "_ch2", 4: "_ch4"}  # lanes a channel's state is split over, x1


def _channel_lanes(tier: int, split: int = 1) -> int:
    """Lanes per channel in the channel form: _CH_PER / split state elements each."""
    return max(1, tier * split // _CH_PER)


def channel_lane_split(blocks: int, seqlen: int, sms: int, forced: int | None = None) -> int:
    """How many times finer than the whole-lane kernels the channel form splits a channel's
    state over lanes (1; 2: the _ch2 kernels; 4: _ch4), given ``blocks`` blocks of the
    whole-lane kernels per segment on ``sms`` multiprocessors: whole lanes or halves where their
    blocks reach CH_FULL_PER_SM a multiprocessor (no segments then); else quarters where theirs
    reach CH_QUARTER_FILL_PER_SM, or where the half-lane blocks in the most segments a
    ``seqlen`` sequence takes stay under it; else halves (with segments)."""
    if forced is not None:
        if forced not in CHANNEL_SPLITS:
            raise ValueError(f"channel_split must be one of {sorted(CHANNEL_SPLITS)}, got {forced}")
        return forced
    if sms <= 0:
        return 1
    for split in (1, 2):
        if blocks * split >= CH_FULL_PER_SM * sms:
            return split
    quarter = CH_QUARTER_FILL_PER_SM * sms
    most_segments = max(1, seqlen // _CH_MIN_SEG)
    return 4 if 4 * blocks >= quarter or 2 * blocks * most_segments < quarter else 2


def _form(tier: int, dims=None) -> str:
    """The form that runs at ``tier`` for a call of ``dims``: kernel_form where it takes it."""
    form = kernel_form
    if form == "channels" and dims is not None and not _channel_form_takes(tier, dims):
        form = "segments"
    if form in ("segments", "channels") and tier not in SELECTIVE_SCAN_SEGMENT_TIERS:
        return "butterfly"
    return form


def _channel_form_takes(tier: int, dims) -> bool:
    """Variable B and C, a block's channels in one group of each, 32-bit offsets in a block."""
    if tier not in SELECTIVE_SCAN_SEGMENT_TIERS or not (dims.b_groups and dims.c_groups):
        return False
    # the whole-lane kernels' channels a block (a multiple of the other forms')
    channels = _CH_THREADS // _channel_lanes(tier)
    for groups in (dims.b_groups, dims.c_groups):
        if groups > 1 and (dims.dim // groups) % channels:
            return False
    return max(channels, dims.dstate) * dims.seqlen < 2**31


def channel_segment_len(blocks: int, seqlen: int, sms: int, forced: int | None = None) -> int:
    """Tokens per segment of the channel form (0: one segment) for ``blocks`` blocks per
    segment on ``sms`` multiprocessors: segments only while the blocks cannot fill the GPU."""
    if forced is not None:
        nseg = max(1, min(forced, GRID_YZ_MAX))
    elif blocks >= CH_FULL_PER_SM * sms:
        return 0
    else:
        want = -(-CH_SEG_PER_SM * sms // blocks)
        nseg = min(want, max(1, seqlen // _CH_MIN_SEG))
    if nseg <= 1:
        return 0
    seg = -(-seqlen // nseg)
    seg = -(-seg // _CH_SEG_ALIGN) * _CH_SEG_ALIGN
    return 0 if seg >= seqlen else seg


def _kernel(kset, u, delta, A, B, C, D, z, delta_bias, delta_softplus, dims, out, last) -> tuple:
    """m2r_selective_scan_<dtype>_n<tier>[form] (csrc/selective_scan.hip): one launch, or two
    for the channel form cut into segments; every operand contiguous (copies only where the
    caller's is not), B / C / A in float32. Returns the float32 B and C it read (the
    backward reads them too: :func:`_train_forward`)."""
    if dims.batch > GRID_YZ_MAX:
        raise ValueError(
            f"the selective-scan kernel takes batch <= {GRID_YZ_MAX}, got {dims.batch}"
        )
    u = u.contiguous()
    delta = like(delta, u).contiguous()
    z = None if z is None else like(z, u).contiguous()
    A, B, C = (t.float().contiguous() for t in (A, B, C))
    D, delta_bias = (
        None if t is None else as_kernel_float(t).contiguous() for t in (D, delta_bias)
    )
    tier = next(n for n in SELECTIVE_SCAN_DSTATE_TIERS if dims.dstate <= n)
    form = _form(tier, dims)
    suffix = KERNEL_FORMS[form]
    # channels per block, as the kernel has them: a lane group per channel
    if form == "channels":
        threads = _CH_THREADS
        whole_blocks = -(-dims.dim // (threads // _channel_lanes(tier))) * dims.batch
        split = channel_lane_split(whole_blocks, dims.seqlen, sm_count(u.device), channel_split)
        channels = threads // _channel_lanes(tier, split)
        suffix = CHANNEL_SPLITS[split]
    else:
        threads = _THREADS
        lanes = _SEGMENT_LANES if form == "segments" else 16 if tier <= 128 else 32
        channels = threads // lanes
    blocks = -(-dims.dim // channels)
    seg_len, seg_state = 0, None
    if form == "channels":
        seg_len = channel_segment_len(blocks * dims.batch, dims.seqlen, sm_count(u.device),
                                      channel_segments)  # fmt: skip
    nseg = -(-dims.seqlen // seg_len) if seg_len else 1
    if nseg > 1:  # (batch, dim, nseg, tier) end states, then (batch, dim, nseg) step sums
        seg_state = torch.empty(dims.batch * dims.dim * nseg * (tier + 1), dtype=torch.float32,
                                device=u.device)  # fmt: skip
    params = (
        u.data_ptr(),
        delta.data_ptr(),
        A.data_ptr(),
        B.data_ptr(),
        C.data_ptr(),
        ptr(D),
        ptr(z),
        ptr(delta_bias),
        out.data_ptr(),
        ptr(last),
        ptr(seg_state),
        dims.batch,
        dims.dim,
        dims.seqlen,
        dims.dstate,
        dims.b_groups,
        dims.c_groups,
        int(delta_softplus),
        DTYPE_CODE[D.dtype] if D is not None else 0,
        DTYPE_CODE[delta_bias.dtype] if delta_bias is not None else 0,
        seg_len,
    )  # fmt: skip  (SelectiveScanParams, field order)
    name = f"m2r_selective_scan_{KERNEL_DTYPE[u.dtype]}_n{tier}{suffix}"
    if nseg > 1:  # every segment's map but the last's, then the outputs
        launch(kset.launcher(name + "s"), u, params, (blocks, dims.batch, nseg - 1), threads)
    launch(kset.launcher(name), u, params, (blocks, dims.batch, nseg), threads)
    return B, C


def _impl(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
    z: Tensor | None, delta_bias: Tensor | None, delta_softplus: bool, return_last_state: bool,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(out, last_state)``, last_state empty unless asked for."""
    return _forward(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state)[:2]


def _forward(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state) -> tuple:
    """``_impl``'s ``(out, last_state)``, then the float32 B and C the kernel read (None, None
    off the kernel tier)."""
    dims = check_selective_scan_args(u, delta, A, B, C, D, z, delta_bias)
    shape = _last_shape(dims, return_last_state)
    if dims.batch == 0 or dims.seqlen == 0:  # empty input: empty output, zero state
        return (torch.empty(u.shape, dtype=u.dtype, device=u.device),
                torch.zeros(shape, dtype=last_state_dtype(A), device=u.device), None, None)  # fmt: skip
    tier, kset = choose(u.device)
    if tier == "kernel" and u.dtype in KERNEL_DTYPE and last_state_dtype(A) == torch.float32:
        out = torch.empty(u.shape, dtype=u.dtype, device=u.device)
        last = torch.empty(shape, dtype=torch.float32, device=u.device)
        Bk, Ck = _kernel(kset, u, delta, A, B, C, D, z, delta_bias, delta_softplus, dims, out,
                         last if return_last_state else None)  # fmt: skip
        return out, last, Bk, Ck
    fn = selective_scan_ref if tier == "eager" else selective_scan_torch
    return (*_torch_tier(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state,
                         fn), None, None)  # fmt: skip


def _last_shape(dims, return_last_state: bool) -> tuple[int, ...]:
    return (dims.batch, dims.dim, dims.dstate) if return_last_state else (0,)


def _torch_tier(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state,
                fn=selective_scan_torch):  # fmt: skip
    """What the torch tier computes for ``_impl``'s arguments (also the backward's
    recomputation); ``fn`` the eager tier's ground truth instead."""
    out, last = fn(u, delta, A, B, C, D, z, delta_bias, delta_softplus, True)
    return out.contiguous(), last if return_last_state else last.new_empty(0)


selective_scan_op = torch.library.custom_op("mamba2_rocm::selective_scan", _impl, mutates_args=())
_DIFFERENTIABLE = (0, 1, 2, 3, 4, 5, 6, 7)  # u, delta, A, B, C, D, z, delta_bias

# csrc/selective_scan_bwd.hip
_BWD_THREADS = 128
_BWD_LD = 256  # variable B / C rows padded to a multiple of every kChunk (128 / 256 tokens)
_BWD_MIN_CHUNK = 128  # the smallest kChunk: ckpt and the per-chunk partials are sized by it
_BWD_CH = 4  # channels per block on wave32 (2 on wave64, which divides it)
_BWD_RANGE = 256  # tokens a chunk range of the gradients' kernel (a kChunk on NVIDIA, two on AMD)
#: Blocks the backward's grid aims at per multiprocessor (measured on the H100, b8 d4096 l2048
#: n16 bf16: 7.3 ms at 8, 8.7 at 4, 7.5 at 16); fewer slices (each a partial of the variable
#: dB / dC the host sums) where that fills the GPU.
BWD_BLOCKS_PER_SM = 8
#: The variable dB / dC partials may take this many times u's bytes, or BWD_PARTIAL_MIN_BYTES
#: if more (more slices than that run fewer, longer blocks instead).
BWD_PARTIAL_FACTOR = 4
BWD_PARTIAL_MIN_BYTES = 64 << 20


def bwd_grid(batch: int, groups: int, gdim: int, seqlen: int, sms: int,
             max_slices: int | None, resident: int | None = None) -> tuple[int, int, int]:  # fmt: skip
    """``(slices, slice_ch, ranges)`` of the backward's gradients kernel: enough channel slices
    a group that the grid reaches BWD_BLOCKS_PER_SM blocks a multiprocessor, no more than
    ``max_slices`` (the variable dB / dC partials' memory cap; None: no cap) and no more than
    the group's _BWD_CH-channel tiles; ``slice_ch`` the channels a slice (a whole number of
    tiles), every slice with channels. Where the slices alone cannot reach that, the chunks go
    in ``ranges`` ranges of _BWD_RANGE tokens, which run in parallel (their carries come from
    the carries' kernel); else one range, and the carries' kernel skips its backward walk.

    With ``resident`` (the gradients kernel's blocks a multiprocessor holds at once, from the
    runtime's occupancy calculator) the tiles a slice are those of :func:`wave_fit_tiles`
    instead: a block walks its slice's tiles one after another, so a grid whose last wave is
    partly empty runs as long as a full one (the H100 at b8 d4096 l2048: 1024 blocks of 8
    tiles, 3 resident a multiprocessor, 2.6 waves, the last a third full)."""
    aim = BWD_BLOCKS_PER_SM * max(1, sms)
    tiles = -(-gdim // _BWD_CH)
    most = tiles if max_slices is None else max(1, min(tiles, max_slices))
    ranges = 1
    if batch * groups * most < aim:
        ranges = max(1, min(-(-seqlen // _BWD_RANGE), GRID_YZ_MAX))
    if resident:
        per = wave_fit_tiles(tiles, most, batch * groups * ranges, resident * max(1, sms))
    else:
        slices = max(1, min(-(-aim // (batch * groups * ranges)), most))
        per = -(-tiles // slices)
    slice_ch = per * _BWD_CH
    return -(-gdim // slice_ch), slice_ch, ranges


@functools.lru_cache(maxsize=1024)
def wave_fit_tiles(tiles: int, most: int, others: int, slots: int) -> int:
    """Tiles a slice (``tiles`` a group, at most ``most`` slices) that finish soonest where
    ``others`` blocks run per slice (batch x groups x ranges) and ``slots`` blocks at once:
    the fewest waves times the tiles a block walks; of equals, the most tiles a slice (fewest
    slices: the fewest dB / dC partials to write and sum). Cached: the search is a loop over
    the tiles on every backward call, 100 µs of host time on the H100 machine at d1536."""
    best, best_cost = tiles, None
    for per in range(tiles, 0, -1):
        slices = -(-tiles // per)
        if slices > most:
            break
        cost = -(-others * slices // slots) * per
        if best_cost is None or cost < best_cost:
            best, best_cost = per, cost
    return best


#: floats each buffer :func:`carved` cuts is aligned to (256 bytes, as the allocator's own)
_CARVE_ALIGN = 64


def carved(make, device, *shapes) -> list:
    """float32 tensors of ``shapes`` cut from one ``make`` (torch.empty or torch.zeros) buffer,
    each starting _CARVE_ALIGN floats apart: one allocation and at most one fill for all of a
    backward's workspaces, where one each cost a launch's host time (their contents as
    ``make`` leaves them)."""
    cuts, at = [], 0
    for shape in shapes:
        strides, n = [], 1
        for size in reversed(shape):  # contiguous strides
            strides.append(n)
            n *= size
        cuts.append((shape, strides[::-1], at))
        at += -(-n // _CARVE_ALIGN) * _CARVE_ALIGN
    buf = make(at, dtype=torch.float32, device=device)
    return [buf.as_strided(shape, strides, start) for shape, strides, start in cuts]


def stacked(*parts):
    """Equally shaped tensors cut from one buffer by :func:`carved`, each at the same distance
    from the one before, as one (len(parts), ...) view (a reduction over all of them is then
    one launch)."""
    first = parts[0]
    step = parts[1].storage_offset() - first.storage_offset() if len(parts) > 1 else 0
    if any(p.shape != first.shape or p.storage_offset() != first.storage_offset() + i * step
           for i, p in enumerate(parts)):  # fmt: skip
        raise ValueError("stacked: the parts are not equally shaped and spaced")
    return first.as_strided((len(parts), *first.shape), (step, *first.stride()),
                            first.storage_offset())  # fmt: skip


def _bwd_kernel(kset, u, delta, A, B, C, D, z, delta_bias, delta_softplus, dims, dout, dlast,
                bc=(None, None)):  # fmt: skip
    """The gradients (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias; None for an absent input)
    by csrc/selective_scan_bwd.hip: m2r_selective_scan_bwd_carry_<dt>_<B><C>[_z] (the chunks'
    carries, a block per 4 channels), then m2r_selective_scan_bwd_<dt>_<B><C>[_z] over
    (group x slice, batch, chunk range) (:func:`bwd_grid`); the kernels' fp32 partials summed
    here (:func:`summed_partials`). ``bc``: the float32 B and C the forward read where it kept
    them (:func:`_train_forward`), else None each: read instead of converting B / C again."""
    batch, dim, L, N = dims.batch, dims.dim, dims.seqlen, dims.dstate
    if batch > GRID_YZ_MAX:
        raise ValueError(f"the selective-scan kernel takes batch <= {GRID_YZ_MAX}, got {batch}")
    dev, f32 = u.device, torch.float32
    x = u.contiguous()
    dl = like(delta, x).contiguous()
    zk = None if z is None else like(z, x).contiguous()
    go = like(dout, x).contiguous()
    gb, gc = dims.b_groups, dims.c_groups
    groups = math.lcm(gb or 1, gc or 1)
    ld = -(-L // _BWD_LD) * _BWD_LD
    nck = -(-L // _BWD_MIN_CHUNK)

    def padded(t, g, k):  # variable: (batch, groups, dstate, ld) float32, zeros past seqlen
        if k is not None:  # the forward's float32 contiguous copy of t
            t = k
        if not g:
            return t.float().contiguous()
        t = t.reshape(batch, g, N, L)
        if ld == L:  # whole rows already: no copy of a float32 contiguous, 16-byte aligned B / C
            k = t.float().contiguous()
            if k.data_ptr() % 16 == 0:  # (the kernel reads rows in 16-byte runs)
                return k
        out = torch.zeros(batch, g, N, ld, dtype=f32, device=dev)
        out[..., :L] = t
        return out

    Bk, Ck = padded(B, gb, bc[0]), padded(C, gc, bc[1])
    Ak = A.float().contiguous()
    gdim = dim // groups
    var_bytes = (bool(gb) + bool(gc)) * batch * groups * N * ld * 4
    allowed = max(BWD_PARTIAL_FACTOR * x.numel() * x.element_size(), BWD_PARTIAL_MIN_BYTES)
    kind = ("v" if gb else "f") + ("v" if gc else "f")
    tail = f"{KERNEL_DTYPE[x.dtype]}_{kind}{'_z' if z is not None else ''}"
    grads_kernel = kset.launcher(f"m2r_selective_scan_bwd_{tail}")
    slices, slice_ch, ranges = bwd_grid(
        batch, groups, gdim, L, sm_count(dev), allowed // var_bytes if var_bytes else None,
        resident_blocks(grads_kernel, _BWD_THREADS),
    )  # fmt: skip
    # ckpt, then the adjoint entering each range's last chunk (wckpt; none read with one range)
    ckpt, wckpt = carved(
        torch.empty, dev, (batch * dim * nck * N,), (batch * dim * nck * N if ranges > 1 else 1,)
    )
    du, ddl = torch.empty_like(x), torch.empty_like(x)
    dz = None if zk is None else torch.empty_like(x)
    per_chunk = (batch, dim, nck, N)  # chunks past the kernel's stay 0
    var_part = (batch, groups, slices, N, ld)  # dB / dC accumulate into it: zeros first
    # absent D, delta_bias and last-state gradient read as zeros: cut from the same buffer
    absent = [s for t, s in ((D, (dim,)), (delta_bias, (dim,)), (dlast, (batch, dim, N)))
              if t is None]  # fmt: skip
    dA_part, dB_part, dC_part, *blank = carved(
        torch.zeros, dev, per_chunk, var_part if gb else per_chunk,
        var_part if gc else per_chunk, *absent,
    )  # fmt: skip
    blank = iter(blank)  # (in absent's order)
    Dk = next(blank) if D is None else as_kernel_float(D).contiguous()
    bias = next(blank) if delta_bias is None else as_kernel_float(delta_bias).contiguous()
    dl_last = next(blank) if dlast is None else dlast.float().contiguous()
    dDb_part = torch.empty(2, ranges, batch, dim, dtype=f32, device=dev)  # dD, ddelta_bias
    dD_part, ddb_part = dDb_part.unbind(0)

    def params(slices: int, slice_ch: int) -> tuple:
        return (
            x.data_ptr(),
            dl.data_ptr(),
            Ak.data_ptr(),
            Bk.data_ptr(),
            Ck.data_ptr(),
            Dk.data_ptr(),
            ptr(zk),
            bias.data_ptr(),
            go.data_ptr(),
            dl_last.data_ptr(),
            ckpt.data_ptr(),
            wckpt.data_ptr(),
            du.data_ptr(),
            ddl.data_ptr(),
            ptr(dz),
            dA_part.data_ptr(),
            dB_part.data_ptr(),
            dC_part.data_ptr(),
            dD_part.data_ptr(),
            ddb_part.data_ptr(),
            batch,
            dim,
            L,
            N,
            gb,
            gc,
            int(delta_softplus),
            DTYPE_CODE[Dk.dtype],
            DTYPE_CODE[bias.dtype],
            groups,
            slices,
            slice_ch,
            ld,
            nck,
            ranges,
            0,
        )  # fmt: skip  (SelectiveScanBwdParams, field order)

    tiles = -(-gdim // _BWD_CH)  # the carries: a block per tile of _BWD_CH channels
    launch(kset.launcher(f"m2r_selective_scan_bwd_carry_{tail}"), x, params(tiles, _BWD_CH),
           (groups * tiles, batch, 1), _BWD_THREADS)  # fmt: skip
    launch(grads_kernel, x, params(slices, slice_ch),
           (groups * slices, batch, ranges), _BWD_THREADS)  # fmt: skip

    dA, dB, dC, dD, ddb = summed_partials(dA_part, dB_part, dC_part, dDb_part, A, B, C, D,
                                          delta_bias, dims, groups)  # fmt: skip
    return du, ddl.to(delta.dtype), dA, dB, dC, dD, None if dz is None else dz.to(z.dtype), ddb


def summed_partials(dA_part, dB_part, dC_part, dDb_part, A, B, C, D, delta_bias, dims,
                    groups: int) -> tuple:  # fmt: skip
    """(dA, dB, dC, dD, ddelta_bias) from the backward kernel's float32 partials, each in its
    input's dtype (None for an absent D / delta_bias), in as few launches as the layouts allow:
    dA and a fixed B / C's (batch, dim, chunks, dstate) partials summed over the batch and the
    chunks in one reduction, a variable B / C's (batch, groups, slices, dstate, ld) over the
    slices in one (and converted once where both go to one dtype as they are), dD with
    ddelta_bias ((2, ranges, batch, dim)) in one. The pieces of each reduction are equally
    spaced in one :func:`carved` buffer (:func:`stacked`). Torch's reductions take a fixed
    order for a given shape: runs are bit-identical."""
    batch, N, L = dims.batch, dims.dstate, dims.seqlen
    gb, gc = dims.b_groups, dims.c_groups
    fixed = [dA_part] + [p for p, g in ((dB_part, gb), (dC_part, gc)) if not g]
    fixed_sums = iter(stacked(*fixed).sum((1, 3)).unbind(0))
    var = [(p, t, g) for p, t, g in ((dB_part, B, gb), (dC_part, C, gc)) if g]
    var_sums = stacked(*(p for p, _, _ in var))[..., :L].sum(3) if var else None
    if var and all(g == groups for _, _, g in var) and len({t.dtype for _, t, _ in var}) == 1:
        var_sums = var_sums.to(var[0][1].dtype)  # (no more sums after: one conversion)
    var_sums = iter(() if var_sums is None else var_sums.unbind(0))

    def bc_grad(t, g):
        if not g:  # fixed: (dim, dstate)
            return next(fixed_sums).to(t.dtype)
        s = next(var_sums)  # (batch, groups, dstate, seqlen)
        if g < groups:  # the finer grouping's groups back to the tensor's
            s = s.view(batch, g, groups // g, N, L).sum(2)
        return s.reshape(t.shape).to(t.dtype)

    dA = next(fixed_sums).to(A.dtype)
    dB, dC = bc_grad(B, gb), bc_grad(C, gc)
    dDb = None if D is None and delta_bias is None else dDb_part.sum((1, 2))
    return (dA, dB, dC, None if D is None else dDb[0].to(D.dtype),
            None if delta_bias is None else dDb[1].to(delta_bias.dtype))  # fmt: skip


def _bwd_impl(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
    z: Tensor | None, delta_bias: Tensor | None, delta_softplus: bool, dout: Tensor,
    dlast: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """The gradients of out and the last state (``dout``, ``dlast`` or None) for (u, delta,
    A, B, C, D, z, delta_bias), each in its input's dtype; an empty tensor stands for an
    absent input. The kernel tier runs csrc/selective_scan_bwd.hip (real A); otherwise
    autograd through the forward's PyTorch tier."""
    return _backward(u, delta, A, B, C, D, z, delta_bias, delta_softplus, dout, dlast)


def _backward(u, delta, A, B, C, D, z, delta_bias, delta_softplus, dout, dlast,
              bc=(None, None)) -> tuple:  # fmt: skip
    """``_bwd_impl``; ``bc`` the float32 B / C the forward kept (:func:`_bwd_kernel`)."""
    dims = check_selective_scan_args(u, delta, A, B, C, D, z, delta_bias)
    _check_grads(u, dims, A, dout, dlast)
    inputs = (u, delta, A, B, C, D, z, delta_bias)
    if u.device.type == "meta" or dims.batch == 0 or dims.seqlen == 0:
        grads = tuple(None if t is None else torch.zeros_like(t) for t in inputs)
    else:
        tier, kset = choose(u.device)
        if tier == "kernel" and u.dtype in KERNEL_DTYPE and not dims.complex_a:
            grads = _bwd_kernel(kset, u, delta, A, B, C, D, z, delta_bias, delta_softplus, dims,
                                dout, dlast, bc)  # fmt: skip
        else:
            grads = _torch_grads(inputs, delta_softplus, dout, dlast)
    return tuple(u.new_empty(0) if g is None else g for g in grads)  # type: ignore[return-value]


def _check_grads(u, dims, A, dout, dlast) -> None:
    """dout like out; dlast (batch, dim, dstate) in the last state's dtype, or None."""
    if dout.shape != u.shape or dout.device != u.device:
        raise ValueError(f"selective_scan backward: dout must be {tuple(u.shape)} on {u.device}, "
                         f"got {tuple(dout.shape)} on {dout.device}")  # fmt: skip
    if dout.dtype not in KERNEL_DTYPE:
        raise TypeError(f"selective_scan backward: dout must be floating, got {dout.dtype}")
    if dlast is not None:
        want = (dims.batch, dims.dim, dims.dstate)
        if tuple(dlast.shape) != want or dlast.device != u.device:
            raise ValueError(f"selective_scan backward: the last state's gradient must be {want} "
                             f"on {u.device}, got {tuple(dlast.shape)} on {dlast.device}")  # fmt: skip
        if dlast.dtype != last_state_dtype(A):
            raise TypeError(f"selective_scan backward: the last state's gradient must be "
                            f"{last_state_dtype(A)}, got {dlast.dtype}")  # fmt: skip


def _torch_grads(inputs, delta_softplus, dout, dlast):
    """The gradients through the PyTorch tier (the kernel's stand-in elsewhere), by
    ``torch.func.vjp``: its own autograd level, which also works inside the registered op,
    where the dispatcher has turned autograd off."""
    present = [i for i, t in enumerate(inputs) if t is not None]

    def fn(*vals):
        args = list(inputs)
        for i, v in zip(present, vals, strict=True):
            args[i] = v
        out, last = _torch_tier(*args, delta_softplus, dlast is not None)
        return (out, last) if dlast is not None else (out,)

    _, pull = torch.func.vjp(fn, *(inputs[i] for i in present))
    got = iter(pull((dout, dlast) if dlast is not None else (dout,)))
    return tuple(None if t is None else next(got) for t in inputs)


selective_scan_bwd = torch.library.custom_op(
    "mamba2_rocm::selective_scan_bwd", _bwd_impl, mutates_args=()
)


@selective_scan_bwd.register_fake
def _bwd_fake(u, delta, A, B, C, D, z, delta_bias, delta_softplus, dout, dlast):
    dims = check_selective_scan_args(u, delta, A, B, C, D, z, delta_bias)
    _check_grads(u, dims, A, dout, dlast)
    return tuple(u.new_empty(0) if t is None else torch.empty_like(t)
                 for t in (u, delta, A, B, C, D, z, delta_bias))  # fmt: skip


def _scan_backward(ctx, dout, dlast):
    """The selective scan's gradients through ``selective_scan_bwd`` (the HIP kernel on the
    kernel tier; the inputs are saved and the states recomputed, as mamba_ssm does, with the
    float32 B / C that eager training may keep: ``_train_forward``). Complex A recomputes
    through the PyTorch tier (``_launch.recomputed_grads``)."""
    inputs, kept = saved_inputs(ctx, extra=True)
    if not wants_grads(ctx, inputs, _DIFFERENTIABLE):
        return (None,) * len(inputs)
    u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state = inputs
    if A.is_complex():
        return recomputed_grads(ctx, inputs, _torch_tier, _DIFFERENTIABLE, (dout, dlast))
    if dout is None:
        dout = torch.zeros_like(u)
    if dlast is not None and (not return_last_state or dlast.numel() == 0):
        dlast = None
    # the registered op while compiling (traced through its fake), else the function itself
    args = (u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus), dout, dlast)
    if traced(u, dout):
        grads = selective_scan_bwd(*args)
    else:
        grads = _backward(*args, bc=kept or (None, None))
    return placed_grads(ctx, inputs, _DIFFERENTIABLE, grads)


def _train_forward(ctx, u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state):
    """Eager training's forward: ``_impl``, with the float32 B / C copies the kernel read kept
    on ``ctx.bc`` (for ``_save_scan``) where the backward reads them as they are: a copy (not
    the caller's float32 tensor itself) of a fixed B / C, or of a variable one whose rows are
    whole (seqlen a multiple of _BWD_LD; else the backward pads a copy anyway). That saves the
    backward two conversions, at b * dstate * seqlen * 4 bytes each held until it runs.
    Gradients of unused outputs stay None (the backward takes a missing one as zeros)."""
    out, last, Bk, Ck = _forward(u, delta, A, B, C, D, z, delta_bias, delta_softplus,
                                 return_last_state)  # fmt: skip
    whole = u.shape[-1] % _BWD_LD == 0

    def kept(k, t):
        return None if k is None or k is t or (t.dim() > 2 and not whole) else k

    ctx.bc = (kept(Bk, B), kept(Ck, C))
    ctx.set_materialize_grads(False)
    return out, last


#: the scan's ``setup_context``: the inputs and the float32 B / C eager training kept
_save_scan = functools.partial(save_inputs_kept, attr="bc")


_train_scan = register_training(selective_scan_op, _impl, _save_scan, _scan_backward,
                                eager_forward=_train_forward)  # fmt: skip


@selective_scan_op.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state):
    dims = check_selective_scan_args(u, delta, A, B, C, D, z, delta_bias)
    return (torch.empty(u.shape, dtype=u.dtype, device=u.device),
            torch.empty(_last_shape(dims, return_last_state), dtype=last_state_dtype(A),
                        device=u.device))  # fmt: skip


def selective_scan_fn(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
    z: Tensor | None = None, delta_bias: Tensor | None = None, delta_softplus: bool = False,
    return_last_state: bool = False,
):  # fmt: skip
    """Mamba1's selective scan: u, delta, z (batch, dim, seqlen); A (dim, dstate) real; B, C
    (dim, dstate), (batch, dstate, seqlen) or (batch, groups, dstate, seqlen); D, delta_bias
    (dim,). Returns out (u's dtype) [, last_state (batch, dim, dstate), A's type (>= fp32)]."""
    grads = (u, delta, A, B, C, D, z, delta_bias)
    # the registered op (or its eager training entry) where the kernel would run, or compiling;
    # else plain PyTorch code, which autograd differentiates directly
    op = entry(_impl, selective_scan_op, _train_scan, *grads)
    out, last = op(u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus),
                   bool(return_last_state))  # fmt: skip
    return (out, last) if return_last_state else out
