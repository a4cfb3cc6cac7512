// Block-wide reductions shared by the kernel sources (after platform.h).
#pragma once

#include "platform.h"

namespace m2r {

// The sums of v[0..N) over the wavefront (every lane gets them): one butterfly, a fixed order.
template <int N>
M2R_DEVICE void wave_sums(float (&v)[N]) {
#pragma unroll
  for (int off = kWavefront / 2; off > 0; off /= 2) {
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] += shfl_xor(v[k], off);
  }
}

// wave_sums of one value
M2R_DEVICE float wave_sum(float v) {
  float a[1] = {v};
  wave_sums(a);
  return a[0];
}

// The sum of v over a block of kThreads threads (every thread gets it), added in a fixed order
// (butterfly within each wavefront, then the wavefronts' sums in order: bit-identical runs).
// partial: kThreads / kWavefront floats of LDS, free again when this returns (the trailing
// barrier lets the next call reuse it).
template <int kThreads>
M2R_DEVICE float block_sum(float v, float* partial) {
  constexpr int kWaves = kThreads / kWavefront;
  v = wave_sum(v);
  if (threadIdx.x % kWavefront == 0) partial[threadIdx.x / kWavefront] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kWaves; ++w) total += partial[w];
  __syncthreads();
  return total;
}

// block_sum of each of N values at once, with one barrier: partial holds N * kThreads /
// kWavefront floats and is not free when this returns (no trailing barrier: a later reduction
// takes other LDS, or a barrier first).
template <int kThreads, int N>
M2R_DEVICE void block_sums(float (&v)[N], float* partial) {
  constexpr int kWaves = kThreads / kWavefront;
  wave_sums(v);
  if (threadIdx.x % kWavefront == 0) {
#pragma unroll
    for (int k = 0; k < N; ++k) partial[k * kWaves + threadIdx.x / kWavefront] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < N; ++k) {
    float t = 0.f;
#pragma unroll
    for (int w = 0; w < kWaves; ++w) t += partial[k * kWaves + w];
    v[k] = t;
  }
}

// column_sum's columns a block (the host's grids for the reduce launches that call it)
constexpr int kColumnSumCols = 16;

// Column sums of a (rows, stride) fp32 matrix, kCols columns a block of kThreads: the block's
// kThreads / kCols slices of threads each add every slice-th row from their own, in order, then
// the first slice adds the slices' sums in order (a fixed order: bit-identical runs). Rows
// split across threads: a thread per column, summing every row alone, took 14.6 us at 528
// rows of d2048 where torch's sum and two conversions took 11.1 (H200). Every thread of the
// block must call it (one barrier). j: the thread's column, blockIdx.x * kCols + threadIdx.x %
// kCols; columns at or past cols add nothing. Returns the column's sum in the first slice
// (threadIdx.x < kCols), a slice's share elsewhere.
template <int kThreads, int kCols = kColumnSumCols>
M2R_DEVICE float column_sum(const float* m, int64_t stride, int rows, int64_t cols, int64_t& j) {
  constexpr int kSlices = kThreads / kCols;
  __shared__ float sums[kSlices][kCols];
  const int col = threadIdx.x % kCols, slice = threadIdx.x / kCols;
  j = static_cast<int64_t>(blockIdx.x) * kCols + col;
  float acc = 0.f;
  if (j < cols) {
    const float* c = m + j;
#pragma unroll 8
    for (int r = slice; r < rows; r += kSlices) acc += c[r * stride];
  }
  sums[slice][col] = acc;
  __syncthreads();
  if (slice == 0) {
#pragma unroll
    for (int k = 1; k < kSlices; ++k) acc += sums[k][col];
  }
  return acc;
}

// Inclusive prefix sum over the block; `wsum` holds one float per wavefront.
M2R_DEVICE float block_inclusive_scan(float v, float* wsum) {
  const int lane = threadIdx.x % kWavefront, wave = threadIdx.x / kWavefront;
#pragma unroll
  for (int off = 1; off < kWavefront; off <<= 1) {
    const float u = shfl_up(v, off);
    if (lane >= off) v += u;
  }
  if (lane == kWavefront - 1) wsum[wave] = v;
  __syncthreads();
  float prefix = 0.f;
  for (int i = 0; i < wave; ++i) prefix += wsum[i];
  __syncthreads();
  return v + prefix;
}

// Inclusive prefix sum over the block that restarts wherever `start` is set (a token that
// begins a new segment): a value never reaches another segment's sums, so a non-finite dt in
// one sequence cannot spread into the next one's decays. Differences of two sums within one
// segment are those of the plain prefix sum. `wsum`/`wstart` hold one entry per wavefront.
M2R_DEVICE float block_segmented_scan(float v, bool start, float* wsum, int* wstart) {
  const int lane = threadIdx.x % kWavefront, wave = threadIdx.x / kWavefront;
  float f = start ? 1.f : 0.f;  // a start in (lane - off, lane]: what the sum already covers
#pragma unroll
  for (int off = 1; off < kWavefront; off <<= 1) {
    const float u = shfl_up(v, off), g = shfl_up(f, off);
    if (lane >= off && f == 0.f) v += u;  // select: never v + 0 * u
    if (lane >= off) f = fmaxf(f, g);
  }
  if (lane == kWavefront - 1) wsum[wave] = v, wstart[wave] = f != 0.f;
  __syncthreads();
  float prefix = 0.f;
  for (int i = 0; i < wave; ++i) prefix = wstart[i] ? wsum[i] : prefix + wsum[i];
  __syncthreads();
  return f != 0.f ? v : v + prefix;
}

// The same over a wavefront's runs: lane j holds the kPer consecutive values v[0..kPer) that
// follow lane j - 1's, start[e] marks a value that begins a new segment. Each lane sums its run
// in order, one shuffle scan combines the runs' sums (a run with a start passes on only what
// follows its last start), and values before the lane's first start take the earlier lanes'
// sum by selection (never + 0 x NaN). No LDS, no barrier: a wavefront does a whole sequence.
template <int kPer>
M2R_DEVICE void wave_runs_segmented_scan(float (&v)[kPer], const bool (&start)[kPer]) {
  const int lane = static_cast<int>(threadIdx.x) % kWavefront;
  float run = 0.f, f = 0.f;
#pragma unroll
  for (int e = 0; e < kPer; ++e) {
    run = start[e] ? v[e] : run + v[e];
    f = start[e] ? 1.f : f;
    v[e] = run;
  }
#pragma unroll
  for (int off = 1; off < kWavefront; off <<= 1) {
    const float u = shfl_up(run, off), g = shfl_up(f, off);
    if (lane >= off && f == 0.f) run += u;
    if (lane >= off) f = fmaxf(f, g);
  }
  const float before = shfl_up(run, 1);  // the earlier lanes' sum since their last start
  bool open = lane > 0;
#pragma unroll
  for (int e = 0; e < kPer; ++e) {
    open = open && !start[e];
    v[e] = open ? v[e] + before : v[e];
  }
}

}  // namespace m2r
