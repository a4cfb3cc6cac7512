// selective_state_update: one decode step of the selective SSM, state updated in place.
// Semantics in params.h (SsuParams). grid (ceil(headdim / kRowsPerBlock), nheads, batch);
// 32 lanes per (batch, head, headdim row), lane l owning dstate elements l, l + 32, ...: every
// state load and store is coalesced, and the C-weighted sum is a 32-lane butterfly.
#include "platform.h"

namespace m2r {
namespace ssu {

constexpr int kThreads = 128;
constexpr int kLanes = 32;
constexpr int kRowsPerBlock = kThreads / kLanes;

// K contiguous elements in as few loads/stores as their size allows (the host guarantees the
// alignment when it picks a *_contig kernel).
template <typename S, int K>
M2R_DEVICE void load_chunk(const S* p, S (&o)[K]) {
  constexpr int kBytes = static_cast<int>(sizeof(S)) * K;
  if constexpr (kBytes % 16 == 0) {
#pragma unroll
    for (int q = 0; q < kBytes / 16; ++q) reinterpret_cast<uint4*>(o)[q] = reinterpret_cast<const uint4*>(p)[q];
  } else if constexpr (kBytes % 8 == 0) {
#pragma unroll
    for (int q = 0; q < kBytes / 8; ++q) reinterpret_cast<uint2*>(o)[q] = reinterpret_cast<const uint2*>(p)[q];
  } else if constexpr (kBytes % 4 == 0) {
#pragma unroll
    for (int q = 0; q < kBytes / 4; ++q) reinterpret_cast<uint32_t*>(o)[q] = reinterpret_cast<const uint32_t*>(p)[q];
  } else {
#pragma unroll
    for (int k = 0; k < K; ++k) o[k] = p[k];
  }
}

template <typename S, int K>
M2R_DEVICE void store_chunk(S* p, const S (&o)[K]) {
  constexpr int kBytes = static_cast<int>(sizeof(S)) * K;
  if constexpr (kBytes % 16 == 0) {
#pragma unroll
    for (int q = 0; q < kBytes / 16; ++q) reinterpret_cast<uint4*>(p)[q] = reinterpret_cast<const uint4*>(o)[q];
  } else if constexpr (kBytes % 8 == 0) {
#pragma unroll
    for (int q = 0; q < kBytes / 8; ++q) reinterpret_cast<uint2*>(p)[q] = reinterpret_cast<const uint2*>(o)[q];
  } else if constexpr (kBytes % 4 == 0) {
#pragma unroll
    for (int q = 0; q < kBytes / 4; ++q) reinterpret_cast<uint32_t*>(p)[q] = reinterpret_cast<const uint32_t*>(o)[q];
  } else {
#pragma unroll
    for (int k = 0; k < K; ++k) p[k] = o[k];
  }
}

// kContig: dstate == kN, unit stride along dstate for state/B/C, aligned: lane l owns the
// contiguous elements [l*kPer, (l+1)*kPer) and moves them in 4..16-byte accesses. Otherwise lane
// l owns l, l+32, ... with any strides. All loads are issued before the first use.
template <typename TS, typename TI, int kN, bool kContig>  // state type, input type, max dstate
M2R_DEVICE void update(const SsuParams& p) {
  typedef typename TS::storage SS;
  typedef typename TI::storage SI;
  constexpr int kPer = kN >= kLanes ? kN / kLanes : 1;
  const int lane = threadIdx.x % kLanes;
  const int64_t pr = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanes;
  const int64_t h = blockIdx.y, b = blockIdx.z;
  if (pr >= p.headdim) return;
  SI* out = static_cast<SI*>(p.out) + b * p.out_batch_stride + h * p.out_h_stride + pr * p.out_p_stride;
  const int64_t row = p.state_indices ? p.state_indices[b] : b;
  if (row < 0 || row >= p.num_states) {
    if (lane == 0) *out = TI::from_float(row == -1 ? 0.f : __int_as_float(0x7fc00000));
    return;
  }
  const int64_t g = h / p.heads_per_group;
  SS* st = static_cast<SS*>(p.state) + row * p.state_batch_stride + h * p.state_h_stride + pr * p.state_p_stride;
  const SI* B = static_cast<const SI*>(p.B) + b * p.B_batch_stride + g * p.B_g_stride;
  const SI* C = static_cast<const SI*>(p.C) + b * p.C_batch_stride + g * p.C_g_stride;
  const int64_t a_row = h * p.A_h_stride + pr * p.A_p_stride;

  SS s_old[kPer];
  SI b_v[kPer], c_v[kPer];
  float a_v[kPer];
  if constexpr (kContig) {
    load_chunk<SS, kPer>(st + lane * kPer, s_old);
    load_chunk<SI, kPer>(B + lane * kPer, b_v);
    load_chunk<SI, kPer>(C + lane * kPer, c_v);
#pragma unroll
    for (int i = 0; i < kPer; ++i) a_v[i] = load_as_float(p.A, p.a_dtype, a_row + (lane * kPer + i) * p.A_n_stride);
  } else {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int n = lane + i * kLanes;
      if (n < p.dstate) {
        s_old[i] = st[n * p.state_n_stride];
        b_v[i] = B[n * p.B_n_stride];
        c_v[i] = C[n * p.C_n_stride];
        a_v[i] = load_as_float(p.A, p.a_dtype, a_row + n * p.A_n_stride);
      }
    }
  }
  float dt = load_as_float(p.dt, p.dt_dtype, b * p.dt_batch_stride + h * p.dt_h_stride + pr * p.dt_p_stride);
  if (p.dt_bias) dt += load_as_float(p.dt_bias, p.dt_bias_dtype, h * p.dt_bias_h_stride + pr * p.dt_bias_p_stride);
  if (p.dt_softplus) dt = softplus(dt);
  const float x = TI::to_float(static_cast<const SI*>(p.x)[b * p.x_batch_stride + h * p.x_h_stride + pr * p.x_p_stride]);
  const float dtx = dt * x;

