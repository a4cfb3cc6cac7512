// Causal depthwise conv1d, backward (semantics: ConvBwdParams in params.h).
//
// One block owns kC channels of one batch row and walks tiles_per_block tiles of kL positions.
// Per tile, in LDS:
//   x   at t0-(W-1) .. t0+kL+W-2  (history for the tile's outputs, and for the W-1 outputs after
//                                  it, whose gradients reach the tile's inputs)
//   dout at t0 .. t0+kL+W-2, turned in place into dy, the gradient before the activation
//                                 (SiLU's derivative from the recomputed pre-activation)
// then dx[s] = sum_k w[k] dy[s+W-1-k] over the taps that stay inside s's sequence, and
// dweight / dbias accumulate in registers over every tile the thread sees. At the end the block
// sums its threads' accumulators in a fixed order and writes one partial row per channel: the
// host adds the partials over blocks in a fixed order too, so a run is bit-identical to the
// next (no atomics, deterministic with or without torch's deterministic mode).
//
// Two tile shapes, which differ in which index the threads walk fastest (so the loads and stores
// are coalesced and the LDS accesses conflict-free in both):
//   *_rows  x seqlen-contiguous (or any strides): 4 channels x 512 positions, 64 threads a row
//   *_cl    x channel-last: 64 channels x 64 positions, 64 channels side by side
// Any strides are read element by element, so both shapes are correct for every layout.
#include "platform.h"

