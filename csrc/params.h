// Kernel parameter structs, passed by value as each kernel's only argument.
//
// Each struct exists twice: here and as a ctypes.Structure in mamba2_rocm/params.py. The build
// reads every kernel's argument size from the code object and fails when it differs from the
// Python struct; tests/test_params.py compiles this header with the host compiler and compares
// every field offset. Keep both in the same order, 8-byte fields first.
//
// Strides are in elements, never bytes. Optional pointers are null when absent.
// Plain C/C++: no device headers, so the host compiler can include it too.
#pragma once

#include <stdint.h>

#define M2R_DTYPE_F32 0
#define M2R_DTYPE_F16 1
#define M2R_DTYPE_BF16 2

// causal_conv1d forward: out[b, c, t] = act(bias[c] + sum_k weight[c, k] * x[b, c, t - (W-1) + k])
// with x at t < 0 taken from initial_states[b, c, W-1+t] (or 0), and, with seq_idx, only taps
// whose seq_idx equals that of t (positions before 0 count as seq_idx -1); a token whose
// seq_idx is negative is padding, its output 0 (causal-conv1d's rule).
struct ConvFwdParams {
  const void* x;               // (batch, dim, seqlen), dtype of the kernel
  const void* weight;          // (dim, width), dtype weight_dtype
  const void* bias;            // (dim,), dtype bias_dtype, or null
  void* out;                   // (batch, dim, seqlen), dtype of the kernel
  const int32_t* seq_idx;      // (batch, seqlen) or null
  const void* initial_states;  // (batch, dim, width-1), dtype of the kernel, or null
  void* final_states;          // (batch, dim, width-1), dtype of the kernel, or null
  int64_t x_batch_stride, x_c_stride, x_l_stride;
  int64_t out_batch_stride, out_c_stride, out_l_stride;
  int64_t weight_c_stride, weight_w_stride;
  int64_t seq_idx_batch_stride, seq_idx_l_stride;
  int64_t init_batch_stride, init_c_stride, init_l_stride;
  int64_t final_batch_stride, final_c_stride, final_l_stride;
  int32_t batch, dim, seqlen;
  int32_t silu;  // 1: apply SiLU to the output
  int32_t weight_dtype, bias_dtype;
  int32_t channels_fastest;  // *_strided kernels: 1 = consecutive threads walk channels
  int32_t reserved;
};

// causal_conv1d backward (csrc/conv1d_bwd.hip), for the forward above with the same x, weight,
// bias, seq_idx, initial_states and silu. Given dout (and dfinal, the gradient of the final
// states, or null) it writes dx (x's shape; any strides), dinit ((batch, dim, width-1), or null
// when there are no initial states) and, per block, partial sums of dweight and dbias in fp32:
// partial[(b * gridDim.x + blockIdx.x), c, k] for k < width, dbias at k = width. A second
// launch, m2r_conv1d_bwd_reduce, sums the partial_rows rows in a fixed order into dweight
// ((dim, width), contiguous, weight_dtype) and dbias ((dim,), bias_dtype, or null): the
// reduction over batch and sequence is deterministic, with no atomics. Each block walks
// tiles_per_block tiles of the sequence.
// initial_states, dfinal and dinit are contiguous (small: the host copies them if need be);
// their strides follow from the sizes, which keeps the struct (scalar registers on AMD) small.
struct ConvBwdParams {
  const void* x;               // (batch, dim, seqlen), dtype of the kernel
  const void* weight;          // (dim, width), dtype weight_dtype
  const void* bias;            // (dim,), dtype bias_dtype, or null
  const void* dout;            // (batch, dim, seqlen), dtype of the kernel
  const int32_t* seq_idx;      // (batch, seqlen) or null
  const void* initial_states;  // (batch, dim, width-1), dtype of the kernel, or null
  const void* dfinal;          // (batch, dim, width-1), dtype of the kernel, or null
  void* dx;                    // (batch, dim, seqlen), dtype of the kernel
  void* dinit;                 // (batch, dim, width-1), dtype of the kernel, or null
  float* partial;              // (batch * gridDim.x, dim, width + 1), fp32
  void* dweight;               // (dim, width) contiguous, weight_dtype: the reduce launch's
  void* dbias;                 // (dim,), bias_dtype, or null: the reduce launch's
  int64_t x_batch_stride, x_c_stride, x_l_stride;
  int64_t dout_batch_stride, dout_c_stride, dout_l_stride;
  int64_t dx_batch_stride, dx_c_stride, dx_l_stride;
  int64_t weight_c_stride, weight_w_stride;
  int64_t seq_idx_batch_stride, seq_idx_l_stride;
  int32_t batch, dim, seqlen;
  int32_t silu;
  int32_t weight_dtype, bias_dtype;
  int32_t tiles_per_block;
  int32_t vec;  // 1: x, dout and dx have unit stride along the tile's fast index and 16-byte rows
  int32_t width, partial_rows;  // the reduce launch's: taps, and rows of partial
};

