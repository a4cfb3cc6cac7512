// Mamba1's selective scan, forward (semantics in params.h: SelectiveScanParams).
//
// Work split: one channel (batch row b, channel d) per kLanes lanes (16; 32 for dstate 256);
// lane l keeps the state elements n = l, l + kLanes, ... in registers (kPer <= 8 of them). The
// lane count divides both wavefront sizes, so a channel never spans two waves and the per-token
// sum over dstate is a butterfly on wave32 (RDNA) and wave64 (CDNA) alike. A block holds
// kCh = 128 / kLanes channels of one batch row.
//
// The sequence is walked in chunks of kChunk tokens: u and the processed delta (bias, softplus
// applied once per element) of the block's channels are staged in LDS with coalesced loads, the
// recurrence runs token by token from LDS, each channel's outputs go to an LDS tile, and the tile
// is written back coalesced with D * u and the silu(z) gate. The state lives in registers across
// chunks: the carry from one chunk to the next is the register itself, never reloaded or
// recomputed (the chunk-boundary bug class of the first consumer-AMD port cannot arise: there is
// no per-chunk state to combine). B / C (float32: the host converts any other type, a copy the
// size of B, tiny next to u) of variable (per token) kind are read from global memory per
// token; the block's channels share a group's row, so those reads hit the caches.
//
// Two forms of the per-token sum over dstate (both exported; the host picks one):
//   m2r_selective_scan_<dt>_n<N>     a butterfly over the channel's lanes at every token (the
//                                    shuffles sit in the token loop);
//   m2r_selective_scan_<dt>_n<N>_dr  deferred: each lane writes its partial sum of the token to
//                                    LDS and the sums are done once per chunk, after the loop,
//                                    so the loop carries only the recurrence h = a h + b (one
//                                    FMA per state element and token on its critical path) and
//                                    is unrolled to issue the next tokens' loads and exps early.
#include "platform.h"

