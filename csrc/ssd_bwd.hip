// Mamba2 SSD chunked scan, backward (the gradients of mamba_chunk_scan_combined). Parameters in
// params.h (SsdBwdParams). The host first runs the forward's stages 1-4 again (csrc/ssd.hip:
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

// ---- 3. state passing, reversed ---------------------------------------------------------------

// The forward: after chunk c, state = k_c entering_c + own_c, with k_c = exp(dA_cs[c][last])
// when the chunk's last token continues the segment of the token before it, else the state
// restarts (own_c alone). Walking back from the final state's gradient: own_c's gradient is
// the gradient after chunk c; k_c's is the sum of that times entering_c; entering_c's is the
// chunk's own reads (stage 2) plus k_c times the gradient after it. A block owns kPassRows /
// headdim whole rows n of the (n, p) state, each thread kPassVec consecutive elements of them,
// and loads the next chunk's while it works on this one; the sums over the block are made per
// wavefront and added up once per kPassBatch chunks. With 16-bit T on the matrix cores
// (kStates16) the gradients go out rounded to T, with the entering states, over dstates' fp32
// values of the rows (state_runs).
template <typename T>
M2R_DEVICE void state_passing(const SsdBwdParams& p) {
  typedef typename T::storage Elem;
  __shared__ float wpart[kPassBatch][kThreads / 32];
  __shared__ float carry[kPassBatch];
  const int h = blockIdx.y, b = blockIdx.z, hd = p.headdim;
  // this block's rows of the (n, p) state: elements [e_lo, e_hi); this thread's from e0
  const int rows = kPassRows / hd;  // (headdim <= 128 <= kPassRows)
  const int e_lo = blockIdx.x * rows * hd, e_hi = min((static_cast<int>(blockIdx.x) + 1) * rows, p.dstate) * hd;
  const int e0 = e_lo + static_cast<int>(threadIdx.x) * kPassVec;
  const bool vec = hd % kPassVec == 0, full = e0 + kPassVec <= e_hi;
  float gr[kPassVec];
  int off16[kPassVec];  // kStates16: where element e0 + v's G goes in a chunk's 16-bit rows
#pragma unroll
  for (int v = 0; v < kPassVec; ++v) {
    const int e = e0 + v;
    const int n = e / hd, pp = e % hd;
    off16[v] = 2 * n * hd + pp;
    gr[v] = e < e_hi && p.dfinal ? p.dfinal[((static_cast<int64_t>(b) * p.nheads + h) * p.headdim + pp) * p.dstate + n] : 0.f;
  }
  auto load = [&](const float* q, float (&r)[kPassVec]) {
    if (vec && full) {
      const float4 u = *reinterpret_cast<const float4*>(q);
      r[0] = u.x, r[1] = u.y, r[2] = u.z, r[3] = u.w;
    } else {
#pragma unroll
      for (int v = 0; v < kPassVec; ++v) r[v] = e0 + v < e_hi ? q[v] : 0.f;
    }
  };
  const int last = p.chunk_size - 1, wave = threadIdx.x / kWavefront;
  float E[kPassVec], S[kPassVec];
  load(p.states + states_at(p, b, p.nchunks - 1, h) + e0, E);
  load(p.dstates + states_at(p, b, p.nchunks - 1, h) + e0, S);
  for (int top = p.nchunks - 1; top >= 0; top -= kPassBatch) {
    const int count = min(kPassBatch, top + 1);
    if (threadIdx.x < count) {  // chunk top - i: its carry, -1 where the state restarts
      const int c = top - threadIdx.x;
      carry[threadIdx.x] = seg_row(p, b, c)[last] == 0 ? __expf(p.dA_cs[chunk_row(p, b, h, c) + last]) : -1.f;
    }
    __syncthreads();
    for (int i = 0; i < count; ++i) {
      const int c = top - i;
      float En[kPassVec] = {}, Sn[kPassVec] = {};
      if (c > 0) {
        load(p.states + states_at(p, b, c - 1, h) + e0, En);
        load(p.dstates + states_at(p, b, c - 1, h) + e0, Sn);
      }
      float part = 0.f;
#pragma unroll
      for (int v = 0; v < kPassVec; ++v) part = fmaf(gr[v], E[v], part);
      const int n_in = min(kPassVec, e_hi - e0);  // (may be <= 0)
      if constexpr (kStates16<T>) {
        // G and the entering state over this block's rows (state_runs): every thread of the
        // block read their fp32 values at the chunk after this one, which the barrier orders
        // before these stores
        __syncthreads();
        Elem* rows16 = reinterpret_cast<Elem*>(p.dstates + states_at(p, b, c, h));
        if (vec) {  // the 4 lie in one row (store4: one 8-byte store where in range and aligned)
          store4<T>(rows16 + off16[0], n_in, gr);
          store4<T>(rows16 + off16[0] + hd, n_in, E);
        } else {
#pragma unroll
          for (int v = 0; v < kPassVec; ++v)
            if (v < n_in) rows16[off16[v]] = T::from_float(gr[v]), rows16[off16[v] + hd] = T::from_float(E[v]);
        }
      } else {
        store4<F32>(p.dstates + states_at(p, b, c, h) + e0, n_in, gr);
      }
      const float k = carry[i];
#pragma unroll
      for (int v = 0; v < kPassVec; ++v) gr[v] = k < 0.f ? S[v] : fmaf(k, gr[v], S[v]);  // select
      part = wave_sum(part);
      if (threadIdx.x % kWavefront == 0) wpart[i][wave] = part;
#pragma unroll
      for (int v = 0; v < kPassVec; ++v) E[v] = En[v], S[v] = Sn[v];
    }
    __syncthreads();
    if (threadIdx.x < count) {
      float total = 0.f;
      for (int w = 0; w < kThreads / kWavefront; ++w) total += wpart[threadIdx.x][w];
      const float k = carry[threadIdx.x];
      const int c = top - threadIdx.x;
      p.dA_last_part[((static_cast<int64_t>(b) * p.nheads + h) * p.nchunks + c) * p.pass_blocks + blockIdx.x] = k < 0.f ? 0.f : k * total;
    }
    __syncthreads();
  }
  if (p.dinit) {
#pragma unroll
    for (int v = 0; v < kPassVec; ++v) {
      const int e = e0 + v;
      if (e >= e_hi) continue;
      const int n = e / hd, pp = e % hd;
      p.dinit[((static_cast<int64_t>(b) * p.nheads + h) * p.headdim + pp) * p.dstate + n] = gr[v];
    }
  }
}

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

