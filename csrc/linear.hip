// The linear layers of a decode step: y (rows, out) = x (rows, in) weight (out, in)^T + bias,
// for a few rows (a small decode batch). Semantics in params.h (LinearParams).
//
// At a few rows a linear layer is a read of its weight (rows * in multiply-adds per weight
// element, far below any matrix unit's need), so the kernel is a streaming read: every weight
// element is loaded once, 16 bytes a load, with kU * kR loads in flight per thread, and meets the
// rows of x (small, re-read from the cache) in float32 registers.
//
// Work split: a block of kThreads threads is 256 / group_threads groups (host: 64, 128 or 256
// threads, whole 64-thread steps on wave32 and wave64 alike); a group owns kR consecutive output
// features and walks their weight rows together, thread t of the group taking the 16-byte
// vectors t, t + group_threads, ... of each. The group's sums are a butterfly in each
// wavefront, then the group's wavefronts' sums added in order through LDS (a fixed order: the
// same result on every run). The host picks group_threads so the grid fills the GPU (small
// `out` layers get more threads a feature).
//
// m2r_linear_<dt>_m<kM>_r<kR>_u<kU>: kM rows at most (the host's row tiers); rows past `rows`
// read x's last row and store nothing.
#include "platform.h"
#include "block_reduce.h"

namespace m2r {
namespace linear {

constexpr int kThreads = 256;
constexpr int kWaves = kThreads / kWavefront;

// the 16-byte vector q of T as floats
template <typename T>
M2R_DEVICE void unpack_vec(const uint4& q, float (&v)[16 / sizeof(typename T::storage)]) {
  if constexpr (sizeof(typename T::storage) == 4) {
    v[0] = __uint_as_float(q.x), v[1] = __uint_as_float(q.y);
    v[2] = __uint_as_float(q.z), v[3] = __uint_as_float(q.w);
  } else {
    unpack8<T>(q, v);
  }
}

constexpr int kMaxConv = 4;  // the _conv kernels' largest conv_width and state_len

// Feature n's output s (as float, already rounded to T) as channel c's new token of a causal
// conv1d decode step on row m's conv state (params.h): the state shifted in place, the conv
// output returned. One thread owns the channel: no other thread touches its state.
template <typename T>
M2R_DEVICE float conv_step(const LinearParams& p, int m, int c, float s) {
  typedef typename T::storage S;
  S* st = static_cast<S*>(p.conv_state) + m * p.state_batch_stride + c * p.state_c_stride;
  const int len = p.state_len, width = p.conv_width;
  float old[kMaxConv];  // the whole state first: its reads come before any of its writes
#pragma unroll
  for (int k = 0; k < kMaxConv; ++k) old[k] = k < len ? T::to_float(st[k * p.state_l_stride]) : 0.f;
  const S* w = static_cast<const S*>(p.conv_weight) + c * p.conv_weight_c_stride;
  float acc = p.conv_bias ? T::to_float(static_cast<const S*>(p.conv_bias)[c]) : 0.f;
#pragma unroll
  for (int k = 0; k < kMaxConv; ++k) {  // window[k]: old[len - width + 1 + k], the token last
    if (k >= width) break;
    const int j = len - width + 1 + k;  // (selected, not indexed: old stays in registers)
    float v = s;
#pragma unroll
    for (int q = 0; q < kMaxConv; ++q)
      if (k < width - 1 && q == j) v = old[q];
    acc = fmaf(T::to_float(w[k]), v, acc);
  }
#pragma unroll
  for (int k = 0; k < kMaxConv; ++k) {
    if (k >= len) break;
    st[k * p.state_l_stride] = T::from_float(k == len - 1 ? s : old[k + 1]);
  }
  return p.conv_silu ? silu(acc) : acc;
}

template <typename T, int kM, int kR, int kU, bool kConv = false>
M2R_DEVICE void linear(const LinearParams& p) {
  typedef typename T::storage S;
  constexpr int kPer = 16 / sizeof(S);  // elements a vector
  constexpr int kOut = kM * kR;
  __shared__ float partial[kWaves][kOut];
  const int tpg = p.group_threads;
  const int local = static_cast<int>(threadIdx.x) % tpg;
  const int group = static_cast<int>(threadIdx.x) / tpg;
  const int n0 = (static_cast<int>(blockIdx.x) * (kThreads / tpg) + group) * kR;
  const int nv = p.in_features / kPer;
  const uint4* w = static_cast<const uint4*>(p.weight);
  const uint4* x = static_cast<const uint4*>(p.x);
  const int64_t xs = p.x_row_stride / kPer;
  // rows past the ends compute on the last row and are not stored (no predicate in the loop)
  int64_t wrow[kR], xrow[kM];
#pragma unroll
  for (int r = 0; r < kR; ++r) wrow[r] = static_cast<int64_t>(min(n0 + r, p.out_features - 1)) * nv;
#pragma unroll
  for (int m = 0; m < kM; ++m) xrow[m] = min(m, p.rows - 1) * xs;
  float acc[kOut];
#pragma unroll
  for (int i = 0; i < kOut; ++i) acc[i] = 0.f;

  for (int v0 = local; v0 < nv; v0 += tpg * kU) {
    uint4 wq[kU][kR];  // every load of the step first: kU * kR requests in flight
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int v = v0 + u * tpg;
#pragma unroll
      for (int r = 0; r < kR; ++r) wq[u][r] = v < nv ? w[wrow[r] + v] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int v = v0 + u * tpg;
      if (v >= nv) break;
      float wf[kR][kPer];
#pragma unroll
      for (int r = 0; r < kR; ++r) unpack_vec<T>(wq[u][r], wf[r]);
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        float xf[kPer];
        unpack_vec<T>(x[xrow[m] + v], xf);
#pragma unroll
        for (int r = 0; r < kR; ++r)
#pragma unroll
          for (int e = 0; e < kPer; ++e) acc[m * kR + r] = fmaf(xf[e], wf[r][e], acc[m * kR + r]);
      }
    }
  }