namespace m2r {
namespace sscan {

constexpr int kThreads = 128;
// the segment form's tokens per lane and chunk (8: 16-byte loads of half-precision rows) and
// state elements in flight per lane; build-time knobs for measuring, the defaults are the
// measured best
#ifndef M2R_SSCAN_TOK
#define M2R_SSCAN_TOK 8
#endif
#ifndef M2R_SSCAN_INTER
#define M2R_SSCAN_INTER 1
#endif
constexpr int kChunk = 64;  // tokens staged per step
// lanes per channel for a dstate tier: 16 up to 128 (8 state elements per lane at most), 32 at
// 256 (16 per lane spilled on gfx10.3); channels per block = kThreads / lanes
constexpr float kLog2e = 1.4426950408889634f;

template <typename T, int kN, bool kDeferred>
M2R_DEVICE void scan(const SelectiveScanParams& p) {
  constexpr int kLanes = kN <= 128 ? 16 : 32;
  constexpr int kPer = kN / kLanes;
  constexpr int kCh = kThreads / kLanes;
  __shared__ float s_u[kCh][kChunk];
  __shared__ float s_dt[kCh][kChunk];
  __shared__ float s_y[kCh][kDeferred ? 1 : kChunk];
  // deferred sums: every lane's partial of every token of the chunk; the row is padded by one
  // so that the per-chunk sums (threads on consecutive tokens) read distinct banks
  __shared__ float s_part[kDeferred ? kChunk : 1][kThreads + 1];
  const int lane = threadIdx.x % kLanes;
  const int ch = threadIdx.x / kLanes;
  const int64_t b = blockIdx.y;
  const int64_t d0 = static_cast<int64_t>(blockIdx.x) * kCh;
  const int64_t d = d0 + ch;
  const bool live = d < p.dim;
  const int64_t dd = live ? d : d0;  // a row past dim computes on row d0 and writes nothing

  // per-lane constants: A in log2 units and the offsets of this lane's B / C elements. A state
  // element past dstate (the tier's tail) gets A = 0 and input weight 0 and reads B / C at the
  // last real element: no predicate and no per-element scalar offset in the token loop (on
  // wave64 both held scalar registers, and they spilled)
  float a2[kPer], h[kPer], keep[kPer];
  int64_t b_off[kPer], c_off[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int n = lane + i * kLanes;
    const bool valid = n < p.dstate;
    const int64_t nn = valid ? n : p.dstate - 1;
    a2[i] = valid ? p.A[dd * p.dstate + n] * kLog2e : 0.f;
    keep[i] = valid ? 1.f : 0.f;
    h[i] = 0.f;
    b_off[i] = p.b_groups ? nn * p.seqlen : nn;  // element n of the channel's B row at token 0
    c_off[i] = p.c_groups ? nn * p.seqlen : nn;
  }
  // this channel's B / C: fixed (dim, dstate) rows, the same at every token; or its group's
  // (dstate, seqlen) block, one column per token
  const int64_t L = p.seqlen;
  const float* bp = p.B + (p.b_groups ? (b * p.b_groups + dd / (p.dim / p.b_groups)) * p.dstate * L
                                       : dd * p.dstate);
  const float* cp = p.C + (p.c_groups ? (b * p.c_groups + dd / (p.dim / p.c_groups)) * p.dstate * L
                                       : dd * p.dstate);

  // staging: thread e stages token e % kChunk of channels e / kChunk + j * kThreads / kChunk;
  // its rows' pointers, delta_bias and D are fixed for the whole sequence, so they are worked
  // out once, in registers (uniform values live across the chunk loop spilled on gfx90a)
  typedef typename T::storage S;
  static_assert(kThreads % kChunk == 0, "a thread stages one token position");
  constexpr int kItems = kCh * kChunk / kThreads;
  const int st = threadIdx.x % kChunk;
  const S* u_row[kItems];
  const S* dl_row[kItems];
  const S* z_row[kItems];
  S* o_row[kItems];
  float dbias[kItems], dcoef[kItems];
  bool ok[kItems];
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int c = threadIdx.x / kChunk + j * (kThreads / kChunk);
    const int64_t dc = d0 + c;
    ok[j] = dc < p.dim;
    const int64_t dr = ok[j] ? dc : d0;
    const int64_t row = (b * p.dim + dr) * L;
    u_row[j] = static_cast<const S*>(p.u) + row;
    dl_row[j] = static_cast<const S*>(p.delta) + row;
    z_row[j] = p.z ? static_cast<const S*>(p.z) + row : nullptr;
    o_row[j] = static_cast<S*>(p.out) + row;
    dbias[j] = p.delta_bias ? load_as_float(p.delta_bias, p.delta_bias_dtype, dr) : 0.f;
    dcoef[j] = p.D ? load_as_float(p.D, p.d_dtype, dr) : 0.f;
  }
  const bool softplus_on = p.delta_softplus != 0;
  const int64_t seqlen = L, b_ls = p.b_groups ? 1 : 0, c_ls = p.c_groups ? 1 : 0;

#pragma unroll 1
  for (int64_t t0 = 0; t0 < seqlen; t0 += kChunk) {
    const int len = static_cast<int>(min(static_cast<int64_t>(kChunk), seqlen - t0));
    const bool in = st < len;
    __syncthreads();  // the previous chunk's tiles are consumed
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int c = threadIdx.x / kChunk + j * (kThreads / kChunk);
      float uu = 0.f, dv = 0.f;
      if (ok[j] && in) {
        uu = T::to_float(u_row[j][t0 + st]);
        dv = T::to_float(dl_row[j][t0 + st]) + dbias[j];
        if (softplus_on) dv = softplus(dv);
      }
      s_u[c][st] = uu;
      s_dt[c][st] = dv;
    }
    __syncthreads();
    const float* bq = bp + t0 * b_ls;
    const float* cq = cp + t0 * c_ls;
    // Two loops on purpose: each form keeps the addressing its compiled code is best with
    // (indexed, unrolled: the deferred form; advanced pointers: the butterfly, byte for byte
    // the form verified on the GPU). One shared loop changed the butterfly's code on sm_90 and
    // raised the deferred form's registers from 168 to 246.
    if constexpr (kDeferred) {
#pragma unroll 4
      for (int t = 0; t < len; ++t) {
        const float dt = s_dt[ch][t];
        const float dtu = dt * s_u[ch][t];
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < kPer; ++i) {
          h[i] = fmaf(fast_exp2(dt * a2[i]), h[i], dtu * keep[i] * bq[t * b_ls + b_off[i]]);
          acc = fmaf(h[i], keep[i] * cq[t * c_ls + c_off[i]], acc);
        }
        s_part[t][threadIdx.x] = acc;
      }
    } else {
#pragma unroll 1
      for (int t = 0; t < len; ++t, bq += b_ls, cq += c_ls) {
        const float dt = s_dt[ch][t];
        const float dtu = dt * s_u[ch][t];
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < kPer; ++i) {
          h[i] = fmaf(fast_exp2(dt * a2[i]), h[i], dtu * keep[i] * bq[b_off[i]]);
          acc = fmaf(h[i], keep[i] * cq[c_off[i]], acc);
        }
#pragma unroll
        for (int off = kLanes / 2; off > 0; off /= 2) acc += shfl_xor_width(acc, off, kLanes);
        if (lane == 0) s_y[ch][t] = acc;
      }
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int c = threadIdx.x / kChunk + j * (kThreads / kChunk);
      if (!ok[j] || !in) continue;
      float sum;
      if constexpr (kDeferred) {  // channel c's lanes' partials of token st, in lane order
        sum = 0.f;
#pragma unroll
        for (int l = 0; l < kLanes; ++l) sum += s_part[st][c * kLanes + l];
      } else {
        sum = s_y[c][st];
      }
      float y = fmaf(dcoef[j], s_u[c][st], sum);
      if (z_row[j]) y *= silu(T::to_float(z_row[j][t0 + st]));
      o_row[j][t0 + st] = T::from_float(y);
    }
  }
  if (p.last_state != nullptr && live) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int n = lane + i * kLanes;
      if (n < p.dstate) p.last_state[(b * p.dim + d) * p.dstate + n] = h[i];
    }
  }
}


