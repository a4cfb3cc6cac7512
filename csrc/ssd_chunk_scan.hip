// Mamba2 SSD forward, stage 5: chunk_scan (the stages and their grids: ssd_common.h).
#include "ssd_common.h"

namespace m2r {
namespace ssd {

// ---- 5. chunk scan --------------------------------------------------------------------------

// Non-finite x entries of one chunk and headdim tile (32 kWords columns). chunk_scan multiplies
// x by a weight matrix whose masked entries (later positions, other sequences) are 0, and 0 x
// NaN is NaN: so x enters the product with those entries as 0, and every output they reach --
// same column, same sequence, at or after them -- is set to NaN afterwards. Entries beyond the
// first are found only when an x value is not finite; the clean path pays one flag test per
// row. Both live in LDS: `cols` (kMaxChunk x kWords words) may be scratch space the kernel
// does not use while x is staged.
template <int kWords = 2>
struct NonFinite {
  uint32_t* cols;  // per position s: cols[kWords s ...], the tile columns of bad x
  int* any;
  template <int kNT = kThreads>
  M2R_DEVICE void clear(int chunk_size) const {  // then a barrier
    for (int s = threadIdx.x; s < kWords * chunk_size; s += kNT) cols[s] = 0u;
    if (threadIdx.x == 0) *any = 0;
  }
  // bits: columns col, col + 1, ... (within one word)
  M2R_DEVICE void mark(int s, int col, uint32_t bits) const {
    atomicOr(&cols[kWords * s + col / 32], bits << (col % 32));
    *any = 1;
  }
  // the columns cq .. cq + 3 (cq a multiple of 4) of output row t that a non-finite x reaches, as
  // 4 bits (after a barrier; callers test *any first, so the clean path never walks the segment)
  M2R_DEVICE uint32_t reaching4(int t, const int32_t* seg, int cq) const {
    uint32_t m = 0;
    for (int s = t; s >= 0 && seg[s] == seg[t]; --s) m |= cols[kWords * s + cq / 32];
    return m >> (cq % 32) & 0xfu;
  }
};

// The last step of chunk_scan for one element: out[t][pp] = (y + D x[t][pp]) silu(z[t][pp]).
// In-chunk offsets are 32-bit (the host checks chunk_size * stride < 2^31): fewer scalar
// registers live, which gfx90a otherwise runs out of.
template <typename T, bool kHasZ>
struct OutRows {
  typedef typename T::storage S;
  const S* xp;
  const S* zp;
  S* out;
  int xl, zl, ol;
  M2R_DEVICE OutRows(const SsdParams& p, int b, int h, int64_t l0, const S* x_chunk)
      : xp(x_chunk),
        zp(kHasZ ? static_cast<const S*>(p.z) + b * p.z_batch_stride + l0 * p.z_l_stride + h * p.z_h_stride : nullptr),
        out(static_cast<S*>(p.out) + b * p.out_batch_stride + l0 * p.out_l_stride + h * p.out_h_stride),
        xl(static_cast<int>(p.x_l_stride)), zl(static_cast<int>(p.z_l_stride)), ol(static_cast<int>(p.out_l_stride)) {}
  M2R_DEVICE void store(const SsdParams& p, int h, int t, int pp, float y) const {
    if (p.D) y = fmaf(load_as_float(p.D, p.d_dtype, h * p.D_h_stride + pp * p.D_p_stride), T::to_float(xp[t * xl + pp]), y);
    if constexpr (kHasZ) y *= silu(T::to_float(zp[t * zl + pp]));
    out[t * ol + pp] = T::from_float(y);
  }
};

// Whether a non-finite x[s][pp] with s <= t in t's segment reaches out[t][pp]: the FMA
// variant's form of NonFinite::reaching4, reading x again (only once a non-finite x was seen).
template <typename T>
M2R_DEVICE bool reached(const typename T::storage* xp, int xl, int t, int pp, const int32_t* seg) {
  for (int s = t; s >= 0 && seg[s] == seg[t]; --s)
    if (!isfinite(T::to_float(xp[s * xl + pp]))) return true;
  return false;
}

// A (kRows positions) x (64 headdim) tile of one chunk and head:
//   y[t] = exp(dA_cs[t]) [seg[t] == 0] C[t]·entering  +  sum_{s <= t, seg[s] == seg[t]}
//          C[t]·B[s] exp(dA_cs[t] - dA_cs[s]) dt[s] x[s]  +  D x[t],   then y * silu(z[t]).
// kCols (64 or 128): the grid's headdim columns per block, taken 64 at a time (the matrix-core
// forms' tile widths, so that every form runs on every target)
template <typename T, int kRows, bool kHasZ, int kNT = kThreads, int kCols = 64>
M2R_DEVICE void chunk_scan_fma(const SsdParams& p) {
  typedef typename T::storage S;
  // a thread's rows: kRowGroups runs of 4, kRowSpan apart (the block's 16-thread rows cover
  // kRowSpan positions)
  constexpr int kRowSpan = kNT / 4, kRowGroups = kRows / kRowSpan;
  static_assert(kRowGroups >= 1 && kRowGroups * kRowSpan == kRows, "tile does not split over the block");
  constexpr int kLdA = kRows + kPad, kLdB = 64 + kPad;
  __shared__ __align__(16) float As[kSlab * kLdA];
  __shared__ __align__(16) float Bs[kSlab * kLdB];
  __shared__ float acs[kMaxChunk], dts[kMaxChunk];
  __shared__ int32_t seg[kMaxChunk];
  __shared__ int bad_any;  // a non-finite x in this tile's chunk (rare)
  const ScanBlock<kRows, kCols> blk(p);
  const int h = blk.h, g = blk.g, b = blk.b, c = blk.c, t0 = blk.t0, p_tile = blk.p0;
  const int64_t l0 = static_cast<int64_t>(c) * p.chunk_size;
  const int rows = static_cast<int>(min(static_cast<int64_t>(p.chunk_size), p.seqlen - l0));
  if (t0 >= rows) return;  // past the sequence's end: no output (as chunk_scan_mma)
  {
    const float* a = p.dA_cs + chunk_row(p, b, h, c);
    const float* d = p.dt_out + chunk_row(p, b, h, c);
    const int32_t* sg = p.seg + (static_cast<int64_t>(b) * p.nchunks + c) * p.chunk_size;
    for (int s = threadIdx.x; s < p.chunk_size; s += kNT) acs[s] = a[s], dts[s] = d[s], seg[s] = sg[s];
  }
  // 64 headdim columns from p0 (a lambda: the 64-column forms take it once, as they were written)
  const auto columns = [&](const int p0) {
    if (threadIdx.x == 0) bad_any = 0;
    __syncthreads();  // acs, dts, seg; bad_any
    const int t_off = 4 * (threadIdx.x / 16), p_off = 4 * (threadIdx.x % 16);
    float acc[4 * kRowGroups][4] = {};

    // the entering state, read through C (it is zero for chunk 0 without initial states)
    if (c > 0 || p.initial_states) {
      const S* Cp = static_cast<const S*>(p.C) + b * p.C_batch_stride + l0 * p.C_l_stride + g * p.C_g_stride;
      const float* E = p.states + states_at(p, b, c, h);
      for (int n0 = 0; n0 < p.dstate; n0 += kSlab) {
        stage_transposed<T, kRows, kLdA, kNT>(As, Cp, p.C_l_stride, t0, rows, n0, p.dstate);
#pragma unroll 4  // more keeps every address live: 3x the registers
        for (int i = 0; i < 64 * kSlab / kNT; ++i) {
          const int idx = threadIdx.x + i * kNT;
          const int col = idx % 64, k = idx / 64;
          Bs[k * kLdB + col] = n0 + k < p.dstate && p0 + col < p.headdim
                                   ? E[static_cast<int64_t>(n0 + k) * p.headdim + p0 + col] : 0.f;
        }
        __syncthreads();
        slab_product<kRowGroups, 1, kLdA, kLdB, kRowSpan>(acc, As, Bs, t_off, p_off);
        __syncthreads();
      }
#pragma unroll
      for (int i = 0; i < 4 * kRowGroups; ++i) {
        const int t = t0 + t_off + (i % 4) + kRowSpan * (i / 4);
        const bool from_before = seg[t] == 0;  // else a sequence that started in this chunk
        const float f = __expf(acs[t]);
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = from_before ? acc[i][j] * f : 0.f;
      }
    }

    // within the chunk: positions s <= t of the same segment
    const S* xp = static_cast<const S*>(p.x) + b * p.x_batch_stride + l0 * p.x_l_stride + h * p.x_h_stride;
    const float* cb = p.cb + ((static_cast<int64_t>(b) * p.nchunks + c) * p.ngroups + g) *
                                 static_cast<int64_t>(p.chunk_size) * p.chunk_size;
    const int s_end = min(t0 + kRows, rows);
    for (int s0 = 0; s0 < s_end; s0 += kSlab) {
#pragma unroll 4  // more keeps every address live: 3x the registers
      for (int i = 0; i < kRows * kSlab / kNT; ++i) {
        const int idx = threadIdx.x + i * kNT;
        const int t = idx % kRows, k = idx / kRows;
        const int s = s0 + k, tt = t0 + t;
        float v = 0.f;
        if (s <= tt && s < rows && seg[s] == seg[tt])
          v = cb[static_cast<int64_t>(s) * p.chunk_size + tt] * __expf(acs[tt] - acs[s]) * dts[s];
        As[k * kLdA + t] = v;
      }
      // x, non-finite entries as 0 and flagged (the masked weights are 0, and 0 x NaN is NaN).
      // Which outputs they reach is worked out from x itself, in the epilogue, only if any was.
      bool nonfinite = false;
#pragma unroll 4
      for (int i = 0; i < 64 * kSlab / kNT; ++i) {
        const int idx = threadIdx.x + i * kNT;
        const int col = idx % 64, r = idx / 64;
        float v = 0.f;
        if (s0 + r < rows && p0 + col < p.headdim) v = T::to_float(xp[(s0 + r) * static_cast<int>(p.x_l_stride) + p0 + col]);
        const bool finite = isfinite(v);
        nonfinite |= !finite;
        Bs[r * kLdB + col] = finite ? v : 0.f;
      }
      if (nonfinite) bad_any = 1;
      __syncthreads();
      slab_product<kRowGroups, 1, kLdA, kLdB, kRowSpan>(acc, As, Bs, t_off, p_off);
      __syncthreads();
    }

    const OutRows<T, kHasZ> o(p, b, h, l0, xp);
#pragma unroll
    for (int i = 0; i < 4 * kRowGroups; ++i) {
      const int t = t0 + t_off + (i % 4) + kRowSpan * (i / 4);
      if (t >= rows) continue;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int pp = p0 + p_off + j;
        if (pp < p.headdim) o.store(p, h, t, pp, bad_any && reached<T>(xp, static_cast<int>(p.x_l_stride), t, pp, seg) ? __int_as_float(0x7fc00000) : acc[i][j]);
      }
    }
  };
  if constexpr (kCols == 64) {
    columns(p_tile);
  } else {
#pragma unroll 1
    for (int p0 = p_tile; p0 < min(p_tile + kCols, p.headdim); p0 += 64) {  // uniform over the block
      columns(p0);
      __syncthreads();  // before the next columns' reset of bad_any and writes to LDS
    }
  }
}

#if M2R_MMA != 0
// kCols: the tile's headdim columns (64, or 128: the entering state's C and the within-chunk
// weights, worked out per tile, then serve a 128-wide headdim once)
template <typename T, int kRows, bool kHasZ, int kNT = kThreads, int kCols = 64>
M2R_DEVICE void chunk_scan_mma(const SsdParams& p) {
  typedef KMajor<kRows> LM;
  typedef KMajor<kCols> LX;
  constexpr int kLdOut = kCols + 8;  // O's rows (kLdO for 64 columns)
  constexpr int kASize = kRows * kLdH > LM::kSize ? kRows * kLdH : LM::kSize;
  constexpr int kLoSize = kSplitScan ? LM::kSize : 0;  // (rounded once: no remainder tile)
  constexpr int kOperands = kASize + kLoSize + 2 * LX::kSize, kOut = 64 * kLdOut * 2;
  __shared__ __align__(16) uint16_t smem[kOperands > kOut ? kOperands : kOut];
  uint16_t* As = smem;                   // C [t][n], then C·Bᵀ weighted [s][t]
  uint16_t* As_lo = As + kASize;         // the weighted C·Bᵀ's rounding remainder (kSplitScan)
  uint16_t* Bs = As_lo + kLoSize;        // entering state [n][p], then x [s][p]
  uint16_t* Bs_lo = Bs + LX::kSize;      // the entering state's rounding remainder
  __shared__ float acs[kMaxChunk], dts[kMaxChunk];  // acs: dA_cs times log2(e)
  __shared__ int32_t seg[kMaxChunk];
  __shared__ int bad_any;
  // non-finite x marks: in Bs_lo, which holds nothing once the entering state is done
  constexpr int kWords = kCols / 32;
  static_assert(LX::kSize * sizeof(uint16_t) >= kWords * kMaxChunk * sizeof(uint32_t), "marks do not fit");
  const NonFinite<kWords> bad{reinterpret_cast<uint32_t*>(Bs_lo), &bad_any};
  const ScanBlock<kRows, kCols> blk(p);
  const int h = blk.h, g = blk.g, b = blk.b, c = blk.c, t0 = blk.t0, p0 = blk.p0;
  const int64_t l0 = static_cast<int64_t>(c) * p.chunk_size;
  const int rows = static_cast<int>(min(static_cast<int64_t>(p.chunk_size), p.seqlen - l0));
  const int xl = static_cast<int>(p.x_l_stride), cl = static_cast<int>(p.C_l_stride);
  const int pcols = min(kCols, p.headdim - p0), cs = p.chunk_size;
  // a tile wholly past the sequence's end (the last chunk's, when it is partial) has no output:
  // its entering-state and within-chunk products would only fill rows that are never stored
  if (t0 >= rows) return;
  constexpr int kWavesM = kRows == 128 && kNT / kWavefront == 8 ? 4 : 2;
  mma::BlockTile<kNT, kRows, kCols, kWavesM> tile;  // rows t, cols p

  {
    const float* a = p.dA_cs + chunk_row(p, b, h, c);
    const float* d = p.dt_out + chunk_row(p, b, h, c);
    const int32_t* sg = p.seg + (static_cast<int64_t>(b) * p.nchunks + c) * p.chunk_size;
    // unrolled to the largest chunk: every load is requested before the first store waits (one
    // round trip, where a loop over kNT positions at a time made two at chunk 256 on 128 threads,
    // with nothing else in flight at the block's start)
    static_assert(kMaxChunk % kNT == 0, "the unrolled loop covers every position of the largest chunk");
#pragma unroll
    for (int u = 0; u < kMaxChunk / kNT; ++u) {
      const int s = static_cast<int>(threadIdx.x) + u * kNT;
      if (s < cs) acs[s] = a[s] * kLog2e, dts[s] = d[s], seg[s] = sg[s];
    }
  }
  // the entering state's decay, exp2(acs[t]) on rows whose sequence began before the chunk
  const auto scale_entering = [&] {
#pragma unroll
    for (int i = 0; i < tile.kFm; ++i)
#pragma unroll
      for (int r = 0; r < mma::kAccRegs; ++r) {
        const int t = t0 + tile.row(i, r);
        const bool from_before = seg[t] == 0;  // else a sequence that started in this chunk
        const float f = fast_exp2(acs[t]);
#pragma unroll
        for (int j = 0; j < tile.kFn; ++j) tile.acc[i][j].v[r] = from_before ? tile.acc[i][j].v[r] * f : 0.f;
      }
  };
  // the entering state, read through C (it is zero for chunk 0 without initial states)
  const bool entering = c > 0 || p.initial_states;
  if (entering) {
    const uint16_t* Cp = static_cast<const uint16_t*>(p.C) + b * p.C_batch_stride + l0 * p.C_l_stride + g * p.C_g_stride + t0 * cl;
    const bool cvec = aligned(Cp, 2 * cl, 16), evec = p.headdim % 4 == 0;
    const int crows = rows - t0;
    const float* E = p.states + states_at(p, b, c, h) + p0;
    Rows16<kRows, kSlab, kNT> cf;
    Rows32<kSlab, kCols, kNT> ef;
    cf.fetch(Cp, cl, crows, p.dstate, cvec), ef.fetch(E, p.headdim, p.dstate, pcols, evec);
    __syncthreads();  // acs, dts, seg
    for (int n0 = 0; n0 < p.dstate; n0 += kSlab) {
      cf.put(As, kLdH);
      ef.template put_split<T, kSplitEnter>(Bs, Bs_lo, LX::kLd);
      __syncthreads();
      const int n1 = n0 + kSlab;
      if (n1 < p.dstate)
        cf.fetch(Cp + n1, cl, crows, p.dstate - n1, cvec), ef.fetch(E + n1 * p.headdim, p.headdim, p.dstate - n1, pcols, evec);
      if constexpr (kSplitEnter) tile.template product_split<T, kSlab, false, true, false>(As, nullptr, kLdH, Bs, Bs_lo, LX::kLd);
      else tile.template product<T, kSlab, false, true>(As, kLdH, Bs, LX::kLd);
      __syncthreads();
    }
    scale_entering();
    bad.template clear<kNT>(cs);  // Bs_lo is free now
  } else {
    bad.template clear<kNT>(cs);
    __syncthreads();  // acs (the entering state's product has barriers of its own)
  }
  // within the chunk: positions s <= t of the same segment, M[s][t] = C·Bᵀ[s][t] dt[s]
  // exp(dA_cs[t] - dA_cs[s]) staged [s][t] (split), times x [s][p]. Its first slab is requested
  // here, before the barrier below (after it, the loads went out with nothing else in flight:
  // H200, chunk_scan 1-3% slower)
  const uint16_t* xp = static_cast<const uint16_t*>(p.x) + b * p.x_batch_stride + l0 * p.x_l_stride + h * p.x_h_stride + p0;
  const bool xvec = aligned(xp, 2 * xl, 16);
  const float* cb = p.cb + ((static_cast<int64_t>(b) * p.nchunks + c) * p.ngroups + g) *
                               static_cast<int64_t>(cs) * cs + t0;
  Rows16<kSlab, kCols, kNT> xf;
  xf.fetch(xp, xl, rows, pcols, xvec);
  Rows32<kSlab, kRows, kNT> mf;  // C·Bᵀ rows: the workspace is chunk_size^2, always in range
  mf.fetch(cb, cs, kSlab, kRows, true);
  // whether dA_cs never rises over the chunk's tokens (dt A <= 0, as in every Mamba model),
  // read from acs in LDS (scaled by log2(e), the values the factored exponentials take) after
  // the entering state's product: a global re-read here cost 1% of chunk_scan (H100), and
  // worked out with acs above, held through the product, the flag spilled scalar registers on
  // the wave64 targets
  int rises = 0;
  for (int s = threadIdx.x + 1; s < rows; s += kNT) rises |= acs[s] > acs[s - 1];
  const bool decays = __syncthreads_count(rises) == 0;  // also the barrier for acs, dts, seg, marks

  const int s_end = min(t0 + kRows, rows);
  // the slabs wholly before the tile end here, where the decay factors (below) and there are no
  // segments (one value for the three)
  const int plain_end = decays && !p.seq_idx ? min(t0 + 1, rows) : 0;
  const int tq = t0 + mf.col();  // this thread's 4 positions t
  // In the slabs wholly before the tile (s <= t0 <= t) the decay factors about t0:
  // exp2(a_t - a_s) = exp2(a_t - a_t0) exp2(a_t0 - a_s), both at most 1 where dA_cs never rises:
  // an exponential per row s and per column t instead of one per element.
  const float a_0 = per_lane(acs[t0]);  // (per_lane: scalar registers, wave64)
  float a_t[4], f_t[4];
  int seg_t[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    a_t[e] = acs[tq + e], seg_t[e] = seg[tq + e];
    f_t[e] = tq + e < rows ? fast_exp2(a_t[e] - a_0) : 0.f;
  }
  for (int s0 = 0; s0 < s_end; s0 += kSlab) {
    // every s of the slab in range, at or before every t of the tile, no segments, the decay
    // factored: no masks
    const bool plain = s0 + kSlab <= plain_end;
#pragma unroll
    for (int i = 0; i < mf.kN; ++i) {
      const int k = mf.row(i), s = s0 + k;
      float v[4] = {mf.q[i].x, mf.q[i].y, mf.q[i].z, mf.q[i].w};
      if (plain) {
        const float ws = dts[s] * fast_exp2(a_0 - acs[s]);
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] *= ws * f_t[e];
      } else {
        const float as = acs[s], ds = dts[s];
        const int sgs = seg[s];
#pragma unroll
        for (int e = 0; e < 4; ++e)
          v[e] = s < rows && s <= tq + e && sgs == seg_t[e] ? v[e] * ds * fast_exp2(a_t[e] - as) : 0.f;
      }
      store_split<T, kSplitScan>(As + k * LM::kLd + mf.col(), As_lo + k * LM::kLd + mf.col(), v);
    }
    xf.template put_finite<T>(Bs, LX::kLd, bad, s0);  // the masked weights are 0: no NaN x
    __syncthreads();
    const int s1 = s0 + kSlab;
    if (s1 < s_end) mf.fetch(cb + s1 * cs, cs, kSlab, kRows, true), xf.fetch(xp + s1 * xl, xl, rows - s1, pcols, xvec);
    // a wave whose rows t all precede the slab has only masked (0) terms in it: it skips the
    // product (in the diagonal slabs; uniform over the wave)
    if (s0 < t0 + tile.m0 + tile.kFm * 16) {
      if constexpr (kSplitScan) tile.template product_split<T, kSlab, true, true, true>(As, As_lo, LM::kLd, Bs, nullptr, LX::kLd);
      else tile.template product<T, kSlab, true, true>(As, LM::kLd, Bs, LX::kLd);
    }
    __syncthreads();
  }

