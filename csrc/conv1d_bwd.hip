// Causal depthwise conv1d, backward (semantics: ConvBwdParams in params.h).
//
// One block owns kC channels of one batch row and walks tiles_per_block tiles of kL positions.
// Per tile, in LDS (as floats):
//   x    at t0-8 .. t0+kL+7   (the W-1 positions of history of the tile's outputs, and the
//                              inputs of the W-1 outputs after it, whose gradients reach the
//                              tile's inputs; 8 on each side keeps whole 16-byte vectors)
//   dout at t0 .. t0+kL+7,    turned in place into dy, the gradient before the activation
//                              (SiLU's derivative from the recomputed pre-activation)
// then dx[s] = sum_k w[k] dy[s+W-1-k] over the taps that stay inside s's sequence, and
// dweight / dbias accumulate in registers over every tile the thread sees. At the end the block
// sums its threads' accumulators in a fixed order and writes one partial row per channel: the
// host adds the partials over blocks in a fixed order too, so a run is bit-identical to the
// next (no atomics, deterministic with or without torch's deterministic mode).
//
// Loads and stores move whole 16-byte vectors along the layout's unit-stride index where the
// host found the tensors aligned (p.vec), element by element elsewhere (any strides). Two tile
// shapes, which differ in that index, so accesses coalesce and LDS is conflict-free in both:
//   *_rows  x seqlen-contiguous (or any strides): 4 channels x 512 positions, 64 threads a row
//   *_cl    x channel-last: 64 channels x 32 positions, 64 channels side by side
// and two kernels without LDS or barriers, which the host takes wherever their layouts allow:
//   *_walk   channel-last x, dout and dx in whole 32-bit words: a thread owns a word of
//            channels and walks a range of positions in registers (backward_walk)
//   *_rwalk  seqlen-contiguous x, dout and dx in 16-byte aligned rows: 32 lanes walk one
//            channel a chunk of 16-byte vectors at a time, history by shuffles (backward_rwalk)
#include <type_traits>

#include "platform.h"
#include "block_reduce.h"

