// Fused residual add + LayerNorm / RMSNorm (mamba_ssm's ops.triton.layer_norm: layer_norm_fn,
// rms_norm_fn), forward and backward. Semantics in params.h (AddNormParams).
//
// A block owns whole rows. Two forms of each direction, chosen by the host
// (mamba2_rocm/ops/add_norm.py):
//  - register-resident (m2r_add_norm_{fwd,bwd}_<dt>_r<kRuns>): hidden % 4 == 0 and every tensor
//    16-byte aligned; blockDim.x threads (a multiple of 64, at most kThreads) each hold kRuns
//    runs of 4 consecutive elements of a row, so every input is read once, 8 or 16 bytes per
//    load. The forward's grid is (rows, 1, 1); the backward's (row blocks, 1, 1), each block
//    walking rows_per_block rows with its dweight / dbias sums in registers. The forward's
//    _r<kRuns>_plain kernels take the calls without x1 / weight1, dropout or rowscale (those
//    pointers null at compile time: a shorter path for a decode step's single row).
//  - generic (m2r_add_norm_{fwd,bwd}_<dt>): any hidden and alignment, blockDim.x = kThreads; the
//    stream s is recomputed from the inputs at each pass over the row (the same operations in
//    the same order: the same values), and the backward's column sums live in its own row of
//    partial (a column belongs to one thread of the block: no races).
// m2r_add_norm_bwd_reduce: the partial rows' column sums, grid (ceil(4 * hidden / 16), 1, 1).
#include "platform.h"
#include "block_reduce.h"

