// Mamba2 SSD backward, stage 6: dC and dB (the stages and their grids: ssd_bwd_common.h).
#include "ssd_bwd_common.h"

namespace m2r {
namespace ssd_bwd {

// dC's / dB's dcb operand, in two phases (as Runs): dcb[s][t] (t unit-stride, tiles of rows
// at r0), its terms with s > t 0. kDB: rows s = r0 + m, runs along the reduction t (k);
// else rows t = r0 + m, runs along them, the reduction over s (k).
template <bool kDB>
struct CausalDcb {
  static constexpr bool kTwoPhase = true, kMFast = !kDB;
  typedef RawRun<float> Raw;
  const float* d;
  int cs, r0, rows;
  M2R_DEVICE Raw fetch(int k, int m, int kv) const {
    Raw r;
    if constexpr (kDB) r.fetch(d + (r0 + m) * cs + k, kv);
    else r.fetch(d + k * cs + r0 + m, kv > 0 ? rows - r0 - m : 0);
    return r;
  }
  M2R_DEVICE void cook(int k, int m, int, const Raw& r, float (&v)[kRun]) const {
    r.template get<F32>(v);
#pragma unroll
    for (int e = 0; e < kRun; ++e) v[e] = (kDB ? r0 + m <= k + e : k <= r0 + m + e) ? v[e] : 0.f;
  }
};

// ---- 6. dC and dB ------------------------------------------------------------------------------

// dC[t] = sum over the group's heads of exp(dA_cs[t]) [t in the first segment] g[t]·entering
//         + sum_{s <= t} dcb[s][t] B[s]
// dB[s] = sum over the group's heads of exp(dA_cs[last] - dA_cs[s]) dt[s] [s in the last
//         segment] x[s]·G  + sum_{t >= s} dcb[s][t] C[t]
// A (64 tokens) x (64 dstate) tile; kDB picks which. On the matrix cores each head's product
// is weighted and summed in its accumulator fragments (frag_heads); on the FMA path dB's heads'
// sum is one product over (head, headdim) pairs, dC's one product per head.
constexpr int kWHeads = 16;   // dC / dB, FMA path: heads whose weights sit in LDS at a time
constexpr int kWHeadsC = 8;   // the same in frag_heads (where dC also holds C: its LDS <= 32 KB)
constexpr int kLdC = kTile + 8;  // dC's C tile in LDS: 16-bit rows, padded (conflict-free reads)

#if M2R_MMA != 0
// dC / dB load the next head's runs while one head multiplies (where a head's product is one
// slab) on NVIDIA's matrix cores; not on AMD's (and their emulations): there the runs held
// across the head's epilogue overran the scalar registers (gfx11 / gfx12: 14-24 SGPRs spilled
// in db; gfx9's wave64 takes slabs of 32 anyway)
constexpr bool kHeadPrefetch = M2R_MMA == 1;
// dC's / dB's heads on the matrix cores, into `sum` (the block's fragments of the tile, rows t
// from r0, columns n from n0): per head h of the group the product P = g_h[t]·entering_h (dC) /
// x_h[t]·G_h (dB) with K = headdim, the rows as stored, then per row t its weight where t takes
// part (rows [lo, hi); else 0, selected): exp(dA_cs[t]) (dC), exp(dA_cs[last] - dA_cs[t]) dt[t]
// (dB), added to `sum`. dC's kind 0 (sum_n C[t][n] P[t][n] times the weight) is reduced in the
// fragments (along each row: within the lane, over the row's lanes, then over the waves through
// LDS) and written by the first kTile threads. (The weights on the operand instead cost an
// unpack, multiply and repack of every element, and dC's kind 0 a hand-off of every head's
// tile through LDS: dC 472 -> 368 us at g8 on an H200.)
template <typename T, bool kDB>
M2R_DEVICE void frag_heads(const SsdBwdParams& p, mma::BlockTile<kThreads, kTile, kTile, 2>& sum, float* sm, int b, int c,
                           int g, int r0, int n0, int nt, int rows, int lo, int hi) {
  typedef typename T::storage S;
  typedef mma::BlockTile<kThreads, kTile, kTile, 2> BT;
  constexpr int kFm = BT::kFm, kFn = BT::kFn;
  __shared__ float part[BT::kWavesN][kTile];                // dC: kind 0 per row, per wave along n
  __shared__ float w[kWHeadsC * kTile];                     // the heads' weights
  __shared__ __align__(16) uint16_t ct[kTile * kLdC];       // dC: C[t][n], 0 out of range
  const int64_t l0 = static_cast<int64_t>(c) * p.chunk_size;
  const int xl = p.nheads * p.headdim, bl = p.ngroups * p.dstate, hd = p.headdim, h0 = g * p.heads_per_group;
  const int nc = min(kTile, p.dstate - n0), last = p.chunk_size - 1;
  if constexpr (!kDB) {
    const Plain<T, true> cl{bc_chunk(p, static_cast<const S*>(p.C), b, l0, g) + n0 + static_cast<int64_t>(r0) * bl, bl, nc};
#pragma unroll
    for (int q = threadIdx.x; q < kTile * kTile / kRun; q += kThreads) {
      const int t = q / (kTile / kRun), n = (q % (kTile / kRun)) * kRun;
      *reinterpret_cast<uint4*>(ct + t * kLdC + n) = cl.raw(t, n, rows - r0 - t);
    }
  }
  float unused[4][4];
  TileAcc<T> head(unused);  // each head's product (never finished)
  const int wn = head.tile.n0 / (16 * kFn);
  const S* rowp = x_chunk(p, static_cast<const S*>(kDB ? p.x : p.dout_g), b, l0, h0) + r0 * xl;
  // head r's operands: its rows of x (dB) / g (dC), its G (dB) / entering state (dC)
  const auto la = [&](int r) { return Plain<T, false>{per_lane(rowp + r * hd), xl, hi}; };  // (per_lane: see dcb)
  const auto lb = [&](int r) { return state_runs<T, false>(per_lane(state_base<T>(p, kDB ? 0 : 1, b, c, h0 + r, 0)), hd, n0, nc); };
  // where a head's product is one slab (headdim <= the slab), the next head's runs are loaded
  // while one head multiplies (kHeadPrefetch)
  const bool ahead = kHeadPrefetch && hd <= kNarrowSlab;
  SlabRuns<T, false, kNarrowSlab, decltype(la(0))> qa;
  SlabRuns<T, false, kNarrowSlab, decltype(lb(0))> qb;
  if (ahead) qa.fetch(0, hd, la(0)), qb.fetch(0, hd, lb(0));
  for (int hb = 0; hb < p.heads_per_group; hb += kWHeadsC) {
    const int nh = min(kWHeadsC, p.heads_per_group - hb);
    for (int e = threadIdx.x; e < nh * kTile; e += kThreads) {  // (w, ct: read after the product's barriers)
      const int m = e % kTile, t = r0 + m;
      const int64_t row = chunk_row(p, b, h0 + hb + e / kTile, c);
      float v = 0.f;
      if (m >= lo && m < hi) v = kDB ? __expf(p.dA_cs[row + last] - p.dA_cs[row + t]) * p.dt_out[row + t] : __expf(p.dA_cs[row + t]);
      w[e] = v;
    }
    for (int r = 0; r < nh; ++r) {
#pragma unroll
      for (int i = 0; i < kFm; ++i)
#pragma unroll
        for (int j = 0; j < kFn; ++j)
#pragma unroll
          for (int q = 0; q < mma::kAccRegs; ++q) head.tile.acc[i][j].v[q] = 0.f;
      const int hr = hb + r;
      if (ahead) {
        uint16_t* As = reinterpret_cast<uint16_t*>(sm);
        uint16_t* Bs = As + kTile * kLdK;
        qa.store(As, 0, hd, la(hr));
        qb.store(Bs, 0, hd, lb(hr));
        __syncthreads();
        if (hr + 1 < p.heads_per_group) qa.fetch(0, hd, la(hr + 1)), qb.fetch(0, hd, lb(hr + 1));
        head.tile.template product<T, kNarrowSlab, false, false>(As, kLdK, Bs, kLdK);
        __syncthreads();
      } else {  // (AMD, or headdim over the slab: the product's own pipeline)
        head.template run<false, false, false, kNarrowSlab>(sm, 0, hd, la(hr), lb(hr));
      }
      const float* wr = w + r * kTile;
      float rs[kFm][mma::kAccRows] = {};
#pragma unroll
      for (int i = 0; i < kFm; ++i)
#pragma unroll
        for (int j = 0; j < kFn; ++j)
#pragma unroll
          for (int q = 0; q < mma::kAccRegs; ++q) {
            const int t = head.tile.row(i, q), n = head.tile.col(j, q);
            const float v = t >= lo && t < hi ? head.tile.acc[i][j].v[q] * wr[t] : 0.f;
            sum.acc[i][j].v[q] += v;
            if constexpr (!kDB) rs[i][mma::acc_slot(q)] = fmaf(T::to_float(ct[t * kLdC + n]), v, rs[i][mma::acc_slot(q)]);
          }
      if constexpr (!kDB) {
#pragma unroll
        for (int i = 0; i < kFm; ++i)
#pragma unroll
          for (int sl = 0; sl < mma::kAccRows; ++sl) {
#pragma unroll
            for (int off = 1; off < mma::kRowLanes; off *= 2) rs[i][sl] += shfl_xor(rs[i][sl], off);
            if (mma::lane() % mma::kRowLanes == 0) part[wn][head.tile.row(i, mma::acc_slot_reg(sl))] = rs[i][sl];
          }
        __syncthreads();
        if (threadIdx.x < kTile) {  // (part is written again after the next head's barriers)
          float k0 = 0.f;
#pragma unroll
          for (int q = 0; q < BT::kWavesN; ++q) k0 += part[q][threadIdx.x];
          tok_row(p, 0, nt, b, h0 + hb + r, c)[r0 + threadIdx.x] = k0;
        }
      }
    }
    __syncthreads();  // (the next batch's weights overwrite w)
  }
}
#endif

template <typename T, bool kDB>
M2R_DEVICE void dbc(const SsdBwdParams& p) {
  typedef typename T::storage S;
  __shared__ __align__(16) float sm[kSmemFloats];
  __shared__ float w[kWHeads * kTile];
  const int ntiles = cdiv(p.dstate, kTile), ltiles = p.chunk_size / kTile;
  const int g = blockIdx.x % p.ngroups, b = blockIdx.z;
  int rest = blockIdx.x / p.ngroups;
  const int nt = rest % ntiles;
  rest /= ntiles;
  const int lt = rest % ltiles, c = rest / ltiles;
  const int r0 = lt * kTile, n0 = nt * kTile, nc = min(kTile, p.dstate - n0);
  const int64_t l0 = static_cast<int64_t>(c) * p.chunk_size;
  const int rows = static_cast<int>(min(static_cast<int64_t>(p.chunk_size), p.seqlen - l0));
  const int xl = p.nheads * p.headdim, bl = p.ngroups * p.dstate, last = p.chunk_size - 1;
  const int32_t* sg = seg_row(p, b, c);
  const int s = threadIdx.x;
  // the next slab's runs are loaded while one is multiplied, except on AMD (there its
  // addresses and the prefetched runs overrun the scalar registers: 2-70 SGPRs spilled)
#if M2R_AMD
  constexpr bool kPrefetch = false;
#else
  constexpr bool kPrefetch = true;
#endif
  // the tokens that read the entering state (dC: the first segment, a prefix) or make the
  // final state (dB: the last segment, a suffix)
  const bool part = s < rows && (kDB ? sg[s] == sg[last] : sg[s] == 0);
  const int count = __syncthreads_count(part);
  const int lo = max(kDB ? rows - count : 0, r0) - r0, hi = min(kDB ? rows : count, r0 + kTile) - r0;
  const Tile tl;
  const int hd = p.headdim, h0 = g * p.heads_per_group;
  float acc[4][4] = {};
  // dC: this thread's 4 x 4 of C, for each head's exponent gradient of its entering-state term
  Quads<T> cq;
  const S* cqp = per_lane(bc_chunk(p, static_cast<const S*>(p.C), b, l0, g) + n0 + (r0 + tl.r_off) * bl + tl.c_off);
  const auto load_c = [&] { cq.load(cqp, bl, rows - r0 - tl.r_off, nc - tl.c_off); };
  // tok kind 0 of head h: sum_n C[t][n] P[t][n] over this tile's n, with P = exp(dA_cs[t]) g[t]·entering
  // (so sum_p g y_off, y_off the output's entering-state term); 0 where the term is not read
  const auto put_kind0 = [&](int h, const float (&rs)[4]) {
    if (threadIdx.x % 16 == 0) {
      float* r = tok_row(p, 0, nt, b, h, c) + r0 + tl.r_off;
#pragma unroll
      for (int i = 0; i < 4; ++i) r[i] = rs[i];
    }
  };
  const auto kind0 = [&](int h, const float (&ph)[4][4]) {  // after load_c()
    float rs[4] = {};
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) rs[i] = fmaf(cq(i, j), ph[i][j], rs[i]);
#pragma unroll
    for (int i = 0; i < 4; ++i) rs[i] = row_sum16(rs[i]);
    put_kind0(h, rs);
  };
  // wave64: C's quads once, before the heads (a load per head overruns gfx9's scalar registers);
  // wave32: once per head, during its hand-off (held across the heads, they overrun sm_90's 128
  // vector registers)
  constexpr bool kCOnce = kWavefront == 64;
  // on the matrix cores each head's product is weighted and summed (dC: and reduced for kind 0)
  // in its accumulator fragments (frag_heads)
  constexpr bool kFrag = TileAcc<T>::kMma;
  if constexpr (!kDB && kCOnce && !kFrag) load_c();
  // the dcb term's product (below); on the matrix cores the heads' sum goes into its fragments first
  TileAcc<T> prod(acc);
  const bool heads_live = hi > lo && (kDB || c > 0 || p.has_init);  // else no head's term is read
  if constexpr (kFrag) {
#if M2R_MMA != 0
    if (heads_live) frag_heads<T, kDB>(p, prod.tile, sm, b, c, g, r0, n0, nt, rows, lo, hi);
#endif
  } else if (heads_live) {
    const S* rowp = x_chunk(p, static_cast<const S*>(kDB ? p.x : p.dout_g), b, l0, h0) + r0 * xl;
    const float* st = (kDB ? p.dstates : p.states) + states_at(p, b, c, h0) + static_cast<int64_t>(n0) * p.headdim;
    const int64_t sstride = static_cast<int64_t>(p.dstate) * p.headdim;  // the next head's state
    TileAcc<T> heads(acc);  // dB: the heads' products, one accumulation
    for (int hb = 0; hb < p.heads_per_group; hb += kWHeads) {  // the heads' weights in LDS
      const int nh = min(kWHeads, p.heads_per_group - hb);
      for (int e = threadIdx.x; e < nh * kTile; e += kThreads) {
        const int r = e / kTile, m = e % kTile, h = h0 + hb + r, t = r0 + m;
        const float* a = p.dA_cs + chunk_row(p, b, h, c);
        float v = 0.f;
        if (m >= lo && m < hi) v = kDB ? __expf(a[last] - a[t]) * p.dt_out[chunk_row(p, b, h, c) + t] : __expf(a[t]);
        w[e] = v;
      }
      __syncthreads();
      for (int r = 0; r < nh; ++r) {
        const S* rp = per_lane(rowp + (hb + r) * hd);  // (per_lane: see dcb)
        const float* sp = per_lane(st + (hb + r) * sstride);
        const float* wr = w + r * kTile;
        const Runs<T, false, true> la{rp, xl, lo, hi, wr};  // the heads' rows times their weights
        // the states (this path is the FMA path's: one run at a time, so one-phase or not
        // makes no difference to dC's registers; on the matrix cores see frag_heads)
        const Runs<F32, false, false> states{sp, hd, 0, nc, nullptr};
        const auto states_dc = [&](int pp, int m, int kv, float (&v)[kRun]) { load_run32(sp + m * hd + pp, m < nc ? kv : 0, v); };
        if constexpr (kDB) {
          heads.template run<false, false, kPrefetch>(sm, 0, hd, la, states);
        } else {  // each head's product apart: its exponent gradient needs it
          float ph[4][4] = {};
          TileAcc<T> head(ph);
          // (one slab per head at headdim 64: prefetch has no next slab to load; wave64: slabs of 32)
          head.template run<false, false, false, kNarrowSlab>(sm, 0, hd, la, states_dc);
          if constexpr (!kCOnce) load_c();
          head.finish(sm);
          kind0(h0 + hb + r, ph);
#pragma unroll
          for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][j] += ph[i][j];
        }
      }
    }
    if constexpr (kDB) heads.finish(sm);
  }
  if constexpr (!kDB) {
    if (!heads_live) {
      const float zero[4] = {};
      for (int r = 0; r < p.heads_per_group; ++r) put_kind0(h0 + r, zero);
    }
  }
  // the dcb term: dcb tiles exist for s-tile <= t-tile, masked entries written as 0
  const int64_t cs = p.chunk_size;
  const float* d = per_lane(p.cb + ((static_cast<int64_t>(b) * p.nchunks + c) * p.ngroups + g) * cs * cs);
  const S* other = per_lane(bc_chunk(p, static_cast<const S*>(kDB ? p.C : p.B), b, l0, g) + n0);
  const Plain<T, true> lb{other, bl, nc};  // k (q) < rows in both products
  if constexpr (kDB) {  // rows s, reduction t >= s: dcb[s][t] with t unit-stride
    prod.template run<false, true, kPrefetch>(sm, r0, rows, CausalDcb<true>{d, static_cast<int>(cs), r0, rows}, lb);
  } else {  // rows t, reduction s <= t: dcb[s][t], t unit-stride
    prod.template run<true, true, kPrefetch>(sm, 0, min(r0 + kTile, rows), CausalDcb<false>{d, static_cast<int>(cs), r0, rows}, lb);
  }
  prod.finish(sm);
  // the gradient in B's (C's) dtype when that is x's, rounded once as a float32 result would be
  // by the host's conversion; else float32
  void* dst = kDB ? p.dB : p.dC;
  const bool io16 = (p.dbc_io >> (kDB ? 0 : 1)) & 1;
  float* out32 = bc_chunk(p, static_cast<float*>(dst), b, l0, g) + n0;
  S* out16 = bc_chunk(p, static_cast<S*>(dst), b, l0, g) + n0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int t = r0 + tl.r_off + i;
    if (t >= rows) continue;
    const int64_t o = static_cast<int64_t>(t) * bl + tl.c_off;
    if (io16)
      store4<T>(out16 + o, nc - tl.c_off, acc[i]);
    else
      store4<F32>(out32 + o, nc - tl.c_off, acc[i]);
  }
}

}  // namespace ssd_bwd
}  // namespace m2r

// ptxas' register cap (NVIDIA only): 2 blocks per SM
#define M2R_SSD_BWD_DBC(DT, T) \
  M2R_KERNEL_MIN_BLOCKS(m2r::ssd_bwd::kThreads, 2) m2r_ssd_bwd_dc_##DT(SsdBwdParams p) { m2r::ssd_bwd::dbc<m2r::T, false>(p); } \
  M2R_KERNEL_MIN_BLOCKS(m2r::ssd_bwd::kThreads, 2) m2r_ssd_bwd_db_##DT(SsdBwdParams p) { m2r::ssd_bwd::dbc<m2r::T, true>(p); }
M2R_SSD_BWD_DBC(f32, F32)
M2R_SSD_BWD_DBC(f16, F16)
M2R_SSD_BWD_DBC(bf16, BF16)