// causal_conv1d_update: x (batch, dim, seqlen) new tokens, conv_state (num_states, dim, state_len)
// updated in place. Without cache_seqlens the state is a shift register; with it, a circular
// buffer written at (cache_seqlens[b] + t) % state_len. state_indices maps batch -> state row
// (int32 or int64, indices_int64; any stride); -1 writes zeros to out and leaves the state
// alone; an index outside [0, num_states), or a row two entries name, writes NaN to out and
// touches no state (the kernel cannot raise, so it is made loud instead of silent; checked in
// the kernel itself: csrc/state_rows.h).
struct ConvUpdateParams {
  const void* x;
  void* conv_state;
  const void* weight;
  const void* bias;
  void* out;
  const int32_t* cache_seqlens;  // (batch,) or null
  const void* state_indices;     // (batch,) int32 or int64, or null
  int64_t x_batch_stride, x_c_stride, x_l_stride;
  int64_t out_batch_stride, out_c_stride, out_l_stride;
  int64_t state_batch_stride, state_c_stride, state_l_stride;
  int64_t weight_c_stride, weight_w_stride;
  int64_t indices_stride;
  int32_t batch, dim, seqlen, state_len;
  int32_t num_states;
  int32_t silu;
  int32_t weight_dtype, bias_dtype;
  int32_t indices_int64;
  int32_t reserved;
};

// selective_state_update (one decode step), multi-head form; the Mamba1 form is passed as one
// head with headdim = dim. dt' = softplus?(dt + dt_bias); state = exp(A dt') state + dt' B x;
// out = sum_n state C + D x, times silu(z). Strides may be 0 ("tied" A/dt/dt_bias/D broadcast
// over headdim and dstate): the kernel reads them as given, nothing is copied.
// state_indices (batch,), int32 or int64 (indices_int64), stride indices_stride, or null: -1 = a
// padded row (out zeros, state untouched); an index outside [0, num_states), or a row two
// entries name: out NaN, state untouched. The contiguous-layout kernels check them themselves
// (state_rows.h) unless indices_checked says m2r_state_rows did (int32 rows, stride 1, -2 for a
// bad one: read as they are); the general kernels always read m2r_state_rows' checked rows.
struct SsuParams {
  void* state;                   // (num_states, nheads, headdim, dstate), dtype of the kernel
  const void* x;                 // (batch, nheads, headdim), input dtype of the kernel
  const void* dt;                // (batch, nheads, headdim), dtype dt_dtype
  const void* A;                 // (nheads, headdim, dstate), dtype a_dtype
  const void* B;                 // (batch, ngroups, dstate), input dtype
  const void* C;                 // (batch, ngroups, dstate), input dtype
  const void* D;                 // (nheads, headdim), dtype d_dtype, or null
  const void* z;                 // (batch, nheads, headdim), input dtype, or null
  const void* dt_bias;           // (nheads, headdim), dtype dt_bias_dtype, or null
  void* out;                     // (batch, nheads, headdim), input dtype
  const void* state_indices;     // (batch,) int32 or int64, or null
  int64_t state_batch_stride, state_h_stride, state_p_stride, state_n_stride;
  int64_t x_batch_stride, x_h_stride, x_p_stride;
  int64_t dt_batch_stride, dt_h_stride, dt_p_stride;
  int64_t A_h_stride, A_p_stride, A_n_stride;
  int64_t B_batch_stride, B_g_stride, B_n_stride;
  int64_t C_batch_stride, C_g_stride, C_n_stride;
  int64_t D_h_stride, D_p_stride;
  int64_t z_batch_stride, z_h_stride, z_p_stride;
  int64_t dt_bias_h_stride, dt_bias_p_stride;
  int64_t out_batch_stride, out_h_stride, out_p_stride;
  int64_t indices_stride;
  int32_t batch, nheads, headdim, dstate;
  int32_t heads_per_group, num_states;
  int32_t dt_softplus;
  int32_t dt_dtype, a_dtype, d_dtype, dt_bias_dtype;
  int32_t indices_int64, indices_checked;
  int32_t reserved;  // explicit tail padding: the size is a multiple of 8 on every ABI
};