namespace m2r {
namespace conv1d_bwd {

constexpr int kThreads = 256;
// staging / storing loops: a tile is 1-2 vectors per thread, both in flight; one at a time on
// AMD's wave64 targets, where the copies' lane masks (scalar register pairs) spilled
#if M2R_AMD && M2R_WAVEFRONT_SIZE == 64
#define M2R_STAGE_UNROLL _Pragma("unroll 1")
#else
#define M2R_STAGE_UNROLL _Pragma("unroll 2")
#endif
constexpr int kRowsC = 4, kRowsL = 512;
constexpr int kClC = 64, kClL = 32;
constexpr int kHalo = 8;  // positions staged on each side of a tile: >= width - 1, whole vectors

template <int kC, int kN, bool kChanFast>
M2R_DEVICE int slot(int c, int j) {  // LDS index of (channel c, position slot j) in a kN-slot tile
  return kChanFast ? j * kC + c : c * kN + j;
}

// Stage a tile of kC channels (from c0) x kNS positions (from pos0) of a (batch row of a)
// (dim, seqlen) tensor into LDS as floats, in the tile's slot order (slot<>). vec: the tensor
// has unit stride along the tile's fast index and 16-byte aligned rows (the host checks), so
// whole 16-byte vectors are loaded where they lie inside the tensor; elements past the end,
// past dim or before position 0 go one by one (before 0: the initial states, or 0; kHist).
template <typename T, int kW, int kC, int kNS, bool kChanFast, bool kHist>
M2R_DEVICE void stage(float* sh, const typename T::storage* base, int64_t c_stride, int64_t l_stride,
                      int64_t c0, int64_t pos0, int64_t dim, int64_t seqlen,
                      const typename T::storage* init, bool vec) {
  typedef typename T::storage S;
  constexpr int kN = 16 / sizeof(S);
  constexpr int kPerRow = kChanFast ? kC / kN : kNS / kN;  // vectors along the fast index
  static_assert((kChanFast ? kC : kNS) % kN == 0, "whole vectors along the fast index");
M2R_STAGE_UNROLL
  for (int e = threadIdx.x; e < kC * kNS / kN; e += kThreads) {
    const int ec = kChanFast ? (e % kPerRow) * kN : e / kPerRow;  // first channel / slot
    const int ej = kChanFast ? e / kPerRow : (e % kPerRow) * kN;
    const int64_t ch = c0 + ec, pos = pos0 + ej;
    float* dst = sh + slot<kC, kNS, kChanFast>(ec, ej);  // kN consecutive floats, 16-byte aligned
    const bool whole = kChanFast ? ch + kN <= dim && pos >= 0 && pos < seqlen
                                 : ch < dim && pos >= 0 && pos + kN <= seqlen;
    if (vec && whole) {
      typename Vec16<T>::U u;
      u.v = load_stream(reinterpret_cast<const vec16_t*>(base + ch * c_stride + pos * l_stride));
      float f[kN];
      Vec16<T>::unpack(u, f);
#pragma unroll
      for (int i = 0; i < kN; i += 4)
        *reinterpret_cast<float4*>(dst + i) = make_float4(f[i], f[i + 1], f[i + 2], f[i + 3]);
    } else {
      // element by element, not unrolled: the edges and unaligned layouts only (unrolled, its
      // conditions' lane masks, scalar register pairs on wave64, spilled AMD's gfx9 targets)
#pragma unroll 1
      for (int i = 0; i < kN; ++i) {
        const int64_t ci = kChanFast ? ch + i : ch, pi = kChanFast ? pos : pos + i;
        float v = 0.f;
        if (ci < dim && pi < seqlen) {
          if (pi >= 0)
            v = T::to_float(base[ci * c_stride + pi * l_stride]);
          else if (kHist && init != nullptr && pi >= -(kW - 1))
            v = T::to_float(init[ci * (kW - 1) + kW - 1 + pi]);
        }
        dst[i] = v;
      }
    }
  }
}

template <typename T, int kW, bool kSeq, int kC, int kL, bool kChanFast>
M2R_DEVICE void backward(const ConvBwdParams& p) {
  typedef typename T::storage S;
  constexpr int kN = 16 / sizeof(S);
  constexpr int kR = kThreads / kC;       // threads per channel
  constexpr int kNX = kL + 2 * kHalo;     // x slots: position t0 - kHalo + j
  constexpr int kNG = kL + kHalo;         // dout / dy slots: position t0 + j
  constexpr int kOff = kHalo - (kW - 1);  // x slot of output j's first tap: j + kOff
  static_assert(kC * kR == kThreads, "a whole number of threads per channel");
  static_assert(kW - 1 <= kHalo && kHalo % 8 == 0, "the halo holds the taps, in whole vectors");
  static_assert(kC * kNG >= kThreads * (kW + 1), "the final reduction reuses the dy tile");
  __shared__ __align__(16) float sx[kC * kNX];
  __shared__ __align__(16) float sg[kC * kNG];
  __shared__ int ss[kSeq ? kNX : 1];  // seq ids of the x slots (-1 before 0, -2 past the end)

  const int tid = threadIdx.x;
  const int my_c = kChanFast ? tid % kC : tid / kR;
  const int my_r = kChanFast ? tid / kC : tid % kR;
  const int64_t b = blockIdx.z;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kC;
  const int64_t c = c0 + my_c;
  // what the loops read of the parameters, held in vector registers: AMD's compiler keeps
  // uniform values in scalar registers, and the struct's fields alone nearly fill them (the
  // wave64 targets spilled)
  const int64_t dim = per_lane(p.dim), seqlen = per_lane(p.seqlen);
  const int64_t x_cs = per_lane(p.x_c_stride), x_ls = per_lane(p.x_l_stride);
  const int64_t g_cs = per_lane(p.dout_c_stride), g_ls = per_lane(p.dout_l_stride);
  const int64_t dx_cs = per_lane(p.dx_c_stride), dx_ls = per_lane(p.dx_l_stride);
  const bool c_ok = c < dim;
  const int64_t cw = c_ok ? c : dim - 1;  // a valid row for the weight loads
  float w[kW];
#pragma unroll
  for (int k = 0; k < kW; ++k)
    w[k] = load_as_float(p.weight, p.weight_dtype, cw * p.weight_c_stride + k * p.weight_w_stride);
  const float bias = p.bias ? load_as_float(p.bias, p.bias_dtype, cw) : 0.f;
  float dw[kW], db = 0.f;
#pragma unroll
  for (int k = 0; k < kW; ++k) dw[k] = 0.f;

  // row pointers in vector registers: AMD's compiler would keep these uniform values in
  // scalar registers, which the struct's strides already fill (gfx90a spilled them)
  const S* x = per_lane(static_cast<const S*>(p.x) + b * p.x_batch_stride);
  const S* dout = per_lane(static_cast<const S*>(p.dout) + b * p.dout_batch_stride);
  S* dx = per_lane(static_cast<S*>(p.dx) + b * p.dx_batch_stride);
  // the states' rows of batch b (contiguous (batch, dim, W-1)), or null
  const S* init = p.initial_states ? per_lane(static_cast<const S*>(p.initial_states) + b * dim * (kW - 1)) : nullptr;
  const S* dfin = p.dfinal ? per_lane(static_cast<const S*>(p.dfinal) + b * dim * (kW - 1)) : nullptr;
  const bool vec = p.vec != 0;

  for (int tile = 0; tile < p.tiles_per_block; ++tile) {
    const int64_t t0 = (static_cast<int64_t>(blockIdx.x) * p.tiles_per_block + tile) * kL;
    if (t0 >= seqlen) break;  // (uniform over the block)
    // ---- stage x, dout and the seq ids; zeros past the end and past dim ----
    stage<T, kW, kC, kNX, kChanFast, true>(sx, x, x_cs, x_ls, c0, t0 - kHalo, dim, seqlen, init, vec);
    stage<T, kW, kC, kNG, kChanFast, false>(sg, dout, g_cs, g_ls, c0, t0, dim, seqlen, nullptr, vec);
    if (kSeq) {
      for (int j = tid; j < kNX; j += kThreads) {
        const int64_t pos = t0 - kHalo + j;
        ss[j] = pos < 0 ? -1 : pos < seqlen ? p.seq_idx[b * p.seq_idx_batch_stride + pos * p.seq_idx_l_stride] : -2;
      }
    }
    __syncthreads();

    // ---- dy = dout * act'(pre), in place; dweight / dbias over the tile's own outputs ----
#pragma unroll 2
    for (int j = my_r; j < kL + kW - 1; j += kR) {
      const int sid = kSeq ? ss[j + kHalo] : 0;
      float g = sg[slot<kC, kNG, kChanFast>(my_c, j)];
      if (kSeq && sid < 0) g = 0.f;  // padding (or past the end): its output was 0
      float xs[kW];
#pragma unroll
      for (int k = 0; k < kW; ++k) {
        const bool tap = !kSeq || ss[j + k + kOff] == sid;
        xs[k] = tap ? sx[slot<kC, kNX, kChanFast>(my_c, j + k + kOff)] : 0.f;
      }
      if (p.silu) {
        float a = bias;
#pragma unroll
        for (int k = 0; k < kW; ++k) a = fmaf(w[k], xs[k], a);
        g *= dsilu_fast(a);
      }
      sg[slot<kC, kNG, kChanFast>(my_c, j)] = g;
      if (j < kL && (!kSeq || sid >= 0)) {
        db += g;
#pragma unroll
        for (int k = 0; k < kW; ++k) dw[k] = fmaf(g, xs[k], dw[k]);
      }
    }
    __syncthreads();

    // ---- dx of the tile's positions, into x slots 0 .. kL-1 (no longer read) ----
#pragma unroll 2
    for (int j = my_r; j < kL; j += kR) {
      const int64_t s = t0 + j;
      const int sid = kSeq ? ss[j + kHalo] : 0;
      float acc = 0.f;
#pragma unroll
      for (int k = 0; k < kW; ++k) {
        const int jt = j + kW - 1 - k;  // the output s feeds through tap k: position t0 + jt
        if (!kSeq || ss[jt + kHalo] == sid) acc = fmaf(w[k], sg[slot<kC, kNG, kChanFast>(my_c, jt)], acc);
      }
      if (dfin != nullptr && c_ok && s < seqlen && s >= seqlen - (kW - 1))
        acc += T::to_float(dfin[c * (kW - 1) + s - seqlen + kW - 1]);
      sx[slot<kC, kNX, kChanFast>(my_c, j)] = acc;
    }
    // dinit: the history positions -(W-1) .. -1 feed the first outputs (no seq_idx with states)
    if (tile == 0 && blockIdx.x == 0 && p.dinit != nullptr && c_ok && my_r == 0) {
      S* dinit = static_cast<S*>(p.dinit) + (b * dim + c) * (kW - 1);
#pragma unroll
      for (int j = 0; j < kW - 1; ++j) {
        const int64_t pos = j - (kW - 1);
        float acc = 0.f;
#pragma unroll
        for (int k = 0; k <= j; ++k) acc = fmaf(w[k], sg[slot<kC, kNG, kChanFast>(my_c, j - k)], acc);
        if (dfin != nullptr && pos >= seqlen - (kW - 1))
          acc += T::to_float(dfin[c * (kW - 1) + pos - seqlen + kW - 1]);
        dinit[j] = T::from_float(acc);
      }
    }
    __syncthreads();

    // ---- store dx: whole 16-byte vectors where they lie inside, else element by element ----
    constexpr int kPerRow = kChanFast ? kC / kN : kL / kN;
M2R_STAGE_UNROLL
    for (int e = tid; e < kC * kL / kN; e += kThreads) {
      const int ec = kChanFast ? (e % kPerRow) * kN : e / kPerRow;
      const int ej = kChanFast ? e / kPerRow : (e % kPerRow) * kN;
      const int64_t ch = c0 + ec, pos = t0 + ej;
      const float* src = sx + slot<kC, kNX, kChanFast>(ec, ej);
      const bool whole = kChanFast ? ch + kN <= dim && pos < seqlen : ch < dim && pos + kN <= seqlen;
      if (vec && whole) {
        float f[kN];
#pragma unroll
        for (int i = 0; i < kN; i += 4) {
          const float4 q = *reinterpret_cast<const float4*>(src + i);
          f[i] = q.x, f[i + 1] = q.y, f[i + 2] = q.z, f[i + 3] = q.w;
        }
        typename Vec16<T>::U u;
        Vec16<T>::pack(f, u);
        store_stream(reinterpret_cast<vec16_t*>(dx + ch * dx_cs + pos * dx_ls), u.v);
      } else {
#pragma unroll 1
        for (int i = 0; i < kN; ++i) {  // (not unrolled: see stage)
          const int64_t ci = kChanFast ? ch + i : ch, pi = kChanFast ? pos : pos + i;
          if (ci < dim && pi < seqlen) dx[ci * dx_cs + pi * dx_ls] = T::from_float(src[i]);
        }
      }
    }
    __syncthreads();  // the next tile's staging overwrites sx and sg
  }

  // ---- the block's dweight / dbias: every thread's sums, added in a fixed order ----
  float* red = sg;  // kThreads * (kW + 1) floats
#pragma unroll
  for (int k = 0; k < kW; ++k) red[(my_c * kR + my_r) * (kW + 1) + k] = dw[k];
  red[(my_c * kR + my_r) * (kW + 1) + kW] = db;
  __syncthreads();
  for (int q = tid; q < kC * (kW + 1); q += kThreads) {
    const int qc = q / (kW + 1), qk = q % (kW + 1);
    if (c0 + qc >= dim) continue;
    float sum = 0.f;
    for (int r = 0; r < kR; ++r) sum += red[(qc * kR + r) * (kW + 1) + qk];
    const int64_t row = b * gridDim.x + blockIdx.x;
    p.partial[(row * dim + c0 + qc) * (kW + 1) + qk] = sum;
  }
}

// ---- channel-last, in registers ("walk") ------------------------------------------------------
// x, dout and dx with unit stride along dim, whole 32-bit words of channels (dim a multiple of a
// word's channels) and word-aligned rows (the host checks). A thread owns one word (kPW channels)
// and walks its block's positions in order, holding the last W inputs and W gradients dy in
// registers: the pre-activation, dy, dweight / dbias and dx (W-1 positions behind dy) need no LDS
// and no barrier, and each element is loaded once (the LDS tile kernels above spent about 100
// instructions an element staging, indexing and exchanging: ncu, H200). The block's outputs are
// positions [a, e), tiles_per_block * kWalkTile of them; the walk starts W-1 earlier for the
// history (the initial states or zeros before 0; from -(W-1) where dinit is wanted, whose
// positions are the history's) and runs W-1 past e for the gradients of the range's last inputs,
// which the next range's outputs feed. Loads go out in chunks of kWalkChunk positions,
// kWalkRing chunks a ring (kWalkSeqChunk, kWalkSeqRing with seq_idx): one is walked while the
// others' loads are in flight. A chunk wholly inside the block's outputs and dx positions (most
// of them) is walked without any of the boundary checks: those selects and predicates, one form
// for every step, had held the walk back more than its loads in flight (H200: 8 positions a
// chunk and two a ring with the checks in every step, 121.2 us at b4 d5376 l2048; more loads in
// flight at the same registers 123.1, at fewer blocks 137-159; without the checks 99.3).
// With seq_idx such a chunk also skips the seq ids' comparisons where its window (the W-1
// positions before it and its own) is one sequence, as most chunks of packed sequences are
// (H200, 4 sequences a row: b4 d5376 l2048 146.7 -> 130.9 us). That also freed the scalar
// registers a ring of 3 chunks needs (with the comparisons in every step, gfx90a spilled 7).
constexpr int kWalkThreads = 128;
constexpr int kWalkTile = 64;   // positions a range is counted in (the host's tiles)
constexpr int kWalkChunk = 4;   // positions whose loads go out together
constexpr int kWalkRing = 3;    // chunks in the ring
constexpr int kWalkSeqChunk = 2, kWalkSeqRing = 3;  // with seq_idx (its ids' loads too)
constexpr int kWalkNvBlocks = 4;  // nvcc's register bound: blocks a multiprocessor

// dy of one position for the walking kernels: dout times silu's derivative at the
// pre-activation bias + sum_k w[k] xs[k] (kSilu), or dout itself
template <int kW, bool kSilu>
M2R_DEVICE float walk_dy(float g, const float (&w)[kW], float bias, const float (&xs)[kW]) {
  if (!kSilu) return g;
  float pre = bias;
#pragma unroll
  for (int k = 0; k < kW; ++k) pre = fmaf(w[k], xs[k], pre);
  return g * dsilu_fast(pre);
}

template <int kP>
struct WalkChunk {  // x and dout words (and seq ids) of kP positions
  uint32_t x[kP], g[kP];
  int sid[kP];
};

template <typename T, int kW, bool kSeq, bool kSilu>
M2R_DEVICE void backward_walk(const ConvBwdParams& p) {
  typedef typename T::storage S;
  constexpr int kPW = T::kPerWord;
  constexpr int kP = kSeq ? kWalkSeqChunk : kWalkChunk;
  constexpr int kRing = kSeq ? kWalkSeqRing : kWalkRing;
  // positions and channels in 32 bits (seqlen and dim are int32): fewer registers and
  // instructions than 64-bit ones; offsets are 64-bit where they meet a stride
  const int64_t b = blockIdx.z;
  const int dim = p.dim, seqlen = p.seqlen;
  const int c0 = (blockIdx.y * kWalkThreads + threadIdx.x) * kPW;
  if (c0 >= dim) return;  // (no barrier below; c0 + kPW <= dim: whole words)
  const int range = p.tiles_per_block * kWalkTile;
  const int a = blockIdx.x * range;
  const int e = min(a + range, seqlen);                         // (a < seqlen: the host's grid)
  const int a0 = a == 0 && p.dinit != nullptr ? -(kW - 1) : a;  // the first dx emitted
  const int s_end = e + kW - 1;                                 // steps [a0, s_end)

  // taps and bias: all requested before the first conversion
  uint32_t wbits[kPW][kW], bbits[kPW];
#pragma unroll
  for (int i = 0; i < kPW; ++i) {
#pragma unroll
    for (int k = 0; k < kW; ++k)
      wbits[i][k] = load_bits(p.weight, p.weight_dtype, (c0 + i) * p.weight_c_stride + k * p.weight_w_stride);
    bbits[i] = p.bias ? load_bits(p.bias, p.bias_dtype, c0 + i) : 0u;
  }
  const S* xr = static_cast<const S*>(p.x) + b * p.x_batch_stride + c0;
  const S* gr = static_cast<const S*>(p.dout) + b * p.dout_batch_stride + c0;
  S* const dxr = static_cast<S*>(p.dx) + b * p.dx_batch_stride + c0;
  // the states' rows: contiguous (batch, dim, W-1)
  const S* init = p.initial_states ? static_cast<const S*>(p.initial_states) + (b * dim + c0) * (kW - 1) : nullptr;
  const S* dfin = p.dfinal ? static_cast<const S*>(p.dfinal) + (b * dim + c0) * (kW - 1) : nullptr;
  S* const dinit = p.dinit ? static_cast<S*>(p.dinit) + (b * dim + c0) * (kW - 1) : nullptr;
  const int64_t x_ls = p.x_l_stride, g_ls = p.dout_l_stride, dx_ls = p.dx_l_stride;

  // a word of x (hist: the initial states, or zeros, before 0) or dout at any position s; zeros
  // past the end
  const auto word_at = [&](const S* r, int64_t ls, int s, bool hist) -> uint32_t {
    if (s >= 0 && s < seqlen) return load_stream(reinterpret_cast<const uint32_t*>(r + s * ls));
    float f[kPW];
#pragma unroll
    for (int i = 0; i < kPW; ++i)
      f[i] = hist && init != nullptr && s < 0 && s >= -(kW - 1) ? T::to_float(init[i * (kW - 1) + kW - 1 + s]) : 0.f;
    return T::pack(f);
  };
  const auto seq_at = [&](int s) {
    return s < 0 ? -1 : s < seqlen ? p.seq_idx[b * p.seq_idx_batch_stride + s * p.seq_idx_l_stride] : -2;
  };
  const auto fetch = [&](WalkChunk<kP>& ch, int s0) {
    if (s0 >= 0 && s0 + kP <= seqlen) {  // inside the sequence: a word load each
      const S* px = xr + s0 * x_ls;
      const S* pg = gr + s0 * g_ls;
#pragma unroll
      for (int q = 0; q < kP; ++q, px += x_ls, pg += g_ls) {
        ch.x[q] = load_stream(reinterpret_cast<const uint32_t*>(px));
        ch.g[q] = load_stream(reinterpret_cast<const uint32_t*>(pg));
      }
    } else {
#pragma unroll
      for (int q = 0; q < kP; ++q) {
        ch.x[q] = word_at(xr, x_ls, s0 + q, true);
        ch.g[q] = word_at(gr, g_ls, s0 + q, false);
      }
    }
    if (kSeq) {
#pragma unroll
      for (int q = 0; q < kP; ++q) ch.sid[q] = seq_at(s0 + q);
    }
  };

  float w[kPW][kW], bias[kPW];
#pragma unroll
  for (int i = 0; i < kPW; ++i) {
#pragma unroll
    for (int k = 0; k < kW; ++k) w[i][k] = bits_to_float(wbits[i][k], p.weight_dtype);
    bias[i] = p.bias ? bits_to_float(bbits[i], p.bias_dtype) : 0.f;
  }
  // windows: after step s, xw[.][k] = x(s-W+1+k), dyw[.][k] = dy(s-W+1+k), sw[k] = seq(s-W+1+k)
  float xw[kPW][kW], dyw[kPW][kW], dw[kPW][kW], db[kPW];
  int sw[kW];
#pragma unroll
  for (int k = 0; k < kW; ++k) sw[k] = -1;
#pragma unroll
  for (int k = 0; k + 1 < kW; ++k) {
    const int s = a0 - (kW - 1) + k;
    float f[kPW];
    T::unpack(word_at(xr, x_ls, s, true), f);
#pragma unroll
    for (int i = 0; i < kPW; ++i) xw[i][k + 1] = f[i];
    if (kSeq) sw[k + 1] = seq_at(s);
  }
#pragma unroll
  for (int i = 0; i < kPW; ++i) {
    db[i] = 0.f;
#pragma unroll
    for (int k = 0; k < kW; ++k) dyw[i][k] = dw[i][k] = 0.f;
  }

  S* pdx = dxr + static_cast<int64_t>(a0 - kW) * dx_ls;  // dx(t) at the step of t (a running
                                                         // pointer: no 64-bit product a step)
  // One step of the walk, at position s: dy(s), dweight / dbias where s is one of the block's
  // outputs, then dx(t), t = s - (W-1), whose outputs t + W-1-k (through tap k) are all known
  // now. The checks are selects and predicates; an inner step (a literal true: s one of the
  // block's outputs, t one of its dx positions, no final states) has none of them.
  // same (a literal true, kSeq): the W positions of the step's window are one sequence (the
  // caller checked the whole chunk's window), so the seq_idx comparisons are skipped too
  const auto step = [&](uint32_t xword, uint32_t gword, int sid, int s, bool inner, bool same) {
    float xf[kPW], gf[kPW];
    T::unpack(xword, xf);
    T::unpack(gword, gf);
    if (kSeq) {
#pragma unroll
      for (int k = 0; k + 1 < kW; ++k) sw[k] = sw[k + 1];
      sw[kW - 1] = sid;
    }
    const bool live = (inner || (s >= 0 && s < seqlen)) && (!kSeq || same || sw[kW - 1] >= 0);
    const bool own = live && (inner || (s >= a && s < e));
#pragma unroll
    for (int i = 0; i < kPW; ++i) {
#pragma unroll
      for (int k = 0; k + 1 < kW; ++k) xw[i][k] = xw[i][k + 1], dyw[i][k] = dyw[i][k + 1];
      xw[i][kW - 1] = xf[i];
      float xs[kW];
#pragma unroll
      for (int k = 0; k < kW; ++k) xs[k] = !kSeq || same || sw[k] == sw[kW - 1] ? xw[i][k] : 0.f;
      float dy = walk_dy<kW, kSilu>(gf[i], w[i], bias[i], xs);
      dy = live ? dy : 0.f;
      db[i] = own ? db[i] + dy : db[i];
#pragma unroll
      for (int k = 0; k < kW; ++k) dw[i][k] = own ? fmaf(dy, xs[k], dw[i][k]) : dw[i][k];
      dyw[i][kW - 1] = dy;
    }
    const int t = s - (kW - 1);
    pdx += dx_ls;
    float dx[kPW];
#pragma unroll
    for (int i = 0; i < kPW; ++i) {
      float acc = 0.f;
#pragma unroll
      for (int k = 0; k < kW; ++k)
        if (!kSeq || same || sw[kW - 1 - k] == sw[0]) acc = fmaf(w[i][k], dyw[i][kW - 1 - k], acc);
      dx[i] = acc;
    }
    if (!inner && t >= seqlen - (kW - 1) && dfin != nullptr) {  // the final states' positions
#pragma unroll
      for (int i = 0; i < kPW; ++i) dx[i] += T::to_float(dfin[i * (kW - 1) + t - seqlen + kW - 1]);
    }
    if (inner || (t >= 0 && t >= a0)) {
      store_stream(reinterpret_cast<uint32_t*>(pdx), T::pack(dx));
    } else if (t >= a0) {  // a history position (a0 < 0: dinit is wanted)
#pragma unroll
      for (int i = 0; i < kPW; ++i) dinit[i * (kW - 1) + t + kW - 1] = T::from_float(dx[i]);
    }
  };
  // kRing chunks a ring: each is refetched as soon as it has been walked, so the loads of up to
  // (kRing - 1) kP positions are in flight while one is walked
  WalkChunk<kP> ring[kRing];
  const int lo = max(a0, 0) + kW - 1;  // inner steps: [lo, e)
#pragma unroll
  for (int r = 0; r < kRing; ++r)
    if (r == 0 || a0 + r * kP < s_end) fetch(ring[r], a0 + r * kP);
  for (int s0 = a0; s0 < s_end; s0 += kRing * kP) {
#pragma unroll
    for (int r = 0; r < kRing; ++r) {
      const int c = s0 + r * kP;
      // with seq_idx: the chunk's window (W-1 positions before it, then its own) one sequence
      bool one = true;
      if (kSeq) {
        const int id = ring[r].sid[kP - 1];
        one = id >= 0;
#pragma unroll
        for (int k = 1; k < kW; ++k) one = one && sw[k] == id;
#pragma unroll
        for (int q = 0; q + 1 < kP; ++q) one = one && ring[r].sid[q] == id;
      }
      if (c >= lo && c + kP <= e && one) {
#pragma unroll
        for (int q = 0; q < kP; ++q) step(ring[r].x[q], ring[r].g[q], kSeq ? ring[r].sid[q] : 0, c + q, true, true);
      } else {
#pragma unroll
        for (int q = 0; q < kP; ++q)
          if (c + q < s_end) step(ring[r].x[q], ring[r].g[q], kSeq ? ring[r].sid[q] : 0, c + q, false, false);
      }
      if (c + kRing * kP < s_end) fetch(ring[r], c + kRing * kP);
    }
  }
  // the thread's channels alone: its sums are the block's partial row
  const int64_t row = b * gridDim.x + blockIdx.x;
#pragma unroll
  for (int i = 0; i < kPW; ++i) {
    float* out = p.partial + (row * dim + c0 + i) * (kW + 1);
#pragma unroll
    for (int k = 0; k < kW; ++k) out[k] = dw[i][k];
    out[kW] = db[i];
  }
}

// ---- seqlen-contiguous, in registers ("rwalk") ------------------------------------------------
// x, dout and dx with unit stride along seqlen and 16-byte aligned rows (the host checks: p.vec).
// A walker of kRLanes lanes (a warp, or half an AMD wave64: shuffles within aligned groups of
// kRLanes) owns one channel and walks its block's range of positions a chunk at a time: lane l
// holds the kN positions s0 + l kN .. of a chunk as one 16-byte vector of x and of dout. The
// history of a lane's first positions comes from the lane below (a shuffle; lane 0 from the
// previous chunk's last lane), dy is computed for the chunk, and dx one chunk behind, when the
// dy of the positions after each lane's (the lane above, or the next chunk's first lane) are
// known; after the range's last chunk, the W-1 gradients past it (the next range's, or zeros
// past the end) finish it. Each walker sums dweight / dbias over its lanes in a fixed order: one
// partial row per (range, channel). Chunks load one ahead of the one computed. A chunk that ends
// inside the sequence computes its dy without the per-position checks, and its dx too where it
// ends at or before e and the final states' positions. No seq_idx form (the rows kernel takes
// those calls: see the kernel definitions below).
constexpr int kRLanes = 32;
constexpr int kRWalkTile = 256;  // positions a range is counted in (a multiple of every chunk)
constexpr int kRWalkNvBlocks = 5;  // nvcc's register bound: blocks a multiprocessor

template <typename T, int kW, bool kSilu>
M2R_DEVICE void backward_rwalk(const ConvBwdParams& p) {
  typedef typename T::storage S;
  constexpr int kN = 16 / sizeof(S);   // positions a lane holds
  constexpr int kChunk = kRLanes * kN;  // positions a chunk
  constexpr int kH = kW - 1;            // history
  static_assert(kH <= kN && kRWalkTile % kChunk == 0, "a lane's history is its neighbour's");
  const int l = threadIdx.x % kRLanes;
  const int dim = p.dim, seqlen = p.seqlen;
  const int c = blockIdx.y * (kWalkThreads / kRLanes) + static_cast<int>(threadIdx.x) / kRLanes;
  if (c >= dim) return;  // a whole walker (its shuffles stay within its lanes)
  const int64_t b = blockIdx.z;
  const int range = p.tiles_per_block * kRWalkTile;
  const int a = blockIdx.x * range;
  const int e = min(a + range, seqlen);  // (a < seqlen: the host's grid)

  float w[kW];
#pragma unroll
  for (int k = 0; k < kW; ++k) w[k] = load_as_float(p.weight, p.weight_dtype, c * p.weight_c_stride + k * p.weight_w_stride);
  const float bias = p.bias ? load_as_float(p.bias, p.bias_dtype, c) : 0.f;
  const S* xr = static_cast<const S*>(p.x) + b * p.x_batch_stride + c * p.x_c_stride;
  const S* gr = static_cast<const S*>(p.dout) + b * p.dout_batch_stride + c * p.dout_c_stride;
  S* const dxr = static_cast<S*>(p.dx) + b * p.dx_batch_stride + c * p.dx_c_stride;
  const S* init = p.initial_states ? static_cast<const S*>(p.initial_states) + (b * dim + c) * kH : nullptr;
  const S* dfin = p.dfinal ? static_cast<const S*>(p.dfinal) + (b * dim + c) * kH : nullptr;
  const auto x_at = [&](int s) {  // any position: the history before 0, zeros past the end
    if (s >= 0) return s < seqlen ? T::to_float(xr[s]) : 0.f;
    return init != nullptr && s >= -kH ? T::to_float(init[kH + s]) : 0.f;
  };
  // a lane's kN positions from p0: one vector each of x and dout where whole, else one by one
  struct Vecs {
    typename Vec16<T>::U x, g;
  };
  const auto fetch = [&](Vecs& v, int p0) {
    if (p0 + kN <= seqlen) {
      v.x.v = load_stream(reinterpret_cast<const vec16_t*>(xr + p0));
      v.g.v = load_stream(reinterpret_cast<const vec16_t*>(gr + p0));
    } else {
#pragma unroll
      for (int j = 0; j < kN; ++j) {
        v.x.s[j] = p0 + j < seqlen ? xr[p0 + j] : S(0);
        v.g.s[j] = p0 + j < seqlen ? gr[p0 + j] : S(0);
      }
    }
  };

  float dw[kW], db = 0.f;
#pragma unroll
  for (int k = 0; k < kW; ++k) dw[k] = 0.f;
  float xcarry[kH];  // x of the kH positions before the chunk (lane 0's history)
#pragma unroll
  for (int k = 0; k < kH; ++k) xcarry[k] = x_at(a - kH + k);
  float dyp[kN];     // the previous chunk's dy (its dx is still to come)
  int prev = -1;     // its first position (-1: none yet)

  // dx of the previous chunk, now that nxt (the kH gradients after its last lane) is known;
  // inner (a literal true): the chunk ends at or before e and before the final states' positions
  const auto finish = [&](const float (&nxt)[kH], bool inner) {
    const int p0 = prev + l * kN;
    float above[kH];
#pragma unroll
    for (int k = 0; k < kH; ++k) {
      above[k] = shfl_width(dyp[k], l + 1, kRLanes);  // (the last lane's wraps to lane 0: replaced)
      if (l == kRLanes - 1) above[k] = nxt[k];
    }
    float dx[kN];
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      float acc = 0.f;
#pragma unroll
      for (int k = 0; k < kW; ++k) {
        const int m = j + kW - 1 - k;  // dy(p0 + m): output p0 + j's tap k
        acc = fmaf(w[k], m < kN ? dyp[m] : above[m - kN], acc);
      }
      if (!inner && dfin != nullptr && p0 + j >= seqlen - kH) acc += T::to_float(dfin[p0 + j - seqlen + kH]);
      dx[j] = acc;
    }
    if (inner || p0 + kN <= e) {
      typename Vec16<T>::U u;
      Vec16<T>::pack(dx, u);
      store_stream(reinterpret_cast<vec16_t*>(dxr + p0), u.v);
    } else {
#pragma unroll
      for (int j = 0; j < kN; ++j)
        if (p0 + j < e) dxr[p0 + j] = T::from_float(dx[j]);
    }
  };

