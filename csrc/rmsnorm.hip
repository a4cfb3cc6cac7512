// Gated RMSNorm and LayerNorm (mamba_ssm's layernorm_gated.rmsnorm_fn / layernorm_fn), forward.
// Semantics in params.h; p.layer_norm subtracts each group's mean before the variance.
//
// Two forms, chosen by the host (mamba2_rocm/ops/rmsnorm.py):
//  - register-resident (m2r_rmsnorm_fwd_<dt>_v<kVecs>[_ga], kVecs 1-4), when group_size is a multiple of 8,
//    at most 8 * kThreads * 4, and every row and the weight/bias are 16-byte aligned: item_threads
//    threads (a power of two) own one (row, group), each holding kVecs runs of 8 elements of x
//    (and the raw z) in registers, so x and z are read once, 16 bytes per load. The sum of
//    squares is reduced by butterfly within the wavefront and through LDS across wavefronts.
//    Several (row, group) items share a block when the group is small. grid (items / block, 1, 1).
//  - generic (m2r_rmsnorm_fwd_<dt>): any group size and alignment; one block per (row, group)
//    reads x twice, element by element. grid (hidden / group_size, rows).
#include "platform.h"
#include "block_reduce.h"

namespace m2r {
namespace rmsnorm {

constexpr int kThreads = 256;
constexpr int kWaves = kThreads / kWavefront;

// The sum of v over one item's tpi threads (aligned runs of tpi lanes; tpi a power of two);
// partial as in block_sum (block_reduce.h), used only when an item spans wavefronts (uniform over the block).
// Both loops run a constant trip count with a uniform predicate instead of a run-time bound:
// ncu counted the run-time loops' branches and index updates as a third of the kernel's
// instructions (the same sums, in the same order).
// kTpi: tpi fixed at compile time -- kThreads (the _b kernels: the item is the whole block) or
// kThreads / 2 (_h: two items a block) -- or 0 (tpi at run time). The fixed forms have no
// per-item predicates, and no second barrier when the caller sums once (kOnce).
template <int kTpi, bool kOnce>
M2R_DEVICE float item_sum(float v, int tpi, float* partial) {
  static_assert(kTpi == 0 || kTpi == kThreads || kTpi == kThreads / 2, "tpi fixed at a block or half");
  // butterflies stay inside aligned runs of min(tpi, wavefront) lanes: one item's
#pragma unroll
  for (int off = kWavefront / 2; off > 0; off /= 2)
    if (kTpi != 0 || off < tpi) v += shfl_xor(v, off);  // (uniform over the wave)
  if constexpr (kTpi != 0) {
    // the item's waves: all of them, or the half of the block this thread is in
    constexpr int kPer = kTpi / kWavefront;
    const int first = kTpi == kThreads ? 0 : static_cast<int>(threadIdx.x) / kTpi * kPer;
    if (threadIdx.x % kWavefront == 0) partial[threadIdx.x / kWavefront] = v;
    __syncthreads();
    v = 0.f;
#pragma unroll
    for (int w = 0; w < kPer; ++w) v += partial[first + w];
    if constexpr (!kOnce) __syncthreads();  // before partial is written again
    return v;
  }
  if (tpi > kWavefront) {
    const int wave = threadIdx.x / kWavefront, per_item = tpi / kWavefront;
    if (threadIdx.x % kWavefront == 0) partial[wave] = v;
    __syncthreads();
    const int first = wave - wave % per_item;
    v = 0.f;
#pragma unroll
    for (int w = 0; w < kWaves; ++w)
      if (w >= first && w < first + per_item) v += partial[w];
    __syncthreads();
  }
  return v;
}

template <typename T>
M2R_DEVICE void forward(const RmsNormParams& p) {
  typedef typename T::storage S;
  __shared__ float partial[kWaves];
  const int tid = threadIdx.x;
  const int64_t row = blockIdx.y;
  const int64_t start = static_cast<int64_t>(blockIdx.x) * p.group_size;
  const S* x = static_cast<const S*>(p.x) + row * p.x_row_stride + start;
  const S* z = p.z ? static_cast<const S*>(p.z) + row * p.z_row_stride + start : nullptr;
  const bool gate_first = z != nullptr && !p.norm_before_gate;

  // LayerNorm: the mean first, then the variance around it (two passes over x, as accurate as
  // the register-resident form); RMSNorm: mean 0
  float mean = 0.f;
  if (p.layer_norm) {
    float sum = 0.f;
    for (int i = tid; i < p.group_size; i += kThreads) {
      float v = T::to_float(x[i]);
      if (gate_first) v *= silu(T::to_float(z[i]));
      sum += v;
    }
    mean = block_sum<kThreads>(sum, partial) / static_cast<float>(p.group_size);
  }
  float ss = 0.f;
  for (int i = tid; i < p.group_size; i += kThreads) {
    float v = T::to_float(x[i]);
    if (gate_first) v *= silu(T::to_float(z[i]));
    v -= mean;
    ss = fmaf(v, v, ss);
  }
  const float rstd = rsqrtf(block_sum<kThreads>(ss, partial) / static_cast<float>(p.group_size) + p.eps);

  S* out = static_cast<S*>(p.out) + row * p.out_row_stride + start;
  for (int i = tid; i < p.group_size; i += kThreads) {
    float v = T::to_float(x[i]);
    if (gate_first) v *= silu(T::to_float(z[i]));
    float y = (v - mean) * rstd * load_as_float(p.weight, p.weight_dtype, start + i);
    if (p.bias) y += load_as_float(p.bias, p.bias_dtype, start + i);
    if (z != nullptr && p.norm_before_gate) y *= silu(T::to_float(z[i]));
    out[i] = T::from_float(y);
  }
}

// p[i .. i + 8) of a weight or bias whose dtype is a run-time parameter; 16-byte aligned
M2R_DEVICE void load8_as_float(const void* p, int dtype, int64_t i, float (&v)[8]) {
  if (dtype == M2R_DTYPE_F32) {
    const float4* q = reinterpret_cast<const float4*>(static_cast<const float*>(p) + i);
    const float4 a = q[0], b = q[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
    const uint4 q = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p) + i);
    if (dtype == M2R_DTYPE_F16) unpack8<F16>(q, v);
    else unpack8<BF16>(q, v);
  }
}

// kGateAfter: the z gate multiplies the output (z given, norm_before_gate): z's raw runs stay
// in registers until then; the other kernels keep none (Mamba2's gate comes first).
// kTpi: threads per item fixed at compile time (the host's _b: kThreads, _h: kThreads / 2), or 0.
template <typename T, int kVecs, bool kGateAfter, int kTpi>
M2R_DEVICE void forward_vec(const RmsNormParams& p) {
  typedef typename T::storage S;
  static_assert(sizeof(S) == 2, "16-bit element types");
  __shared__ float partial[kWaves];
  const int tpi = kTpi ? kTpi : p.item_threads, local = threadIdx.x % tpi, gs = p.group_size;
  // items (row, group) in 32 bits (the host checks rows * groups < 2^31): a 64-bit division
  // is a long instruction sequence ahead of every thread's first load
  const int groups = p.hidden / gs;
  const int item = static_cast<int>(blockIdx.x) * (kThreads / tpi) + static_cast<int>(threadIdx.x) / tpi;
  const bool active = item < p.rows * groups;
  // one group per row (every Mamba2 checkpoint): no division at all
  const int row_i = !active ? 0 : groups == 1 ? item : item / groups;
  const int64_t row = row_i;
  const int start = !active || groups == 1 ? 0 : (item - row_i * groups) * gs;
  const S* x = static_cast<const S*>(p.x) + row * p.x_row_stride + start;
  const S* z = p.z ? static_cast<const S*>(p.z) + row * p.z_row_stride + start : nullptr;
  const bool gate_first = z != nullptr && !p.norm_before_gate;

  // From 2 runs a thread a 16-bit weight (a Mamba2 block's, in the activations' dtype) is
  // requested with x and z, as raw runs (4 registers a run), and converted after the
  // reduction: loaded after it, from L2, it was a second round trip in every item's life, which
  // held the H200 at 80-87% of a copy (16384 rows, bf16: d5120 150 -> 120 us, d3072 87 -> 71,
  // d1536 44.7 -> 38.6, with the host's plan of more runs a thread, vec_plan). One run a thread
  // (a decode step's plan, latency-bound) keeps the late load: early it ran the 64-row step in
  // 3.2-3.4 us instead of 2.9-3.0 (H200). An fp32 weight always loads after the reduction: 8
  // registers a run held from the start (v1 40 registers, v3 96, v4 117 on sm_90) cost more
  // occupancy than the round trip (H100).
  float v[kVecs][8];
  uint4 zq[kGateAfter ? kVecs : 1];
  const bool w16 = kVecs > 1 && p.weight_dtype != M2R_DTYPE_F32;
  uint4 wq[kVecs];
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int i = 8 * (local + k * tpi);
    const bool in = active && i < gs;
    const uint4 xq = in ? *reinterpret_cast<const uint4*>(x + i) : make_uint4(0, 0, 0, 0);
    const uint4 zk = in && z ? *reinterpret_cast<const uint4*>(z + i) : make_uint4(0, 0, 0, 0);
    wq[k] = in && w16 ? *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.weight) + start + i) : make_uint4(0, 0, 0, 0);
    if constexpr (kGateAfter) zq[k] = zk;
    unpack8<T>(xq, v[k]);
    if (gate_first) {
      float zv[8];
      unpack8<T>(zk, zv);
#pragma unroll
      for (int e = 0; e < 8; ++e) v[k][e] *= silu(zv[e]);
    }
  }
  // LayerNorm: subtract the item's mean (out-of-range runs hold zeros and stay out of the sums)
  if (p.layer_norm) {
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < kVecs; ++k)
#pragma unroll
      for (int e = 0; e < 8; ++e) sum += v[k][e];
    const float mean = item_sum<kTpi, false>(sum, tpi, partial) / static_cast<float>(gs);
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const bool in = active && 8 * (local + k * tpi) < gs;
#pragma unroll
      for (int e = 0; e < 8; ++e) v[k][e] = in ? v[k][e] - mean : 0.f;
    }
  }
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < kVecs; ++k)
#pragma unroll
    for (int e = 0; e < 8; ++e) ss = fmaf(v[k][e], v[k][e], ss);
  const float rstd = rsqrtf(item_sum<kTpi, true>(ss, tpi, partial) / static_cast<float>(gs) + p.eps);

  S* out = static_cast<S*>(p.out) + row * p.out_row_stride + start;
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int i = 8 * (local + k * tpi);
    if (!active || i >= gs) continue;
    float y[8];
    if (w16) {
      if (p.weight_dtype == M2R_DTYPE_F16) unpack8<F16>(wq[k], y);
      else unpack8<BF16>(wq[k], y);
    } else {
      load8_as_float(p.weight, p.weight_dtype, start + i, y);
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) y[e] *= v[k][e] * rstd;
    if (p.bias) {
      float b[8];
      load8_as_float(p.bias, p.bias_dtype, start + i, b);
#pragma unroll
      for (int e = 0; e < 8; ++e) y[e] += b[e];
    }
    if constexpr (kGateAfter) {
      float zv[8];
      unpack8<T>(zq[k], zv);
#pragma unroll
      for (int e = 0; e < 8; ++e) y[e] *= silu(zv[e]);
    }
    *reinterpret_cast<uint4*>(out + i) = make_uint4(T::pack(y), T::pack(y + 2), T::pack(y + 4), T::pack(y + 6));
  }
}

}  // namespace rmsnorm
}  // namespace m2r

