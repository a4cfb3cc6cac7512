// Mamba2 SSD backward, stage 4: dx (the stages and their grids: ssd_bwd_common.h).
#include "ssd_bwd_common.h"

namespace m2r {
namespace ssd_bwd {

// dx's first operand: C·Bᵀ decayed and masked, [s][t] with t (k) unit-stride, in two phases
// (as Runs): the fp32 runs first, then the decays and masks
struct DecayedCb {
  static constexpr bool kTwoPhase = true, kMFast = false;
  typedef RawRun<float> Raw;
  const float* cb;
  const float* acs;
  const int32_t* seg;
  int s0, cs;
  bool one_seg;
  M2R_DEVICE Raw fetch(int t, int m, int kv) const {
    Raw r;
    r.fetch(cb + (s0 + m) * cs + t, kv);
    return r;
  }
  M2R_DEVICE void cook(int t, int m, int kv, const Raw& r, float (&v)[kRun]) const {
    r.template get<F32>(v);
    const int s = s0 + m;
    const float as = acs[s];
    float a[kRun];
    lds8(acs + t, a);
    if (one_seg && kv == kRun && s <= t) {  // every term of the run is live
#pragma unroll
      for (int e = 0; e < kRun; ++e) v[e] *= fast_exp2(a[e] - as);
    } else {
      const int sg = seg[s];
      int32_t st[kRun];
      lds8(seg + t, st);
#pragma unroll
      for (int e = 0; e < kRun; ++e) v[e] = e < kv && s <= t + e && st[e] == sg ? v[e] * fast_exp2(a[e] - as) : 0.f;
    }
  }
};

// ---- 4. dx -------------------------------------------------------------------------------------

// dx loads each slab's runs during the product before it on the wave32 targets (NVIDIA, where
// ptxas fits it in 128 registers, and gfx11 / gfx12); the wave64 targets' scalar registers are
// short for the second set of addresses
constexpr bool kDxPrefetch = kWavefront == 32;

template <typename T>
M2R_DEVICE void dx(const SsdBwdParams& p) {
  typedef typename T::storage S;
  __shared__ __align__(16) float sm[kSmemFloats];
  __shared__ __align__(16) float acs[kMaxChunk];
  __shared__ float dts[kMaxChunk];
  __shared__ __align__(16) int32_t seg[kMaxChunk];
  __shared__ float to_end[kTile];  // the tile's rows' decay to the chunk end, 0 before its last segment
  // a block takes two tiles of rows, sq and stiles - 1 - sq (the middle one alone when stiles is
  // odd): the chunk's loads, masks and index arithmetic once for both, and every block the same
  // work (a tile's C·Bᵀ product runs from its rows to the chunk end)
  const int ptiles = cdiv(p.headdim, kTile), stiles = p.chunk_size / kTile, squads = cdiv(stiles, 2);
  const int h = blockIdx.x % p.nheads, g = h / p.heads_per_group, b = blockIdx.z;
  int rest = blockIdx.x / p.nheads;
  const int pt = rest % ptiles;
  rest /= ptiles;
  const int sq = rest % squads, c = rest / squads;
  const int p0 = pt * kTile, pc = min(kTile, p.headdim - p0);
  const int64_t l0 = static_cast<int64_t>(c) * p.chunk_size;
  const int rows = static_cast<int>(min(static_cast<int64_t>(p.chunk_size), p.seqlen - l0));
  const int xl = p.nheads * p.headdim, bl = p.ngroups * p.dstate, last = p.chunk_size - 1, cs = p.chunk_size;
  for (int s = threadIdx.x; s < p.chunk_size; s += kThreads) {
    acs[s] = p.dA_cs[chunk_row(p, b, h, c) + s] * kLog2e;
    dts[s] = p.dt_out[chunk_row(p, b, h, c) + s];
    seg[s] = seg_row(p, b, c)[s];
  }
  __syncthreads();
  // the chunk's last segment (a suffix) is what its final state is made of
  const int first_last = __syncthreads_count(threadIdx.x < p.chunk_size && seg[threadIdx.x] < seg[last]);
  const bool one_seg = first_last == 0;  // the chunk is one segment
  // the chunk's operands, the same for both tiles (per_lane: held in vector registers; live
  // through the loop they overran the scalar ones on the wave64 targets)
  const S* const xc = per_lane(x_chunk(p, static_cast<const S*>(p.x), b, l0, h) + p0);
  const S* const Bc = per_lane(bc_chunk(p, static_cast<const S*>(p.B), b, l0, g));
  const auto G = per_lane(state_base<T>(p, 0, b, c, h, p0));
  const float* const cb =
      per_lane(p.cb + ((static_cast<int64_t>(b) * p.nchunks + c) * p.ngroups + g) * p.chunk_size * p.chunk_size);
  const S* const gp = per_lane(x_chunk(p, static_cast<const S*>(p.dout_g), b, l0, h) + p0);
  const float* const Dp = p.D ? per_lane(p.D + static_cast<int64_t>(h) * p.headdim + p0) : nullptr;
  for (int k = 0; k < 2; ++k) {
    const int st = k == 0 ? sq : stiles - 1 - sq;
    if (k == 1) {
      if (st == sq) break;
      __syncthreads();  // the first tile's epilogue has read sm and to_end
    }
    const int s0 = st * kTile;
    // where this tile's dD partials go (column j at dd[j * dd_stride]: each column's partials
    // lie together, so their sum is a reduction of contiguous rows), held in vector registers: the
    // scalar ones run short by the epilogue on the wave64 targets
    const int dd_stride = p.batch * p.nchunks * stiles;
    float* const dd = per_lane(p.dD_part + (static_cast<int64_t>(h) * p.headdim + p0) * dd_stride +
                               (static_cast<int64_t>(b) * p.nchunks + c) * stiles + st);
    const Tile tl;
    float acc[4][4] = {}, kpart[4] = {};
    Quads<T> xq, gq;  // this thread's 4 x 4 of x and g
    const int at = (s0 + tl.r_off) * xl + tl.c_off, nr = rows - s0 - tl.r_off, nq = pc - tl.c_off;
    // Both products accumulate in one tile: B·G first, which decays to the chunk end (its rows
    // scaled in place, its share of ddt read on the way), then the masked, decayed C·Bᵀ times g.
    // On the matrix cores the FMA-layout acc stays 0 until the end, which leaves the registers to
    // load each slab's runs during the product before it.
    TileAcc<T> prod(acc);
    if (s0 + kTile > first_last) {  // B·G, decayed to the chunk end; its share of ddt first
      if (threadIdx.x < kTile) {
        const int s = s0 + threadIdx.x;
        to_end[threadIdx.x] = s < rows && s >= first_last ? fast_exp2(acs[last] - acs[s]) : 0.f;  // (read after the product's barriers)
      }
      prod.template run<false, true, kDxPrefetch, kNarrowSlab>(
          sm, 0, p.dstate, Plain<T, false>{Bc + s0 * bl, bl, rows - s0}, state_runs<T, true>(G, p.headdim, 0, pc));
      xq.load(xc + at, xl, nr, nq);
      float v[4][4];
      prod.view(sm, v);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float f = to_end[tl.r_off + i];
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (f != 0.f) kpart[i] = fmaf(xq(i, j), v[i][j] * f, kpart[i]);  // 0 past headdim: x's quad holds 0 there
      }
      prod.scale_rows(to_end);
    }
    const DecayedCb decayed{cb, acs, seg, s0, cs, one_seg};
    prod.template run<false, true, kDxPrefetch, kNarrowSlab>(sm, s0, rows, decayed, Plain<T, true>{gp, xl, pc});
    xq.load(xc + at, xl, nr, nq);  // (again: registers are short while the product runs)
    if (Dp) gq.load(gp + at, xl, nr, nq);
    prod.finish(sm);

    S* dxp = per_lane(x_chunk(p, static_cast<S*>(p.dx), b, l0, h) + p0);  // (per_lane: scalar registers, wave64)
    // each row's 4 columns in one store (store4): ncu had the element-by-element form, with D
    // and dt read again for every element, at a fifth of the kernel's instructions
    float dcol[4] = {};  // D of this thread's columns (0 past headdim)
    if (Dp) {
#pragma unroll
      for (int j = 0; j < 4; ++j) dcol[j] = j < nq ? Dp[tl.c_off + j] : 0.f;
    }
    float ddt[4] = {};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int s = s0 + tl.r_off + i;
      if (s >= rows) continue;
      const float dt_s = dts[s];
      float v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        v[j] = dt_s * acc[i][j];
        if (Dp) v[j] = fmaf(dcol[j], gq(i, j), v[j]);
        ddt[i] = fmaf(xq(i, j), acc[i][j], ddt[i]);  // 0 past headdim: x's quad holds 0 there
      }
      store4<T>(dxp + s * xl + tl.c_off, nq, v);
    }
    float dsum[4] = {};  // dD = sum_s g x, this thread's columns
    if (Dp) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) dsum[j] = fmaf(gq(i, j), xq(i, j), dsum[j]);  // 0 out of range
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) ddt[i] = row_sum16(ddt[i]), kpart[i] = row_sum16(kpart[i]);
    if (threadIdx.x % 16 == 0) {
      float* r1 = tok_row(p, 1, pt, b, h, c);
      float* r2 = tok_row(p, 2, pt, b, h, c);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int s = s0 + tl.r_off + i;
        r1[s] = ddt[i];
        r2[s] = s < rows ? kpart[i] * dts[s] : 0.f;
      }
    }
    if (Dp) {  // the 16 row groups' column sums through LDS (free: the product's last barrier has
               // passed), added in order; last, when little else is live (wave64: scalar registers)
#pragma unroll
      for (int j = 0; j < 4; ++j) sm[(threadIdx.x / 16) * kTile + tl.c_off + j] = dsum[j];
      __syncthreads();
      if (threadIdx.x < pc) {
        float v = 0.f;
        for (int q = 0; q < kThreads / 16; ++q) v += sm[q * kTile + threadIdx.x];
        dd[static_cast<int64_t>(threadIdx.x) * dd_stride] = v;
      }
    }
  }
}

}  // namespace ssd_bwd
}  // namespace m2r

// ptxas' register cap (NVIDIA only): 2 blocks per SM (dx skips the prefetch to fit it)
#define M2R_SSD_BWD_DX(DT, T) \
  M2R_KERNEL_MIN_BLOCKS(m2r::ssd_bwd::kThreads, 2) m2r_ssd_bwd_dx_##DT(SsdBwdParams p) { m2r::ssd_bwd::dx<m2r::T>(p); }
M2R_SSD_BWD_DX(f32, F32)
M2R_SSD_BWD_DX(f16, F16)
M2R_SSD_BWD_DX(bf16, BF16)
