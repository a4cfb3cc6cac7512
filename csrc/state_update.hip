// selective_state_update: one decode step of the selective SSM, state updated in place.
// Semantics in params.h (SsuParams). 32 lanes per (batch, head, headdim row), lane l owning dstate elements l, l + 32, ...: every
// state load and store is coalesced, and the C-weighted sum is a 32-lane butterfly.
#include "platform.h"

namespace m2r {
namespace ssu {

constexpr int kThreads = 256;
constexpr int kLanes = 32;
constexpr int kGroups = kThreads / kLanes;  // 32-lane groups per block, looping over headdim

// K contiguous elements held in registers, moved in as few 4..16-byte accesses as their size
// allows (the host guarantees the alignment when it picks a *_contig kernel). A union filled
// word by word keeps the values in registers, where reinterpreting an array's address did not.
template <typename S, int K>
struct Chunk {
  static_assert(sizeof(S) == 2 || sizeof(S) == 4, "16- or 32-bit elements");
  static constexpr int kPerWord = 4 / static_cast<int>(sizeof(S));
  static constexpr int kBytes = static_cast<int>(sizeof(S)) * K;
  static constexpr int kWords = (K + kPerWord - 1) / kPerWord;
  uint32_t w[kWords];  // only whole words: element access is shifts, never type punning