#define M2R_RMSNORM(DT, T)                                                                   \
  M2R_KERNEL(m2r::rmsnorm::kThreads) m2r_rmsnorm_fwd_##DT(RmsNormParams p) {                \
    m2r::rmsnorm::forward<m2r::T>(p);                                                         \
  }
// m2r_rmsnorm_fwd_<dt>_v<V>[_ga][_b|_h]: V runs per thread; _ga: the gate after the norm; _b /
// _h: one item a block / two. NB: blocks per SM the NVIDIA build is held to (a register cap; AMD
// ignores it); 1: none. The v2-v4 kernels hold what they need (on sm_90, bf16: v2 52-56, v3 64,
// v4 77-80 registers, the _ga forms up to 96): the caps they had (6 / 5 / 4 blocks a
// multiprocessor, the most without spills, for one run a thread on the H100) cost the H200 4-12%
// at the plans it now takes (vec_plan: up to 4 runs a thread; 16384 rows, bf16: d5120 153.7 ->
// 120.2 us, d4096 at 128 x 4 109.7 -> 94.0, d8192 in groups of 1024 at 32 x 4 222.3 -> 188.5,
// each with the weight requested early). v1 keeps its cap (8 blocks, 6 with the gate after): the
// code a decode step runs, unchanged.
#define M2R_RMSNORM_VEC1(DT, T, V, NB, GA, TPI, SUFFIX)                                                     \
  M2R_KERNEL_MIN_BLOCKS(m2r::rmsnorm::kThreads, NB) m2r_rmsnorm_fwd_##DT##_v##V##SUFFIX(RmsNormParams p) { \
    m2r::rmsnorm::forward_vec<m2r::T, V, GA, TPI>(p);                                                       \
  }