  wave_sums(acc);
  const int wave = static_cast<int>(threadIdx.x) / kWavefront, lane = static_cast<int>(threadIdx.x) % kWavefront;
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < kOut; ++i) partial[wave][i] = acc[i];
  }
  __syncthreads();
  // the group's first kOut threads: one output each, the group's waves added in order
  const int i = local;
  if (i >= kOut) return;
  const int m = i / kR, r = i % kR, n = n0 + r;
  if (m >= p.rows || n >= p.out_features) return;
  const int first = group * tpg / kWavefront, waves = tpg < kWavefront ? 1 : tpg / kWavefront;
  float s = 0.f;
  for (int k = 0; k < waves; ++k) s += partial[first + k][i];
  if (p.bias) s += T::to_float(static_cast<const S*>(p.bias)[n]);
  if constexpr (kConv) {
    const int c = n - p.conv_start;
    if (c >= 0 && c < p.conv_channels) s = conv_step<T>(p, m, c, T::to_float(T::from_float(s)));
  }
  static_cast<S*>(p.y)[m * p.y_row_stride + n] = T::from_float(s);
}

// ---- prefetch ------------------------------------------------------------------------------
// m2r_linear_prefetch: one 4-byte word of each 32-byte sector of `weight`'s first in_features
// sectors is read, so that the sectors sit in the GPU's cache (NVIDIA's L2; AMD's L2 and
// Infinity Cache) when the layer's own kernel reads them. A decode step's small kernels (the
// scan step, the norms) leave the memory bus idle for microseconds; a prefetch running beside
// them on another stream fills that time with the next projection's weight. The loads' values
// are folded into one word that is stored to y only when rows < 0, which the host never sets:
// the loads cannot be dropped, and nothing is written. A grid-stride walk, kPrefetchLoads
// sectors a thread in flight.
constexpr int kPrefetchLoads = 16;
constexpr int kSectorBytes = 32;  // ops/linear.py: _SECTOR

M2R_DEVICE void prefetch(const LinearParams& p) {
  const uint32_t* words = static_cast<const uint32_t*>(p.weight);
  const int64_t sectors = p.in_features;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  uint32_t acc = 0u;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < sectors;
       i += kPrefetchLoads * stride) {
    uint32_t v[kPrefetchLoads];
#pragma unroll
    for (int k = 0; k < kPrefetchLoads; ++k) {
      const int64_t j = i + k * stride;
      v[k] = j < sectors ? words[j * (kSectorBytes / 4)] : 0u;
    }
#pragma unroll
    for (int k = 0; k < kPrefetchLoads; ++k) acc ^= v[k];
  }
  if (p.rows < 0) static_cast<uint32_t*>(p.y)[0] = acc;
}

}  // namespace linear
}  // namespace m2r

M2R_KERNEL(m2r::linear::kThreads) m2r_linear_prefetch(LinearParams p) { m2r::linear::prefetch(p); }

// each form plain and with the conv step (_conv)
#define M2R_LINEAR(DT, T, M, R, U)                                                          \
  M2R_KERNEL(m2r::linear::kThreads) m2r_linear_##DT##_m##M##_r##R##_u##U(LinearParams p) {      \
    m2r::linear::linear<m2r::T, M, R, U>(p);                                               \
  }                                                                                        \
  M2R_KERNEL(m2r::linear::kThreads) m2r_linear_##DT##_m##M##_r##R##_u##U##_conv(LinearParams p) { \
    m2r::linear::linear<m2r::T, M, R, U, true>(p);                                         \
  }
#define M2R_LINEAR_ALL(M, R, U) M2R_LINEAR(f32, F32, M, R, U) M2R_LINEAR(f16, F16, M, R, U) M2R_LINEAR(bf16, BF16, M, R, U)
// the forms of mamba2_rocm/kernels.py: LINEAR_FORMS
M2R_LINEAR_ALL(1, 4, 2)
M2R_LINEAR_ALL(2, 2, 4)
#ifdef M2R_LINEAR_EXPLORE  // other forms, for measuring them (not in the kernel table)
M2R_LINEAR_ALL(1, 1, 4) M2R_LINEAR_ALL(1, 2, 4) M2R_LINEAR_ALL(2, 4, 2) M2R_LINEAR_ALL(2, 1, 4)
M2R_LINEAR_ALL(4, 2, 4) M2R_LINEAR_ALL(4, 4, 2) M2R_LINEAR_ALL(8, 2, 2) M2R_LINEAR_ALL(8, 4, 2)
#endif