// ---- the segment form (m2r_selective_scan_<dt>_n<16|32|64>_sp) -----------------------------
// The forms above walk each channel's tokens one by one: the whole sequence is one dependency
// chain per channel, and a channel's lanes share one state element each, so at Mamba1's dstate
// 16 the chain (a load, an exp, an FMA, a cross-lane sum per token) is all a lane does and the
// kernel runs at the latency of that chain, a few percent of the memory bandwidth. The segment
// form parallelises along the sequence instead: a channel takes a group of kSeg = 32 lanes
// (one warp, half a wave64: a group never spans two waves), and in every chunk of
// kSeg * kTok tokens lane j owns the kTok consecutive tokens from j * kTok. The state elements
// are independent recurrences (only the outputs sum over them), so the lane takes them one at a
// time, and for each:
//   1. runs the recurrence over its tokens from a zero state: the segment's affine map
//      h -> P h + hl (P the product of its tokens' decays exp(A delta), hl the state from zero);
//   2. an inclusive scan over the group's lanes (Hillis-Steele, shuffles; products, no exps)
//      composes the maps; the exclusive map applied to the carry from the previous chunk is the
//      state at the lane's first token, lane 31's inclusive map the carry into the next chunk
//      (LDS, per lane and element; nothing is written to memory between chunks);
//   3. runs its tokens again from that state with the decays and B it kept, summing C h into
//      the lane's outputs.
// One exp, one B and one C load per token and element, as the sequential forms. The outputs
// get D u and the silu(z) gate and are written once per chunk.
// Every load is a lane's kTok consecutive elements of a row: one or two 16-byte loads where the
// row is 16-byte aligned and the segment lies inside the sequence, element loads otherwise; a
// warp's loads are contiguous. Tokens past seqlen (the last chunk's tail) take delta 0 and u 0:
// the identity step, so the carry and the last state are untouched by them.

// 32-bit word i of a run of 16-byte words (i a compile-time constant after unrolling: no
// indexed register arrays, which AMD's compiler would put in scratch memory)
template <int kWords>
M2R_DEVICE uint32_t word(const uint4 (&w)[kWords], int i) {
  const uint4 q = w[i / 4];
  return (i & 3) == 0 ? q.x : (i & 3) == 1 ? q.y : (i & 3) == 2 ? q.z : q.w;
}

