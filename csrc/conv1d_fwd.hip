// Causal depthwise conv1d, forward. Four layouts per (dtype, width):
//   *_vec         x and out (batch, dim, seqlen) with unit stride along seqlen, 16-byte aligned:
//                 one 16-byte load and store per thread, neighbours' taps exchanged in LDS.
//   *_strided     any strides (sliced, transposed, misaligned): same tiling, scalar accesses.
//   *_cl_vec      channel-last (unit stride along dim), 16-byte aligned: each thread owns one
//                 16-byte vector of channels and walks a run of positions with a sliding window.
//   *_cl_strided  channel-last tiling with scalar accesses and any strides.
// The host picks the layout; all variants compute the same function (tested against each other).
#include "platform.h"

namespace m2r {
namespace conv1d {

constexpr int kThreads = 128;
constexpr int kClLanesC = 32;                  // channel-last: lanes along dim
constexpr int kClRowsL = kThreads / kClLanesC;  // channel-last: thread rows along seqlen
constexpr int kClPosPerThread = 16;            // channel-last: positions per thread

template <typename T>
struct Vec {
  typedef typename T::storage S;
  static constexpr int kN = 16 / sizeof(S);
  union U {
    vec16_t v;
    S s[kN];
  };
};

// x at position pos < seqlen of row (b, c), with the history rule for pos < 0.
template <typename T, int kW>
M2R_DEVICE float x_at(const ConvFwdParams& p, int64_t b, int64_t c, int64_t pos) {
  typedef typename T::storage S;
  if (pos >= 0) {
    const S* x = static_cast<const S*>(p.x);
    return T::to_float(x[b * p.x_batch_stride + c * p.x_c_stride + pos * p.x_l_stride]);
  }
  if (p.initial_states == nullptr) return 0.f;
  const S* init = static_cast<const S*>(p.initial_states);
  return T::to_float(
      init[b * p.init_batch_stride + c * p.init_c_stride + (kW - 1 + pos) * p.init_l_stride]);
}

M2R_DEVICE int seq_at(const ConvFwdParams& p, int64_t b, int64_t pos) {
  return pos >= 0 ? p.seq_idx[b * p.seq_idx_batch_stride + pos * p.seq_idx_l_stride] : -1;
}

// final_states[b, c, j] = the last W-1 entries of [initial_states, x] (zero-padded on the left).
template <typename T, int kW>
M2R_DEVICE void write_final_states(const ConvFwdParams& p, int64_t b, int64_t c) {
  typedef typename T::storage S;
  S* fin = static_cast<S*>(p.final_states);
#pragma unroll
  for (int j = 0; j < kW - 1; ++j) {
    const int64_t pos = static_cast<int64_t>(p.seqlen) - (kW - 1) + j;
    const float v = pos >= -(kW - 1) ? x_at<T, kW>(p, b, c, pos) : 0.f;
    fin[b * p.final_batch_stride + c * p.final_c_stride + j * p.final_l_stride] = T::from_float(v);
  }
}

// One output from a window of kW inputs ending at that position.
template <int kW, bool kSeq>
M2R_DEVICE float tap(const float (&w)[kW], float bias, const float* win, const int* sid, int silu) {
  float acc = bias;
#pragma unroll
  for (int k = 0; k < kW; ++k) {
    if (!kSeq || sid[k] == sid[kW - 1]) acc = fmaf(w[k], win[k], acc);
  }
  return silu ? m2r::silu(acc) : acc;
}

// ---- layout: seqlen-contiguous ---------------------------------------------------------------
// grid (ceil(seqlen / (kThreads * kN)), dim, batch); each thread owns kN consecutive positions.
template <typename T, int kW, bool kVec>
M2R_DEVICE void fwd_rows(const ConvFwdParams& p) {
  typedef typename T::storage S;
  constexpr int kN = Vec<T>::kN;
  __shared__ float sh_x[kThreads + 1][kW - 1];
  __shared__ int sh_s[kThreads + 1][kW - 1];

  const int tid = threadIdx.x;
  const int64_t b = blockIdx.z, c = blockIdx.y;
  const int64_t blk0 = static_cast<int64_t>(blockIdx.x) * kThreads * kN;
  const int64_t t0 = blk0 + static_cast<int64_t>(tid) * kN;
  const bool has_seq = p.seq_idx != nullptr;

  const S* x = static_cast<const S*>(p.x) + b * p.x_batch_stride + c * p.x_c_stride;
  float xv[kN];
  if (kVec && t0 + kN <= p.seqlen) {
    typename Vec<T>::U u;
    u.v = load_stream(reinterpret_cast<const vec16_t*>(x + t0));
#pragma unroll
    for (int i = 0; i < kN; ++i) xv[i] = T::to_float(u.s[i]);
  } else {
#pragma unroll
    for (int i = 0; i < kN; ++i)
      xv[i] = t0 + i < p.seqlen ? T::to_float(x[(t0 + i) * p.x_l_stride]) : 0.f;
  }
  int sid[kW - 1 + kN];
  if (has_seq) {
#pragma unroll
    for (int i = 0; i < kN; ++i) sid[kW - 1 + i] = t0 + i < p.seqlen ? seq_at(p, b, t0 + i) : -2;
  }

  // Hand this thread's last kW-1 taps to the next thread; thread 0 fetches the block's history.
#pragma unroll
  for (int j = 0; j < kW - 1; ++j) {
    sh_x[tid + 1][j] = xv[kN - (kW - 1) + j];
    if (has_seq) sh_s[tid + 1][j] = sid[kW - 1 + kN - (kW - 1) + j];
  }
  if (tid == 0) {
#pragma unroll
    for (int j = 0; j < kW - 1; ++j) {
      const int64_t pos = blk0 - (kW - 1) + j;
      sh_x[0][j] = x_at<T, kW>(p, b, c, pos);
      if (has_seq) sh_s[0][j] = seq_at(p, b, pos);
    }
  }
  float w[kW];
#pragma unroll
  for (int k = 0; k < kW; ++k)
    w[k] = load_as_float(p.weight, p.weight_dtype, c * p.weight_c_stride + k * p.weight_w_stride);
  const float bias = p.bias ? load_as_float(p.bias, p.bias_dtype, c) : 0.f;
  __syncthreads();

  float win[kW - 1 + kN];
#pragma unroll
  for (int j = 0; j < kW - 1; ++j) {
    win[j] = sh_x[tid][j];
    if (has_seq) sid[j] = sh_s[tid][j];
  }
#pragma unroll
  for (int i = 0; i < kN; ++i) win[kW - 1 + i] = xv[i];

  float yv[kN];
#pragma unroll
  for (int i = 0; i < kN; ++i)
    yv[i] = has_seq ? tap<kW, true>(w, bias, win + i, sid + i, p.silu)
                    : tap<kW, false>(w, bias, win + i, sid, p.silu);

  S* out = static_cast<S*>(p.out) + b * p.out_batch_stride + c * p.out_c_stride;
  if (kVec && t0 + kN <= p.seqlen) {
    typename Vec<T>::U u;
#pragma unroll
    for (int i = 0; i < kN; ++i) u.s[i] = T::from_float(yv[i]);
    store_stream(reinterpret_cast<vec16_t*>(out + t0), u.v);
  } else {
#pragma unroll
    for (int i = 0; i < kN; ++i)
      if (t0 + i < p.seqlen) out[(t0 + i) * p.out_l_stride] = T::from_float(yv[i]);
  }
  if (p.final_states != nullptr && tid == 0 && blockIdx.x == gridDim.x - 1)
    write_final_states<T, kW>(p, b, c);
}

// Channel-last: the kN channels c0.. at position pos (zeros past the end, history before 0).
template <typename T, int kW, bool kVec>
M2R_DEVICE void cl_load(const ConvFwdParams& p, int64_t b, int64_t c0, int64_t pos, bool full_c,
                        float (&v)[Vec<T>::kN]) {
  typedef typename T::storage S;
  constexpr int kN = Vec<T>::kN;
  if (pos >= p.seqlen) {
#pragma unroll
    for (int i = 0; i < kN; ++i) v[i] = 0.f;
  } else if (kVec && pos >= 0 && full_c) {
    const S* x = static_cast<const S*>(p.x) + b * p.x_batch_stride + pos * p.x_l_stride + c0;
    typename Vec<T>::U u;
    u.v = load_stream(reinterpret_cast<const vec16_t*>(x));
#pragma unroll
    for (int i = 0; i < kN; ++i) v[i] = T::to_float(u.s[i]);
  } else {
#pragma unroll
    for (int i = 0; i < kN; ++i) v[i] = c0 + i < p.dim ? x_at<T, kW>(p, b, c0 + i, pos) : 0.f;
  }
}

// ---- layout: channel-last --------------------------------------------------------------------
// grid (ceil(seqlen / (kClRowsL * kClPosPerThread)), ceil(dim / (kClLanesC * kN)), batch);
// a thread owns kN consecutive channels and kClPosPerThread consecutive positions.
template <typename T, int kW, bool kVec>
M2R_DEVICE void fwd_channel_last(const ConvFwdParams& p) {
  typedef typename T::storage S;
  constexpr int kN = Vec<T>::kN;
  const int lane = threadIdx.x % kClLanesC, row = threadIdx.x / kClLanesC;
  const int64_t b = blockIdx.z;
  const int64_t c0 = (static_cast<int64_t>(blockIdx.y) * kClLanesC + lane) * kN;
  const int64_t t0 = (static_cast<int64_t>(blockIdx.x) * kClRowsL + row) * kClPosPerThread;
  if (c0 >= p.dim || t0 >= p.seqlen) return;
  const bool full_c = c0 + kN <= p.dim;
  const bool has_seq = p.seq_idx != nullptr;

  float w[kN][kW], bias[kN];
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const int64_t c = full_c ? c0 + i : min(c0 + i, static_cast<int64_t>(p.dim) - 1);
#pragma unroll
    for (int k = 0; k < kW; ++k)
      w[i][k] = load_as_float(p.weight, p.weight_dtype, c * p.weight_c_stride + k * p.weight_w_stride);
    bias[i] = p.bias ? load_as_float(p.bias, p.bias_dtype, c) : 0.f;
  }