  M2R_DEVICE S get(int i) const {
    if constexpr (sizeof(S) == 4) {
      return __uint_as_float(w[i]);
    } else {
      return static_cast<S>(w[i / 2] >> (16 * (i % 2)));
    }
  }
  M2R_DEVICE void set(int i, S v) {
    if constexpr (sizeof(S) == 4) {
      w[i] = __float_as_uint(v);
    } else {
      const int sh = 16 * (i % 2);
      w[i / 2] = (w[i / 2] & ~(0xffffu << sh)) | (static_cast<uint32_t>(v) << sh);
    }
  }
  M2R_DEVICE void load(const S* p) {
    if constexpr (kBytes == 16) {  // (wider chunks in 8-byte steps: 32-byte ones made ptxas spill)
#pragma unroll
      for (int q = 0; q < kBytes / 16; ++q) {
        const uint4 v = reinterpret_cast<const uint4*>(p)[q];
        w[4 * q] = v.x, w[4 * q + 1] = v.y, w[4 * q + 2] = v.z, w[4 * q + 3] = v.w;
      }
    } else if constexpr (kBytes % 8 == 0) {
#pragma unroll
      for (int q = 0; q < kBytes / 8; ++q) {
        const uint2 v = reinterpret_cast<const uint2*>(p)[q];
        w[2 * q] = v.x, w[2 * q + 1] = v.y;
      }
    } else if constexpr (kBytes % 4 == 0) {
#pragma unroll
      for (int q = 0; q < kWords; ++q) w[q] = reinterpret_cast<const uint32_t*>(p)[q];
    } else {
#pragma unroll
      for (int k = 0; k < K; ++k) set(k, p[k]);
    }
  }
  M2R_DEVICE void store(S* p) const {
    if constexpr (kBytes == 16) {  // (wider chunks in 8-byte steps: 32-byte ones made ptxas spill)
#pragma unroll
      for (int q = 0; q < kBytes / 16; ++q)
        reinterpret_cast<uint4*>(p)[q] = make_uint4(w[4 * q], w[4 * q + 1], w[4 * q + 2], w[4 * q + 3]);
    } else if constexpr (kBytes % 8 == 0) {
#pragma unroll
      for (int q = 0; q < kBytes / 8; ++q) reinterpret_cast<uint2*>(p)[q] = make_uint2(w[2 * q], w[2 * q + 1]);
    } else if constexpr (kBytes % 4 == 0) {
#pragma unroll
      for (int q = 0; q < kWords; ++q) reinterpret_cast<uint32_t*>(p)[q] = w[q];
    } else {
#pragma unroll
      for (int k = 0; k < K; ++k) p[k] = get(k);
    }
  }
};

// One block per (head, batch): grid (nheads, batch). Group g (32 lanes) takes headdim rows
// g, g + kGroups, ...; B and C of the (batch, group) are read and converted once per block.
// kContig: dstate == kN, unit dstate stride for state/B/C, aligned: lane l owns elements
// [l*kPer, (l+1)*kPer), moved in 4..16-byte accesses; otherwise lane l owns l, l+32, ...
// Tied A (stride 0 over headdim and dstate, the Mamba2 case): exp(A*dt) is one value per row.
template <typename TS, typename TI, typename TB, int kN, bool kContig>
M2R_DEVICE void update_head(const SsuParams& p) {
  typedef typename TS::storage SS;
  typedef typename TI::storage SI;
  typedef typename TB::storage SB;
  constexpr int kPer = kN >= kLanes ? kN / kLanes : 1;
  const int lane = threadIdx.x % kLanes;
  const int group = threadIdx.x / kLanes;
  const int64_t h = blockIdx.x, b = blockIdx.y;
  const int64_t row = p.state_indices ? p.state_indices[b] : b;
  SI* out = static_cast<SI*>(p.out) + b * p.out_batch_stride + h * p.out_h_stride;
  if (row < 0 || row >= p.num_states) {  // -1: padding, zeros; beyond the pool: NaN, loudly
    const float fill = row == -1 ? 0.f : __int_as_float(0x7fc00000);
    for (int64_t pr = group; pr < p.headdim; pr += kGroups)
      if (lane == 0) out[pr * p.out_p_stride] = TI::from_float(fill);
    return;
  }
  const int64_t g = h / p.heads_per_group;
  const SB* B = static_cast<const SB*>(p.B) + b * p.B_batch_stride + g * p.B_g_stride;
  const SB* C = static_cast<const SB*>(p.C) + b * p.C_batch_stride + g * p.C_g_stride;
  float bf[kPer], cf[kPer];
  if constexpr (kContig) {
    Chunk<SB, kPer> bv, cv;
    bv.load(B + lane * kPer);
    cv.load(C + lane * kPer);
#pragma unroll
    for (int i = 0; i < kPer; ++i) bf[i] = TB::to_float(bv.get(i)), cf[i] = TB::to_float(cv.get(i));
  } else {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int n = lane + i * kLanes;
      bf[i] = n < p.dstate ? TB::to_float(B[n * p.B_n_stride]) : 0.f;
      cf[i] = n < p.dstate ? TB::to_float(C[n * p.C_n_stride]) : 0.f;
    }
  }
  const bool a_tied = p.A_p_stride == 0 && p.A_n_stride == 0;
  SS* st = static_cast<SS*>(p.state) + row * p.state_batch_stride + h * p.state_h_stride;

#pragma unroll 1
  for (int64_t pr = group; pr < p.headdim; pr += kGroups) {
    SS* srow = st + pr * p.state_p_stride;
    Chunk<SS, kPer> s_old;
    if constexpr (kContig) {
      s_old.load(srow + lane * kPer);
    } else {
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int n = lane + i * kLanes;
        if (n < p.dstate) s_old.set(i, srow[n * p.state_n_stride]);
      }
    }
    float dt = load_as_float(p.dt, p.dt_dtype, b * p.dt_batch_stride + h * p.dt_h_stride + pr * p.dt_p_stride);
    if (p.dt_bias) dt += load_as_float(p.dt_bias, p.dt_bias_dtype, h * p.dt_bias_h_stride + pr * p.dt_bias_p_stride);
    if (p.dt_softplus) dt = softplus(dt);
    const float x = TI::to_float(static_cast<const SI*>(p.x)[b * p.x_batch_stride + h * p.x_h_stride + pr * p.x_p_stride]);
    const float dtx = dt * x;
    const int64_t a_row = h * p.A_h_stride + pr * p.A_p_stride;
    const float da_tied = a_tied ? __expf(load_as_float(p.A, p.a_dtype, a_row) * dt) : 0.f;