namespace m2r {
namespace add_norm {

constexpr int kThreads = 256;
constexpr int kMaxWaves = kThreads / kWavefront;

// The sums of v[0..N) over the block (blockDim.x threads, a multiple of the wavefront), in a
// fixed order: a butterfly in each wavefront, then the wavefronts' sums in order. partial holds
// N * kMaxWaves floats; free again on return (trailing barrier).
template <int N>
M2R_DEVICE void row_sums(float (&v)[N], float* partial) {
  wave_sums(v);
  const int waves = static_cast<int>(blockDim.x) / kWavefront, wave = threadIdx.x / kWavefront;
  if (threadIdx.x % kWavefront == 0) {
#pragma unroll
    for (int k = 0; k < N; ++k) partial[k * kMaxWaves + wave] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < N; ++k) {
    float t = 0.f;
    for (int w = 0; w < waves; ++w) t += partial[k * kMaxWaves + w];
    v[k] = t;
  }
  __syncthreads();
}

// p[i .. i + 4), p of run-time dtype, as raw bits: 16 bytes (fp32), or 8 bytes in .x / .y
// (16-bit types); 16 or 8 bytes aligned. The load is only requested here: nothing waits for it
// until raw4_as_float reads the registers.
M2R_DEVICE uint4 load4_raw(const void* p, int dtype, int64_t i) {
  if (dtype == M2R_DTYPE_F32) return *reinterpret_cast<const uint4*>(static_cast<const float*>(p) + i);
  const uint2 q = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(p) + i);
  return make_uint4(q.x, q.y, 0u, 0u);
}

// load4_raw's bits of run-time dtype as floats
M2R_DEVICE void raw4_as_float(const uint4& q, int dtype, float (&v)[4]) {
  if (dtype == M2R_DTYPE_F32) {
    v[0] = __uint_as_float(q.x), v[1] = __uint_as_float(q.y);
    v[2] = __uint_as_float(q.z), v[3] = __uint_as_float(q.w);
    return;
  }
  const Packed4 w{q.x, q.y};
  if (dtype == M2R_DTYPE_F16) unpack4<F16>(w, v);
  else unpack4<BF16>(w, v);
}

// p[i .. i + 4) as floats, p of run-time dtype; 16 bytes (fp32) or 8 bytes aligned
M2R_DEVICE void load4_as_float(const void* p, int dtype, int64_t i, float (&v)[4]) {
  raw4_as_float(load4_raw(p, dtype, i), dtype, v);
}

// v into p[i .. i + 4), rounded to p's run-time dtype (nearest even)
M2R_DEVICE void store4_as(void* p, int dtype, int64_t i, const float (&v)[4]) {
  if (dtype == M2R_DTYPE_F32) {
    *reinterpret_cast<float4*>(static_cast<float*>(p) + i) = make_float4(v[0], v[1], v[2], v[3]);
    return;
  }
  const Packed4 w = dtype == M2R_DTYPE_F16 ? pack4<F16>(v) : pack4<BF16>(v);
  *reinterpret_cast<uint2*>(static_cast<uint16_t*>(p) + i) = make_uint2(w.lo, w.hi);
}

// v / keep where the mask byte is set, else 0 (torch's masked_fill, then the division)
M2R_DEVICE float dropped(float v, uint32_t mask_byte, float keep) { return mask_byte ? v / keep : 0.f; }

// ---- forward --------------------------------------------------------------------------------

// s at element i of row (base = row * hidden), element by element (the generic form)
template <typename T>
M2R_DEVICE float stream_at(const AddNormParams& p, int64_t at, float rowscale) {
  typedef typename T::storage S;
  float v = T::to_float(static_cast<const S*>(p.x)[at]) * rowscale;
  if (p.mask) v = dropped(v, p.mask[at], p.keep);
  if (p.x1) {
    float u = T::to_float(static_cast<const S*>(p.x1)[at]);
    if (p.mask1) u = dropped(u, p.mask1[at], p.keep);
    v += u;
  }
  if (p.residual) v += load_as_float(p.residual, p.stream_dtype, at);
  return v;
}

template <typename T>
M2R_DEVICE void forward(const AddNormParams& p) {
  typedef typename T::storage S;
  __shared__ float partial[kMaxWaves];
  const int tid = threadIdx.x, n = p.hidden;
  const int64_t row = blockIdx.x, base = row * n;
  const float rs = p.rowscale ? p.rowscale[row] : 1.f;
  float mean = 0.f;
  float sum[1] = {0.f};
  for (int i = tid; i < n; i += kThreads) {
    const float v = stream_at<T>(p, base + i, rs);
    if (p.stream) store_as(p.stream, p.stream_dtype, base + i, v);
    sum[0] += v;
  }
  if (p.layer_norm) {
    row_sums(sum, partial);
    mean = sum[0] / static_cast<float>(n);
  }
  float ss[1] = {0.f};
  for (int i = tid; i < n; i += kThreads) {
    const float v = stream_at<T>(p, base + i, rs) - mean;
    ss[0] = fmaf(v, v, ss[0]);
  }
  row_sums(ss, partial);
  const float rstd = rsqrtf(ss[0] / static_cast<float>(n) + p.eps);
  if (tid == 0) {
    if (p.mean) p.mean[row] = mean;
    p.rstd[row] = rstd;
  }
  for (int i = tid; i < n; i += kThreads) {
    const float h = (stream_at<T>(p, base + i, rs) - mean) * rstd;
    float y = h * load_as_float(p.weight, p.weight_dtype, i);
    if (p.bias) y += load_as_float(p.bias, p.bias_dtype, i);
    static_cast<S*>(p.y)[base + i] = T::from_float(y);
    if (p.y1) {
      float y1 = h * load_as_float(p.weight1, p.weight1_dtype, i);
      if (p.bias1) y1 += load_as_float(p.bias1, p.bias1_dtype, i);
      static_cast<S*>(p.y1)[base + i] = T::from_float(y1);
    }
  }
}

// The 4 mask bytes of elements at .. at + 3 (4-byte aligned), one per byte of the result
M2R_DEVICE uint32_t load_mask4(const uint8_t* m, int64_t at) { return *reinterpret_cast<const uint32_t*>(m + at); }

// Runs a thread up to which the forward requests the weight with the row's inputs (16-byte
// registers a run held through the reduction) instead of after it; a build-time knob for
// measuring (0: always after).
#ifndef M2R_ADD_NORM_EARLY_WEIGHT_RUNS
#define M2R_ADD_NORM_EARLY_WEIGHT_RUNS 0
#endif

// kPlain: the call of a pre-norm block (no x1 / weight1, dropout or rowscale; the host checks):
// those pointers are known null at compile time, so each run is one straight block of code. The
// full form tests them element by element at run time; a decode step's single row pays that
// path length in latency.
template <typename T, int kRuns, bool kPlain>
M2R_DEVICE void forward_rows(const AddNormParams& p) {
  __shared__ float partial[kMaxWaves];
  const void* const x1 = kPlain ? nullptr : p.x1;
  const uint8_t* const mask = kPlain ? nullptr : p.mask;
  const uint8_t* const mask1 = kPlain ? nullptr : p.mask1;
  const float* const rowscale = kPlain ? nullptr : p.rowscale;
  void* const y1 = kPlain ? nullptr : p.y1;
  constexpr bool kEarlyWeight = kRuns <= M2R_ADD_NORM_EARLY_WEIGHT_RUNS;
  // (eight runs a thread keep their loads with their run: all first took 74 -> 87 registers
  // on sm_90, a block fewer a multiprocessor, at widths where many rows hide the latency)
  constexpr bool kLoadsFirst = kRuns <= 4;
  constexpr bool kWeightsFirst = kLoadsFirst && !kEarlyWeight;
  const int n = p.hidden, nt = blockDim.x;
  const int64_t row = blockIdx.x, base = row * n;
  const float rs = rowscale ? rowscale[row] : 1.f;
  // x and the residual of every run are requested before any value is used or any store is
  // made: a store to the stream may alias an input as far as the compiler knows, so loads
  // written after a run's store waited for it, and the runs' loads went out one round trip
  // after another (at a decode step's single row, most of the kernel's time). x1 and the
  // dropout masks (rare: a parallel residual, training with dropout) load with their run, as
  // before, to keep their registers out of every call's budget.
  uint4 xq[kRuns], rq[kRuns], wq[kEarlyWeight ? kRuns : 1];
#pragma unroll
  for (int k = 0; k < kRuns; ++k) {
    const int c = 4 * (static_cast<int>(threadIdx.x) + k * nt);
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    xq[k] = rq[k] = zero;
    if constexpr (kEarlyWeight) wq[k] = zero;
    if (!kLoadsFirst || c >= n) continue;
    xq[k] = load4_raw(p.x, T::kDType, base + c);
    if (p.residual) rq[k] = load4_raw(p.residual, p.stream_dtype, base + c);
    if constexpr (kEarlyWeight) wq[k] = load4_raw(p.weight, p.weight_dtype, c);
  }
  float s[kRuns][4];
  float sum[1] = {0.f};
#pragma unroll
  for (int k = 0; k < kRuns; ++k) {
    const int c = 4 * (static_cast<int>(threadIdx.x) + k * nt);
#pragma unroll
    for (int e = 0; e < 4; ++e) s[k][e] = 0.f;
    if (c >= n) continue;
    float u[4], r[4];
    if constexpr (!kLoadsFirst) {
      xq[k] = load4_raw(p.x, T::kDType, base + c);
      if (p.residual) rq[k] = load4_raw(p.residual, p.stream_dtype, base + c);
    }
    if (x1) load4_as_float(x1, T::kDType, base + c, u);
    const uint32_t m = mask ? load_mask4(mask, base + c) : 0u;
    const uint32_t m1 = mask1 ? load_mask4(mask1, base + c) : 0u;
    raw4_as_float(xq[k], T::kDType, s[k]);
    if (p.residual) raw4_as_float(rq[k], p.stream_dtype, r);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float v = s[k][e] * rs;
      if (mask) v = dropped(v, (m >> (8 * e)) & 0xffu, p.keep);
      if (x1) v += mask1 ? dropped(u[e], (m1 >> (8 * e)) & 0xffu, p.keep) : u[e];
      if (p.residual) v += r[e];
      s[k][e] = v;
      sum[0] += v;
    }
    if (p.stream) store4_as(p.stream, p.stream_dtype, base + c, s[k]);
  }
  float mean = 0.f;
  if (p.layer_norm) {
    row_sums(sum, partial);
    mean = sum[0] / static_cast<float>(n);
  }
  float ss[1] = {0.f};
#pragma unroll
  for (int k = 0; k < kRuns; ++k) {
    if (4 * (static_cast<int>(threadIdx.x) + k * nt) >= n) continue;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[k][e] -= mean;
      ss[0] = fmaf(s[k][e], s[k][e], ss[0]);
    }
  }
  // The weight of every run is requested before the reduction, so that it arrives during it:
  // loaded run by run after it, each run's load waited for the store of the run before (a
  // possible alias again), one round trip to memory per run at a single row. (The bias, rare in
  // these models, stays with its run: held too, it took the 4-run form from 58 to 71 registers
  // on sm_90, a block fewer a multiprocessor.)
  uint4 lw[kWeightsFirst ? kRuns : 1];
  if constexpr (kWeightsFirst) {
#pragma unroll
    for (int k = 0; k < kRuns; ++k) {
      const int c = 4 * (static_cast<int>(threadIdx.x) + k * nt);
      lw[k] = make_uint4(0u, 0u, 0u, 0u);
      if (c >= n) continue;
      lw[k] = load4_raw(p.weight, p.weight_dtype, c);
    }
  }
  row_sums(ss, partial);
  const float rstd = rsqrtf(ss[0] / static_cast<float>(n) + p.eps);
  if (threadIdx.x == 0) {
    if (p.mean) p.mean[row] = mean;
    p.rstd[row] = rstd;
  }