  // D, the gate and the store, 64 rows at a time through LDS (over the operand tiles): each
  // thread then owns 4 consecutive headdim columns of every kRowStep-th row (kCols / 4 threads
  // a row: the 16th row on 256 threads at 64 columns), 8 bytes at a time.
  float* O = reinterpret_cast<float*>(smem);
  constexpr int kRowThreads = kCols / 4, kRowStep = kNT / kRowThreads, kOutRows = 64 / kRowStep;  // a thread's rows of each 64
  const int cq = 4 * (threadIdx.x % kRowThreads), r_first = threadIdx.x / kRowThreads;
  // which of those outputs a non-finite x reaches: 4 bits per row, read before O overwrites
  // the marks
  static_assert(kRows / 64 * kOutRows * 4 <= 32, "poison bits do not fit a word");
  uint32_t poison = 0;
  if (bad_any) {
#pragma unroll
    for (int half = 0; half < kRows / 64; ++half)
#pragma unroll
      for (int k = 0; k < kOutRows; ++k) {
        const int t = t0 + 64 * half + r_first + kRowStep * k;
        if (t < rows) poison |= bad.reaching4(t, seg, cq) << (16 * half + 4 * k);
      }
  }
  float dq[4] = {};
  if (p.D) {
    if (p.D_p_stride == 0) {  // one D per head (as a Mamba2 block passes it): one load
      const float d = load_as_float(p.D, p.d_dtype, h * p.D_h_stride);
#pragma unroll
      for (int e = 0; e < 4; ++e) dq[e] = d;
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (cq + e < pcols) dq[e] = load_as_float(p.D, p.d_dtype, h * p.D_h_stride + (p0 + cq + e) * p.D_p_stride);
    }
  }
  const uint16_t* xo = xp;
  const uint16_t* zo = kHasZ ? static_cast<const uint16_t*>(p.z) + b * p.z_batch_stride + l0 * p.z_l_stride + h * p.z_h_stride + p0 : nullptr;
  uint16_t* out = static_cast<uint16_t*>(p.out) + b * p.out_batch_stride + l0 * p.out_l_stride + h * p.out_h_stride + p0;
  const int zl = static_cast<int>(p.z_l_stride), ol = static_cast<int>(p.out_l_stride);
  // one flag for the three (fewer live scalars; gfx90a runs short of them): 8-byte accesses
  const bool vec = aligned(xo, 2 * xl, 8) && aligned(out, 2 * ol, 8) && (!kHasZ || aligned(zo, 2 * zl, 8));
  // this thread's 4 columns in range and 8-byte accesses: one flag for all its rows (checked per
  // row, nvcc kept it as a bit mask worked out row by row); row offsets unsigned 32-bit (t <
  // chunk_size: the host checks chunk_size * stride < 2^31), no sign extension per row
  const bool cvec = vec && cq + 3 < pcols;
#pragma unroll
  for (int half = 0; half < kRows / 64; ++half) {
    // the x and z of this thread's rows are requested before the accumulators go through LDS,
    // all at once: one memory round trip per half instead of one per row
    Packed4 xq[kOutRows], zq[kHasZ ? kOutRows : 1];
#pragma unroll
    for (int k = 0; k < kOutRows; ++k) {
      const int t = min(t0 + 64 * half + r_first + kRowStep * k, rows - 1);  // rows past seqlen: not stored
      const uint16_t* xr = xo + static_cast<uint32_t>(t * xl);
      xq[k] = load4(xr, cq, pcols, cvec);
      if constexpr (kHasZ) zq[k] = load4(zo + static_cast<uint32_t>(t * zl), cq, pcols, cvec);
    }
    __syncthreads();
    stage_half<decltype(tile), kLdOut>(tile, O, half);
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kOutRows; ++k) {
      const int rr = r_first + kRowStep * k, t = t0 + 64 * half + rr;
      if (t >= rows) break;
      const float4 a = *reinterpret_cast<const float4*>(O + rr * kLdOut + cq);
      float y[4] = {a.x, a.y, a.z, a.w}, xv[4];
      const uint32_t poisoned = poison >> (16 * half + 4 * k);
      if (poisoned & 0xfu) {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (poisoned >> e & 1u) y[e] = __int_as_float(0x7fc00000);
      }
      unpack4<T>(xq[k], xv);
#pragma unroll
      for (int e = 0; e < 4; ++e) y[e] = fmaf(dq[e], xv[e], y[e]);
      if constexpr (kHasZ) {
        float zv[4];
        unpack4<T>(zq[k], zv);
#pragma unroll
        for (int e = 0; e < 4; ++e) y[e] *= silu(zv[e]);
      }
      const Packed4 q = pack4<T>(y);
      uint16_t* const orow = out + static_cast<uint32_t>(t * ol);
      if (cvec) {
        // one 8-byte store: nvcc split a uint2 store of the two words into two 4-byte ones
        *reinterpret_cast<uint64_t*>(orow + cq) = static_cast<uint64_t>(q.hi) << 32 | q.lo;
      } else {
        const uint16_t e4[4] = {static_cast<uint16_t>(q.lo), static_cast<uint16_t>(q.lo >> 16),
                                static_cast<uint16_t>(q.hi), static_cast<uint16_t>(q.hi >> 16)};
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (cq + e < pcols) orow[cq + e] = e4[e];
      }
    }
  }
}
#endif