    float acc = 0.f;
    Chunk<SS, kPer> s_new;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int n = kContig ? lane * kPer + i : lane + i * kLanes;
      if (!kContig && n >= p.dstate) continue;
      // contiguous variant: A's dstate stride is 1 unless tied (host-checked), so offsets are constants
      const float da = a_tied ? da_tied
                              : __expf(load_as_float(p.A, p.a_dtype, a_row + (kContig ? n : n * p.A_n_stride)) * dt);
      const float s = fmaf(TS::to_float(s_old.get(i)), da, bf[i] * dtx);
      acc = fmaf(s, cf[i], acc);
      s_new.set(i, TS::from_float(s));
      if (!kContig) srow[n * p.state_n_stride] = s_new.get(i);
    }
    if constexpr (kContig) s_new.store(srow + lane * kPer);
#pragma unroll
    for (int off = kLanes / 2; off > 0; off /= 2) acc += shfl_xor_width(acc, off, kLanes);
    if (lane == 0) {
      float y = acc;
      if (p.D) y = fmaf(load_as_float(p.D, p.d_dtype, h * p.D_h_stride + pr * p.D_p_stride), x, y);
      if (p.z) {
        const SB* z = static_cast<const SB*>(p.z);
        y *= silu(TB::to_float(z[b * p.z_batch_stride + h * p.z_h_stride + pr * p.z_p_stride]));
      }
      out[pr * p.out_p_stride] = TI::from_float(y);
    }
  }
}

// The general path (any strides, any dstate): one headdim row per 32-lane group, lane l owning
// elements l, l+32, ...; grid (ceil(headdim / kGroups), nheads, batch). No row loop: with
// one, AMD's compiler hoisted the per-element offsets into scalar registers and spilled them.
template <typename TS, typename TI, typename TB, int kN, bool kContig>  // state, x, B/C/z types
M2R_DEVICE void update_row(const SsuParams& p, int64_t b, int64_t h, int64_t pr, int lane) {
  typedef typename TS::storage SS;
  typedef typename TI::storage SI;
  typedef typename TB::storage SB;
  constexpr int kPer = kN >= kLanes ? kN / kLanes : 1;
  SI* out = static_cast<SI*>(p.out) + b * p.out_batch_stride + h * p.out_h_stride + pr * p.out_p_stride;
  const int64_t row = p.state_indices ? p.state_indices[b] : b;
  if (row < 0 || row >= p.num_states) {
    if (lane == 0) *out = TI::from_float(row == -1 ? 0.f : __int_as_float(0x7fc00000));
    return;
  }
  const int64_t g = h / p.heads_per_group;
  SS* st = static_cast<SS*>(p.state) + row * p.state_batch_stride + h * p.state_h_stride + pr * p.state_p_stride;
  const SB* B = static_cast<const SB*>(p.B) + b * p.B_batch_stride + g * p.B_g_stride;
  const SB* C = static_cast<const SB*>(p.C) + b * p.C_batch_stride + g * p.C_g_stride;
  const int64_t a_row = h * p.A_h_stride + pr * p.A_p_stride;

  Chunk<SS, kPer> s_old;
  Chunk<SB, kPer> b_v, c_v;
  float a_v[kPer];
  if constexpr (kContig) {
    s_old.load(st + lane * kPer);
    b_v.load(B + lane * kPer);
    c_v.load(C + lane * kPer);
#pragma unroll
    for (int i = 0; i < kPer; ++i) a_v[i] = load_as_float(p.A, p.a_dtype, a_row + (lane * kPer + i) * p.A_n_stride);
  } else {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int n = lane + i * kLanes;
      if (n < p.dstate) {
        s_old.set(i, st[n * p.state_n_stride]);
        b_v.set(i, B[n * p.B_n_stride]);
        c_v.set(i, C[n * p.C_n_stride]);
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
  Chunk<SS, kPer> s_new;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int n = kContig ? lane * kPer + i : lane + i * kLanes;
    if (!kContig && n >= p.dstate) continue;
    const float s = TS::to_float(s_old.get(i)) * __expf(a_v[i] * dt) + TB::to_float(b_v.get(i)) * dtx;
    acc = fmaf(s, TB::to_float(c_v.get(i)), acc);
    s_new.set(i, TS::from_float(s));
    if (!kContig) st[n * p.state_n_stride] = s_new.get(i);
  }
  if constexpr (kContig) s_new.store(st + lane * kPer);
#pragma unroll
  for (int off = kLanes / 2; off > 0; off /= 2) acc += shfl_xor_width(acc, off, kLanes);
  if (lane == 0) {
    float y = acc;
    if (p.D) y = fmaf(load_as_float(p.D, p.d_dtype, h * p.D_h_stride + pr * p.D_p_stride), x, y);
    if (p.z) {
      const SB* z = static_cast<const SB*>(p.z);
      y *= silu(TB::to_float(z[b * p.z_batch_stride + h * p.z_h_stride + pr * p.z_p_stride]));
    }
    *out = TI::from_float(y);
  }
}

// kContig: the per-head kernel's layout conditions (dstate == kN, unit dstate strides, aligned),
// lane l moving elements [l*kPer, (l+1)*kPer) in 4..16-byte accesses.
template <typename TS, typename TI, typename TB, int kN, bool kContig>
M2R_DEVICE void update_rows(const SsuParams& p) {
  const int64_t pr = static_cast<int64_t>(blockIdx.x) * kGroups + threadIdx.x / kLanes;
  if (pr < p.headdim) update_row<TS, TI, TB, kN, kContig>(p, blockIdx.z, blockIdx.y, pr, threadIdx.x % kLanes);
}

}  // namespace ssu
}  // namespace m2r

