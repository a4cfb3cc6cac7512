// Mamba2 SSD chunked scan, backward (the gradients of mamba_chunk_scan_combined). Parameters in
// params.h (SsdBwdParams). One source per stage below (csrc/ssd_bwd_<stage>.hip; this header
// holds what they share). The host first runs the forward's stages 1-4 again (csrc/ssd_*.hip:
// dt', the per-chunk cumsum of dt' A, the segments, C·Bᵀ and the state entering every chunk:
// nothing but the inputs is kept from the forward), then these stages, each over one
// (batch, chunk) at a time and with every product accumulated in fp32:
//
//   1. dz        with z only: the chunk scan's product again (y = decayed C·entering + masked
//                decayed C·Bᵀ x), giving dz = dout y' silu'(z) (y' = y + D x) and g = dout silu(z),
//                the output gradient every later stage reads (without z, g is dout);
//                                                        grid (chunks*ttiles*ptiles*h, 1, b)
//   2. dstates   the gradient of each chunk's entering state: sum_t exp(dA_cs[t]) gᵀ C[t] over
//                the tokens that read it (the chunk's first segment), two 64-wide tiles of
//                dstate per block;                       grid (chunks*pairs*ptiles*h, 1, b)
//   3. state_passing  a reverse loop over chunks: the gradient of each chunk's own final state
//                (overwriting stage 2's; with 16-bit inputs on the matrix cores rounded to them,
//                with the entering states, in stage 2's bytes: state_runs), per chunk the
//                carry's exponent gradient, and the initial states' gradient;
//                                                        grid (cdiv(n, 1024 / p), h, b)
//   4. dx        dx = dt (B·G decayed to the chunk end + (masked, decayed C·Bᵀ)ᵀ g) + D g; per
//                token sum_p x dx/dt (ddt) and its chunk-state part (the chunk end's exponent);
//                per column sum_s g x (dD); a block takes two tiles of rows;
//                                                        grid (chunks*cdiv(stiles,2)*ptiles*h, 1, b)
//   5. dcb       the gradient of C·Bᵀ: per group, sum over its heads of (g xᵀ) decayed and masked
//                (overwrites the forward's C·Bᵀ, read by stages 1 and 4 before), and per head
//                the intra-chunk terms' exponent gradients, summed per row and column;
//                                                        grid (chunks*g*tile pairs, 1, b)
//   6. dC, dB    sum over the group's heads of the decayed g·entering (dC) / x·G (dB), plus
//                dcb·B (dC) / dcbᵀ·C (dB); dC also takes each head's term times C, summed over
//                n: per token sum_p g y_off, the exponent gradient of the entering state's term
//                (y_off = exp(dA_cs[t]) C[t]·entering);  grid (chunks*tiles*g, 1, b)
//   7. cumsum    the exponent gradients of the chunk, summed back over each segment (a reversed
//                segmented scan), give ddt' and dA; then through the clamp, softplus and bias to
//                ddt, with per-chunk dA and ddt_bias partials;  grid (chunks, h, b)
//
// The token and head sums are fp32 partials in fixed positions, added in a fixed order by the
// next stage or the host: no atomics, so runs are bit-identical. Masked terms are selected away,
// never multiplied by 0. Every product is a 64 x 64 output tile over 256 threads (TileAcc below):
// fp16/bf16 on the matrix cores where the target has them (mma.h), else the fp32 FMA path
// (fma_tile.h: fp32 inputs, and gfx10.3 for every dtype); either way the epilogues see each
// thread's 4 x 4 of the tile.
#pragma once

#include "block_reduce.h"
#include "fma_tile.h"
#include "mma.h"
#include "platform.h"
#include "token_runs.h"