// element k of a run of 16-byte words holding kTok elements of T's storage, as float
template <typename T, int kWords>
M2R_DEVICE float element(const uint4 (&w)[kWords], int k) {
  if constexpr (sizeof(typename T::storage) == 4) {
    return __uint_as_float(word(w, k));
  } else {
    return T::to_float(static_cast<typename T::storage>((word(w, k / 2) >> (16 * (k & 1))) & 0xffffu));
  }
}

// kTok consecutive elements of a row from token t on, as float (0 past len)
template <typename T, int kTok>
M2R_DEVICE void load_seg(const typename T::storage* row, int64_t t, int64_t len, bool vec,
                         float* out) {
  constexpr int kWords = kTok * static_cast<int>(sizeof(typename T::storage)) / 16;
  static_assert(kWords * 16 == kTok * static_cast<int>(sizeof(typename T::storage)),
                "whole 16-byte loads");
  if (vec && t + kTok <= len) {
    uint4 w[kWords];
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = reinterpret_cast<const uint4*>(row + t)[i];
#pragma unroll
    for (int k = 0; k < kTok; ++k) out[k] = element<T>(w, k);
  } else {
#pragma unroll
    for (int k = 0; k < kTok; ++k) out[k] = t + k < len ? T::to_float(row[t + k]) : 0.f;
  }
}

M2R_DEVICE bool aligned16(const void* q) { return (reinterpret_cast<uintptr_t>(q) & 15) == 0; }

