"""ctypes mirrors of ``csrc/params.h``: each kernel's single by-value argument.

The build refuses a code object whose argument size differs from these, and
``tests/test_params.py`` compares every field offset against the C header compiled by the host
compiler. Torch-free: the build driver imports this inside the toolchain image.
"""

from __future__ import annotations

import ctypes
import struct

__all__ = [
    "DTYPE_CODES",
    "AddNormParams",
    "ConvBwdParams",
    "ConvFwdParams",
    "ConvUpdateParams",
    "DecayParams",
    "LinearParams",
    "MmaProbeParams",
    "RmsNormBwdParams",
    "RmsNormParams",
    "SelectiveScanBwdParams",
    "SelectiveScanParams",
    "SsdBwdParams",
    "SsdParams",
    "SsuParams",
    "StateRowsParams",
    "explain_pack_error",
    "packer",
]

#: dtype name -> the M2R_DTYPE_* code the kernels take for run-time-typed tensors.
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}

_p = ctypes.c_void_p
_i64 = ctypes.c_int64
_i32 = ctypes.c_int32


def _fields(pointers: str, int64s: str, int32s: str) -> list[tuple[str, type]]:
    return (
        [(n, _p) for n in pointers.split()]
        + [(n, _i64) for n in int64s.split()]
        + [(n, _i32) for n in int32s.split()]
    )


class ConvFwdParams(ctypes.Structure):
    _fields_ = _fields(
        "x weight bias out seq_idx initial_states final_states",
        "x_batch_stride x_c_stride x_l_stride out_batch_stride out_c_stride out_l_stride "
        "weight_c_stride weight_w_stride seq_idx_batch_stride seq_idx_l_stride "
        "init_batch_stride init_c_stride init_l_stride "
        "final_batch_stride final_c_stride final_l_stride",
        "batch dim seqlen silu weight_dtype bias_dtype channels_fastest reserved",
    )


class ConvBwdParams(ctypes.Structure):
    _fields_ = _fields(
        "x weight bias dout seq_idx initial_states dfinal dx dinit partial dweight dbias",
        "x_batch_stride x_c_stride x_l_stride dout_batch_stride dout_c_stride dout_l_stride "
        "dx_batch_stride dx_c_stride dx_l_stride weight_c_stride weight_w_stride "
        "seq_idx_batch_stride seq_idx_l_stride",
        "batch dim seqlen silu weight_dtype bias_dtype tiles_per_block vec width partial_rows",
    )


class ConvUpdateParams(ctypes.Structure):
    _fields_ = _fields(
        "x conv_state weight bias out cache_seqlens state_indices",
        "x_batch_stride x_c_stride x_l_stride out_batch_stride out_c_stride out_l_stride "
        "state_batch_stride state_c_stride state_l_stride weight_c_stride weight_w_stride "
        "indices_stride",
        "batch dim seqlen state_len num_states silu weight_dtype bias_dtype indices_int64 reserved",
    )


class SsuParams(ctypes.Structure):
    _fields_ = _fields(
        "state x dt A B C D z dt_bias out state_indices",
        "state_batch_stride state_h_stride state_p_stride state_n_stride "
        "x_batch_stride x_h_stride x_p_stride dt_batch_stride dt_h_stride dt_p_stride "
        "A_h_stride A_p_stride A_n_stride B_batch_stride B_g_stride B_n_stride "
        "C_batch_stride C_g_stride C_n_stride D_h_stride D_p_stride "
        "z_batch_stride z_h_stride z_p_stride dt_bias_h_stride dt_bias_p_stride "
        "out_batch_stride out_h_stride out_p_stride indices_stride",
        "batch nheads headdim dstate heads_per_group num_states dt_softplus "
        "dt_dtype a_dtype d_dtype dt_bias_dtype indices_int64 indices_checked reserved",
    )


class MmaProbeParams(ctypes.Structure):
    _fields_ = _fields("a b c d hits info", "", "mode reserved")


class LinearParams(ctypes.Structure):
    _fields_ = _fields(
        "x weight bias y conv_state conv_weight conv_bias",
        "x_row_stride y_row_stride state_batch_stride state_c_stride state_l_stride "
        "conv_weight_c_stride",
        "rows out_features in_features group_threads "
        "conv_start conv_channels conv_width state_len conv_silu reserved",
    )


class DecayParams(ctypes.Structure):
    _fields_ = _fields("table out", "", "layers a_dtype")


class StateRowsParams(ctypes.Structure):
    _fields_ = _fields("in out", "in_stride", "batch num_states in_int64 reserved")


class RmsNormBwdParams(ctypes.Structure):
    _fields_ = [
        *_fields("x z weight bias dout stats dx dz partial dweight dbias",
                 "x_row_stride z_row_stride dout_row_stride dx_row_stride dz_row_stride",
                 "rows hidden group_size norm_before_gate"),
        ("eps", ctypes.c_float),
        *_fields("", "", "weight_dtype bias_dtype layer_norm rows_per_block vec partial_rows reserved"),
    ]  # fmt: skip