  Vecs cur, nxt_v;
  fetch(cur, a + l * kN);
  for (int s0 = a; s0 < e; s0 += kChunk) {
    const int p0 = s0 + l * kN;
    if (s0 + kChunk < e) fetch(nxt_v, p0 + kChunk);
    float xv[kN], gv[kN];
    Vec16<T>::unpack(cur.x, xv);
    Vec16<T>::unpack(cur.g, gv);
    // the kH positions before this lane's: the lane below's last, lane 0 the previous chunk's
    float xl[kH];
#pragma unroll
    for (int k = 0; k < kH; ++k) {
      xl[k] = shfl_up_width(xv[kN - kH + k], 1, kRLanes);
      if (l == 0) xl[k] = xcarry[k];
      xcarry[k] = shfl_width(xv[kN - kH + k], kRLanes - 1, kRLanes);
    }
    // dy of the lane's positions; whole (a literal true): the chunk ends at or before seqlen
    float dy[kN];
    const auto chunk_dy = [&](bool whole) {
#pragma unroll
      for (int j = 0; j < kN; ++j) {
        float xs[kW];
#pragma unroll
        for (int k = 0; k < kW; ++k) {
          const int m = j - kH + k;  // the tap's position, relative to p0
          xs[k] = m >= 0 ? xv[m] : xl[m + kH];
        }
        const bool live = whole || p0 + j < seqlen;
        // (a chunk never runs past e but where e is the end: live positions are the block's own)
        float d = walk_dy<kW, kSilu>(gv[j], w, bias, xs);
        d = live ? d : 0.f;
        db = live ? db + d : db;
#pragma unroll
        for (int k = 0; k < kW; ++k) dw[k] = live ? fmaf(d, xs[k], dw[k]) : dw[k];
        dy[j] = d;
      }
    };
    if (s0 + kChunk <= seqlen) chunk_dy(true);
    else chunk_dy(false);
    // the history positions' gradients (dinit): lane 0 of the sequence's first chunk
    if (s0 == 0 && p.dinit != nullptr && l == 0) {
      S* dinit = static_cast<S*>(p.dinit) + (b * dim + c) * kH;
#pragma unroll
      for (int t = -kH; t < 0; ++t) {
        float acc = 0.f;
#pragma unroll
        for (int k = 0; k < kW; ++k)
          if (t + kW - 1 - k >= 0) acc = fmaf(w[k], dy[t + kW - 1 - k], acc);
        if (dfin != nullptr && t >= seqlen - kH) acc += T::to_float(dfin[t - seqlen + kH]);
        dinit[kH + t] = T::from_float(acc);
      }
    }
    if (prev >= 0) {
      float first[kH];
#pragma unroll
      for (int k = 0; k < kH; ++k) first[k] = shfl_width(dy[k], 0, kRLanes);
      if (prev + kChunk <= e && (dfin == nullptr || prev + kChunk <= seqlen - kH)) finish(first, true);
      else finish(first, false);
    }
#pragma unroll
    for (int j = 0; j < kN; ++j) dyp[j] = dy[j];
    prev = s0;
    cur = nxt_v;
  }
  // the kH gradients past the range (the next range's first outputs, or zeros past the end),
  // every lane alike: x of the kH positions before them from the last chunk's last lane
  {
    float tail[kH];
    float xw[kW + kH - 1];  // x at e - kH .. e + kH - 1
#pragma unroll
    for (int q = 0; q < kW + kH - 1; ++q) xw[q] = q < kH ? xcarry[q] : x_at(e - kH + q);
#pragma unroll
    for (int k0 = 0; k0 < kH; ++k0) {  // position e + k0
      const int s = e + k0;
      // (walk_dy's form, written out: through walk_dy, hipcc scheduled these differently)
      float d = s < seqlen ? T::to_float(gr[s]) : 0.f;
      if (kSilu) {
        float pre = bias;
#pragma unroll
        for (int k = 0; k < kW; ++k) pre = fmaf(w[k], xw[k0 + k], pre);
        d *= dsilu_fast(pre);
      }
      tail[k0] = s < seqlen ? d : 0.f;
    }
    // (a last chunk cut short by the end of the sequence: its lanes past e store nothing)
    finish(tail, false);
  }
  // the walker's sums over its lanes, in a fixed order: the partial row of (range, channel)
#pragma unroll
  for (int k = 0; k <= kW; ++k) {
    float v = k < kW ? dw[k] : db;
#pragma unroll
    for (int o = kRLanes / 2; o > 0; o /= 2) v += shfl_xor_width(v, o, kRLanes);
    if (l == 0) p.partial[((b * gridDim.x + blockIdx.x) * dim + c) * (kW + 1) + k] = v;
  }
}

// ---- dweight / dbias from the partial rows (a launch of its own, after the kernels above) -----
// grid (ceil(dim * (width + 1) / kColumnSumCols), 1, 1): column j of the (partial_rows, dim *
// (width + 1)) fp32 partials is column_sum over the rows (a fixed order: deterministic, no
// atomics), stored in its parameter's dtype: dweight[c, k] (k < width) or dbias[c] (k = width;
// none without a bias). One launch in place of a torch sum over the rows and two dtype
// conversions (three launches, three buffers).
constexpr int kReduceThreads = 256;

M2R_DEVICE void reduce_partials(const ConvBwdParams& p) {
  const int wp1 = p.width + 1;
  const int64_t cols = static_cast<int64_t>(p.dim) * wp1;
  int64_t j;
  const float acc = column_sum<kReduceThreads>(p.partial, cols, p.partial_rows, cols, j);
  if (threadIdx.x >= kColumnSumCols || j >= cols) return;
  const int64_t c = j / wp1;
  const int k = static_cast<int>(j - c * wp1);
  if (k < p.width) store_as(p.dweight, p.weight_dtype, c * p.width + k, acc);
  else if (p.dbias != nullptr) store_as(p.dbias, p.bias_dtype, c, acc);
}

}  // namespace conv1d_bwd
}  // namespace m2r