namespace m2r {
namespace conv1d_bwd {

constexpr int kThreads = 256;
// staging loops: 4 loads in flight per thread on NVIDIA; 2 on AMD, where the unrolled copies'
// uniform index terms (scalar registers) spilled on gfx90a / gfx942
#if M2R_AMD
#define M2R_STAGE_UNROLL _Pragma("unroll 2")
#else
#define M2R_STAGE_UNROLL _Pragma("unroll 4")
#endif
constexpr int kRowsC = 4, kRowsL = 512;
constexpr int kClC = 64, kClL = 64;

// d silu(a) / da
M2R_DEVICE float dsilu(float a) {
  const float s = __fdividef(1.0f, 1.0f + __expf(-a));
  return s * fmaf(a, 1.0f - s, 1.0f);
}

template <int kC, int kN, bool kChanFast>
M2R_DEVICE int slot(int c, int j) {  // LDS index of (channel c, position slot j) in a kN-slot tile
  return kChanFast ? j * kC + c : c * kN + j;
}

template <typename T, int kW, bool kSeq, int kC, int kL, bool kChanFast>
M2R_DEVICE void backward(const ConvBwdParams& p) {
  typedef typename T::storage S;
  constexpr int kR = kThreads / kC;       // threads per channel
  constexpr int kNX = kL + 2 * (kW - 1);  // x slots: position t0 - (W-1) + j
  constexpr int kNG = kL + kW - 1;        // dout / dy slots: position t0 + j
  static_assert(kC * kR == kThreads, "a whole number of threads per channel");
  static_assert(kC * kNG >= kThreads * (kW + 1), "the final reduction reuses the dy tile");
  __shared__ float sx[kC * kNX];
  __shared__ float sg[kC * kNG];
  __shared__ int ss[kSeq ? kNX : 1];  // seq ids of the x slots (-1 before 0, -2 past the end)

  const int tid = threadIdx.x;
  const int my_c = kChanFast ? tid % kC : tid / kR;
  const int my_r = kChanFast ? tid / kC : tid % kR;
  const int64_t b = blockIdx.z;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kC;
  const int64_t c = c0 + my_c;
  const bool c_ok = c < p.dim;
  const int64_t cw = c_ok ? c : p.dim - 1;  // a valid row for the weight loads
  float w[kW];
#pragma unroll
  for (int k = 0; k < kW; ++k)
    w[k] = load_as_float(p.weight, p.weight_dtype, cw * p.weight_c_stride + k * p.weight_w_stride);
  const float bias = p.bias ? load_as_float(p.bias, p.bias_dtype, cw) : 0.f;
  float dw[kW], db = 0.f;
#pragma unroll
  for (int k = 0; k < kW; ++k) dw[k] = 0.f;

  // row pointers in vector registers: AMD's compiler would keep these uniform values in
  // scalar registers, which the struct's strides already fill (gfx90a spilled them)
  const S* x = per_lane(static_cast<const S*>(p.x) + b * p.x_batch_stride);
  const S* dout = per_lane(static_cast<const S*>(p.dout) + b * p.dout_batch_stride);
  S* dx = per_lane(static_cast<S*>(p.dx) + b * p.dx_batch_stride);
  const S* init = static_cast<const S*>(p.initial_states);
  const S* dfin = static_cast<const S*>(p.dfinal);
  const int64_t seqlen = p.seqlen;

  for (int tile = 0; tile < p.tiles_per_block; ++tile) {
    const int64_t t0 = (static_cast<int64_t>(blockIdx.x) * p.tiles_per_block + tile) * kL;
    if (t0 >= seqlen) break;  // (uniform over the block)
    // ---- stage x, dout and the seq ids; zeros past the end and past dim ----
M2R_STAGE_UNROLL
    for (int e = tid; e < kC * kNX; e += kThreads) {
      const int ec = kChanFast ? e % kC : e / kNX, ej = kChanFast ? e / kC : e % kNX;
      const int64_t ch = c0 + ec, pos = t0 - (kW - 1) + ej;
      float v = 0.f;
      if (ch < p.dim && pos < seqlen) {
        if (pos >= 0)
          v = T::to_float(x[ch * p.x_c_stride + pos * p.x_l_stride]);
        else if (init != nullptr)
          v = T::to_float(init[(b * p.dim + ch) * (kW - 1) + kW - 1 + pos]);
      }
      sx[e] = v;  // e is the slot index: the walk above is the LDS order
    }
M2R_STAGE_UNROLL
    for (int e = tid; e < kC * kNG; e += kThreads) {
      const int ec = kChanFast ? e % kC : e / kNG, ej = kChanFast ? e / kC : e % kNG;
      const int64_t ch = c0 + ec, pos = t0 + ej;
      sg[e] = ch < p.dim && pos < seqlen ? T::to_float(dout[ch * p.dout_c_stride + pos * p.dout_l_stride])
                                         : 0.f;
    }
    if (kSeq) {
      for (int j = tid; j < kNX; j += kThreads) {
        const int64_t pos = t0 - (kW - 1) + j;
        ss[j] = pos < 0 ? -1 : pos < seqlen ? p.seq_idx[b * p.seq_idx_batch_stride + pos * p.seq_idx_l_stride] : -2;
      }
    }
    __syncthreads();

    // ---- dy = dout * act'(pre), in place; dweight / dbias over the tile's own outputs ----
#pragma unroll 2
    for (int j = my_r; j < kNG; j += kR) {
      const int sid = kSeq ? ss[j + kW - 1] : 0;
      float g = sg[slot<kC, kNG, kChanFast>(my_c, j)];
      if (kSeq && sid < 0) g = 0.f;  // padding (or past the end): its output was 0
      float xs[kW];
#pragma unroll
      for (int k = 0; k < kW; ++k) {
        const bool tap = !kSeq || ss[j + k] == sid;
        xs[k] = tap ? sx[slot<kC, kNX, kChanFast>(my_c, j + k)] : 0.f;
      }
      if (p.silu) {
        float a = bias;
#pragma unroll
        for (int k = 0; k < kW; ++k) a = fmaf(w[k], xs[k], a);
        g *= dsilu(a);
      }
      sg[slot<kC, kNG, kChanFast>(my_c, j)] = g;
      if (j < kL && (!kSeq || sid >= 0)) {
        db += g;
#pragma unroll
        for (int k = 0; k < kW; ++k) dw[k] = fmaf(g, xs[k], dw[k]);
      }
    }
    __syncthreads();

    // ---- dx of the tile's positions, into the x slots they no longer need ----
#pragma unroll 2
    for (int j = my_r; j < kL; j += kR) {
      const int64_t s = t0 + j;
      const int sid = kSeq ? ss[j + kW - 1] : 0;
      float acc = 0.f;
#pragma unroll
      for (int k = 0; k < kW; ++k) {
        const int jt = j + kW - 1 - k;  // the output s feeds through tap k: position t0 + jt
        if (!kSeq || ss[jt + kW - 1] == sid) acc = fmaf(w[k], sg[slot<kC, kNG, kChanFast>(my_c, jt)], acc);
      }
      if (dfin != nullptr && c_ok && s < seqlen && s >= seqlen - (kW - 1))
        acc += T::to_float(dfin[(b * p.dim + c) * (kW - 1) + s - seqlen + kW - 1]);
      sx[slot<kC, kNX, kChanFast>(my_c, j)] = acc;
    }
    // dinit: the history positions -(W-1) .. -1 feed the first outputs (no seq_idx with states)
    if (tile == 0 && blockIdx.x == 0 && p.dinit != nullptr && c_ok && my_r == 0) {
      S* dinit = static_cast<S*>(p.dinit) + (b * p.dim + c) * (kW - 1);
#pragma unroll
      for (int j = 0; j < kW - 1; ++j) {
        const int64_t pos = j - (kW - 1);
        float acc = 0.f;
#pragma unroll
        for (int k = 0; k <= j; ++k) acc = fmaf(w[k], sg[slot<kC, kNG, kChanFast>(my_c, j - k)], acc);
        if (dfin != nullptr && pos >= seqlen - (kW - 1))
          acc += T::to_float(dfin[(b * p.dim + c) * (kW - 1) + pos - seqlen + kW - 1]);
        dinit[j] = T::from_float(acc);
      }
    }
    __syncthreads();

    // ---- store dx in the walk of the loads ----
M2R_STAGE_UNROLL
    for (int e = tid; e < kC * kNX; e += kThreads) {
      const int ec = kChanFast ? e % kC : e / kNX, ej = kChanFast ? e / kC : e % kNX;
      const int64_t ch = c0 + ec, pos = t0 + ej;
      if (ej < kL && ch < p.dim && pos < seqlen)
        dx[ch * p.dx_c_stride + pos * p.dx_l_stride] = T::from_float(sx[e]);
    }
    __syncthreads();  // the next tile's staging overwrites sx and sg
  }

  // ---- the block's dweight / dbias: every thread's sums, added in a fixed order ----
  float* red = sg;  // kThreads * (kW + 1) floats
#pragma unroll
  for (int k = 0; k < kW; ++k) red[(my_c * kR + my_r) * (kW + 1) + k] = dw[k];
  red[(my_c * kR + my_r) * (kW + 1) + kW] = db;
  __syncthreads();
  for (int q = tid; q < kC * (kW + 1); q += kThreads) {
    const int qc = q / (kW + 1), qk = q % (kW + 1);
    if (c0 + qc >= p.dim) continue;
    float sum = 0.f;
    for (int r = 0; r < kR; ++r) sum += red[(qc * kR + r) * (kW + 1) + qk];
    const int64_t row = b * gridDim.x + blockIdx.x;
    p.partial[(row * p.dim + c0 + qc) * (kW + 1) + qk] = sum;
  }
}

}  // namespace conv1d_bwd
}  // namespace m2r

