// Mamba2 SSD backward, stage 1: dz and the gated output gradient (the stages and their grids: ssd_bwd_common.h).
#include "ssd_bwd_common.h"

namespace m2r {
namespace ssd_bwd {

// dz's first operand: C·Bᵀ dt decayed and masked, [s][t] with t (m) unit-stride, in two
// phases (as Runs)
struct DecayedCbT {
  static constexpr bool kTwoPhase = true, kMFast = true;
  typedef RawRun<float> Raw;
  const float* cb;
  const float* acs;
  const float* dts;
  const int32_t* seg;
  int t0, cs, rows;
  bool one_seg;
  M2R_DEVICE Raw fetch(int s, int m, int kv) const {
    Raw r;
    r.fetch(cb + s * cs + t0 + m, kv > 0 ? rows - t0 - m : 0);
    return r;
  }
  M2R_DEVICE void cook(int s, int m, int, const Raw& r, float (&v)[kRun]) const {
    r.template get<F32>(v);
    const int t = t0 + m;
    const float as = acs[s], ds = dts[s];
    float a[kRun];
    lds8(acs + t, a);
    if (one_seg && s <= t && t + kRun <= rows) {  // every term of the run is live
#pragma unroll
      for (int e = 0; e < kRun; ++e) v[e] *= fast_exp2(a[e] - as) * ds;
    } else {
      const int sg = seg[s];
      int32_t st[kRun];
      lds8(seg + t, st);
#pragma unroll
      for (int e = 0; e < kRun; ++e) v[e] = s <= t + e && t + e < rows && st[e] == sg ? v[e] * fast_exp2(a[e] - as) * ds : 0.f;
    }
  }
};

// ---- 1. dz and the gated output gradient -----------------------------------------------------

template <typename T>
M2R_DEVICE void dz(const SsdBwdParams& p) {
  typedef typename T::storage S;
  __shared__ __align__(16) float sm[kSmemFloats];
  __shared__ __align__(16) float acs[kMaxChunk];
  __shared__ float dts[kMaxChunk];
  __shared__ __align__(16) int32_t seg[kMaxChunk];
  const int ptiles = cdiv(p.headdim, kTile), ttiles = p.chunk_size / kTile;
  const int h = blockIdx.x % p.nheads, g = h / p.heads_per_group, b = blockIdx.z;
  int rest = blockIdx.x / p.nheads;
  const int pt = rest % ptiles;
  rest /= ptiles;
  const int tt = rest % ttiles, c = rest / ttiles;
  const int t0 = tt * kTile, p0 = pt * kTile, pc = min(kTile, p.headdim - p0);
  const int64_t l0 = static_cast<int64_t>(c) * p.chunk_size;
  const int rows = static_cast<int>(min(static_cast<int64_t>(p.chunk_size), p.seqlen - l0));
  const int xl = p.nheads * p.headdim, bl = p.ngroups * p.dstate;
  for (int s = threadIdx.x; s < p.chunk_size; s += kThreads) {
    acs[s] = p.dA_cs[chunk_row(p, b, h, c) + s] * kLog2e;
    dts[s] = p.dt_out[chunk_row(p, b, h, c) + s];
    seg[s] = seg_row(p, b, c)[s];
  }
  __syncthreads();
  const Tile tl;
  float acc[4][4] = {};
  const S* xc = x_chunk(p, static_cast<const S*>(p.x), b, l0, h) + p0;
  const S* dop = x_chunk(p, static_cast<const S*>(p.dout), b, l0, h) + p0;
  const S* zp = x_chunk(p, static_cast<const S*>(p.z), b, l0, h) + p0;
  Quads<T> dq, zq, xq;  // this thread's 4 x 4 of dout, z and x
  const int at = (t0 + tl.r_off) * xl + tl.c_off, nr = rows - t0 - tl.r_off, nq = pc - tl.c_off;
  if (c > 0 || p.has_init) {  // the entering state read through C (zero for chunk 0 without one)
    const S* Cc = bc_chunk(p, static_cast<const S*>(p.C), b, l0, g);
    const float* E = p.states + states_at(p, b, c, h) + p0;
    tile_product<T, false, true>(
        acc, sm, 0, p.dstate, Plain<T, false>{Cc + t0 * bl, bl, rows - t0}, Runs<F32, true, false>{E, p.headdim, 0, pc, nullptr});
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int t = t0 + tl.r_off + i;
      const bool reads = t < rows && seg[t] == 0;  // else a sequence that started in the chunk
      const float f = reads ? fast_exp2(acs[t]) : 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = reads ? acc[i][j] * f : 0.f;
    }
  }
  {  // y's intra-chunk term
    const bool one_seg = seg[0] == seg[p.chunk_size - 1];  // the chunk is one segment
    const float* cb = p.cb + ((static_cast<int64_t>(b) * p.nchunks + c) * p.ngroups + g) * p.chunk_size * p.chunk_size;
    const int cs = p.chunk_size;
    TileAcc<T> prod(acc);
    prod.template run<true, true, true, kNarrowSlab>(sm, 0, min(t0 + kTile, rows),
                                                     DecayedCbT{cb, acs, dts, seg, t0, cs, rows, one_seg},
                                                     Plain<T, true>{xc, xl, pc});
    dq.load(dop + at, xl, nr, nq);  // in flight during finish()'s LDS hand-off
    zq.load(zp + at, xl, nr, nq);
    xq.load(xc + at, xl, nr, nq);
    prod.finish(sm);
  }

  S* dgp = x_chunk(p, static_cast<S*>(p.dout_g), b, l0, h) + p0;
  S* dzp = x_chunk(p, static_cast<S*>(p.dz), b, l0, h) + p0;
  const float* Dp = p.D ? p.D + static_cast<int64_t>(h) * p.headdim + p0 : nullptr;
  float dcol[4] = {};  // D of this thread's columns (0 past headdim); rows stored 4 at a time, as dx's
  if (Dp) {
#pragma unroll
    for (int j = 0; j < 4; ++j) dcol[j] = j < nq ? Dp[tl.c_off + j] : 0.f;
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int t = t0 + tl.r_off + i;
    if (t >= rows) continue;
    float dzv[4], gv[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float yd = Dp ? fmaf(dcol[j], xq(i, j), acc[i][j]) : acc[i][j];
      dzv[j] = dq(i, j) * yd * dsilu(zq(i, j));
      gv[j] = dq(i, j) * silu(zq(i, j));  // g, rounded as later stages read it
    }
    store4<T>(dzp + t * xl + tl.c_off, nq, dzv);
    store4<T>(dgp + t * xl + tl.c_off, nq, gv);
  }
}

}  // namespace ssd_bwd
}  // namespace m2r

// ptxas' register cap (NVIDIA only): 2 blocks per SM
#define M2R_SSD_BWD_DZ(DT, T) \
  M2R_KERNEL_MIN_BLOCKS(m2r::ssd_bwd::kThreads, 2) m2r_ssd_bwd_dz_##DT(SsdBwdParams p) { m2r::ssd_bwd::dz<m2r::T>(p); }
M2R_SSD_BWD_DZ(f32, F32)
M2R_SSD_BWD_DZ(f16, F16)
M2R_SSD_BWD_DZ(bf16, BF16)