namespace m2r {
namespace ssd_bwd {

constexpr int kThreads = 256;
constexpr int kTile = 64;
constexpr int kLd = kTile + 4;    // fp32 LDS rows, padded; 16-byte aligned
constexpr int kLd16 = kTile + 8;  // 16-bit LDS rows for the matrix cores (mma.h: a multiple of 8)
constexpr int kMaxChunk = 256;
static_assert(kMaxChunk <= kThreads, "stages that give each thread one position of a chunk");
constexpr int kPassVec = 4;
constexpr int kPassBatch = 64;  // chunks per reduction step of the reversed state passing
constexpr int kPassRows = kThreads * kPassVec;  // its blocks' (n, p) elements: whole rows n up to this many

M2R_DEVICE int cdiv(int a, int b) { return (a + b - 1) / b; }

M2R_DEVICE int64_t chunk_row(const SsdBwdParams& p, int b, int h, int c) {  // dt_out / dA_cs / tok
  return ((static_cast<int64_t>(b) * p.nheads + h) * p.nchunks + c) * p.chunk_size;
}

M2R_DEVICE int64_t states_at(const SsdBwdParams& p, int b, int c, int h) {
  return ((static_cast<int64_t>(b) * p.nchunks + c) * p.nheads + h) * p.dstate * p.headdim;
}

// Per-token partial sums, fp32, one plane per (kind, tile) summed by the cumsum stage:
//   kind 0, per dstate tile: sum_p g y_off (the entering state's term, y_off = exp(dA_cs[t])
//           C[t]·entering), written by dC as sum_n C[t][n] (exp(dA_cs[t]) g[t]·entering)[n]
//   kind 1, per headdim tile: sum_p x dx/dt (ddt, without the exponents)
//   kind 2, per headdim tile: its chunk-state part times dt (the chunk end's exponent)
//   kind 3, per token tile ts: sum over s in tile ts of M[t][s] (intra-chunk terms, at t)
//   kind 4, per token tile tt: sum over t in tile tt of M[t][s] (at s)
// with M[t][s] = (g[t]·x[s]) C[t]·B[s] exp(dA_cs[t] - dA_cs[s]) dt[s] (same segment, s <= t).
M2R_DEVICE float* tok_row(const SsdBwdParams& p, int kind, int tile, int b, int h, int c) {
  const int ntiles = cdiv(p.dstate, kTile), ptiles = cdiv(p.headdim, kTile), ltiles = p.chunk_size / kTile;
  const int64_t plane = static_cast<int64_t>(p.batch) * p.nheads * p.nchunks * p.chunk_size;
  // planes: kinds 1, 2, then 0, then 3, 4 (dx's kinds need no dstate term: scalar registers)
  const int64_t index = kind == 1 || kind == 2 ? static_cast<int64_t>(kind - 1) * ptiles + tile
                        : kind == 0            ? 2LL * ptiles + tile
                                               : 2LL * ptiles + ntiles + static_cast<int64_t>(kind - 3) * ltiles + tile;
  return p.tok + index * plane + chunk_row(p, b, h, c);
}

M2R_DEVICE const int32_t* seg_row(const SsdBwdParams& p, int b, int c) {
  return p.seg + (static_cast<int64_t>(b) * p.nchunks + c) * p.chunk_size;
}

// Rows of x-like tensors (batch, seqlen, nheads, headdim) at the chunk's first token.
template <typename P>
M2R_DEVICE P* x_chunk(const SsdBwdParams& p, P* base, int b, int64_t l0, int h) {
  return base + (static_cast<int64_t>(b) * p.seqlen + l0) * p.nheads * p.headdim + static_cast<int64_t>(h) * p.headdim;
}

template <typename P>
M2R_DEVICE P* bc_chunk(const SsdBwdParams& p, P* base, int b, int64_t l0, int g) {
  return base + (static_cast<int64_t>(b) * p.seqlen + l0) * p.ngroups * p.dstate + static_cast<int64_t>(g) * p.dstate;
}

// The sum of v over the 16 threads that share a tile row (consecutive lanes).
M2R_DEVICE float row_sum16(float v) {
#pragma unroll
  for (int off = 8; off > 0; off /= 2) v += shfl_xor(v, off);
  return v;
}

M2R_DEVICE float wave_sum(float v) {
#pragma unroll
  for (int off = kWavefront / 2; off > 0; off /= 2) v += shfl_xor(v, off);
  return v;
}

struct Tile {  // this thread's 4 x 4 of a 64 x 64 output tile: rows r_off.., columns c_off..
  int r_off = 4 * (static_cast<int>(threadIdx.x) / 16), c_off = 4 * (static_cast<int>(threadIdx.x) % 16);
};

// LDS of one tile product: the staged slabs, then the result handed to the epilogue layout.
// The matrix cores take slabs of kMmaSlab along k (kRuns runs per thread and operand, so more
// loads are in flight per slab and half the barriers); the FMA path takes kFmaSlab.
constexpr int kMmaSlab = 64;
constexpr int kLdK = kMmaSlab + 8;  // [m][k] 16-bit tiles: rows 16-byte aligned
constexpr int kSmemFloats = kTile * kLdK;  // the floats that two 16-bit kTile x kLdK slabs take
static_assert(kTile * kLd <= kSmemFloats, "the result tile must fit the staging space");
static_assert(2 * kFmaSlab * kLd <= kSmemFloats, "fp32 slabs must fit the staging space");
static_assert(kMmaSlab * kLd16 <= kTile * kLdK, "16-bit slabs must fit the staging space");

// The tile-product engine. A product's operands are given by loaders: la(k, m, kv, v) fills
// v[0..8) with A at (k, m) and the 7 elements after it along the operand's unit-stride index in
// memory (m when kMFast, else k; kv = how many of those k are below the range's end), 0 where
// out of range (past kv too: the engine does not zero k-runs again). Each thread loads runs of
// 8 per operand and slab (16 bytes of a 16-bit tensor, when aligned), so a slab's loads are few
// and wide: a slab of 64 along k is 64 x 64 = 512 runs, two per thread. On the matrix cores the
// runs are held packed in the inputs' dtype (the rounding the LDS store would make; an operand
// used as stored is a Plain, below, whose runs are kept as loaded) and go to LDS as 16-byte
// stores, [k][m] for m-runs and [m][k] for k-runs (each read by ldmatrix-style fragment loads;
// mma.h); with kPrefetch the next slab's runs are loaded while the current one is multiplied.
// The FMA path stages fp32 [k][m] (fma_tile.h), a run per thread and slab of 32.
constexpr int kRun = 8;

M2R_DEVICE bool aligned16(const void* q) { return (reinterpret_cast<uintptr_t>(q) & 15u) == 0; }

// A run of 8 elements of S as loaded (16-bit: one 16-byte word; fp32: two), 0 past its n in
// range, and the same as floats (get). Loaders that fetch into these before they compute
// anything let a slab's loads go out together (Runs, below).
template <typename S>
struct RawRun;
template <>
struct RawRun<uint16_t> {
  uint4 q;
  M2R_DEVICE void fetch(const uint16_t* p, int n) { q = load8(p, 0, n, aligned16(p)); }
  template <typename T>
  M2R_DEVICE void get(float (&v)[kRun]) const { unpack8<T>(q, v); }
};
template <>
struct RawRun<float> {
  float4 a, b;
  M2R_DEVICE void fetch(const float* p, int n) {
    if (n >= kRun && aligned16(p)) {
      a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
      return;
    }
    a.x = n > 0 ? p[0] : 0.f, a.y = n > 1 ? p[1] : 0.f, a.z = n > 2 ? p[2] : 0.f, a.w = n > 3 ? p[3] : 0.f;
    b.x = n > 4 ? p[4] : 0.f, b.y = n > 5 ? p[5] : 0.f, b.z = n > 6 ? p[6] : 0.f, b.w = n > 7 ? p[7] : 0.f;
  }
  template <typename T>
  M2R_DEVICE void get(float (&v)[kRun]) const {
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  }
};

// n (<= 0: none) elements from q into v[0..8), 0 past them: one 16-byte load where it can
template <typename T>
M2R_DEVICE void load_run(const typename T::storage* q, int n, float (&v)[kRun]) {
  RawRun<typename T::storage> r;
  r.fetch(q, n);
  r.template get<T>(v);
}

M2R_DEVICE void load_run32(const float* q, int n, float (&v)[kRun]) { load_run<F32>(q, n, v); }

// 8 consecutive values of an LDS array at a multiple of 8 (the array 16-byte aligned): 2 reads
M2R_DEVICE void lds8(const float* q, float (&v)[kRun]) {
  const float4 a = reinterpret_cast<const float4*>(q)[0], b = reinterpret_cast<const float4*>(q)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
M2R_DEVICE void lds8(const int32_t* q, int32_t (&v)[kRun]) {
  const int4 a = reinterpret_cast<const int4*>(q)[0], b = reinterpret_cast<const int4*>(q)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// An epilogue's store of this thread's 4 consecutive columns of a row, n (<= 0: none) of them
// in range: one 8-byte (16-bit types) / 16-byte (fp32) store when all 4 are in range and the
// address allows it, else element by element.
template <typename T>
M2R_DEVICE bool quad_aligned(const typename T::storage* q) {
  return (reinterpret_cast<uintptr_t>(q) & (4 * sizeof(typename T::storage) - 1)) == 0;
}

template <typename T>
M2R_DEVICE void store4(typename T::storage* q, int n, const float (&v)[4]) {
  if (n >= 4 && quad_aligned<T>(q)) {
    if constexpr (sizeof(typename T::storage) == 2) {
      *reinterpret_cast<uint2*>(q) = make_uint2(T::pack(v), T::pack(v + 2));
    } else {
      *reinterpret_cast<float4*>(q) = make_float4(v[0], v[1], v[2], v[3]);
    }
    return;
  }
#pragma unroll
  for (int e = 0; e < 4; ++e)
    if (e < n) q[e] = T::from_float(v[e]);
}

// This thread's 4 x 4 of a (token, headdim) tile of an x-like tensor, as stored: each row's 4
// columns in one 8-byte (16-bit types) / 16-byte (fp32) load when in range and aligned, 0
// outside the nrows x ncols in range. Epilogues load these between a product's run() and its
// finish(), so the loads are in flight during finish()'s LDS round trip instead of after it.
template <typename T>
struct Quads {
  typedef typename T::storage S;
  static constexpr bool k16 = sizeof(S) == 2;
  Packed4 h[4];   // 16-bit types: each row packed (2 registers)
  float f[4][4];  // fp32
  M2R_DEVICE void load(const S* q, int ld, int nrows, int ncols) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const S* r = q + i * ld;
      const int n = i < nrows ? ncols : 0;
      if constexpr (k16)
        h[i] = load4(r, 0, n, quad_aligned<T>(r));
      else
        load_seg<T, 4>(r, 0, n, quad_aligned<T>(r), f[i]);
    }
  }
  M2R_DEVICE float operator()(int i, int j) const {
    if constexpr (k16) return T::to_float(static_cast<S>((j < 2 ? h[i].lo : h[i].hi) >> (16 * (j % 2))));
    return f[i][j];
  }
};

// run r of this thread in a slab of kSlab along k: its first (m, k)
template <bool kMFast, int kSlab>
M2R_DEVICE void run_origin(int r, int& m, int& k) {
  const int q = static_cast<int>(threadIdx.x) + r * kThreads;
  m = kMFast ? (q % (kTile / kRun)) * kRun : q / (kSlab / kRun);
  k = kMFast ? q / (kTile / kRun) : (q % (kSlab / kRun)) * kRun;
}
static_assert(kTile * kFmaSlab == kThreads * kRun, "one run per thread and FMA slab");
// runs per thread and operand in a matrix-core slab of kSlab (32 or kMmaSlab) along k
template <int kSlab>
constexpr int kRuns = kTile * kSlab / (kThreads * kRun);
static_assert(kRuns<kMmaSlab> * kThreads * kRun == kTile * kMmaSlab, "whole runs per thread and matrix-core slab");
// The slab a kernel with many live addresses takes: on the wave64 targets a slab of 64's second
// run per operand overruns the 102 scalar registers in some kernels (its addresses are uniform
// values the compiler hoists), so those take slabs of 32 there.
constexpr int kNarrowSlab = kWavefront == 64 ? 32 : kMmaSlab;

// An operand read as stored (no arithmetic on it): (k, m) at base + k * ld + m when kMFast,
// base + m * ld + k otherwise, in range for m < m_end (and k below the product's end). On the
// matrix cores its 16-bit runs go to LDS as loaded, with no round trip through fp32; it is also
// a loader of the (k, m, kv, v) form for the FMA path.
template <typename T, bool kMFast_>
struct Plain {
  typedef typename T::storage S;
  static constexpr bool kMFast = kMFast_;
  const S* base;
  int ld, m_end;
  M2R_DEVICE const S* at(int k, int m) const { return kMFast ? base + k * ld + m : base + m * ld + k; }
  // elements of the run at (k, m) in range, kv of its k below the end (<= 0: none)
  M2R_DEVICE int count(int m, int kv) const {
    if (kMFast) return kv > 0 ? m_end - m : 0;
    return m < m_end ? kv : 0;
  }
  M2R_DEVICE void operator()(int k, int m, int kv, float (&v)[kRun]) const { load_run<T>(at(k, m), count(m, kv), v); }
  M2R_DEVICE uint4 raw(int k, int m, int kv) const {  // the run's 16-bit bits, 0 past the range
    const S* q = at(k, m);
    return load8(q, 0, count(m, kv), aligned16(q));
  }
};

template <class L>
struct IsPlain {
  static constexpr bool value = false;
};
template <typename T, bool kMFast>
struct IsPlain<Plain<T, kMFast>> {
  static constexpr bool value = true;
};

// An operand read as stored, optionally times a weight per run (w at the run's fixed index: m
// when the runs go along k, k when they go along m), in two phases: fetch() loads a run,
// cook() makes its floats. The matrix-core staging fetches every run of a slab before it cooks
// the first, so their loads are in flight together; a one-phase loader (a lambda) loads and
// computes each run in turn, and ncu saw those loads wait one after another (dC / dB: a third
// of the stall samples on the instruction after each load). In range: m in [m_lo, m_hi) and k
// below the product's end.
template <typename T, bool kMFast_, bool kWeighted>
struct Runs {
  typedef typename T::storage S;
  typedef RawRun<S> Raw;
  static constexpr bool kMFast = kMFast_, kTwoPhase = true;
  const S* base;
  int ld, m_lo, m_hi;
  const float* w;
  M2R_DEVICE Raw fetch(int k, int m, int kv) const {
    Raw r;
    const int n = kMFast ? (kv > 0 ? m_hi - m : 0) : (m >= m_lo && m < m_hi ? kv : 0);
    r.fetch(kMFast ? base + k * ld + m : base + m * ld + k, n);
    return r;
  }
  M2R_DEVICE void cook(int k, int m, int, const Raw& r, float (&v)[kRun]) const {
    r.template get<T>(v);
    if constexpr (kWeighted) {
      const float wr = w[kMFast ? k : m];
#pragma unroll
      for (int e = 0; e < kRun; ++e) v[e] *= wr;
    }
  }
};

// a two-phase loader (Runs, or a kernel's own with fetch / cook and kTwoPhase): run_fetch16
// fetches a slab's runs before it cooks them, run_fetch (the FMA path) one run at a time
template <class L>
constexpr auto two_phase_(int) -> decltype(L::kTwoPhase, true) {
  return true;
}
template <class L>
constexpr bool two_phase_(...) {
  return false;
}
template <class L>
constexpr bool kTwoPhase = two_phase_<L>(0);

// run r of the slab at k0: the loader fills it, 0 past k_end (kv, the loader's contract)
template <bool kMFast, int kSlab, class L>
M2R_DEVICE void run_fetch(float (&v)[kRun], int r, int k0, int k_end, const L& load) {
  int m, k;
  run_origin<kMFast, kSlab>(r, m, k);
  if (kMFast && k0 + k >= k_end) {
#pragma unroll
    for (int e = 0; e < kRun; ++e) v[e] = 0.f;
    return;
  }
  const int kv = min(kRun, k_end - k0 - k);
  if constexpr (kTwoPhase<L>) load.cook(k0 + k, m, kv, load.fetch(k0 + k, m, kv), v);
  else load(k0 + k, m, kv, v);
}

// a two-phase loader's slab of runs as loaded (fetch), and those runs rounded to T and packed
// (cook)
template <bool kMFast, int kSlab, class L>
M2R_DEVICE void run_fetch_raw(typename L::Raw (&raw)[kRuns<kSlab>], int k0, int k_end, const L& load) {
  static_assert(L::kMFast == kMFast, "a loader of the product's layout");
#pragma unroll
  for (int r = 0; r < kRuns<kSlab>; ++r) {
    int m, k;
    run_origin<kMFast, kSlab>(r, m, k);
    // (kMFast: k past the end gives n = 0 below, the run 0, as run_fetch has it)
    raw[r] = load.fetch(k0 + k, m, kMFast && k0 + k >= k_end ? 0 : min(kRun, k_end - k0 - k));
  }
}
template <typename T, bool kMFast, int kSlab, class L>
M2R_DEVICE void run_cook16(uint4 (&q)[kRuns<kSlab>], const typename L::Raw (&raw)[kRuns<kSlab>], int k0, int k_end,
                           const L& load) {
#pragma unroll
  for (int r = 0; r < kRuns<kSlab>; ++r) {
    int m, k;
    run_origin<kMFast, kSlab>(r, m, k);
    float v[kRun];
    load.cook(k0 + k, m, min(kRun, k_end - k0 - k), raw[r], v);
    q[r] = kMFast && k0 + k >= k_end ? make_uint4(0u, 0u, 0u, 0u)  // (no weight past the end)
                                     : make_uint4(T::pack(v), T::pack(v + 2), T::pack(v + 4), T::pack(v + 6));
  }
}

// the kRuns runs of one operand's matrix-core slab, rounded to T and packed (a Plain operand's
// as loaded)
template <typename T, bool kMFast, int kSlab, class L>
M2R_DEVICE void run_fetch16(uint4 (&q)[kRuns<kSlab>], int k0, int k_end, const L& load) {
  if constexpr (kTwoPhase<L>) {  // every run's loads, then their floats
    typename L::Raw raw[kRuns<kSlab>];
    run_fetch_raw<kMFast, kSlab>(raw, k0, k_end, load);
    run_cook16<T, kMFast, kSlab>(q, raw, k0, k_end, load);
  } else {
#pragma unroll
    for (int r = 0; r < kRuns<kSlab>; ++r) {
      if constexpr (IsPlain<L>::value) {
        static_assert(L::kMFast == kMFast && sizeof(typename L::S) == 2, "a Plain operand of the product's layout");
        int m, k;
        run_origin<kMFast, kSlab>(r, m, k);
        q[r] = load.raw(k0 + k, m, k_end - k0 - k);
      } else {
        float v[kRun];
        run_fetch<kMFast, kSlab>(v, r, k0, k_end, load);
        q[r] = make_uint4(T::pack(v), T::pack(v + 2), T::pack(v + 4), T::pack(v + 6));
      }
    }
  }
}

template <bool kMFast, int kSlab>
M2R_DEVICE void run_store16(uint16_t* dst, const uint4 (&q)[kRuns<kSlab>]) {
#pragma unroll
  for (int r = 0; r < kRuns<kSlab>; ++r) {
    int m, k;
    run_origin<kMFast, kSlab>(r, m, k);
    *reinterpret_cast<uint4*>(dst + (kMFast ? k * kLd16 + m : m * kLdK + k)) = q[r];
  }
}

// A hint (prefetch_l1) for the lines of the next product's first slab of two [m][k] operands
// (each run's start: a at a + m * lda + k for m < a_rows, k < a_cols; b likewise), as this
// thread's runs of a slab of kSlab lie
template <int kSlab, typename A, typename B>
M2R_DEVICE void prefetch_slab(const A* a, int lda, int a_rows, int a_cols, const B* b, int ldb, int b_rows, int b_cols) {
#pragma unroll
  for (int r = 0; r < kRuns<kSlab>; ++r) {
    int m, k;
    run_origin<false, kSlab>(r, m, k);
    if (m < a_rows && k < a_cols) prefetch_l1(a + m * lda + k);
    if (m < b_rows && k < b_cols) prefetch_l1(b + m * ldb + k);
  }
}

// a two-phase loader whose raw runs take no more registers than packed ones (16-bit runs)
template <class L>
constexpr auto holds_raw_(int) -> decltype(L::kTwoPhase, true) {
  return sizeof(typename L::Raw) <= sizeof(uint4);
}
template <class L>
constexpr bool holds_raw_(...) {
  return false;
}
template <class L, bool = holds_raw_<L>(0)>
struct SlabHeld {  // what SlabRuns holds per run: packed 16-bit values
  typedef uint4 type;
};
template <class L>
struct SlabHeld<L, true> {  // the run as loaded
  typedef typename L::Raw type;
};

// One operand's matrix-core slab between its loads (fetch) and its LDS store (store). A
// prefetched slab's loads are issued before the product of the slab before it and waited for
// at its store, after that product: held as loaded where that costs no registers (a two-phase
// loader's 16-bit runs, cooked at the store), else rounded and packed at the fetch (whose cook
// then waits for the loads before the product).
template <typename T, bool kMFast, int kSlab, class L>
struct SlabRuns {
  static constexpr bool kRaw = holds_raw_<L>(0);
  typename SlabHeld<L>::type held[kRuns<kSlab>];
  M2R_DEVICE void fetch(int k0, int k_end, const L& load) {
    if constexpr (kRaw) run_fetch_raw<kMFast, kSlab>(held, k0, k_end, load);
    else run_fetch16<T, kMFast, kSlab>(held, k0, k_end, load);
  }
  M2R_DEVICE void store(uint16_t* dst, int k0, int k_end, const L& load) const {
    if constexpr (kRaw) {
      uint4 c[kRuns<kSlab>];
      run_cook16<T, kMFast, kSlab>(c, held, k0, k_end, load);
      run_store16<kMFast, kSlab>(dst, c);
    } else {
      run_store16<kMFast, kSlab>(dst, held);
    }
  }
};

template <bool kMFast>
M2R_DEVICE void run_store32(float* dst, const float (&v)[kRun]) {  // [k][m], ld kLd
  int m, k;
  run_origin<kMFast, kFmaSlab>(0, m, k);
  if constexpr (kMFast) {
    *reinterpret_cast<float4*>(dst + k * kLd + m) = make_float4(v[0], v[1], v[2], v[3]);
    *reinterpret_cast<float4*>(dst + k * kLd + m + 4) = make_float4(v[4], v[5], v[6], v[7]);
  } else {
#pragma unroll
    for (int e = 0; e < kRun; ++e) dst[(k + e) * kLd + m] = v[e];
  }
}

// One 64 x 64 fp32 product accumulated over any number of run() calls (each a range of k with
// its own operands) and added into `out` (the FMA layout): directly on the FMA path, by
// finish() through LDS on the matrix cores.
template <typename T>
struct TileAcc {
#if M2R_MMA != 0
  static constexpr bool kMma = mma::kEnabled<T>;
#else
  static constexpr bool kMma = false;
#endif
  float (&out)[4][4];
#if M2R_MMA != 0
  mma::BlockTile<kThreads, kTile, kTile, 2> tile;
#endif
  M2R_DEVICE explicit TileAcc(float (&acc)[4][4]) : out(acc) {}