// One kernel per (dtype, width, tile shape), each with and without seq_idx ("_seq").
#define M2R_CONV_BWD_ONE(DT, T, W, NAME, C, L, CF)                                                   \
  M2R_KERNEL_MIN_BLOCKS(m2r::conv1d_bwd::kThreads, 3) m2r_conv1d_bwd_##DT##_w##W##_##NAME(ConvBwdParams p) {       \
    m2r::conv1d_bwd::backward<m2r::T, W, false, m2r::conv1d_bwd::C, m2r::conv1d_bwd::L, CF>(p);      \
  }                                                                                                  \
  M2R_KERNEL_MIN_BLOCKS(m2r::conv1d_bwd::kThreads, 3) m2r_conv1d_bwd_##DT##_w##W##_##NAME##_seq(ConvBwdParams p) { \
    m2r::conv1d_bwd::backward<m2r::T, W, true, m2r::conv1d_bwd::C, m2r::conv1d_bwd::L, CF>(p);       \
  }
#define M2R_CONV_BWD(DT, T, W)                                 \
  M2R_CONV_BWD_ONE(DT, T, W, rows, kRowsC, kRowsL, false)      \
  M2R_CONV_BWD_ONE(DT, T, W, cl, kClC, kClL, true)
#define M2R_CONV_BWD_WIDTHS(DT, T) M2R_CONV_BWD(DT, T, 2) M2R_CONV_BWD(DT, T, 3) M2R_CONV_BWD(DT, T, 4)

M2R_CONV_BWD_WIDTHS(f32, F32)
M2R_CONV_BWD_WIDTHS(f16, F16)
M2R_CONV_BWD_WIDTHS(bf16, BF16)