// ---- 7. cumsum: exponent gradients to ddt, dA, ddt_bias -------------------------------------------

// dA_cs[t] = sum of dt'[s] A over s <= t in t's segment, so dt'[s] A gets the sum of the
// exponent gradients of t >= s in its segment: thread i takes position chunk_size - 1 - i and
// runs the forward's segmented scan, restarting at each segment's last token. The exponent
// gradient at t: sum_p g y_off + sum_s M[t][s] - sum_t' M[t'][t] - (chunk-state part), and at
// the chunk end also the chunk-state parts of every token and the carry's gradient.
M2R_DEVICE void cumsum(const SsdBwdParams& p) {
  __shared__ float wsum[kThreads / kWavefront], partial[kThreads / kWavefront];
  __shared__ int wstart[kThreads / kWavefront];
  __shared__ int32_t seg[kMaxChunk];
  const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z, i = threadIdx.x, last = p.chunk_size - 1;
  const int32_t* sg = seg_row(p, b, c);
  if (i < p.chunk_size) seg[i] = sg[i];
  __syncthreads();
  const bool in = i < p.chunk_size;
  const int q = in ? last - i : 0;
  const int64_t pos = static_cast<int64_t>(c) * p.chunk_size + q;
  const bool valid = in && pos < p.seqlen;
  const bool start = in && q < last && seg[q + 1] != seg[q];
  const int ntiles = cdiv(p.dstate, kTile), ptiles = cdiv(p.headdim, kTile), ltiles = p.chunk_size / kTile, qt = q / kTile;
  // this position's partials: the loads of up to kBatch tiles of every kind are issued together
  // (the tile counts are known only at run time; ltiles <= kBatch always)
  constexpr int kBatch = kMaxChunk / kTile;
  float r = 0.f, dd = 0.f, kk = 0.f;
  if (valid) {
    float v0[kBatch], v1[kBatch], v2[kBatch], v3[kBatch], v4[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      v0[k] = k < ntiles ? tok_row(p, 0, k, b, h, c)[q] : 0.f;
      v1[k] = k < ptiles ? tok_row(p, 1, k, b, h, c)[q] : 0.f;
      v2[k] = k < ptiles ? tok_row(p, 2, k, b, h, c)[q] : 0.f;
      v3[k] = k <= qt ? tok_row(p, 3, k, b, h, c)[q] : 0.f;
      v4[k] = k >= qt && k < ltiles ? tok_row(p, 4, k, b, h, c)[q] : 0.f;
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) r += v0[k], dd += v1[k], kk += v2[k];
    for (int nt = kBatch; nt < ntiles; ++nt) r += tok_row(p, 0, nt, b, h, c)[q];  // dstate > 256
    for (int pt = kBatch; pt < ptiles; ++pt) {                                   // headdim > 256
      dd += tok_row(p, 1, pt, b, h, c)[q];
      kk += tok_row(p, 2, pt, b, h, c)[q];
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) r += v3[k];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) r -= v4[k];
  }
  const float dtq = valid ? p.dt_out[chunk_row(p, b, h, c) + q] : 0.f;
  // the raw dt, loaded before the barriers below so its latency overlaps them
  const float d_raw = valid ? load_as_float(p.dt, p.dt_dtype, b * p.dt_batch_stride + pos * p.dt_l_stride + h * p.dt_h_stride) : 0.f;
  // the state passing's carry-exponent partials of this chunk, one per thread, join kk's sum
  float lp = 0.f;
  {
    const float* lpp = p.dA_last_part + ((static_cast<int64_t>(b) * p.nheads + h) * p.nchunks + c) * p.pass_blocks;
    for (int k = i; k < p.pass_blocks; k += kThreads) lp += lpp[k];
  }
  float dacs = valid ? r - kk : 0.f;
  const float ksum = block_sum<kThreads>(kk + lp, partial);
  if (i == 0) dacs += ksum;  // position `last`: the chunk end, which the chunk state and the carry read
  const float back = block_segmented_scan(dacs, start, wsum, wstart);
  float ddt_raw = 0.f;
  if (valid) {
    const float ddt = fmaf(p.A[h], back, dd);  // the gradient of dt' at q
    float d = d_raw;
    if (p.dt_bias) d += p.dt_bias[h];
    float slope = 1.f;
    if (p.dt_softplus) {
      if (d <= 20.f) slope = 1.f / (1.f + __expf(-d));
      d = softplus(d);
    }
    const bool kept = d >= p.dt_min && d <= p.dt_max;  // clamp's gradient: where it is not clamped
    ddt_raw = kept ? ddt * slope : 0.f;
    p.ddt[(static_cast<int64_t>(b) * p.seqlen + pos) * p.nheads + h] = ddt_raw;
  }
  const float da = block_sum<kThreads>(valid ? dtq * back : 0.f, partial);
  const float db = block_sum<kThreads>(ddt_raw, partial);
  if (i == 0) {
    const int64_t plane = static_cast<int64_t>(p.batch) * p.nchunks * p.nheads;
    const int64_t at = (static_cast<int64_t>(b) * p.nchunks + c) * p.nheads + h;
    p.head_part[at] = da;
    p.head_part[plane + at] = db;
  }
}

}  // namespace ssd_bwd
}  // namespace m2r