// The state rows of a decode step (causal_conv1d_update's conv_state_indices,
// selective_state_update's state_batch_indices), checked on the device before an update reads
// them: in (batch,) int32 or int64 (in_int64), out (batch,) int32. -1 (a padded row) stays -1;
// an index outside [0, num_states), or a row that two entries name, becomes -2: the update
// kernels write NaN for any row < -1 and leave the state alone, so two entries never race on
// one state row. The kernels cannot raise; checking on the host would cost a device sync.
struct StateRowsParams {
  const void* in;
  int32_t* out;
  int64_t in_stride;
  int32_t batch, num_states, in_int64;
  int32_t reserved;  // explicit tail padding: the size is a multiple of 8 on every ABI
};

// Decay rates of a model's Mamba layers (csrc/decay.hip): out[table[l][2] + i] =
// -exp(A_log_l[i]) for i < table[l][1], A_log_l at address table[l][0] (contiguous, dtype
// a_dtype, the same for every layer); one block per layer. table: (layers, 3) int64 on the
// device; out: float32.
struct DecayParams {
  const int64_t* table;
  float* out;
  int32_t layers, a_dtype;
};

// The matrix-core self-test (csrc/mma_probe.hip): one 16x16x16 step D = C + A B^T through
// mma.h on one wave. a, b: (16, 16) 16-bit values of the kernel's dtype, rows of 16 k (A is
// M x K, B is N x K); c, d: (16, 16) fp32; hits: (16, 16) int32, zeros in, +1 per accumulator
// register written to the cell; info: (3,) int32 out: M2R_MMA of the build, the wavefront
// size, 1 if the matrix instruction is emulated. A build without matrix cores (M2R_MMA 0)
// writes only info.
struct MmaProbeParams {
  const uint16_t* a;
  const uint16_t* b;
  const float* c;
  float* d;
  int32_t* hits;
  int32_t* info;
  int32_t mode;      // bit 0: A staged k-major and read with load_lane_t; bit 1: the same for B;
                     // bit 2: A built in registers (mma::make_a at a_row / a_k) instead
  int32_t reserved;  // explicit tail padding: the size is a multiple of 8 on every ABI
};