// each with _b / _h: item_threads fixed at kThreads / kThreads / 2
#define M2R_RMSNORM_VEC(DT, T, V, NB, GA, SUFFIX)                           \
  M2R_RMSNORM_VEC1(DT, T, V, NB, GA, 0, SUFFIX)                             \
  M2R_RMSNORM_VEC1(DT, T, V, NB, GA, m2r::rmsnorm::kThreads, SUFFIX##_b)    \
  M2R_RMSNORM_VEC1(DT, T, V, NB, GA, m2r::rmsnorm::kThreads / 2, SUFFIX##_h)
#define M2R_RMSNORM_VECS(DT, T)                                                                 \
  M2R_RMSNORM_VEC(DT, T, 1, 8, false, ) M2R_RMSNORM_VEC(DT, T, 2, 1, false, )                   \
  M2R_RMSNORM_VEC(DT, T, 3, 1, false, ) M2R_RMSNORM_VEC(DT, T, 4, 1, false, )                   \
  M2R_RMSNORM_VEC(DT, T, 1, 6, true, _ga) M2R_RMSNORM_VEC(DT, T, 2, 1, true, _ga)               \
  M2R_RMSNORM_VEC(DT, T, 3, 1, true, _ga) M2R_RMSNORM_VEC(DT, T, 4, 1, true, _ga)
M2R_RMSNORM(f32, F32)
M2R_RMSNORM(f16, F16)
M2R_RMSNORM(bf16, BF16)
M2R_RMSNORM_VECS(f16, F16)
M2R_RMSNORM_VECS(bf16, BF16)