  // kPrefetch: load the next slab's runs while multiplying (matrix cores; costs registers);
  // kSlab: the matrix cores' slab along k (kMmaSlab, or kNarrowSlab)
  template <bool kMFastA, bool kMFastB, bool kPrefetch = true, int kSlab = kMmaSlab, class LA, class LB>
  M2R_DEVICE void run(float* sm, int k_begin, int k_end, const LA& la, const LB& lb) {
    if (k_begin >= k_end) return;
#if M2R_MMA != 0
    if constexpr (kMma) {
      constexpr int kLdA = kMFastA ? kLd16 : kLdK, kLdB = kMFastB ? kLd16 : kLdK;
      uint16_t* As = reinterpret_cast<uint16_t*>(sm);
      uint16_t* Bs = As + kTile * kLdK;
      SlabRuns<T, kMFastA, kSlab, LA> qa;
      SlabRuns<T, kMFastB, kSlab, LB> qb;
      if constexpr (kPrefetch) qa.fetch(k_begin, k_end, la), qb.fetch(k_begin, k_end, lb);
      for (int k0 = k_begin; k0 < k_end; k0 += kSlab) {
        if constexpr (!kPrefetch) qa.fetch(k0, k_end, la), qb.fetch(k0, k_end, lb);
        qa.store(As, k0, k_end, la);
        qb.store(Bs, k0, k_end, lb);
        __syncthreads();
        if (kPrefetch && k0 + kSlab < k_end) qa.fetch(k0 + kSlab, k_end, la), qb.fetch(k0 + kSlab, k_end, lb);
        tile.template product<T, kSlab, kMFastA, kMFastB>(As, kLdA, Bs, kLdB);
        __syncthreads();
      }
      return;
    }
#endif
    const Tile tl;
    float* As = sm;
    float* Bs = sm + kFmaSlab * kLd;
    float ra[kRun], rb[kRun];
    for (int k0 = k_begin; k0 < k_end; k0 += kFmaSlab) {
      run_fetch<kMFastA, kFmaSlab>(ra, 0, k0, k_end, la);
      run_fetch<kMFastB, kFmaSlab>(rb, 0, k0, k_end, lb);
      run_store32<kMFastA>(As, ra);
      run_store32<kMFastB>(Bs, rb);
      __syncthreads();
      if constexpr (!kMma) slab_product<1, 1, kLd, kLd>(out, As, Bs, tl.r_off, tl.c_off);
      __syncthreads();
    }
  }

