// Mamba2 SSD backward, stage 2: dstates (the stages and their grids: ssd_bwd_common.h).
#include "ssd_bwd_common.h"

namespace m2r {
namespace ssd_bwd {

// ---- 2. the gradient of each chunk's entering state --------------------------------------------

template <typename T>
M2R_DEVICE void dstates(const SsdBwdParams& p) {
  typedef typename T::storage S;
  __shared__ __align__(16) float sm[kPairSmemFloats];
  __shared__ float w[kMaxChunk];
  const int pairs_n = cdiv(p.dstate, 2 * kTile), tiles = pairs_n * cdiv(p.headdim, kTile);
  const int h = blockIdx.x % p.nheads, g = h / p.heads_per_group, b = blockIdx.z;
  const int tile = (blockIdx.x / p.nheads) % tiles, c = blockIdx.x / p.nheads / tiles;
  const int p0 = (tile / pairs_n) * kTile, n0 = (tile % pairs_n) * 2 * kTile, pc = min(kTile, p.headdim - p0);
  const int64_t l0 = static_cast<int64_t>(c) * p.chunk_size;
  const int rows = static_cast<int>(min(static_cast<int64_t>(p.chunk_size), p.seqlen - l0));
  const int xl = p.nheads * p.headdim, bl = p.ngroups * p.dstate;
  const int32_t* sg = seg_row(p, b, c);
  const float* a = p.dA_cs + chunk_row(p, b, h, c);
  const int s = threadIdx.x;  // chunk_size <= kThreads
  const bool reads = s < rows && sg[s] == 0;  // the chunk's first segment reads the entering state
  if (s < p.chunk_size) w[s] = reads ? __expf(a[s]) : 0.f;
  const int count = __syncthreads_count(reads);  // a prefix of the chunk; also w's barrier
  const S* gp = x_chunk(p, static_cast<const S*>(p.dout_g), b, l0, h) + p0;
  const S* Cc = bc_chunk(p, static_cast<const S*>(p.C), b, l0, g) + n0;
  const int nc0 = min(kTile, p.dstate - n0), nc1 = p.dstate - n0 - kTile;  // nc1 <= 0: no second tile
  const bool second = nc1 > 0;
  const Tile tl;
  float acc0[4][4] = {}, acc1[4][4] = {};  // rows n, columns p: each row of the result is a run of
  tile_product_pair<T, true, true>(        // the output's p-contiguous rows, stored 16 bytes at a time
      acc0, acc1, sm, 0, count, Plain<T, true>{Cc, bl, nc0}, Plain<T, true>{Cc + kTile, bl, min(kTile, nc1)}, second,
      Runs<T, true, true>{gp, xl, 0, pc, w});  // g[t] times w[t], loaded once for both tiles of n
  float* out = p.dstates + states_at(p, b, c, h) + p0 + tl.c_off;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (tl.r_off + i < nc0) store4<F32>(out + static_cast<int64_t>(n0 + tl.r_off + i) * p.headdim, pc - tl.c_off, acc0[i]);
    if (tl.r_off + i < nc1) store4<F32>(out + static_cast<int64_t>(n0 + kTile + tl.r_off + i) * p.headdim, pc - tl.c_off, acc1[i]);
  }
}

}  // namespace ssd_bwd
}  // namespace m2r

// dstates is short and waits on its loads: 2 blocks per SM (128 registers), each with two
// tiles of dstate sharing its g operand's loads (one tile at 3 blocks, 85 registers, took
// 179.5 us at g8 on an H200)
#define M2R_DSTATES_BLOCKS 2
#define M2R_SSD_BWD_DSTATES(DT, T) \
  M2R_KERNEL_MIN_BLOCKS(m2r::ssd_bwd::kThreads, M2R_DSTATES_BLOCKS) m2r_ssd_bwd_dstates_##DT(SsdBwdParams p) { m2r::ssd_bwd::dstates<m2r::T>(p); }
M2R_SSD_BWD_DSTATES(f32, F32)
M2R_SSD_BWD_DSTATES(f16, F16)
M2R_SSD_BWD_DSTATES(bf16, BF16)
