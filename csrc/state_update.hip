// selective_state_update: one decode step of the selective SSM, state updated in place.
// Semantics in params.h (SsuParams). Every state access is coalesced and a row's C-weighted sum
// is a butterfly over the lanes that hold it: in the contiguous layout (update_lanes) a row is
// dstate / kVec lanes of 16 bytes each; in any other (update_row) 32 lanes, lane l owning
// elements l, l + 32, ...
#include "platform.h"
#include "state_rows.h"

namespace m2r {
namespace ssu {

// 128 threads a block: 8-9% less time than 256 from batch 16 on (H100, bf16, graph-timed, h64 /
// h128 p64 n128: batch 64 66.9 -> 61.8 us, batch 256 250.6 -> 230.0 / 499.2 -> 457.5 us; 64
// threads fell in between); batch 1 the same
constexpr int kThreads = 128;
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

// The contiguous layout (dstate == kN <= 128, unit dstate strides, 16-byte aligned state rows,
// B / C aligned for their runs; the host checks): a headdim row is kRowLanes lanes, each moving
// 16 bytes of state (kVec elements) in one access, so a wave holds several rows and every state
// access is a full 16-byte one. Each thread takes kRowsPer rows, kRowsPass apart, and requests
// every input of all of them (state, x, dt, dt_bias, A, D, z) before the first is used: one
// memory round trip per thread instead of one per row. kRowsPer = 1 (the _rows kernels)
// spreads small batches over many blocks; kRowsPer = kRowsPerWide (_contig) cuts the per-row
// instructions where the batch fills the GPU. B / C are read once per thread.
// Grid (ceil(headdim / rows_per_block), nheads, batch).
template <typename TS, int kN>
struct LaneMap {
  static constexpr int kVec = 16 / static_cast<int>(sizeof(typename TS::storage));
  static constexpr int kRowLanes = kN / kVec;
  static_assert(kRowLanes >= 1 && kRowLanes <= 32 && kN % kVec == 0, "a row is 1..32 lanes");
  static constexpr int kRowsPass = kThreads / kRowLanes;
};
// Rows per thread of the _contig kernels (mamba2_rocm.kernels.SSU_ROWS_PER_WIDE); the macro is a
// measurement knob (scripts/profile_ssu.py --sweep), the host's grid must be told the same.
#ifndef M2R_SSU_ROWS_PER_WIDE
#define M2R_SSU_ROWS_PER_WIDE 2
#endif
constexpr int kRowsPerWide = M2R_SSU_ROWS_PER_WIDE;
// Offsets within a batch row in 32 bits (the _rows kernels) or 64 (_contig): see update_lanes.
template <bool k32>
struct RowOffset {
  typedef int64_t T;
};
template <>
struct RowOffset<true> {
  typedef int T;
};

template <typename TS, typename TI, typename TB, int kN, int kRowsPer, bool kStd = false>
M2R_DEVICE void update_lanes(const SsuParams& p) {
  typedef typename TS::storage SS;
  typedef typename TI::storage SI;
  typedef typename TB::storage SB;
  typedef LaneMap<TS, kN> Map;
  constexpr int kVec = Map::kVec, kRL = Map::kRowLanes, kPass = Map::kRowsPass;
  // The _rows kernels (kRowsPer 1) take offsets within a batch row in 32 bits: each tensor's
  // base is moved to its batch row (the state's to its pool row) in 64 bits, once, and the host
  // checks that every offset within a row fits (int32_offsets, mamba2_rocm/ops/state_update.py):
  // 64-bit offsets were a third of the kernel's instructions, all before the first load. The
  // _contig kernels keep 64-bit ones: in 32 bits ptxas took 62 registers instead of 56 (8 blocks
  // per multiprocessor instead of 9: batch 64-256 ran 6% slower) and spilled when held to 56.
  typedef typename RowOffset<kRowsPer == 1>::T I;
  // kStd (the _rows_std kernels): a Mamba2 block's parameters, which the host checks: A one value
  // per head (stride 0 over headdim and dstate), A, D and dt_bias float32, dt in x's dtype. Known
  // at compile time, their dtype branches and the per-element A path are gone: 17% off batch 1
  // (H100, 64 heads: 2.93 -> 2.43 us, graph-timed).
  // (the dtype each use names: kStd ? the fixed one : the field; locals holding the fields
  // moved ptxas's schedule of the other kernels)
  constexpr int kF32 = M2R_DTYPE_F32;
  const int lane = static_cast<int>(threadIdx.x) % kRL;
  const I h = blockIdx.y, b = blockIdx.z;
  const I pr0 = static_cast<I>(blockIdx.x) * (kPass * kRowsPer) + static_cast<int>(threadIdx.x) / kRL;
  SI* out = static_cast<SI*>(p.out) + b * p.out_batch_stride + h * static_cast<I>(p.out_h_stride);
  // every lane of the block reaches this with the same b (state_rows.h's rule); the host has
  // m2r_state_rows check large batches first (each wave's search grows with the batch)
  const int64_t row = p.indices_checked
      ? static_cast<const int32_t*>(p.state_indices)[b]
      : checked_state_row(p.state_indices, p.indices_stride, p.indices_int64, p.batch, p.num_states, static_cast<int>(b));
  if (row < 0) {  // -1: padding, zeros; out of the pool or named twice (-2): NaN, loudly
    const float fill = row == -1 ? 0.f : __int_as_float(0x7fc00000);
#pragma unroll
    for (int j = 0; j < kRowsPer; ++j) {
      const I pr = pr0 + j * kPass;
      if (lane == 0 && pr < p.headdim) out[pr * static_cast<I>(p.out_p_stride)] = TI::from_float(fill);
    }
    return;
  }
  const I g = h / p.heads_per_group;
  const SB* B = static_cast<const SB*>(p.B) + b * p.B_batch_stride + (g * static_cast<I>(p.B_g_stride) + lane * kVec);
  const SB* C = static_cast<const SB*>(p.C) + b * p.C_batch_stride + (g * static_cast<I>(p.C_g_stride) + lane * kVec);
  SS* st = static_cast<SS*>(p.state) + row * p.state_batch_stride + (h * static_cast<I>(p.state_h_stride) + lane * kVec);
  const bool a_tied = kStd || (p.A_p_stride == 0 && p.A_n_stride == 0);  // Mamba2: one A per head

  // every load of every row first, raw (load_bits): the conversions wait for them all at once
  Chunk<SB, kVec> bv, cv;
  bv.load(B);
  cv.load(C);
  Chunk<SS, kVec> s_old[kRowsPer];
  uint32_t dt_r[kRowsPer], bias_r[kRowsPer], d_r[kRowsPer], a_r[kRowsPer];
  SI x_r[kRowsPer];
  SB z_r[kRowsPer];
#pragma unroll
  for (int j = 0; j < kRowsPer; ++j) {
    const I pr = pr0 + j * kPass;
    const bool live = pr < p.headdim;
    const I prc = live ? pr : 0;  // rows past headdim read row 0 and write nothing
    s_old[j].load(st + prc * static_cast<I>(p.state_p_stride));
    dt_r[j] = load_bits(p.dt, kStd ? TI::kDType : p.dt_dtype, b * p.dt_batch_stride + (h * static_cast<I>(p.dt_h_stride) + prc * static_cast<I>(p.dt_p_stride)));
    bias_r[j] = p.dt_bias ? load_bits(p.dt_bias, kStd ? kF32 : p.dt_bias_dtype, h * static_cast<I>(p.dt_bias_h_stride) + prc * static_cast<I>(p.dt_bias_p_stride)) : 0u;
    x_r[j] = static_cast<const SI*>(p.x)[b * p.x_batch_stride + (h * static_cast<I>(p.x_h_stride) + prc * static_cast<I>(p.x_p_stride))];
    d_r[j] = p.D ? load_bits(p.D, kStd ? kF32 : p.d_dtype, h * static_cast<I>(p.D_h_stride) + prc * static_cast<I>(p.D_p_stride)) : 0u;
    a_r[j] = a_tied ? load_bits(p.A, kStd ? kF32 : p.a_dtype, h * static_cast<I>(p.A_h_stride)) : 0u;
    // (last: LLVM converts z inside its branch, where the thread waits for it)
    z_r[j] = p.z ? static_cast<const SB*>(p.z)[b * p.z_batch_stride + (h * static_cast<I>(p.z_h_stride) + prc * static_cast<I>(p.z_p_stride))] : SB{};
  }
  float dt[kRowsPer], x[kRowsPer], d[kRowsPer], zg[kRowsPer], a[kRowsPer];
#pragma unroll
  for (int j = 0; j < kRowsPer; ++j) {
    dt[j] = bits_to_float(dt_r[j], kStd ? TI::kDType : p.dt_dtype);
    if (p.dt_bias) dt[j] += bits_to_float(bias_r[j], kStd ? kF32 : p.dt_bias_dtype);
    x[j] = TI::to_float(x_r[j]);
    d[j] = p.D ? bits_to_float(d_r[j], kStd ? kF32 : p.d_dtype) : 0.f;
    zg[j] = p.z ? TB::to_float(z_r[j]) : 0.f;
    a[j] = a_tied ? bits_to_float(a_r[j], kStd ? kF32 : p.a_dtype) : 0.f;
  }

  float acc[kRowsPer];
#pragma unroll
  for (int j = 0; j < kRowsPer; ++j) {
    const I pr = pr0 + j * kPass;
    const float dtj = p.dt_softplus ? softplus(dt[j]) : dt[j];
    const float dtx = dtj * x[j];
    const float da_tied = __expf(a[j] * dtj);
    // A per element (unit dstate stride, host-checked): read here, not ahead, so the tied case
    // (Mamba2's, one A per head) holds one register per row instead of kVec
    const I a_row = h * static_cast<I>(p.A_h_stride) + (pr < p.headdim ? pr : 0) * static_cast<I>(p.A_p_stride) + lane * kVec;
    Chunk<SS, kVec> s_new;
    acc[j] = 0.f;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const float da = a_tied ? da_tied : __expf(load_as_float(p.A, kStd ? kF32 : p.a_dtype, a_row + i) * dtj);
      const float s = fmaf(TS::to_float(s_old[j].get(i)), da, TB::to_float(bv.get(i)) * dtx);
      acc[j] = fmaf(s, TB::to_float(cv.get(i)), acc[j]);
      s_new.set(i, TS::from_float(s));
    }
    if (pr < p.headdim) s_new.store(st + pr * static_cast<I>(p.state_p_stride));
  }
#pragma unroll
  for (int off = kRL / 2; off > 0; off /= 2) {
#pragma unroll
    for (int j = 0; j < kRowsPer; ++j) acc[j] += shfl_xor_width(acc[j], off, kRL);
  }
#pragma unroll
  for (int j = 0; j < kRowsPer; ++j) {
    const I pr = pr0 + j * kPass;
    if (lane == 0 && pr < p.headdim) {
      float y = p.D ? fmaf(d[j], x[j], acc[j]) : acc[j];
      if (p.z) y *= silu(zg[j]);
      out[pr * static_cast<I>(p.out_p_stride)] = TI::from_float(y);
    }
  }
}

// The general path (any strides, any dstate): one headdim row per 32-lane group, lane l owning
// elements l, l+32, ...; grid (ceil(headdim / kGroups), nheads, batch). No row loop: with
// one, AMD's compiler hoisted the per-element offsets into scalar registers and spilled them.
// D and z are requested with the other inputs, not after the reduction (a second round trip).
template <typename TS, typename TI, typename TB, int kN>  // state, x, B/C/z types
M2R_DEVICE void update_row(const SsuParams& p, int64_t b, int64_t h, int64_t pr, int lane) {
  typedef typename TS::storage SS;
  typedef typename TI::storage SI;
  typedef typename TB::storage SB;
  constexpr int kPer = kN >= kLanes ? kN / kLanes : 1;
  SI* out = static_cast<SI*>(p.out) + b * p.out_batch_stride + h * p.out_h_stride + pr * p.out_p_stride;
  // The general kernels read rows m2r_state_rows checked (int32, -2 for a bad one): the check
  // inside them spilled 16-56 scalar registers on every CDNA and RDNA2 target (hipcc 7.0.2).
  const int64_t row = p.state_indices ? static_cast<const int32_t*>(p.state_indices)[b] : b;
  if (row < 0 || row >= p.num_states) {  // -1: padding, zeros; -2: NaN
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
  float a_v[kPer] = {};
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
  float dt = load_as_float(p.dt, p.dt_dtype, b * p.dt_batch_stride + h * p.dt_h_stride + pr * p.dt_p_stride);
  if (p.dt_bias) dt += load_as_float(p.dt_bias, p.dt_bias_dtype, h * p.dt_bias_h_stride + pr * p.dt_bias_p_stride);
  const float x = TI::to_float(static_cast<const SI*>(p.x)[b * p.x_batch_stride + h * p.x_h_stride + pr * p.x_p_stride]);
  const float d = p.D ? load_as_float(p.D, p.d_dtype, h * p.D_h_stride + pr * p.D_p_stride) : 0.f;
  const float zg = p.z ? TB::to_float(static_cast<const SB*>(p.z)[b * p.z_batch_stride + h * p.z_h_stride + pr * p.z_p_stride]) : 0.f;
  if (p.dt_softplus) dt = softplus(dt);
  const float dtx = dt * x;

  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int n = lane + i * kLanes;
    if (n >= p.dstate) continue;
    const float s = TS::to_float(s_old.get(i)) * __expf(a_v[i] * dt) + TB::to_float(b_v.get(i)) * dtx;
    acc = fmaf(s, TB::to_float(c_v.get(i)), acc);
    st[n * p.state_n_stride] = TS::from_float(s);
  }
#pragma unroll
  for (int off = kLanes / 2; off > 0; off /= 2) acc += shfl_xor_width(acc, off, kLanes);
  if (lane == 0) {
    float y = p.D ? fmaf(d, x, acc) : acc;
    if (p.z) y *= silu(zg);
    *out = TI::from_float(y);
  }
}

template <typename TS, typename TI, typename TB, int kN>
M2R_DEVICE void update_rows(const SsuParams& p) {
  const int64_t pr = static_cast<int64_t>(blockIdx.x) * kGroups + threadIdx.x / kLanes;
  if (pr < p.headdim) update_row<TS, TI, TB, kN>(p, blockIdx.z, blockIdx.y, pr, threadIdx.x % kLanes);
}

}  // namespace ssu
}  // namespace m2r