  // v = this thread's 4 x 4 of the product so far (the FMA layout), which stays accumulated;
  // on the matrix cores through sm, ending with a barrier. FMA path: out as it is.
  M2R_DEVICE void view(float* sm, float (&v)[4][4]) const {
#if M2R_MMA != 0
    if constexpr (kMma) {
      const Tile tl;
      stage(sm);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float4 q = *reinterpret_cast<const float4*>(sm + (tl.r_off + i) * kLd + tl.c_off);
        v[i][0] = q.x, v[i][1] = q.y, v[i][2] = q.z, v[i][3] = q.w;
      }
      __syncthreads();
      return;
    }
#endif
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) v[i][j] = out[i][j];
  }

  // the product so far times w[row] (w: the tile's 64 rows, e.g. in LDS); rows with w 0 become
  // 0 whatever they held
  M2R_DEVICE void scale_rows(const float* w) {
#if M2R_MMA != 0
    if constexpr (kMma) {
#pragma unroll
      for (int i = 0; i < tile.kFm; ++i)
#pragma unroll
        for (int j = 0; j < tile.kFn; ++j)
#pragma unroll
          for (int r = 0; r < mma::kAccRegs; ++r) {
            const float f = w[tile.row(i, r)];
            tile.acc[i][j].v[r] = f != 0.f ? tile.acc[i][j].v[r] * f : 0.f;
          }
      return;
    }
#endif
    const Tile tl;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float f = w[tl.r_off + i];
#pragma unroll
      for (int j = 0; j < 4; ++j) out[i][j] = f != 0.f ? out[i][j] * f : 0.f;
    }
  }

  // out += the product; uses sm and ends with a barrier on the matrix-core path
  M2R_DEVICE void finish(float* sm) {
    if constexpr (kMma) {
      float v[4][4];
      view(sm, v);
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) out[i][j] += v[i][j];
    }
  }

 private:
#if M2R_MMA != 0
  // the fragments to sm as [row][kLd] fp32, then a barrier
  M2R_DEVICE void stage(float* sm) const {
#pragma unroll
    for (int i = 0; i < tile.kFm; ++i)
#pragma unroll
      for (int j = 0; j < tile.kFn; ++j)
#pragma unroll
        for (int r = 0; r < mma::kAccRegs; ++r) sm[tile.row(i, r) * kLd + tile.col(j, r)] = tile.acc[i][j].v[r];
    __syncthreads();
  }
#endif
};

template <typename T, bool kMFastA, bool kMFastB, bool kPrefetch = true, int kSlab = kMmaSlab, class LA, class LB>
M2R_DEVICE void tile_product(float (&acc)[4][4], float* sm, int k_begin, int k_end, const LA& la, const LB& lb) {
  TileAcc<T> t(acc);
  t.template run<kMFastA, kMFastB, kPrefetch, kSlab>(sm, k_begin, k_end, la, lb);
  t.finish(sm);
}

// The staging floats tile_product_pair takes: three 16-bit slabs
constexpr int kPairSmemFloats = kSmemFloats * 3 / 2;

// Two products that share their second operand, acc0 += A0·B and (when `second`, uniform)
// acc1 += A1·B over the same k: on the matrix cores each slab of B is loaded (and cooked)
// once for both, and the next slab's runs are loaded while both multiply; sm holds
// kPairSmemFloats. The FMA path runs the two products in turn.
template <typename T, bool kMFastA, bool kMFastB, class LA, class LB>
M2R_DEVICE void tile_product_pair(float (&acc0)[4][4], float (&acc1)[4][4], float* sm, int k_begin, int k_end,
                                  const LA& la0, const LA& la1, bool second, const LB& lb) {
  TileAcc<T> t0(acc0), t1(acc1);
#if M2R_MMA != 0
  if constexpr (TileAcc<T>::kMma) {
    constexpr int kLdA = kMFastA ? kLd16 : kLdK, kLdB = kMFastB ? kLd16 : kLdK;
    uint16_t* As0 = reinterpret_cast<uint16_t*>(sm);
    uint16_t* As1 = As0 + kTile * kLdK;
    uint16_t* Bs = As1 + kTile * kLdK;
    SlabRuns<T, kMFastA, kMmaSlab, LA> qa0, qa1;
    SlabRuns<T, kMFastB, kMmaSlab, LB> qb;
    auto fetch = [&](int k0) {
      qa0.fetch(k0, k_end, la0);
      if (second) qa1.fetch(k0, k_end, la1);
      qb.fetch(k0, k_end, lb);
    };
    if (k_begin < k_end) fetch(k_begin);
    for (int k0 = k_begin; k0 < k_end; k0 += kMmaSlab) {
      qa0.store(As0, k0, k_end, la0);
      if (second) qa1.store(As1, k0, k_end, la1);
      qb.store(Bs, k0, k_end, lb);
      __syncthreads();
      if (k0 + kMmaSlab < k_end) fetch(k0 + kMmaSlab);
      t0.tile.template product<T, kMmaSlab, kMFastA, kMFastB>(As0, kLdA, Bs, kLdB);
      if (second) t1.tile.template product<T, kMmaSlab, kMFastA, kMFastB>(As1, kLdA, Bs, kLdB);
      __syncthreads();
    }
    t0.finish(sm);
    if (second) t1.finish(sm);
    return;
  }
#endif
  t0.template run<kMFastA, kMFastB>(sm, k_begin, k_end, la0, lb);
  if (second) t1.template run<kMFastA, kMFastB>(sm, k_begin, k_end, la1, lb);
}