#pragma unroll
  for (int k = 0; k < kRuns; ++k) {
    const int c = 4 * (static_cast<int>(threadIdx.x) + k * nt);
    if (c >= n) continue;
    float w[4], y[4];
    if constexpr (kEarlyWeight) raw4_as_float(wq[k], p.weight_dtype, w);
    else if constexpr (kWeightsFirst) raw4_as_float(lw[k], p.weight_dtype, w);
    else load4_as_float(p.weight, p.weight_dtype, c, w);
#pragma unroll
    for (int e = 0; e < 4; ++e) y[e] = s[k][e] * rstd * w[e];
    if (p.bias) {
      load4_as_float(p.bias, p.bias_dtype, c, w);
#pragma unroll
      for (int e = 0; e < 4; ++e) y[e] += w[e];
    }
    store4_as(p.y, T::kDType, base + c, y);
    if (y1) {
      load4_as_float(p.weight1, p.weight1_dtype, c, w);
#pragma unroll
      for (int e = 0; e < 4; ++e) y[e] = s[k][e] * rstd * w[e];
      if (p.bias1) {
        load4_as_float(p.bias1, p.bias1_dtype, c, w);
#pragma unroll
        for (int e = 0; e < 4; ++e) y[e] += w[e];
      }
      store4_as(y1, T::kDType, base + c, y);
    }
  }
}