// m2r_ssu_<state dtype>_<input dtype>[_f32bcz]_n<max dstate>[_contig|_rows|_rows_std]: the
// general kernel, and the contiguous layout's kernels with kRowsPerWide rows per thread
// (_contig) or one (_rows; _rows_std for a Mamba2 block's parameters, see update_lanes).
// B, C and z are read in the input dtype, or with _f32bcz (16-bit inputs only) in float32:
// mamba_ssm callers pass float32 B / C / z with half x, and mamba_ssm reads them unrounded.
#define M2R_SSU(SD, TS, ID, TI, BD, TB, N)                                                  \
  M2R_KERNEL(m2r::ssu::kThreads) m2r_ssu_##SD##_##ID##BD##_n##N(SsuParams p) {             \
    m2r::ssu::update_rows<m2r::TS, m2r::TI, m2r::TB, N>(p);                                 \
  }
// The contiguous-layout kernels, up to dstate 128 for every state dtype (256: below).
#define M2R_SSU_CONTIG(SD, TS, ID, TI, BD, TB, N)                                                        \
  M2R_KERNEL(m2r::ssu::kThreads) m2r_ssu_##SD##_##ID##BD##_n##N##_contig(SsuParams p) {                  \
    m2r::ssu::update_lanes<m2r::TS, m2r::TI, m2r::TB, N, m2r::ssu::kRowsPerWide>(p);                     \
  }                                                                                                      \
  M2R_KERNEL(m2r::ssu::kThreads) m2r_ssu_##SD##_##ID##BD##_n##N##_rows(SsuParams p) {                    \
    m2r::ssu::update_lanes<m2r::TS, m2r::TI, m2r::TB, N, 1>(p);                                          \
  }                                                                                                      \
  M2R_KERNEL(m2r::ssu::kThreads) m2r_ssu_##SD##_##ID##BD##_n##N##_rows_std(SsuParams p) {                \
    m2r::ssu::update_lanes<m2r::TS, m2r::TI, m2r::TB, N, 1, true>(p);                                    \
  }