template <typename T, int kRows, bool kHasZ, int kNT = kThreads, int kCols = 64>
M2R_DEVICE void chunk_scan(const SsdParams& p) {
#if M2R_MMA != 0
  if constexpr (mma::kEnabled<T>) return chunk_scan_mma<T, kRows, kHasZ, kNT, kCols>(p);
  else
#endif
  chunk_scan_fma<T, kRows, kHasZ, kNT, kCols>(p);
}

// chunk_scan's 64-row tile, blocks per multiprocessor (NVIDIA): 3 at 80 registers on the matrix
// cores (ptxas took 96 for the non-gated one without the bound), 4 at 64 on the fp32 FMA path
template <typename T>
constexpr int kScan64Blocks = mma::kEnabled<T> ? 3 : 4;

// The fp16 / bf16 chunk_scan on matrix cores, at every chunk size: the 64-row tile on a block
// of kScanBlock128 threads (4 waves of 32 along 2 x 2 sub-tiles of 32 x 32 on wave32 targets
// and NVIDIA, 2 waves of 64 on wave64 ones), kScanBlock128Blocks per multiprocessor on NVIDIA
// (128 registers, the 16 warps the 128-row tile's 2 blocks of 8 had), instead of the 64- / 128-
// row tile on 256 threads: half the waves meet at each slab's barrier, which the kernel was
// bound by (ncu, H100: 1.2 barrier stalls per issue against Triton's 0.22 in its 2-warp blocks).
// H100, profile_ssd, chunk_scan alone: 134 -> 124 us at b2 l4096 h32, 507 -> 463 at b1 l16384
// h64 g8, 443 -> 393 at Nemotron-H b1 l8192, 222 -> 204 at Codestral b8 l512, 219 -> 201 at
// Falcon-H1 l8192; at chunk 64 (against the 64-row tile on 256 threads) 120 -> 109 at b2 l4096
// h32, 437 -> 400 at Nemotron-H b1 l8192. The FMA path (gfx10.3, fp32) keeps 256 threads: its
// 128-thread form (a thread's rows two runs of 4, kNT / 4 apart) ran 1-6% slower than the
// 128-row tile in the gfx1030 emulation on the H100 at 5 of 6 shapes. At 3 blocks per
// multiprocessor (152 registers) chunk_scan ran 14-17% slower (H200: 122 -> 139 us at b2 l4096
// h32, 462 -> 541 at b1 l16384 h64 g8).
constexpr int kScanBlock128 = 128, kScanBlock128Blocks = 4;
constexpr int kScanP128 = 256, kScanP128Blocks = 2;  // (the same registers a thread)

}  // namespace ssd
}  // namespace m2r