// Gated RMSNorm / LayerNorm over the last dim, in groups of group_size: with norm_before_gate,
// out = (x - mean) * rstd * weight + bias, then * silu(z); otherwise x * silu(z) is normalized.
// mean = 0 for RMSNorm (layer_norm 0), the group's mean for LayerNorm;
// rstd = 1 / sqrt(mean((v - mean)^2) + eps) per (row, group). Rows of x, z and out have unit
// stride along hidden; row strides are free.
struct RmsNormParams {
  const void* x;       // (rows, hidden), dtype of the kernel
  const void* z;       // (rows, hidden), dtype of the kernel, or null
  const void* weight;  // (hidden,), dtype weight_dtype
  const void* bias;    // (hidden,), dtype bias_dtype, or null
  void* out;           // (rows, hidden), dtype of the kernel
  int64_t x_row_stride, z_row_stride, out_row_stride;
  int32_t rows, hidden, group_size, norm_before_gate;
  float eps;
  int32_t weight_dtype, bias_dtype;
  int32_t item_threads;  // the register-resident variants (_v1/_v2/_v4): threads per (row, group)
  int32_t layer_norm;    // 1: LayerNorm (subtract the group's mean first), 0: RMSNorm
  int32_t reserved;      // explicit tail padding: the size is a multiple of 8 on every ABI
};

// Gated RMSNorm / LayerNorm backward (csrc/rmsnorm_bwd.hip), for the forward above with the
// same x, z, weight, bias, eps, group_size, norm_before_gate and layer_norm. Two kernels:
//  - m2r_rmsnorm_bwd_stats[_w]_<dt>: per (row, group) item, stats[item] = (mean, rstd, c1, c2)
//    in fp32, with xhat the normalized input and dxhat = dy * weight: c1 = mean(dxhat * xhat),
//    c2 = mean(dxhat) (LayerNorm) or 0; a block per item (grid (items, 1, 1)), or with _w a
//    wavefront per item (grid (ceil(items / (256 / wavefront)), 1, 1)).
//  - m2r_rmsnorm_bwd[_v]_<dt>: dx, dz (z given) and per-block partial sums of dweight / dbias,
//    partial[(blockIdx.y * 2 + {0: dweight, 1: dbias}) * hidden + column] (fp32); a thread
//    owns 16 bytes of columns and walks rows_per_block rows; grid (column blocks, row blocks, 1).
//    _v: vec and group_size whole 16-byte runs (16-byte loads and stores, a row ahead).
// A third launch, m2r_rmsnorm_bwd_reduce, adds the partial_rows rows of partial in a fixed
// order (deterministic, no atomics) into dweight ((hidden,), weight_dtype) and dbias
// ((hidden,), bias_dtype, or null); the other kernels ignore those three fields.
// Rows have unit stride along hidden (the host copies others).
struct RmsNormBwdParams {
  const void* x;       // (rows, hidden), dtype of the kernel
  const void* z;       // (rows, hidden), dtype of the kernel, or null
  const void* weight;  // (hidden,), dtype weight_dtype
  const void* bias;    // (hidden,), dtype bias_dtype, or null
  const void* dout;    // (rows, hidden), dtype of the kernel
  float* stats;        // (rows * groups, 4)
  void* dx;            // (rows, hidden), dtype of the kernel
  void* dz;            // (rows, hidden), dtype of the kernel, or null (no z)
  float* partial;      // (row blocks, 2, hidden)
  void* dweight;       // (hidden,), dtype weight_dtype: the reduce launch's
  void* dbias;         // (hidden,), dtype bias_dtype, or null: the reduce launch's
  int64_t x_row_stride, z_row_stride, dout_row_stride, dx_row_stride, dz_row_stride;
  int32_t rows, hidden, group_size, norm_before_gate;
  float eps;
  int32_t weight_dtype, bias_dtype;
  int32_t layer_norm;
  int32_t rows_per_block;
  int32_t vec;  // 1: every row of x, z, dout, dx, dz 16-byte aligned (16-byte loads and stores)
  int32_t partial_rows;  // the reduce launch's: rows of partial
  int32_t reserved;      // explicit tail padding: the size is a multiple of 8 on every ABI
};

