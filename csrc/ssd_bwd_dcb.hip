// Mamba2 SSD backward, stage 5: dcb (the stages and their grids: ssd_bwd_common.h).
#include "ssd_bwd_common.h"

namespace m2r {
namespace ssd_bwd {

// ---- 5. the gradient of C·Bᵀ, and the intra-chunk exponent terms --------------------------------

template <typename T>
M2R_DEVICE void dcb(const SsdBwdParams& p) {
  typedef typename T::storage S;
  __shared__ __align__(16) float sm[kSmemFloats];
  __shared__ float acs[kMaxChunk], dts[kMaxChunk];
  __shared__ int32_t seg[kMaxChunk];
  // blockIdx.x: (chunk, group) major, then the lower-triangular tile pairs (ts <= tt)
  const int tiles = p.chunk_size / kTile, pairs = tiles * (tiles + 1) / 2;
  int tq = 0, rem = blockIdx.x % pairs;
  while (rem > tq) rem -= ++tq;
  // the block's coordinates as per-lane values: AMD's compiler would keep everything derived
  // from them in scalar registers, which this kernel's per-head addresses run out of
  const int tt = per_lane(tq), ts = per_lane(rem);
  const int cg = blockIdx.x / pairs, c = per_lane(cg / p.ngroups), g = per_lane(cg % p.ngroups);
  const int b = per_lane(static_cast<int>(blockIdx.z));
  const int64_t l0 = static_cast<int64_t>(c) * p.chunk_size;
  const int rows = static_cast<int>(min(static_cast<int64_t>(p.chunk_size), p.seqlen - l0));
  const int xl = p.nheads * p.headdim;
  const int64_t cs = p.chunk_size;
  for (int s = threadIdx.x; s < p.chunk_size; s += kThreads) seg[s] = seg_row(p, b, c)[s];
  const Tile tl;  // rows: s in tile ts, columns: t in tile tt
  float* cbp = p.cb + ((static_cast<int64_t>(b) * p.nchunks + c) * p.ngroups + g) * cs * cs;
  float cbv[4][4], total[4][4] = {};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 v = *reinterpret_cast<const float4*>(cbp + (ts * kTile + tl.r_off + i) * cs + tt * kTile + tl.c_off);
    cbv[i][0] = v.x, cbv[i][1] = v.y, cbv[i][2] = v.z, cbv[i][3] = v.w;
  }
  const int sr = min(kTile, rows - ts * kTile), tr = min(kTile, rows - tt * kTile);  // may be <= 0
  uint32_t live = 0;  // which of this thread's 16 (s, t) pairs are terms: set at the first head
  // each thread holds one position's dA_cs / dt of the next head (chunk_size <= kThreads), read
  // while the current head is multiplied
  const bool own = threadIdx.x < p.chunk_size;
  const int h0 = g * p.heads_per_group;
  float next_a = own ? p.dA_cs[chunk_row(p, b, h0, c) + threadIdx.x] : 0.f;
  float next_dt = own ? p.dt_out[chunk_row(p, b, h0, c) + threadIdx.x] : 0.f;
  for (int r = 0; r < p.heads_per_group; ++r) {
    const int h = h0 + r;
    __syncthreads();  // the last head's epilogue read acs / dts
    if (own) {
      acs[threadIdx.x] = next_a * kLog2e, dts[threadIdx.x] = next_dt;
      if (r + 1 < p.heads_per_group) {
        next_a = p.dA_cs[chunk_row(p, b, h + 1, c) + threadIdx.x];
        next_dt = p.dt_out[chunk_row(p, b, h + 1, c) + threadIdx.x];
      }
    }
    const S* xc = x_chunk(p, static_cast<const S*>(p.x), b, l0, h) + ts * kTile * xl;
    const S* gp = x_chunk(p, static_cast<const S*>(p.dout_g), b, l0, h) + tt * kTile * xl;
    // the next head's first slab towards L1 while this one is multiplied (one slab per head at
    // headdim 64, so the product's own prefetch has none: each head's loads waited out the
    // memory latency)
    if (r + 1 < p.heads_per_group) prefetch_slab<kNarrowSlab>(xc + p.headdim, xl, sr, p.headdim, gp + p.headdim, xl, tr, p.headdim);
    float acc[4][4] = {};
    tile_product<T, false, false, true, kNarrowSlab>(
        acc, sm, 0, p.headdim,
        Plain<T, false>{xc, xl, sr}, Plain<T, false>{gp, xl, tr});
    // M[t][s] = (g[t]·x[s]) C[t]·B[s] exp(dA_cs[t] - dA_cs[s]) dt[s]; dcb gets the same without C·B
    // for s <= t in the same segment, the pairs in `live` (the same for every head)
    if (r == 0) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int s = ts * kTile + tl.r_off + i, t = tt * kTile + tl.c_off + j;
          if (s <= t && t < rows && seg[s] == seg[t]) live |= 1u << (4 * i + j);
        }
    }
    float rs[4] = {}, csum[4] = {}, a_t[4], a_s[4], dt_s[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      a_t[e] = acs[tt * kTile + tl.c_off + e];
      a_s[e] = acs[ts * kTile + tl.r_off + e], dt_s[e] = dts[ts * kTile + tl.r_off + e];
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (live >> (4 * i + j) & 1u) {
          const float d = acc[i][j] * fast_exp2(a_t[j] - a_s[i]) * dt_s[i];
          total[i][j] += d;
          const float m = d * cbv[i][j];
          rs[i] += m, csum[j] += m;
        }
      }
    // at s: the sum over this tile's t (a row); at t: over this tile's s (a column, in order)
#pragma unroll
    for (int i = 0; i < 4; ++i) rs[i] = row_sum16(rs[i]);
    if (threadIdx.x % 16 == 0) {
      float* q = tok_row(p, 4, tt, b, h, c) + ts * kTile;
#pragma unroll
      for (int i = 0; i < 4; ++i) q[tl.r_off + i] = rs[i];
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) sm[(threadIdx.x / 16) * kTile + tl.c_off + j] = csum[j];
    __syncthreads();
    if (threadIdx.x < kTile) {
      float v = 0.f;
      for (int q = 0; q < kThreads / 16; ++q) v += sm[q * kTile + threadIdx.x];
      tok_row(p, 3, ts, b, h, c)[tt * kTile + threadIdx.x] = v;
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int s = ts * kTile + tl.r_off + i, t = tt * kTile + tl.c_off;
    *reinterpret_cast<float4*>(cbp + s * cs + t) = make_float4(total[i][0], total[i][1], total[i][2], total[i][3]);
  }
}


}  // namespace ssd_bwd
}  // namespace m2r

// ptxas' register cap (NVIDIA only): 2 blocks per SM
#define M2R_SSD_BWD_DCB(DT, T) \
  M2R_KERNEL_MIN_BLOCKS(m2r::ssd_bwd::kThreads, 2) m2r_ssd_bwd_dcb_##DT(SsdBwdParams p) { m2r::ssd_bwd::dcb<m2r::T>(p); }
M2R_SSD_BWD_DCB(f32, F32)
M2R_SSD_BWD_DCB(f16, F16)
M2R_SSD_BWD_DCB(bf16, BF16)