#define M2R_SSD_SCAN(DT, T)                                                                  \
  M2R_KERNEL_MIN_BLOCKS(m2r::ssd::kThreads, m2r::ssd::kScan64Blocks<m2r::T>)                 \
  m2r_ssd_chunk_scan_##DT##_t64(SsdParams p) {                                               \
    m2r::ssd::chunk_scan<m2r::T, 64, false>(p);                                              \
  }                                                                                          \
  M2R_KERNEL_MIN_BLOCKS(m2r::ssd::kThreads, m2r::ssd::kScan64Blocks<m2r::T>)                 \
  m2r_ssd_chunk_scan_##DT##_t64_z(SsdParams p) {                                             \
    m2r::ssd::chunk_scan<m2r::T, 64, true>(p);                                               \
  }                                                                                          \
  M2R_KERNEL(m2r::ssd::kThreads) m2r_ssd_chunk_scan_##DT##_t128(SsdParams p) {               \
    m2r::ssd::chunk_scan<m2r::T, 128, false>(p);                                             \
  }                                                                                          \
  M2R_KERNEL(m2r::ssd::kThreads) m2r_ssd_chunk_scan_##DT##_t128_z(SsdParams p) {             \
    m2r::ssd::chunk_scan<m2r::T, 128, true>(p);                                              \
  }