// Fused residual add + LayerNorm / RMSNorm of pre-norm blocks (mamba_ssm's
// ops.triton.layer_norm; csrc/add_norm.hip), forward and backward in one struct: each kernel
// reads the fields it needs. Every (rows, hidden) tensor is contiguous (row stride = hidden).
// Forward: s = drop(x * rowscale) + drop(x1) + residual in fp32, drop(v) = mask ? v / keep : 0;
// stream = s in stream_dtype (when not null); mean / rstd of s per row (mean null: RMSNorm);
// y = (s - mean) * rstd * weight + bias, y1 the same with weight1 / bias1, both in x's dtype.
// Backward, from the stream the forward wrote, mean, rstd, dy, dy1 and dstream (the gradient of
// the stream output, or null): dresidual (stream_dtype, or null), dx, dx1 (x's dtype, or null)
// and per block partial sums partial[(block * 4 + q) * hidden + column] in fp32, q = dweight,
// dbias, dweight1, dbias1 (only those whose output is not null); m2r_add_norm_bwd_reduce adds
// the partial_rows rows in a fixed order into dweight ... dbias1 (deterministic, no atomics).
struct AddNormParams {
  const void* x;         // (rows, hidden), dtype of the kernel
  const void* residual;  // (rows, hidden), stream_dtype, or null
  const void* x1;        // (rows, hidden), dtype of the kernel, or null
  const void* weight;    // (hidden,), weight_dtype
  const void* bias;      // (hidden,), bias_dtype, or null
  const void* weight1;   // (hidden,), weight1_dtype, or null (no second output)
  const void* bias1;     // (hidden,), bias1_dtype, or null
  const float* rowscale;  // (rows,), or null
  const uint8_t* mask;    // (rows, hidden) dropout keep-mask of x, or null (no dropout)
  const uint8_t* mask1;   // (rows, hidden) the same for x1, or null
  void* y;                // (rows, hidden), dtype of the kernel
  void* y1;               // (rows, hidden), dtype of the kernel, or null
  void* stream;           // (rows, hidden), stream_dtype: written by the forward, read by the backward
  float* mean;            // (rows,), or null (RMSNorm)
  float* rstd;            // (rows,)
  const void* dy;         // (rows, hidden), dtype of the kernel
  const void* dy1;        // (rows, hidden), dtype of the kernel, or null
  const void* dstream;    // (rows, hidden), stream_dtype, or null
  void* dx;               // (rows, hidden), dtype of the kernel
  void* dresidual;        // (rows, hidden), stream_dtype, or null
  void* dx1;              // (rows, hidden), dtype of the kernel, or null
  float* partial;         // (row blocks, 4, hidden)
  void* dweight;          // (hidden,), weight_dtype: the reduce launch's
  void* dbias;            // (hidden,), bias_dtype, or null
  void* dweight1;         // (hidden,), weight1_dtype, or null
  void* dbias1;           // (hidden,), bias1_dtype, or null
  int32_t rows, hidden;
  int32_t stream_dtype, weight_dtype, bias_dtype, weight1_dtype, bias1_dtype;
  int32_t layer_norm;      // 1: LayerNorm (subtract the row's mean first), 0: RMSNorm
  int32_t rows_per_block;  // the backward's rows a block
  int32_t partial_rows;    // the reduce launch's: rows of partial
  float eps;
  float keep;  // 1 - dropout_p
};