  S* out = static_cast<S*>(p.out) + b * p.out_batch_stride;

  // Sliding window: win[k] holds position t - (kW-1) + k for the output position t.
  float win[kW][kN];
  int sid[kW];
#pragma unroll
  for (int k = 0; k < kW - 1; ++k) {
    cl_load<T, kW, kVec>(p, b, c0, t0 - (kW - 1) + k, full_c, win[k]);
    if (has_seq) sid[k] = seq_at(p, b, t0 - (kW - 1) + k);
  }
  const int steps = static_cast<int>(min(static_cast<int64_t>(kClPosPerThread), p.seqlen - t0));
#pragma unroll 1
  for (int s = 0; s < steps; ++s) {
    const int64_t t = t0 + s;
    cl_load<T, kW, kVec>(p, b, c0, t, full_c, win[kW - 1]);
    if (has_seq) sid[kW - 1] = seq_at(p, b, t);
    float y[kN];
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      float acc = bias[i];
#pragma unroll
      for (int k = 0; k < kW; ++k)
        if (!has_seq || sid[k] == sid[kW - 1]) acc = fmaf(w[i][k], win[k][i], acc);
      y[i] = p.silu ? silu(acc) : acc;
    }
    if (kVec && full_c) {
      typename Vec<T>::U u;
#pragma unroll
      for (int i = 0; i < kN; ++i) u.s[i] = T::from_float(y[i]);
      store_stream(reinterpret_cast<vec16_t*>(out + t * p.out_l_stride + c0), u.v);
    } else {
#pragma unroll
      for (int i = 0; i < kN; ++i)
        if (c0 + i < p.dim) out[t * p.out_l_stride + (c0 + i) * p.out_c_stride] = T::from_float(y[i]);
    }
#pragma unroll
    for (int k = 0; k < kW - 1; ++k) {
#pragma unroll
      for (int i = 0; i < kN; ++i) win[k][i] = win[k + 1][i];
      sid[k] = sid[k + 1];
    }
  }
  if (p.final_states != nullptr && t0 + kClPosPerThread >= p.seqlen) {
#pragma unroll 1
    for (int i = 0; i < kN; ++i)
      if (c0 + i < p.dim) write_final_states<T, kW>(p, b, c0 + i);
  }
}

}  // namespace conv1d
}  // namespace m2r