// ---- backward -------------------------------------------------------------------------------
// With xhat = (s - mean) * rstd and g = dy * weight + dy1 * weight1 (the gradient reaching xhat):
//   ds = rstd * (g - xhat * mean(xhat * g) - mean(g)) (LayerNorm; RMSNorm without mean(g)),
//   plus dstream; dresidual = ds, dx = drop(ds) * rowscale, dx1 = drop(ds);
//   dweight += dy * xhat, dbias += dy, dweight1 += dy1 * xhat, dbias1 += dy1 over rows.

// The rows of block b: [b * rows_per_block, min(rows, (b + 1) * rows_per_block))
M2R_DEVICE void block_rows(const AddNormParams& p, int64_t& r0, int64_t& r1) {
  r0 = static_cast<int64_t>(blockIdx.x) * p.rows_per_block;
  r1 = r0 + p.rows_per_block < p.rows ? r0 + p.rows_per_block : p.rows;
}

// The gradient part of element `at` of a row whose statistics are mean / rstd: xhat, dy, dy1, g
template <typename T>
M2R_DEVICE void grad_at(const AddNormParams& p, int64_t at, int i, float mean, float rstd, float& xh,
                        float& dy, float& dy1, float& g) {
  typedef typename T::storage S;
  xh = (load_as_float(p.stream, p.stream_dtype, at) - mean) * rstd;
  dy = T::to_float(static_cast<const S*>(p.dy)[at]);
  g = dy * load_as_float(p.weight, p.weight_dtype, i);
  dy1 = 0.f;
  if (p.dy1) {
    dy1 = T::to_float(static_cast<const S*>(p.dy1)[at]);
    g = fmaf(dy1, load_as_float(p.weight1, p.weight1_dtype, i), g);
  }
}