M2R_KERNEL(m2r::conv1d_bwd::kReduceThreads) m2r_conv1d_bwd_reduce(ConvBwdParams p) {
  m2r::conv1d_bwd::reduce_partials(p);
}

// One kernel per (dtype, width, tile shape), each with and without seq_idx ("_seq").
#define M2R_CONV_BWD_ONE(DT, T, W, NAME, C, L, CF)                                                   \
  M2R_KERNEL_MIN_BLOCKS(m2r::conv1d_bwd::kThreads, 3) m2r_conv1d_bwd_##DT##_w##W##_##NAME(ConvBwdParams p) {       \
    m2r::conv1d_bwd::backward<m2r::T, W, false, m2r::conv1d_bwd::C, m2r::conv1d_bwd::L, CF>(p);      \
  }                                                                                                  \
  M2R_KERNEL_MIN_BLOCKS(m2r::conv1d_bwd::kThreads, 3) m2r_conv1d_bwd_##DT##_w##W##_##NAME##_seq(ConvBwdParams p) { \
    m2r::conv1d_bwd::backward<m2r::T, W, true, m2r::conv1d_bwd::C, m2r::conv1d_bwd::L, CF>(p);       \
  }
// the walking kernels, silu or not as a template argument (a branch per step otherwise), with
// nvcc's register bound at the most blocks a multiprocessor that spills nothing at any width and
// dtype (kWalkNvBlocks, kRWalkNvBlocks: without one it took 148-167 registers). rwalk has no
// seq_idx form: causal-conv1d takes seq_idx with channel-last x only (the rows kernel serves the
// rest), and that form spilled scalar registers on the wave64 targets
#define M2R_CONV_BWD_WALK(DT, T, W)                                                                \
  M2R_KERNEL_MIN_BLOCKS(m2r::conv1d_bwd::kWalkThreads, m2r::conv1d_bwd::kWalkNvBlocks)             \
  m2r_conv1d_bwd_##DT##_w##W##_walk(ConvBwdParams p) {                                             \
    if (p.silu) m2r::conv1d_bwd::backward_walk<m2r::T, W, false, true>(p);                         \
    else m2r::conv1d_bwd::backward_walk<m2r::T, W, false, false>(p);                               \
  }                                                                                                \
  M2R_KERNEL_MIN_BLOCKS(m2r::conv1d_bwd::kWalkThreads, m2r::conv1d_bwd::kWalkNvBlocks)             \
  m2r_conv1d_bwd_##DT##_w##W##_walk_seq(ConvBwdParams p) {                                         \
    if (p.silu) m2r::conv1d_bwd::backward_walk<m2r::T, W, true, true>(p);                          \
    else m2r::conv1d_bwd::backward_walk<m2r::T, W, true, false>(p);                                \
  }