M2R_SSD_SCAN(f32, F32)
M2R_SSD_SCAN(f16, F16)
M2R_SSD_SCAN(bf16, BF16)

// the 16-bit types' chunk_scan on matrix cores: the 64-row tile on kScanBlock128 threads (built
// for every target, so that every target has every form; the host takes it where the target has
// matrix cores: mamba2_rocm/ops/ssd.py, _scan_form)
#define M2R_SSD_SCAN_B128(DT, T)                                                \
  M2R_KERNEL_MIN_BLOCKS(m2r::ssd::kScanBlock128, m2r::ssd::kScanBlock128Blocks) \
  m2r_ssd_chunk_scan_##DT##_t64b128(SsdParams p) {                              \
    m2r::ssd::chunk_scan<m2r::T, 64, false, m2r::ssd::kScanBlock128>(p);        \
  }                                                                             \
  M2R_KERNEL_MIN_BLOCKS(m2r::ssd::kScanBlock128, m2r::ssd::kScanBlock128Blocks) \
  m2r_ssd_chunk_scan_##DT##_t64b128_z(SsdParams p) {                            \
    m2r::ssd::chunk_scan<m2r::T, 64, true, m2r::ssd::kScanBlock128>(p);         \
  }
M2R_SSD_SCAN_B128(f16, F16)
M2R_SSD_SCAN_B128(bf16, BF16)