template <typename T>
M2R_DEVICE void backward(const AddNormParams& p) {
  typedef typename T::storage S;
  __shared__ float partial[2 * kMaxWaves];
  const int tid = threadIdx.x, n = p.hidden;
  const float inv_n = 1.f / static_cast<float>(n);
  float* acc = p.partial + static_cast<int64_t>(blockIdx.x) * 4 * n;  // this block's sums
  for (int i = tid; i < n; i += kThreads) acc[i] = acc[n + i] = acc[2 * n + i] = acc[3 * n + i] = 0.f;
  int64_t r0, r1;
  block_rows(p, r0, r1);
  for (int64_t row = r0; row < r1; ++row) {
    const int64_t base = row * n;
    const float mean = p.mean ? p.mean[row] : 0.f, rstd = p.rstd[row];
    float c[2] = {0.f, 0.f};
    for (int i = tid; i < n; i += kThreads) {
      float xh, dy, dy1, g;
      grad_at<T>(p, base + i, i, mean, rstd, xh, dy, dy1, g);
      c[0] = fmaf(xh, g, c[0]);
      c[1] += g;
    }
    row_sums(c, partial);
    const float c1 = c[0] * inv_n, c2 = p.mean ? c[1] * inv_n : 0.f;
    const float rs = p.rowscale ? p.rowscale[row] : 1.f;
    for (int i = tid; i < n; i += kThreads) {
      const int64_t at = base + i;
      float xh, dy, dy1, g;
      grad_at<T>(p, at, i, mean, rstd, xh, dy, dy1, g);
      float ds = (g - fmaf(xh, c1, c2)) * rstd;
      if (p.dstream) ds += load_as_float(p.dstream, p.stream_dtype, at);
      if (p.dresidual) store_as(p.dresidual, p.stream_dtype, at, ds);
      const float dx = p.mask ? dropped(ds, p.mask[at], p.keep) : ds;
      static_cast<S*>(p.dx)[at] = T::from_float(dx * rs);
      if (p.dx1) static_cast<S*>(p.dx1)[at] = T::from_float(p.mask1 ? dropped(ds, p.mask1[at], p.keep) : ds);
      acc[i] = fmaf(dy, xh, acc[i]);
      acc[n + i] += dy;
      acc[2 * n + i] = fmaf(dy1, xh, acc[2 * n + i]);
      acc[3 * n + i] += dy1;
    }
  }
}

// dweight, dbias, dweight1, dbias1 (q = 0 .. 3): the output and its dtype
M2R_DEVICE void* grad_out(const AddNormParams& p, int64_t q) {
  return q == 0 ? p.dweight : q == 1 ? p.dbias : q == 2 ? p.dweight1 : p.dbias1;
}
M2R_DEVICE int grad_dtype(const AddNormParams& p, int64_t q) {
  return q == 0 ? p.weight_dtype : q == 1 ? p.bias_dtype : q == 2 ? p.weight1_dtype : p.bias1_dtype;
}

// The register form takes the calls of a pre-norm block (no x1 / weight1, dropout or rowscale:
// the host sends those to the generic form): with those eight pointers too, the wave64 targets
// spilled up to 11 scalar registers (gfx9-4-generic, hipcc 7.0.2).
// The register forms (bit R - 1: the R-run form) whose blocks request the next row's stream,
// dy and dstream before the current row's reduction and stores, so that a row's round trip to
// memory overlaps the row before it; without it each row loads after the last one's stores,
// which a possible alias makes it wait for. On by default in every form (bits 0-3; the 4-run
// form in 16-bit types only: in f32 it spilled 16 bytes at 128 registers). H100, bf16, 16384
// rows, forward + backward, alternating builds in one run: d768 143.9 -> 130.4 us (81.6 -> 90.0%
// of copy), d2048 385.9 -> 331.0 (81.1 -> 94.6%), d2560 584.3 -> 412.9 (67.0 -> 94.7%), d4096
// 847.4 -> 657.5 (73.9 -> 95.2%). Registers, sm_90 bf16: 1 run 55 -> 72, 2 runs 71 -> 96,
// 3 runs 89 -> 122, 4 runs 125 -> 128. The knob stays for measuring (0: off).
#ifndef M2R_ADD_NORM_BWD_PREFETCH
#define M2R_ADD_NORM_BWD_PREFETCH 15
#endif