// Mamba2 SSD chunked scan (mamba_chunk_scan_combined), forward. One struct for the five stage
// kernels of csrc/ssd_*.hip (csrc/ssd_common.h); each reads the fields it needs. x, z, out: (batch, seqlen, nheads,
// headdim); B, C: (batch, seqlen, ngroups, dstate); the last dim of each has unit stride.
// Workspaces (fp32/int32, contiguous, allocated by the caller), with c = chunk, s = position:
//   dt_out, dA_cs (batch, nheads, nchunks, chunk_size): dt' and the inclusive cumsum of dt' A;
//   seg (batch, nchunks, chunk_size): seq_idx changes since the token before the chunk;
//   cb (batch, nchunks, ngroups, chunk_size, chunk_size): C·Bᵀ stored [s][t];
//   states (batch, nchunks, nheads, dstate, headdim): each chunk's own state, turned in place
//   into the state entering the chunk by the state-passing kernel; or, chained, the entering
//   states written by chunk_state itself (the state passing at the end of its blocks);
//   chain (1 + batch * nchunks * state tiles * nheads): the chained chunk_state's ticket counter
//   and flags, zeroed by chunk_cumsum; null when not chained.
struct SsdParams {
  const void* x;
  const void* dt;              // (batch, seqlen, nheads), dtype dt_dtype
  const void* A;               // (nheads,), dtype a_dtype
  const void* B;
  const void* C;
  const void* D;               // (nheads,) or (nheads, headdim), dtype d_dtype, or null
  const void* z;               // or null
  const void* dt_bias;         // (nheads,), dtype dt_bias_dtype, or null
  const void* initial_states;  // (batch, nheads, headdim, dstate), dtype init_dtype, or null
  const int32_t* seq_idx;      // (batch, seqlen) or null
  const int32_t* cu_seqlens;   // (num_seqs + 1,) or null
  void* out;
  void* final_states;   // (batch, nheads, headdim, dstate) contiguous, dtype state_dtype, or null
  void* varlen_states;  // (num_seqs, nheads, headdim, dstate) contiguous, dtype state_dtype
  float* dt_out;
  float* dA_cs;
  int32_t* seg;
  float* cb;
  float* states;
  int32_t* chain;  // chunk_state's ticket counter, then a flag per (batch, chunk, tile, head)
  int64_t x_batch_stride, x_l_stride, x_h_stride;
  int64_t z_batch_stride, z_l_stride, z_h_stride;
  int64_t out_batch_stride, out_l_stride, out_h_stride;
  int64_t B_batch_stride, B_l_stride, B_g_stride;
  int64_t C_batch_stride, C_l_stride, C_g_stride;
  int64_t dt_batch_stride, dt_l_stride, dt_h_stride;
  int64_t seq_idx_batch_stride, seq_idx_l_stride;
  int64_t init_batch_stride, init_h_stride, init_p_stride, init_n_stride;
  int64_t A_stride, dt_bias_stride, D_h_stride, D_p_stride;
  int32_t batch, seqlen, nheads, headdim;
  int32_t ngroups, dstate, chunk_size, nchunks;
  int32_t heads_per_group, num_seqs;
  int32_t dt_softplus;
  int32_t dt_dtype, a_dtype, d_dtype, dt_bias_dtype, init_dtype, state_dtype;
  float dt_min, dt_max;
  int32_t reserved;
};