  float acc = 0.f;
  SS s_new[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int n = kContig ? lane * kPer + i : lane + i * kLanes;
    if (!kContig && n >= p.dstate) continue;
    const float s = TS::to_float(s_old[i]) * __expf(a_v[i] * dt) + TI::to_float(b_v[i]) * dtx;
    acc = fmaf(s, TI::to_float(c_v[i]), acc);
    s_new[i] = TS::from_float(s);
    if (!kContig) st[n * p.state_n_stride] = s_new[i];
  }
  if constexpr (kContig) store_chunk<SS, kPer>(st + lane * kPer, s_new);
#pragma unroll
  for (int off = kLanes / 2; off > 0; off /= 2) acc += shfl_xor_width(acc, off, kLanes);
  if (lane == 0) {
    float y = acc;
    if (p.D) y = fmaf(load_as_float(p.D, p.d_dtype, h * p.D_h_stride + pr * p.D_p_stride), x, y);
    if (p.z) {
      const SI* z = static_cast<const SI*>(p.z);
      y *= silu(TI::to_float(z[b * p.z_batch_stride + h * p.z_h_stride + pr * p.z_p_stride]));
    }
    *out = TI::from_float(y);
  }
}

}  // namespace ssu
}  // namespace m2r

// m2r_ssu_<state dtype>_<input dtype>_n<max dstate>[_contig]
#define M2R_SSU(SD, TS, ID, TI, N)                                                           \
  M2R_KERNEL(m2r::ssu::kThreads) m2r_ssu_##SD##_##ID##_n##N(SsuParams p) {                  \
    m2r::ssu::update<m2r::TS, m2r::TI, N, false>(p);                                         \
  }                                                                                         \
  M2R_KERNEL(m2r::ssu::kThreads) m2r_ssu_##SD##_##ID##_n##N##_contig(SsuParams p) {         \
    m2r::ssu::update<m2r::TS, m2r::TI, N, true>(p);                                          \
  }
#define M2R_SSU_N(SD, TS, ID, TI) \
  M2R_SSU(SD, TS, ID, TI, 32) M2R_SSU(SD, TS, ID, TI, 64) M2R_SSU(SD, TS, ID, TI, 128) M2R_SSU(SD, TS, ID, TI, 256)
#define M2R_SSU_STATE(SD, TS) M2R_SSU_N(SD, TS, f32, F32) M2R_SSU_N(SD, TS, f16, F16) M2R_SSU_N(SD, TS, bf16, BF16)

M2R_SSU_STATE(f32, F32)
M2R_SSU_STATE(f16, F16)
M2R_SSU_STATE(bf16, BF16)