#define M2R_SSU_N(SD, TS, ID, TI, BD, TB)                                                            \
  M2R_SSU(SD, TS, ID, TI, BD, TB, 32) M2R_SSU(SD, TS, ID, TI, BD, TB, 64)                           \
  M2R_SSU(SD, TS, ID, TI, BD, TB, 128) M2R_SSU(SD, TS, ID, TI, BD, TB, 256)                         \
  M2R_SSU_CONTIG(SD, TS, ID, TI, BD, TB, 32) M2R_SSU_CONTIG(SD, TS, ID, TI, BD, TB, 64)             \
  M2R_SSU_CONTIG(SD, TS, ID, TI, BD, TB, 128)
// Every input combination of state dtype SD (x's dtype; B, C, z in it or, _f32bcz, in float32),
// each given to X(SD, TS, ID, TI, BD, TB)
#define M2R_SSU_INPUTS(X, SD, TS)                                                                    \
  X(SD, TS, f32, F32, , F32) X(SD, TS, f16, F16, , F16) X(SD, TS, bf16, BF16, , BF16)              \
  X(SD, TS, f16, F16, _f32bcz, F32) X(SD, TS, bf16, BF16, _f32bcz, F32)
#define M2R_SSU_CONTIG_N256(SD, TS, ID, TI, BD, TB) M2R_SSU_CONTIG(SD, TS, ID, TI, BD, TB, 256)

M2R_SSU_INPUTS(M2R_SSU_N, f32, F32)
M2R_SSU_INPUTS(M2R_SSU_N, f16, F16)
M2R_SSU_INPUTS(M2R_SSU_N, bf16, BF16)
// dstate 256 in the contiguous layout: 16-bit states only (a row's 32 lanes of 16 bytes; float32
// would take 64: mamba2_rocm.kernels.SSU_CONTIG_MAX_DSTATE)
M2R_SSU_INPUTS(M2R_SSU_CONTIG_N256, f16, F16)
M2R_SSU_INPUTS(M2R_SSU_CONTIG_N256, bf16, BF16)