template <typename T, int kN>
M2R_DEVICE void scan_segments(const SelectiveScanParams& p) {
  constexpr int kSeg = 32;  // lanes (segments) per channel
  constexpr int kTok = M2R_SSCAN_TOK;      // tokens per lane and chunk
  constexpr int kInter = M2R_SSCAN_INTER;  // state elements in flight per lane (1 or 2)
  constexpr int kCh = kThreads / kSeg;
  typedef typename T::storage S;
  // the carry between chunks per state element, in LDS (the loop over state elements stays
  // rolled: unrolled, AMD's compiler kept every element's loads and exps live at once and
  // spilled); the same in every lane of a channel, each lane keeps its own copy, so no lane
  // waits for another's write
  __shared__ float s_carry[kN][kThreads];
  const int tid = threadIdx.x;
  const int j = tid % kSeg;
  const int64_t b = blockIdx.y;
  const int64_t d0 = static_cast<int64_t>(blockIdx.x) * kCh;
  const int64_t d = d0 + tid / kSeg;
  const bool live = d < p.dim;
  const int64_t dd = live ? d : d0;  // a channel past dim computes on channel d0, writes nothing
  const int64_t L = p.seqlen;
  const int nst = p.dstate;  // <= kN
  const float* a_row = p.A + dd * nst;
  // only this thread reads its column; every row, also past dstate: an element in flight past
  // dstate (odd dstate, kInter 2) computes on a zero carry with B = C = 0
  for (int n = 0; n < kN; ++n) s_carry[n][tid] = 0.f;
  const int64_t row = (b * p.dim + dd) * L;
  const S* u_row = static_cast<const S*>(p.u) + row;
  const S* dl_row = static_cast<const S*>(p.delta) + row;
  const S* z_row = p.z ? static_cast<const S*>(p.z) + row : nullptr;
  S* o_row = static_cast<S*>(p.out) + row;
  // B / C: a group's (dstate, seqlen) block (row n at n * L) or fixed (dim, dstate) values
  const float* bp = p.B + (p.b_groups ? (b * p.b_groups + dd / (p.dim / p.b_groups)) * nst * L
                                       : dd * nst);
  const float* cp = p.C + (p.c_groups ? (b * p.c_groups + dd / (p.dim / p.c_groups)) * nst * L
                                       : dd * nst);
  const bool vec_x = aligned16(u_row) && aligned16(dl_row) && (!z_row || aligned16(z_row)) &&
                     aligned16(o_row);
  // every row of a B / C block starts 16-byte aligned when the block does and L is a multiple of 4
  const bool vec_b = p.b_groups && aligned16(bp) && L % 4 == 0;
  const bool vec_c = p.c_groups && aligned16(cp) && L % 4 == 0;
  const float dbias = p.delta_bias ? load_as_float(p.delta_bias, p.delta_bias_dtype, dd) : 0.f;
  const float dcoef = p.D ? load_as_float(p.D, p.d_dtype, dd) : 0.f;
  const bool softplus_on = p.delta_softplus != 0;

#pragma unroll 1
  for (int64_t c0 = 0; c0 < L; c0 += kSeg * kTok) {
    const int64_t t = c0 + j * kTok;  // this lane's first token
    float u[kTok], dt[kTok], dtu[kTok], y[kTok];
    load_seg<T, kTok>(u_row, t, L, vec_x, u);
    load_seg<T, kTok>(dl_row, t, L, vec_x, dt);
#pragma unroll
    for (int k = 0; k < kTok; ++k) {
      float v = dt[k] + dbias;
      if (softplus_on) v = softplus(v);
      dt[k] = t + k < L ? v : 0.f;  // past the sequence: the identity step
      dtu[k] = dt[k] * u[k];
      y[k] = 0.f;
    }
    // B / C of state element n (fixed ones broadcast over the tokens; 0 past dstate)
    auto load_bc = [&](int n, float* bq, float* cq) {
      if (n >= nst) {
#pragma unroll
        for (int k = 0; k < kTok; ++k) bq[k] = 0.f, cq[k] = 0.f;
        return;
      }
      if (p.b_groups) {
        load_seg<F32, kTok>(bp + n * L, t, L, vec_b, bq);
      } else {
#pragma unroll
        for (int k = 0; k < kTok; ++k) bq[k] = bp[n];
      }
      if (p.c_groups) {
        load_seg<F32, kTok>(cp + n * L, t, L, vec_c, cq);
      } else {
#pragma unroll
        for (int k = 0; k < kTok; ++k) cq[k] = cp[n];
      }
    };
    // kInter state elements at a time (independent recurrences; only the outputs sum over
    // them), the next ones' B / C loads in flight while these compute (the scan is a chain of
    // shuffles)
    float nb[kInter][kTok], nc[kInter][kTok];
#pragma unroll
    for (int i = 0; i < kInter; ++i) load_bc(i, nb[i], nc[i]);
#pragma unroll 1
    for (int n = 0; n < nst; n += kInter) {
      float bv[kInter][kTok], cv[kInter][kTok], a2[kInter];
#pragma unroll
      for (int i = 0; i < kInter; ++i) {
        a2[i] = n + i < nst ? a_row[n + i] * kLog2e : 0.f;
#pragma unroll
        for (int k = 0; k < kTok; ++k) bv[i][k] = nb[i][k], cv[i][k] = nc[i][k];
      }
      if (n + kInter < nst) {
#pragma unroll
        for (int i = 0; i < kInter; ++i) load_bc(n + kInter + i, nb[i], nc[i]);
      }
      // 1. the segment's map h -> P h + hl: its decays' product and its state from zero
      float decay[kInter][kTok], h[kInter], P[kInter];
#pragma unroll
      for (int i = 0; i < kInter; ++i) {
        h[i] = 0.f, P[i] = 1.f;
#pragma unroll
        for (int k = 0; k < kTok; ++k) {
          decay[i][k] = fast_exp2(a2[i] * dt[k]);
          h[i] = fmaf(decay[i][k], h[i], dtu[k] * bv[i][k]);
          P[i] *= decay[i][k];
        }
      }
      // 2. inclusive scan of the maps over the channel's lanes (Hillis-Steele: the lane's range
      // composed with the range before it); the exclusive map applied to the carry is the state
      // at the lane's first token, lane 31's inclusive map the carry into the next chunk
#pragma unroll
      for (int s = 0; s < 5; ++s) {
#pragma unroll
        for (int i = 0; i < kInter; ++i) {
          const float hp = shfl_up_width(h[i], 1 << s, kSeg);
          const float Pp = shfl_up_width(P[i], 1 << s, kSeg);
          if (j >= (1 << s)) h[i] = fmaf(P[i], hp, h[i]), P[i] *= Pp;
        }
      }
      static_assert(kSeg == 32, "five scan steps");
#pragma unroll
      for (int i = 0; i < kInter; ++i) {
        const float h_ex = shfl_up_width(h[i], 1, kSeg);  // every lane shuffles; lane 0 drops
        const float P_ex = shfl_up_width(P[i], 1, kSeg);
        const float h_all = shfl_width(h[i], kSeg - 1, kSeg);
        const float P_all = shfl_width(P[i], kSeg - 1, kSeg);
        const float carry = s_carry[n + i][tid];
        s_carry[n + i][tid] = fmaf(P_all, carry, h_all);
        h[i] = j > 0 ? fmaf(P_ex, carry, h_ex) : carry;
      }
      // 3. the lane's tokens again from that state (the decays and B kept), with the outputs
#pragma unroll
      for (int i = 0; i < kInter; ++i) {
#pragma unroll
        for (int k = 0; k < kTok; ++k) {
          h[i] = fmaf(decay[i][k], h[i], dtu[k] * bv[i][k]);
          y[k] = fmaf(h[i], cv[i][k], y[k]);
        }
      }
    }
    if (!live) continue;
    float zv[kTok];
    if (z_row) load_seg<T, kTok>(z_row, t, L, vec_x, zv);
#pragma unroll
    for (int k = 0; k < kTok; ++k) {
      y[k] = fmaf(dcoef, u[k], y[k]);
      if (z_row) y[k] *= silu(zv[k]);
    }
    if (vec_x && t + kTok <= L) {
      constexpr int kWords = kTok * static_cast<int>(sizeof(S)) / 16;
      uint32_t v[4 * kWords];
#pragma unroll
      for (int i = 0; i < 4 * kWords; ++i) {
        if constexpr (sizeof(S) == 4) {
          v[i] = __float_as_uint(y[i]);
        } else {
          v[i] = static_cast<uint32_t>(T::from_float(y[2 * i])) |
                 (static_cast<uint32_t>(T::from_float(y[2 * i + 1])) << 16);
        }
      }
#pragma unroll
      for (int i = 0; i < kWords; ++i)
        reinterpret_cast<uint4*>(o_row + t)[i] =
            make_uint4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
    } else {
#pragma unroll
      for (int k = 0; k < kTok; ++k)
        if (t + k < L) o_row[t + k] = T::from_float(y[k]);
    }
  }
  if (p.last_state != nullptr && live && j == 0) {
    for (int n = 0; n < nst; ++n) p.last_state[(b * p.dim + d) * nst + n] = s_carry[n][tid];
  }
}

}  // namespace sscan
}  // namespace m2r

