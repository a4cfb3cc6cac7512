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

template <typename TS, typename TI, int kN>  // state type, input type, max dstate
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
  float dt = load_as_float(p.dt, p.dt_dtype, b * p.dt_batch_stride + h * p.dt_h_stride + pr * p.dt_p_stride);
  if (p.dt_bias) dt += load_as_float(p.dt_bias, p.dt_bias_dtype, h * p.dt_bias_h_stride + pr * p.dt_bias_p_stride);
  if (p.dt_softplus) dt = softplus(dt);
  const float x = TI::to_float(static_cast<const SI*>(p.x)[b * p.x_batch_stride + h * p.x_h_stride + pr * p.x_p_stride]);
  const float dtx = dt * x;
  SS* st = static_cast<SS*>(p.state) + row * p.state_batch_stride + h * p.state_h_stride + pr * p.state_p_stride;
  const SI* B = static_cast<const SI*>(p.B) + b * p.B_batch_stride + g * p.B_g_stride;
  const SI* C = static_cast<const SI*>(p.C) + b * p.C_batch_stride + g * p.C_g_stride;
  const int64_t a_row = h * p.A_h_stride + pr * p.A_p_stride;

  float acc = 0.f;
  SS s_old[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {  // all state loads in flight first
    const int n = lane + i * kLanes;
    if (n < p.dstate) s_old[i] = st[n * p.state_n_stride];
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int n = lane + i * kLanes;
    if (n >= p.dstate) continue;
    const float a = load_as_float(p.A, p.a_dtype, a_row + n * p.A_n_stride);
    const float s = TS::to_float(s_old[i]) * __expf(a * dt) + TI::to_float(B[n * p.B_n_stride]) * dtx;
    acc = fmaf(s, TI::to_float(C[n * p.C_n_stride]), acc);
    st[n * p.state_n_stride] = TS::from_float(s);
  }
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

// m2r_ssu_<state dtype>_<input dtype>_n<max dstate>
#define M2R_SSU(SD, TS, ID, TI, N)                                                          \
  M2R_KERNEL(m2r::ssu::kThreads) m2r_ssu_##SD##_##ID##_n##N(SsuParams p) {                 \
    m2r::ssu::update<m2r::TS, m2r::TI, N>(p);                                               \
  }
#define M2R_SSU_N(SD, TS, ID, TI) \
  M2R_SSU(SD, TS, ID, TI, 32) M2R_SSU(SD, TS, ID, TI, 64) M2R_SSU(SD, TS, ID, TI, 128) M2R_SSU(SD, TS, ID, TI, 256)
#define M2R_SSU_STATE(SD, TS) M2R_SSU_N(SD, TS, f32, F32) M2R_SSU_N(SD, TS, f16, F16) M2R_SSU_N(SD, TS, bf16, BF16)

M2R_SSU_STATE(f32, F32)
M2R_SSU_STATE(f16, F16)
M2R_SSU_STATE(bf16, BF16)