template <typename T, int kRuns>
M2R_DEVICE void backward_rows(const AddNormParams& p) {
  __shared__ float partial[2 * kMaxWaves];
  constexpr bool kPrefetch = ((M2R_ADD_NORM_BWD_PREFETCH >> (kRuns - 1)) & 1) != 0 &&
                            (kRuns < 4 || T::kDType != M2R_DTYPE_F32);
  constexpr int kHeld = kPrefetch ? kRuns : 1;
  const int n = p.hidden, nt = blockDim.x;
  const float inv_n = 1.f / static_cast<float>(n);
  float acc[2][kRuns][4];
#pragma unroll
  for (int q = 0; q < 2; ++q)
#pragma unroll
    for (int k = 0; k < kRuns; ++k)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[q][k][e] = 0.f;
  int64_t r0, r1;
  block_rows(p, r0, r1);
  // kPrefetch: the next row's raw bits (stream, dy, dstream) and statistics, requested early
  uint4 qs[kHeld], qd[kHeld], qg[kHeld];
  float next_mean = 0.f, next_rstd = 0.f;
  auto fetch = [&](int64_t row) {
    const int64_t base = row * n;
    next_mean = p.mean ? p.mean[row] : 0.f;
    next_rstd = p.rstd[row];
#pragma unroll
    for (int k = 0; k < kHeld; ++k) {
      const int col = 4 * (static_cast<int>(threadIdx.x) + k * nt);
      qs[k] = qd[k] = qg[k] = make_uint4(0u, 0u, 0u, 0u);
      if (col >= n) continue;
      qs[k] = load4_raw(p.stream, p.stream_dtype, base + col);
      qd[k] = load4_raw(p.dy, T::kDType, base + col);
      if (p.dstream) qg[k] = load4_raw(p.dstream, p.stream_dtype, base + col);
    }
  };
  if constexpr (kPrefetch) {
    if (r0 < r1) fetch(r0);
  }
  for (int64_t row = r0; row < r1; ++row) {
    const int64_t base = row * n;
    float mean, rstd;
    if constexpr (kPrefetch) {
      mean = next_mean, rstd = next_rstd;
    } else {
      mean = p.mean ? p.mean[row] : 0.f, rstd = p.rstd[row];
    }
    // h = g * rstd + dstream, so that ds = h - (xhat * c1 + c2) * rstd once the row's sums are
    // known: dstream is read with the rest of the row, before the reduction (read after it, a
    // second round trip to memory in every row's life), and held in g's registers.
    float xh[kRuns][4], h[kRuns][4];
    float c[2] = {0.f, 0.f};
#pragma unroll
    for (int k = 0; k < kRuns; ++k) {
      const int col = 4 * (static_cast<int>(threadIdx.x) + k * nt);
#pragma unroll
      for (int e = 0; e < 4; ++e) xh[k][e] = h[k][e] = 0.f;
      if (col >= n) continue;
      float dy[4], w[4], d[4];
      if constexpr (kPrefetch) {
        raw4_as_float(qs[k], p.stream_dtype, xh[k]);
        raw4_as_float(qd[k], T::kDType, dy);
        load4_as_float(p.weight, p.weight_dtype, col, w);
        if (p.dstream) raw4_as_float(qg[k], p.stream_dtype, d);
      } else {
        load4_as_float(p.stream, p.stream_dtype, base + col, xh[k]);
        load4_as_float(p.dy, T::kDType, base + col, dy);
        load4_as_float(p.weight, p.weight_dtype, col, w);
        if (p.dstream) load4_as_float(p.dstream, p.stream_dtype, base + col, d);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        xh[k][e] = (xh[k][e] - mean) * rstd;
        const float g = dy[e] * w[e];
        acc[0][k][e] = fmaf(dy[e], xh[k][e], acc[0][k][e]);
        acc[1][k][e] += dy[e];
        c[0] = fmaf(xh[k][e], g, c[0]);
        c[1] += g;
        h[k][e] = p.dstream ? fmaf(g, rstd, d[e]) : g * rstd;
      }
    }
    if constexpr (kPrefetch) {
      if (row + 1 < r1) fetch(row + 1);
    }
    row_sums(c, partial);
    const float c1 = c[0] * inv_n, c2 = p.mean ? c[1] * inv_n : 0.f;
#pragma unroll
    for (int k = 0; k < kRuns; ++k) {
      const int col = 4 * (static_cast<int>(threadIdx.x) + k * nt);
      if (col >= n) continue;
      float ds[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) ds[e] = h[k][e] - fmaf(xh[k][e], c1, c2) * rstd;
      if (p.dresidual) store4_as(p.dresidual, p.stream_dtype, base + col, ds);
      store4_as(p.dx, T::kDType, base + col, ds);
    }
  }
  // this block's column sums: dweight always, dbias where it exists
  float* out = p.partial + static_cast<int64_t>(blockIdx.x) * 4 * n;
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    if (q == 1 && p.dbias == nullptr) continue;
#pragma unroll
    for (int k = 0; k < kRuns; ++k) {
      const int col = 4 * (static_cast<int>(threadIdx.x) + k * nt);
      if (col < n) *reinterpret_cast<float4*>(out + q * n + col) = make_float4(acc[q][k][0], acc[q][k][1], acc[q][k][2], acc[q][k][3]);
    }
  }
}