// The SSD scan's backward (csrc/ssd_bwd_*.hip), after the forward's first four stages were run
// again (SsdParams' dt_out, dA_cs, seg, cb and states: the entering state of each chunk).
// x, B, C, z and dout are contiguous in the kernel's dtype, so their strides follow from the
// sizes; dt is the caller's (any strides, dtype dt_dtype: the clamp and softplus derivatives
// read it); A, D ((nheads, headdim), a (nheads,) D broadcast) and dt_bias are contiguous fp32.
// Every reduction over tokens, heads or state elements is written as fp32 partials in a fixed
// order and summed by the next kernel or the host: no atomics, bit-identical runs.
struct SsdBwdParams {
  const void* x;       // (batch, seqlen, nheads, headdim)
  const void* B;       // (batch, seqlen, ngroups, dstate)
  const void* C;       // (batch, seqlen, ngroups, dstate)
  const void* z;       // like x, or null
  const void* dout;    // like x
  const void* dt;      // (batch, seqlen, nheads), dtype dt_dtype
  const float* A;      // (nheads,)
  const float* D;      // (nheads, headdim), or null
  const float* dt_bias;   // (nheads,), or null
  const float* dt_out;    // the forward's workspaces (SsdParams)
  const float* dA_cs;
  const int32_t* seg;
  float* cb;              // C·Bᵀ of the forward, then overwritten with its gradient
  const float* states;    // (batch, nchunks, nheads, dstate, headdim): entering each chunk
  const float* dfinal;    // (batch, nheads, headdim, dstate), or null
  void* dout_g;           // like x: dout times silu(z), written by dz; without z: dout itself (read only)
  void* dz;               // like x, or null
  void* dx;               // like x
  float* dstates;         // like states: the gradient of each chunk's entering, then its final state
                          // (16-bit x on the matrix cores: 16-bit copies, csrc/ssd_bwd_*.hip state_runs)
  float* dinit;           // (batch, nheads, headdim, dstate), or null
  void* dB;               // (batch, seqlen, ngroups, dstate): float32, or x's dtype (dbc_io bit 0)
  void* dC;               // (batch, seqlen, ngroups, dstate): float32, or x's dtype (dbc_io bit 1)
  float* ddt;             // (batch, seqlen, nheads)
  float* tok;             // (ntiles + 2 ptiles + 2 chunk_size / 64, batch, nheads, nchunks, chunk_size)
  float* dD_part;         // (nheads, headdim, batch, nchunks, chunk_size / 64)
  float* dA_last_part;    // (batch, nheads, nchunks, pass_blocks)
  float* head_part;       // (2, batch, nchunks, nheads): dA, ddt_bias
  int64_t dt_batch_stride, dt_l_stride, dt_h_stride;
  int32_t batch, seqlen, nheads, headdim;
  int32_t ngroups, dstate, chunk_size, nchunks;
  int32_t heads_per_group, has_init, dt_softplus, dt_dtype;
  int32_t pass_blocks;
  float dt_min, dt_max;
  int32_t dbc_io;  // bit 0: dB in x's dtype (B is), bit 1: dC (C is); else float32
};

// Mamba1's selective scan (mamba_ssm's selective_scan_fn), forward, real A:
//   delta' = softplus(delta + delta_bias) if delta_softplus else delta + delta_bias
//   h[n] = exp(delta'[t] * A[d, n]) * h[n] + delta'[t] * B[n, t] * u[t]      (h starts at 0)
//   out[t] = (sum_n C[n, t] * h[n] + D[d] * u[t]) * silu(z[t])
// Every tensor is contiguous (the host copies any other layout, as mamba_ssm does): u, delta,
// z, out (batch, dim, seqlen); A (dim, dstate); B / C fixed (dim, dstate) when *_groups is 0,
// else (batch, groups, dstate, seqlen) with channel d reading group d / (dim / groups).
// Strides follow from the sizes, which keeps the struct small: AMD's compiler loads the whole
// argument struct into scalar registers, and a larger one spilled them on gfx90a.
struct SelectiveScanParams {
  const void* u;           // dtype of the kernel
  const void* delta;       // dtype of the kernel
  const float* A;
  const float* B;
  const float* C;
  const void* D;           // (dim,), dtype d_dtype, or null
  const void* z;           // dtype of the kernel, or null
  const void* delta_bias;  // (dim,), dtype delta_bias_dtype, or null
  void* out;               // dtype of the kernel
  float* last_state;       // (batch, dim, dstate), or null
  float* seg_state;        // the channel form's segment maps (csrc/selective_scan.hip), or null
  int32_t batch, dim, seqlen, dstate;
  int32_t b_groups, c_groups;  // 0: fixed (dim, dstate)
  int32_t delta_softplus;
  int32_t d_dtype, delta_bias_dtype;
  int32_t seg_len;  // the channel form's tokens per segment (a multiple of its chunk), 0: one
};

