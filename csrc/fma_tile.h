// The fp32 FMA tile product shared by the SSD kernels (forward and backward): a block's
// operands go through LDS in slabs of kFmaSlab along the reduction dim, k-major ([k][row],
// rows padded), and each thread owns a register tile read with 16-byte LDS loads. This is the
// path every target runs for fp32, and gfx10.3 (no matrix cores) for every dtype.
#pragma once

#include "platform.h"

namespace m2r {

constexpr int kFmaSlab = 32;

// acc[i][j] += sum_k A[k][row_i] * B[k][col_j] over one LDS slab. A thread's rows are
// kRowGroups runs of 4 at row0 + kRowStride g, its columns kColGroups runs of 4 at col0 + 64 g,
// so a quarter-wavefront reads consecutive 16-byte words (no bank conflicts) or one broadcast
// word.
template <int kRowGroups, int kColGroups, int kLdA, int kLdB, int kRowStride = 64>
M2R_DEVICE void slab_product(float (&acc)[4 * kRowGroups][4 * kColGroups], const float* As,
                             const float* Bs, int row0, int col0) {
#pragma unroll
  for (int k = 0; k < kFmaSlab; ++k) {
    float a[4 * kRowGroups], b[4 * kColGroups];
#pragma unroll
    for (int g = 0; g < kRowGroups; ++g) {
      const float4 v = *reinterpret_cast<const float4*>(As + k * kLdA + row0 + kRowStride * g);
      a[4 * g] = v.x, a[4 * g + 1] = v.y, a[4 * g + 2] = v.z, a[4 * g + 3] = v.w;
    }
#pragma unroll
    for (int g = 0; g < kColGroups; ++g) {
      const float4 v = *reinterpret_cast<const float4*>(Bs + k * kLdB + col0 + 64 * g);
      b[4 * g] = v.x, b[4 * g + 1] = v.y, b[4 * g + 2] = v.z, b[4 * g + 3] = v.w;
    }
#pragma unroll
    for (int i = 0; i < 4 * kRowGroups; ++i)
#pragma unroll
      for (int j = 0; j < 4 * kColGroups; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
  }
}

}  // namespace m2r
