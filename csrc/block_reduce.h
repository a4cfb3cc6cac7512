// Block-wide reductions shared by the kernel sources (after platform.h).
#pragma once

#include "platform.h"

namespace m2r {

// The sum of v over a block of kThreads threads (every thread gets it), added in a fixed order
// (butterfly within each wavefront, then the wavefronts' sums in order: bit-identical runs).
// partial: kThreads / kWavefront floats of LDS, free again when this returns (the trailing
// barrier lets the next call reuse it).
template <int kThreads>
M2R_DEVICE float block_sum(float v, float* partial) {
  constexpr int kWaves = kThreads / kWavefront;
#pragma unroll
  for (int off = kWavefront / 2; off > 0; off /= 2) v += shfl_xor(v, off);
  if (threadIdx.x % kWavefront == 0) partial[threadIdx.x / kWavefront] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kWaves; ++w) total += partial[w];
  __syncthreads();
  return total;
}

}  // namespace m2r