// The chunks' states as the matrix-core products read them. A product rounds an fp32 operand to
// T once, as it stages it; with 16-bit T on the matrix cores the reversed state passing writes G
// (each chunk's final-state gradient, which dx and dB read) and the entering states (which dC
// reads) rounded to T instead: the same values in half the bytes and without the products'
// conversions. They take no memory of their own: they go over dstates' fp32 values (stage 2's,
// which the state passing has read by then), row by row of the (n, p) state: row n's fp32
// values make room for its G (first headdim values) and entering state (next headdim), so the
// 16-bit copies are rows of stride 2 headdim. (Each state passing block owns whole rows.)
template <typename T>
constexpr bool kStates16 = TileAcc<T>::kMma;

// Chunk c / head h's G (plane 0) or entering state (plane 1) from column p0 of its (n, p) state:
// the 16-bit rows (kStates16: a T::storage pointer), else the fp32 values (dstates / states)
template <typename T>
M2R_DEVICE auto state_base(const SsdBwdParams& p, int plane, int b, int c, int h, int p0) {
  const int64_t at = states_at(p, b, c, h);
  if constexpr (kStates16<T>) return reinterpret_cast<const typename T::storage*>(p.dstates + at) + plane * p.headdim + p0;
  else return (plane == 0 ? p.dstates : p.states) + at + p0;
}

// A product's operand of those rows, [n][p] (p unit-stride) from row n0 of state_base's q
template <typename T, bool kMFast, typename E>
M2R_DEVICE auto state_runs(const E* q, int headdim, int n0, int m_end) {
  if constexpr (kStates16<T>) return Plain<T, kMFast>{q + 2 * n0 * headdim, 2 * headdim, m_end};
  else return Runs<F32, kMFast, false>{q + n0 * headdim, headdim, 0, m_end, nullptr};
}

}  // namespace ssd_bwd
}  // namespace m2r