class AddNormParams(ctypes.Structure):
    _fields_ = [
        *_fields("x residual x1 weight bias weight1 bias1 rowscale mask mask1 y y1 stream mean "
                 "rstd dy dy1 dstream dx dresidual dx1 partial dweight dbias dweight1 dbias1", "",
                 "rows hidden stream_dtype weight_dtype bias_dtype weight1_dtype bias1_dtype "
                 "layer_norm rows_per_block partial_rows"),
        ("eps", ctypes.c_float),
        ("keep", ctypes.c_float),
    ]  # fmt: skip


class SsdParams(ctypes.Structure):
    _fields_ = [
        *_fields(
            "x dt A B C D z dt_bias initial_states seq_idx cu_seqlens out final_states "
            "varlen_states dt_out dA_cs seg cb states chain",
            "x_batch_stride x_l_stride x_h_stride z_batch_stride z_l_stride z_h_stride "
            "out_batch_stride out_l_stride out_h_stride B_batch_stride B_l_stride B_g_stride "
            "C_batch_stride C_l_stride C_g_stride dt_batch_stride dt_l_stride dt_h_stride "
            "seq_idx_batch_stride seq_idx_l_stride "
            "init_batch_stride init_h_stride init_p_stride init_n_stride "
            "A_stride dt_bias_stride D_h_stride D_p_stride",
            "batch seqlen nheads headdim ngroups dstate chunk_size nchunks heads_per_group "
            "num_seqs dt_softplus dt_dtype a_dtype d_dtype dt_bias_dtype init_dtype state_dtype",
        ),
        ("dt_min", ctypes.c_float),
        ("dt_max", ctypes.c_float),
        *_fields("", "", "reserved"),
    ]


class SsdBwdParams(ctypes.Structure):
    _fields_ = [
        *_fields(
            "x B C z dout dt A D dt_bias dt_out dA_cs seg cb states dfinal dout_g dz dx "
            "dstates dinit dB dC ddt tok dD_part dA_last_part head_part",
            "dt_batch_stride dt_l_stride dt_h_stride",
            "batch seqlen nheads headdim ngroups dstate chunk_size nchunks heads_per_group "
            "has_init dt_softplus dt_dtype pass_blocks",
        ),
        ("dt_min", ctypes.c_float),
        ("dt_max", ctypes.c_float),
        *_fields("", "", "dbc_io"),
    ]


class RmsNormParams(ctypes.Structure):
    _fields_ = [
        *_fields("x z weight bias out", "x_row_stride z_row_stride out_row_stride",
                 "rows hidden group_size norm_before_gate"),
        ("eps", ctypes.c_float),
        *_fields("", "", "weight_dtype bias_dtype item_threads layer_norm reserved"),
    ]  # fmt: skip


_FORMAT = {ctypes.c_void_p: "Q", ctypes.c_int64: "q", ctypes.c_int32: "i", ctypes.c_float: "f"}


def packer(params: type[ctypes.Structure]) -> struct.Struct:
    """A ``struct.Struct`` with the same byte layout as ``params``.

    Packing a tuple is several times faster than filling a ctypes.Structure field by field,
    and the launch path runs once per op call. Pointers are passed as ints (0 for null).
    """
    fmt = "<" + "".join(_FORMAT[ctype] for _, ctype in params._fields_)
    packed = struct.Struct(fmt)
    if packed.size != ctypes.sizeof(params):
        raise AssertionError(
            f"{params.__name__}: packed size {packed.size} != ctypes size {ctypes.sizeof(params)}"
        )
    return packed


_LIMITS = {ctypes.c_int32: (-(2**31), 2**31 - 1), ctypes.c_int64: (-(2**63), 2**63 - 1)}


def explain_pack_error(params: type[ctypes.Structure], values: tuple) -> ValueError:
    """The error to raise when ``packer(params).pack(*values)`` failed: which field got which
    value, and the range the kernel's field takes (a size >= 2**31 in a 32-bit size field,
    rather than ``struct.error: 'i' format requires ...`` from deep in a launch)."""
    for (name, ctype), value in zip(params._fields_, values, strict=False):
        lo_hi = _LIMITS.get(ctype)
        if lo_hi is not None and not (isinstance(value, int) and lo_hi[0] <= value <= lo_hi[1]):
            return ValueError(
                f"{params.__name__}.{name} = {value!r} does not fit the kernel's "
                f"{8 * ctypes.sizeof(ctype)}-bit field (range {lo_hi[0]}..{lo_hi[1]}): a size or "
                "stride too large for this kernel"
            )
    if len(values) != len(params._fields_):
        return ValueError(
            f"{params.__name__} takes {len(params._fields_)} values, got {len(values)}"
        )
    return ValueError(f"{params.__name__}: cannot pack {values!r}")


class SelectiveScanParams(ctypes.Structure):
    _fields_ = _fields(
        "u delta A B C D z delta_bias out last_state seg_state",
        "",
        "batch dim seqlen dstate b_groups c_groups delta_softplus d_dtype delta_bias_dtype seg_len",
    )


class SelectiveScanBwdParams(ctypes.Structure):
    _fields_ = _fields(
        "u delta A B C D z delta_bias dout dlast ckpt wckpt du ddelta dz dA_part dB_part dC_part "
        "dD_part ddb_part",
        "",
        "batch dim seqlen dstate b_groups c_groups delta_softplus d_dtype delta_bias_dtype "
        "groups slices slice_ch ld nck ranges reserved",
    )