#define M2R_CONV_BWD_RWALK(DT, T, W)                                                               \
  M2R_KERNEL_MIN_BLOCKS(m2r::conv1d_bwd::kWalkThreads, m2r::conv1d_bwd::kRWalkNvBlocks)            \
  m2r_conv1d_bwd_##DT##_w##W##_rwalk(ConvBwdParams p) {                                            \
    if (p.silu) m2r::conv1d_bwd::backward_rwalk<m2r::T, W, true>(p);                               \
    else m2r::conv1d_bwd::backward_rwalk<m2r::T, W, false>(p);                                     \
  }
#define M2R_CONV_BWD(DT, T, W)                                 \
  M2R_CONV_BWD_ONE(DT, T, W, rows, kRowsC, kRowsL, false)      \
  M2R_CONV_BWD_ONE(DT, T, W, cl, kClC, kClL, true)             \
  M2R_CONV_BWD_WALK(DT, T, W)                                  \
  M2R_CONV_BWD_RWALK(DT, T, W)
#define M2R_CONV_BWD_WIDTHS(DT, T) M2R_CONV_BWD(DT, T, 2) M2R_CONV_BWD(DT, T, 3) M2R_CONV_BWD(DT, T, 4)

M2R_CONV_BWD_WIDTHS(f32, F32)
M2R_CONV_BWD_WIDTHS(f16, F16)
M2R_CONV_BWD_WIDTHS(bf16, BF16)