// m2r_selective_scan_<dtype>_n<max dstate>[_dr]: dstate tiers 16, 32, 64, 128, 256
#define M2R_SSCAN(DT, T, N)                                                                      \
  M2R_KERNEL(m2r::sscan::kThreads) m2r_selective_scan_##DT##_n##N(SelectiveScanParams p) {       \
    m2r::sscan::scan<m2r::T, N, false>(p);                                                       \
  }                                                                                              \
  M2R_KERNEL(m2r::sscan::kThreads) m2r_selective_scan_##DT##_n##N##_dr(SelectiveScanParams p) {  \
    m2r::sscan::scan<m2r::T, N, true>(p);                                                        \
  }
// the segment form for the small dstate tiers (all of a channel's state in one lane's registers)
#define M2R_SSCAN_SEG(DT, T, N)                                                                  \
  M2R_KERNEL(m2r::sscan::kThreads) m2r_selective_scan_##DT##_n##N##_sp(SelectiveScanParams p) {  \
    m2r::sscan::scan_segments<m2r::T, N>(p);                                                     \
  }
#define M2R_SSCAN_N(DT, T)                                                                        \
  M2R_SSCAN(DT, T, 16) M2R_SSCAN(DT, T, 32) M2R_SSCAN(DT, T, 64) M2R_SSCAN(DT, T, 128)            \
  M2R_SSCAN(DT, T, 256) M2R_SSCAN_SEG(DT, T, 16) M2R_SSCAN_SEG(DT, T, 32) M2R_SSCAN_SEG(DT, T, 64)

M2R_SSCAN_N(f32, F32)
M2R_SSCAN_N(f16, F16)
M2R_SSCAN_N(bf16, BF16)