M2R_KERNEL_MIN_BLOCKS(m2r::ssd_bwd::kThreads, 2) m2r_ssd_bwd_cumsum(SsdBwdParams p) { m2r::ssd_bwd::cumsum(p); }

// dstates is short and waits on its loads: 2 blocks per SM (128 registers), each with two
// tiles of dstate sharing its g operand's loads (one tile at 3 blocks, 85 registers, took
// 179.5 us at g8 on an H200)
#define M2R_DSTATES_BLOCKS 2
#define M2R_SSD_BWD(DT, T)                                                                                            \
  M2R_KERNEL_MIN_BLOCKS(m2r::ssd_bwd::kThreads, 2) m2r_ssd_bwd_dz_##DT(SsdBwdParams p) { m2r::ssd_bwd::dz<m2r::T>(p); }          \
  M2R_KERNEL_MIN_BLOCKS(m2r::ssd_bwd::kThreads, M2R_DSTATES_BLOCKS) m2r_ssd_bwd_dstates_##DT(SsdBwdParams p) { m2r::ssd_bwd::dstates<m2r::T>(p); } \
  M2R_KERNEL_MIN_BLOCKS(m2r::ssd_bwd::kThreads, 2) m2r_ssd_bwd_state_passing_##DT(SsdBwdParams p) { m2r::ssd_bwd::state_passing<m2r::T>(p); } \
  M2R_KERNEL_MIN_BLOCKS(m2r::ssd_bwd::kThreads, 2) m2r_ssd_bwd_dx_##DT(SsdBwdParams p) { m2r::ssd_bwd::dx<m2r::T>(p); }           \
  M2R_KERNEL_MIN_BLOCKS(m2r::ssd_bwd::kThreads, 2) m2r_ssd_bwd_dcb_##DT(SsdBwdParams p) { m2r::ssd_bwd::dcb<m2r::T>(p); }         \
  M2R_KERNEL_MIN_BLOCKS(m2r::ssd_bwd::kThreads, 2) m2r_ssd_bwd_dc_##DT(SsdBwdParams p) { m2r::ssd_bwd::dbc<m2r::T, false>(p); }   \
  M2R_KERNEL_MIN_BLOCKS(m2r::ssd_bwd::kThreads, 2) m2r_ssd_bwd_db_##DT(SsdBwdParams p) { m2r::ssd_bwd::dbc<m2r::T, true>(p); }
// ptxas' register cap (NVIDIA only): 2 blocks per SM (dx skips the prefetch to fit it)
M2R_SSD_BWD(f32, F32)
M2R_SSD_BWD(f16, F16)
M2R_SSD_BWD(bf16, BF16)