// Mamba1's selective scan, backward (csrc/selective_scan_bwd.hip): the gradients of out and of
// the last state (dout, dlast) for u, delta, A, B, C, D, z and delta_bias. Inputs as in
// SelectiveScanParams (contiguous; B / C / A float32), dout like u. Outputs: du, ddelta, dz in
// the kernel's dtype (batch, dim, seqlen); fp32 partials the host sums in a fixed order:
//   dA_part (batch, dim, nck, dstate); dD_part, ddb_part (ranges, batch, dim), ranges = gridDim.z
//   of the gradients' launch (D / delta_bias: zeros where absent, never null);
//   dB_part / dC_part: fixed B / C (batch, dim, nck, dstate); variable ones (batch, groups,
//   slices, dstate, ld), one slice per block, summed over the slice's channels.
// groups: the finer of the variable B / C groupings (a block's channels share a group of each;
// 1 when both are fixed); slices, slice_ch: the blocks per group and channels per block.
// ckpt, wckpt: (batch, dim, nck, dstate) fp32 workspaces the carries' kernel writes and the
// gradients' kernel reads: the state entering each chunk, and the adjoint entering the last
// chunk of each range from the right (the ranges chain it through their other chunks).
struct SelectiveScanBwdParams {
  const void* u;
  const void* delta;
  const float* A;
  const float* B;
  const float* C;
  const void* D;
  const void* z;
  const void* delta_bias;
  const void* dout;
  const float* dlast;  // (batch, dim, dstate), or null
  float* ckpt;
  float* wckpt;
  void* du;
  void* ddelta;
  void* dz;  // null without z
  float* dA_part;
  float* dB_part;
  float* dC_part;
  float* dD_part;
  float* ddb_part;
  int32_t batch, dim, seqlen, dstate;
  int32_t b_groups, c_groups;
  int32_t delta_softplus;
  int32_t d_dtype, delta_bias_dtype;
  int32_t groups, slices, slice_ch;
  int32_t ld;   // row length of variable B / C and their partials: seqlen rounded up to 256
  int32_t nck;  // chunks per channel in ckpt and the per-chunk partials: seqlen / 128 rounded up
  int32_t ranges;  // the gradients' chunk ranges (the gridDim.z of its launch; the carries' own is 1)
  int32_t reserved;  // (the struct's size a multiple of 8 without padding: the host packs it)
};

// Small-batch linear layer of a decode step (csrc/linear.hip): y[m, n] = sum_k x[m, k] *
// weight[n, k] (+ bias[n]), float32 sums of the kernel's dtype; x, weight, bias, y of that
// dtype. x rows of x_row_stride elements (unit stride inside a row), weight (out_features,
// in_features) contiguous, y rows of y_row_stride. in_features, x_row_stride and every pointer
// 16-byte aligned (the host checks). group_threads: threads a feature group (64, 128 or 256).
// The _conv kernels also run a causal conv1d decode step on the features [conv_start,
// conv_start + conv_channels) (Mamba2's xBC, straight out of in_proj): feature n's output,
// rounded to the dtype as a stored projection would be, is the new token of channel
// c = n - conv_start of conv_state (rows, channels, state_len; row m of x is batch row m),
// which is shifted in place; y there is bias_c + sum_k conv_weight[c, k] window[k] (window:
// the state's last conv_width - 1 entries, then the token), silu'd when conv_silu. conv_state,
// conv_weight (channels, conv_width), conv_bias of the kernel's dtype; state_len and
// conv_width at most 4, state_len >= conv_width - 1.
// m2r_linear_prefetch reads weight's first in_features 32-byte sectors (weight 32-byte
// aligned) and writes nothing; rows is 1 (see the kernel).
struct LinearParams {
  const void* x;
  const void* weight;
  const void* bias;  // or null
  void* y;
  void* conv_state;         // null: no conv (the plain kernels ignore the conv fields)
  const void* conv_weight;  // (conv_channels, conv_width), row stride conv_weight_c_stride
  const void* conv_bias;    // (conv_channels,), or null
  int64_t x_row_stride, y_row_stride;
  int64_t state_batch_stride, state_c_stride, state_l_stride, conv_weight_c_stride;
  int32_t rows, out_features, in_features, group_threads;
  int32_t conv_start, conv_channels, conv_width, state_len, conv_silu, reserved;
};