// m2r_ssu_<state dtype>_<input dtype>[_f32bcz]_n<max dstate>[_contig|_rows]: the general
// kernel, the per-head one and the row-parallel one with the per-head one's contiguous layout.
// B, C and z are read in the input dtype, or with _f32bcz (16-bit inputs only) in float32:
// mamba_ssm callers pass float32 B / C / z with half x, and mamba_ssm reads them unrounded.
#define M2R_SSU(SD, TS, ID, TI, BD, TB, N)                                                  \
  M2R_KERNEL(m2r::ssu::kThreads) m2r_ssu_##SD##_##ID##BD##_n##N(SsuParams p) {             \
    m2r::ssu::update_rows<m2r::TS, m2r::TI, m2r::TB, N, false>(p);                          \
  }
// The per-head contiguous kernels stop at dstate 128: at 256 the row loop spilled scalar
// registers on wave64 targets (gfx90a); dstate 256 uses the general kernel.
#define M2R_SSU_CONTIG(SD, TS, ID, TI, BD, TB, N)                                           \
  M2R_KERNEL(m2r::ssu::kThreads) m2r_ssu_##SD##_##ID##BD##_n##N##_contig(SsuParams p) {     \
    m2r::ssu::update_head<m2r::TS, m2r::TI, m2r::TB, N, true>(p);                           \
  }                                                                                         \
  M2R_KERNEL(m2r::ssu::kThreads) m2r_ssu_##SD##_##ID##BD##_n##N##_rows(SsuParams p) {       \
    m2r::ssu::update_rows<m2r::TS, m2r::TI, m2r::TB, N, true>(p);                           \
  }
#define M2R_SSU_N(SD, TS, ID, TI, BD, TB)                                                            \
  M2R_SSU(SD, TS, ID, TI, BD, TB, 32) M2R_SSU(SD, TS, ID, TI, BD, TB, 64)                           \
  M2R_SSU(SD, TS, ID, TI, BD, TB, 128) M2R_SSU(SD, TS, ID, TI, BD, TB, 256)                         \
  M2R_SSU_CONTIG(SD, TS, ID, TI, BD, TB, 32) M2R_SSU_CONTIG(SD, TS, ID, TI, BD, TB, 64)             \
  M2R_SSU_CONTIG(SD, TS, ID, TI, BD, TB, 128)
#define M2R_SSU_STATE(SD, TS)                                                                        \
  M2R_SSU_N(SD, TS, f32, F32, , F32) M2R_SSU_N(SD, TS, f16, F16, , F16)                             \
  M2R_SSU_N(SD, TS, bf16, BF16, , BF16) M2R_SSU_N(SD, TS, f16, F16, _f32bcz, F32)                   \
  M2R_SSU_N(SD, TS, bf16, BF16, _f32bcz, F32)

M2R_SSU_STATE(f32, F32)
M2R_SSU_STATE(f16, F16)
M2R_SSU_STATE(bf16, BF16)