#define M2R_CONV_FWD(DT, T, W)                                                                 \
  M2R_KERNEL(m2r::conv1d::kThreads) m2r_conv1d_fwd_##DT##_w##W##_vec(ConvFwdParams p) {        \
    m2r::conv1d::fwd_rows<m2r::T, W, true>(p);                                                  \
  }                                                                                            \
  M2R_KERNEL(m2r::conv1d::kThreads) m2r_conv1d_fwd_##DT##_w##W##_strided(ConvFwdParams p) {    \
    m2r::conv1d::fwd_rows<m2r::T, W, false>(p);                                                 \
  }                                                                                            \
  M2R_KERNEL(m2r::conv1d::kThreads) m2r_conv1d_fwd_##DT##_w##W##_cl_vec(ConvFwdParams p) {     \
    m2r::conv1d::fwd_channel_last<m2r::T, W, true>(p);                                          \
  }                                                                                            \
  M2R_KERNEL(m2r::conv1d::kThreads) m2r_conv1d_fwd_##DT##_w##W##_cl_strided(ConvFwdParams p) { \
    m2r::conv1d::fwd_channel_last<m2r::T, W, false>(p);                                         \
  }

#define M2R_CONV_FWD_WIDTHS(DT, T) M2R_CONV_FWD(DT, T, 2) M2R_CONV_FWD(DT, T, 3) M2R_CONV_FWD(DT, T, 4)

M2R_CONV_FWD_WIDTHS(f32, F32)
M2R_CONV_FWD_WIDTHS(f16, F16)
M2R_CONV_FWD_WIDTHS(bf16, BF16)