// the same tile 128 headdim columns wide on kScanP128 threads (headdim 128, Falcon-H1's: the
// entering state's C and the within-chunk weights are worked out once for the whole headdim
// instead of once per 64 columns); each wave keeps the 64-column form's sub-tile. H200,
// profile_ssd, chunk_scan against t64b128: 91.6 -> 88.7 us at Falcon-H1 b8 l512, 191.5 -> 184.4
// at b4 l2048, 196.6 -> 190.4 at b1 l8192. The host takes it there on NVIDIA only (37 KB of LDS:
// half the blocks per CDNA compute unit)
#define M2R_SSD_SCAN_P128(DT, T)                                                    \
  M2R_KERNEL_MIN_BLOCKS(m2r::ssd::kScanP128, m2r::ssd::kScanP128Blocks)             \
  m2r_ssd_chunk_scan_##DT##_t64p128(SsdParams p) {                                  \
    m2r::ssd::chunk_scan<m2r::T, 64, false, m2r::ssd::kScanP128, 128>(p);           \
  }                                                                                 \
  M2R_KERNEL_MIN_BLOCKS(m2r::ssd::kScanP128, m2r::ssd::kScanP128Blocks)             \
  m2r_ssd_chunk_scan_##DT##_t64p128_z(SsdParams p) {                                \
    m2r::ssd::chunk_scan<m2r::T, 64, true, m2r::ssd::kScanP128, 128>(p);            \
  }
M2R_SSD_SCAN_P128(f16, F16)
M2R_SSD_SCAN_P128(bf16, BF16)