// dweight, dbias, dweight1, dbias1 from the partial rows: column j of a (partial_rows, 4 * hidden)
// matrix goes to output j / hidden, element j % hidden. A block whose columns all belong to
// absent outputs returns at once (uniformly: before column_sum's barrier).
M2R_DEVICE void reduce_partials(const AddNormParams& p) {
  const int64_t n = p.hidden, cols = 4 * n;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kColumnSumCols;
  const int64_t last = first + kColumnSumCols - 1 < cols - 1 ? first + kColumnSumCols - 1 : cols - 1;
  bool any = false;
  for (int64_t q = first / n; q <= last / n; ++q) any = any || grad_out(p, q) != nullptr;
  if (!any) return;
  int64_t j;
  const float sum = column_sum<kThreads>(p.partial, cols, p.partial_rows, cols, j);
  if (threadIdx.x < kColumnSumCols && j < cols) {
    const int64_t q = j / n;
    void* out = grad_out(p, q);
    if (out != nullptr) store_as(out, grad_dtype(p, q), j - q * n, sum);
  }
}

}  // namespace add_norm
}  // namespace m2r

// m2r_add_norm_{fwd,bwd}_<dt>: the generic forms; _r<R>: R register-resident 4-element runs a
// thread. The backward's register forms stop at 4 runs (its column sums held across the rows
// are 8 registers a run); its 3-run form serves d2560 / d3072 with 256 threads, where 4 runs
// left 192 (H100, bf16, 16384 rows, backward alone: 321.0 -> 286.9 us at d2560, 352.5 -> 323.3
// at d3072) and are held to 2 blocks a multiprocessor on NVIDIA: unheld, ptxas
// spilled 32 bytes in the f32 2-run form at 80 registers (CUDA 13.0, sm_90).
#define M2R_ADD_NORM_FWD_R(DT, T, R)                                                         \
  M2R_KERNEL(m2r::add_norm::kThreads) m2r_add_norm_fwd_##DT##_r##R(AddNormParams p) {      \
    m2r::add_norm::forward_rows<m2r::T, R, false>(p);                                       \
  }                                                                                         \
  M2R_KERNEL(m2r::add_norm::kThreads) m2r_add_norm_fwd_##DT##_r##R##_plain(AddNormParams p) { \
    m2r::add_norm::forward_rows<m2r::T, R, true>(p);                                        \
  }
#define M2R_ADD_NORM_BWD_R(DT, T, R)                                                    \
  M2R_KERNEL_MIN_BLOCKS(m2r::add_norm::kThreads, 2) m2r_add_norm_bwd_##DT##_r##R(AddNormParams p) { \
    m2r::add_norm::backward_rows<m2r::T, R>(p);                                        \
  }
#define M2R_ADD_NORM(DT, T)                                                           \
  M2R_KERNEL(m2r::add_norm::kThreads) m2r_add_norm_fwd_##DT(AddNormParams p) {      \
    m2r::add_norm::forward<m2r::T>(p);                                               \
  }                                                                                   \
  M2R_KERNEL(m2r::add_norm::kThreads) m2r_add_norm_bwd_##DT(AddNormParams p) {      \
    m2r::add_norm::backward<m2r::T>(p);                                              \
  }                                                                                   \
  M2R_ADD_NORM_FWD_R(DT, T, 1) M2R_ADD_NORM_FWD_R(DT, T, 2) M2R_ADD_NORM_FWD_R(DT, T, 4) \
  M2R_ADD_NORM_FWD_R(DT, T, 8)                                                        \
  M2R_ADD_NORM_BWD_R(DT, T, 1) M2R_ADD_NORM_BWD_R(DT, T, 2) M2R_ADD_NORM_BWD_R(DT, T, 3)  \
  M2R_ADD_NORM_BWD_R(DT, T, 4)

M2R_ADD_NORM(f32, F32)
M2R_ADD_NORM(f16, F16)
M2R_ADD_NORM(bf16, BF16)

M2R_KERNEL(m2r::add_norm::kThreads) m2r_add_norm_bwd_reduce(AddNormParams p) { m2r::add_norm::reduce_partials(p); }
