"""The kernel table: every csrc source, the kernels it must define, and their parameter struct.

The build driver checks each code object against this table (every kernel present, argument
size equal to the struct) and the runtime looks kernels up through it. Torch-free.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from mamba2_rocm.params import (
    AddNormParams,
    ConvBwdParams,
    ConvFwdParams,
    ConvUpdateParams,
    DecayParams,
    LinearParams,
    MmaProbeParams,
    RmsNormBwdParams,
    RmsNormParams,
    SelectiveScanBwdParams,
    SelectiveScanParams,
    SsdBwdParams,
    SsdParams,
    SsuParams,
    StateRowsParams,
)

__all__ = ["SOURCES", "KernelSource", "kernel_params", "source_of"]

KERNEL_DTYPES = ("f32", "f16", "bf16")
CONV_WIDTHS = (2, 3, 4)
#: vec_s: short seqlen-contiguous rows; vec_m: rows up to 512 16-bit tokens, 8 a block; cl_vec /
#: cl_cf: channel-last, position tiles / channel blocks fastest in the grid
CONV_FWD_LAYOUTS = ("vec", "vec_s", "vec_m", "cl_vec", "cl_cf", "strided")
#: csrc/conv1d_bwd.hip: the LDS tile walked along seqlen / channels, and both in registers
#: (rwalk without seq_idx only: causal-conv1d takes seq_idx with channel-last x alone, and its
#: wave64 form spilled scalar registers)
CONV_BWD_SHAPES = ("rows", "cl", "walk", "rwalk")
SSU_DSTATE_TIERS = (32, 64, 128, 256)
#: csrc/state_update.hip: the contiguous-layout kernels' largest dstate per state dtype (a row is
#: at most 32 lanes of 16 bytes: 256 16-bit or 128 float32 elements)
SSU_CONTIG_MAX_DSTATE = {"f32": 128, "f16": 256, "bf16": 256}
SSU_ROWS_PER_WIDE = 2  # csrc/state_update.hip: kRowsPerWide, rows per thread of the _contig kernels
#: csrc/ssd_chunk_scan.hip: chunk_scan's kernel forms, by suffix -> (positions per tile, threads a block,
#: headdim columns a block). Every target has every form (t64b128 / t64p128 for the 16-bit
#: types only); which one runs is the host's rule (mamba2_rocm/ops/ssd.py, _scan_form).
SSD_SCAN_FORMS = {
    "t64": (64, 256, 64), "t128": (128, 256, 64), "t64b128": (64, 128, 64), "t64p128": (64, 256, 128),
}  # fmt: skip
SSD_SCAN_16BIT_FORMS = ("t64b128", "t64p128")
RMSNORM_VECS = (1, 2, 3, 4)  # csrc/rmsnorm.hip: 8-element runs per thread, register-resident form
RMSNORM_VEC_DTYPES = ("f16", "bf16")
#: csrc/rmsnorm_bwd.hip: kRowMaxThreads, the one-pass backward's threads a block at most (one
#: 8-element run each; bf16 only)
RMSNORM_BWD_ROW_MAX_THREADS = 512
#: csrc/add_norm.hip: 4-element runs a thread of the register-resident forward / backward
ADD_NORM_FWD_RUNS = (1, 2, 4, 8)
ADD_NORM_BWD_RUNS = (1, 2, 3, 4)
#: csrc/linear.hip: a decode step's linear layers, by row tier (the most rows a kernel takes) ->
#: (output features a thread group walks together, 16-byte weight loads a feature in flight per
#: thread). Swept on the H100 (2026-12-06, weights rotated past L2) over (1, 2, 4) features x
#: (2, 4, 8) loads: one row (4, 2) was the best or within 2% at every projection; two rows
#: (4, 2) was up to 7% faster than (2, 4), which is what the GPU suite has run so far.
LINEAR_FORMS = {1: (4, 2), 2: (2, 4)}
SELECTIVE_SCAN_DSTATE_TIERS = (16, 32, 64, 128, 256)  # csrc/selective_scan.hip: 16 lanes each
SELECTIVE_SCAN_SEGMENT_TIERS = (16, 32, 64)  # the segment (_sp) and channel (_ch) forms


@dataclass(frozen=True)
class KernelSource:
    """One csrc file: compiled to one code object per target."""

    name: str  # file stem in csrc/, e.g. "conv1d_fwd"
    params: type[ctypes.Structure]
    kernels: tuple[str, ...]

    @property
    def filename(self) -> str:
        return f"{self.name}.hip"


SOURCES: dict[str, KernelSource] = {
    s.name: s
    for s in (
        KernelSource(
            "conv1d_fwd",
            ConvFwdParams,
            tuple(
                f"m2r_conv1d_fwd_{dt}_w{w}_{layout}{seq}"
                for dt in KERNEL_DTYPES
                for w in CONV_WIDTHS
                for layout in CONV_FWD_LAYOUTS
                for seq in ("", "_seq")
            ),
        ),
        KernelSource(
            "conv1d_bwd",
            ConvBwdParams,
            (
                *(
                    f"m2r_conv1d_bwd_{dt}_w{w}_{shape}{seq}"
                    for dt in KERNEL_DTYPES
                    for w in CONV_WIDTHS
                    for shape in CONV_BWD_SHAPES
                    for seq in ("", "_seq")
                    if not (shape == "rwalk" and seq)  # (seqlen-contiguous seq_idx: rows kernel)
                ),
                "m2r_conv1d_bwd_reduce",  # dweight / dbias from the partial rows
            ),
        ),
        KernelSource(
            "conv1d_update",
            ConvUpdateParams,
            tuple(
                f"m2r_conv1d_update_{dt}_w{w}{tile}"
                for dt in KERNEL_DTYPES
                for w in CONV_WIDTHS
                # _tile: the block's states through LDS; _vec_c<S> / _vec_s<S>: a few channels a
                # thread in whole runs, states of S slots in channel or slot order
                for tile in ("", "_tile", *(f"_vec_{o}{s}" for o in "cs" for s in (w - 1, w)))
            ),
        ),
        KernelSource(
            "state_update",
            SsuParams,
            tuple(
                f"m2r_ssu_{sd}_{xd}{bcz}_n{n}{contig}"
                for sd in KERNEL_DTYPES
                for xd in KERNEL_DTYPES
                for bcz in ("", "_f32bcz")  # B, C, z read in x's dtype, or in float32
                if not (bcz and xd == "f32")
                for n in SSU_DSTATE_TIERS
                for contig in ("", "_contig", "_rows", "_rows_std")
                if not (contig and n > SSU_CONTIG_MAX_DSTATE[sd])
            ),
        ),
        KernelSource("state_rows", StateRowsParams, ("m2r_state_rows",)),
        KernelSource("decay", DecayParams, ("m2r_decay_rates",)),
        KernelSource(
            "linear",
            LinearParams,
            (
                *(
                    f"m2r_linear_{dt}_m{m}_r{r}_u{u}{conv}"
                    for m, (r, u) in LINEAR_FORMS.items()
                    for dt in KERNEL_DTYPES
                    for conv in ("", "_conv")
                ),
                "m2r_linear_prefetch",
            ),
        ),
        # the matrix-core interface's self-test (tests/gpu/test_mma_probe_gpu.py)
        KernelSource(
            "mma_probe", MmaProbeParams, tuple(f"m2r_mma_probe_{dt}" for dt in ("f16", "bf16"))
        ),
        KernelSource(
            "selective_scan",
            SelectiveScanParams,
            tuple(
                f"m2r_selective_scan_{dt}_n{n}{form}"
                for dt in KERNEL_DTYPES
                for n in SELECTIVE_SCAN_DSTATE_TIERS
                for form in ("", "_dr")  # the per-token butterfly; the deferred sums
            )
            + tuple(
                f"m2r_selective_scan_{dt}_n{n}_sp"  # the segment form
                for dt in KERNEL_DTYPES
                for n in SELECTIVE_SCAN_SEGMENT_TIERS
            )
            + tuple(
                # the channel form: outputs, segment maps; the same at half / a quarter of
                # the state a lane
                f"m2r_selective_scan_{dt}_n{n}{part}"
                for dt in KERNEL_DTYPES
                for n in SELECTIVE_SCAN_SEGMENT_TIERS
                for part in ("_ch", "_chs", "_ch2", "_ch2s", "_ch4", "_ch4s")
            ),
        ),
        KernelSource(
            "selective_scan_bwd",
            SelectiveScanBwdParams,
            tuple(
                f"m2r_selective_scan_bwd_{stage}{dt}_{bc}{z}"
                for stage in ("carry_", "")  # the chunks' carries, then the gradients
                for dt in KERNEL_DTYPES
                for bc in ("vv", "vf", "fv", "ff")  # B, C variable or fixed
                for z in ("", "_z")
            ),
        ),
        # the SSD forward's five stages, a source each (csrc/ssd_common.h: what they share)
        KernelSource("ssd_chunk_cumsum", SsdParams, ("m2r_ssd_chunk_cumsum",)),
        KernelSource("ssd_bmm", SsdParams, tuple(f"m2r_ssd_bmm_{dt}" for dt in KERNEL_DTYPES)),
        KernelSource(
            "ssd_chunk_state",
            SsdParams,
            tuple(
                f"m2r_ssd_{stage}_{dt}"
                for dt in KERNEL_DTYPES
                for stage in (
                    "chunk_state",
                    "chunk_state_chain",
                    "chunk_state_chain_lds",
                    "varlen_state",
                )
            ),
        ),
        KernelSource("ssd_state_passing", SsdParams, ("m2r_ssd_state_passing",)),
        KernelSource(
            "ssd_chunk_scan",
            SsdParams,
            tuple(
                f"m2r_ssd_chunk_scan_{dt}_{form}{z}"
                for dt in KERNEL_DTYPES
                for form in SSD_SCAN_FORMS
                if dt != "f32" or form not in SSD_SCAN_16BIT_FORMS
                for z in ("", "_z")
            ),
        ),
        # the SSD backward's stages, a source each (csrc/ssd_bwd_common.h: what they share)
        KernelSource(
            "ssd_bwd_dz", SsdBwdParams, tuple(f"m2r_ssd_bwd_dz_{dt}" for dt in KERNEL_DTYPES)
        ),
        KernelSource(
            "ssd_bwd_dstates",
            SsdBwdParams,
            tuple(f"m2r_ssd_bwd_dstates_{dt}" for dt in KERNEL_DTYPES),
        ),
        KernelSource(
            "ssd_bwd_state_passing",
            SsdBwdParams,
            tuple(f"m2r_ssd_bwd_state_passing_{dt}" for dt in KERNEL_DTYPES),
        ),
        KernelSource(
            "ssd_bwd_dx", SsdBwdParams, tuple(f"m2r_ssd_bwd_dx_{dt}" for dt in KERNEL_DTYPES)
        ),
        KernelSource(
            "ssd_bwd_dcb", SsdBwdParams, tuple(f"m2r_ssd_bwd_dcb_{dt}" for dt in KERNEL_DTYPES)
        ),
        KernelSource(
            "ssd_bwd_dbc",
            SsdBwdParams,
            tuple(f"m2r_ssd_bwd_{d}_{dt}" for dt in KERNEL_DTYPES for d in ("dc", "db")),
        ),
        KernelSource("ssd_bwd_cumsum", SsdBwdParams, ("m2r_ssd_bwd_cumsum",)),
        KernelSource(
            "add_norm",
            AddNormParams,
            (
                *(f"m2r_add_norm_{d}_{dt}" for dt in KERNEL_DTYPES for d in ("fwd", "bwd")),
                *(
                    f"m2r_add_norm_fwd_{dt}_r{r}{plain}"
                    for dt in KERNEL_DTYPES
                    for r in ADD_NORM_FWD_RUNS
                    for plain in ("", "_plain")  # _plain: no x1 / weight1, dropout, rowscale
                ),
                *(f"m2r_add_norm_bwd_{dt}_r{r}" for dt in KERNEL_DTYPES for r in ADD_NORM_BWD_RUNS),
                "m2r_add_norm_bwd_reduce",  # dweight ... dbias1 from the partial rows
            ),
        ),
        KernelSource(
            "rmsnorm_bwd",
            RmsNormBwdParams,
            (
                *(
                    f"m2r_rmsnorm_bwd{part}_{dt}"
                    for dt in KERNEL_DTYPES
                    # stats: a block / a wavefront an item; gradients element-wise / 16-byte runs
                    for part in ("_stats", "_stats_w", "", "_v")
                ),
                # one pass: stats and gradients of an item's runs held in registers
                "m2r_rmsnorm_bwd_row_bf16",
                "m2r_rmsnorm_bwd_reduce",  # dweight / dbias from the partial rows
            ),
        ),
        KernelSource(
            "rmsnorm",
            RmsNormParams,
            (
                *(f"m2r_rmsnorm_fwd_{dt}" for dt in KERNEL_DTYPES),
                *(
                    f"m2r_rmsnorm_fwd_{dt}_v{v}{ga}{whole}"
                    for dt in RMSNORM_VEC_DTYPES
                    for v in RMSNORM_VECS
                    for ga in ("", "_ga")  # the z gate after the norm (norm_before_gate)
                    # item_threads fixed: the whole block (_b) or half of it (_h)
                    for whole in ("", "_b", "_h")
                ),
            ),
        ),
    )
}

_SOURCE_OF = {k: src for src in SOURCES.values() for k in src.kernels}


def source_of(kernel: str) -> KernelSource:
    try:
        return _SOURCE_OF[kernel]
    except KeyError:
        raise KeyError(f"unknown kernel {kernel!r}: not in mamba2_rocm.kernels.SOURCES") from None


def kernel_params(kernel: str) -> type[ctypes.Structure]:
    return source_of(kernel).params
