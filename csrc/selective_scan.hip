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
#include "token_runs.h"

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
    store_seg<T, kTok>(o_row, t, L, vec_x, y);
  }
  if (p.last_state != nullptr && live && j == 0) {
    for (int n = 0; n < nst; ++n) p.last_state[(b * p.dim + d) * nst + n] = s_carry[n][tid];
  }
}


// ---- the channel form (m2r_selective_scan_<dt>_n<16|32|64>_ch, _chs) ------------------------
// The forms above spend more on moving the state between lanes than on the scan: Mamba1's
// dstate 16 gives a channel too little work per token to share it among lanes. Here a thread
// takes a whole channel (kPer = 16 state elements; 2 / 4 lanes per channel at dstate 32 / 64,
// whose partial output sums meet in LDS, no shuffles) and walks its tokens one by one: per token
// and state element one exp, four FP32 operations and two LDS reads shared by the block; the
// exps, one per (token, channel, state element) as in every form, are the bound. Blocks of
// kChThreads threads take kCh channels of one batch row and one group of B / C (the host
// checks that a group's channels fill whole blocks). The sequence is walked in chunks of kChT
// tokens: u, the processed step (bias, softplus) and the chunk's B / C columns are staged in LDS
// by coalesced 16-byte loads, every channel's outputs meet in an LDS tile and leave coalesced
// with D u and the silu(z) gate. The state stays in registers across chunks (the carry is the
// register itself, as in the butterfly form).
//
// Few channels (one long sequence) cannot fill the GPU that way, so the sequence may be cut into
// segments of p.seg_len tokens (blockIdx.z): a first launch (the _chs kernel) runs every segment
// but the last from a zero state and keeps its end state and its steps' sum in p.seg_state; the
// output launch starts segment s from the composition of the maps of segments 0..s-1
// (h -> exp2(A log2e sum(dt)) h + h_end), done once per thread before its first token. That
// costs the segments' exps twice; the host cuts only when the GPU would otherwise idle.
// Tokens past the segment's end (the last chunk's tail) take step 0 and input 0: the identity.
// threads per block of the channel form (a build-time knob for measuring; the host's _CH_THREADS
// must match): fewer make more blocks at the narrow widths
#ifndef M2R_SSCAN_CH_THREADS
#define M2R_SSCAN_CH_THREADS 64
#endif
constexpr int kChThreads = M2R_SSCAN_CH_THREADS;
// tokens per chunk (a build-time knob for measuring). 32 on NVIDIA, the measured best (H100,
// b8 d4096 l2048 n16 bf16: 536 us vs 563 at 16). 16 on AMD, unmeasured there: the LDS per block
// (u and step tiles, B / C columns) is 11 KB at 16 and 21 KB at 32, and a CDNA CU's 64 KB then
// holds 5 one-wave blocks instead of 3 (fewer than its 4 SIMDs)
#ifndef M2R_SSCAN_CHT
#if M2R_AMD
#define M2R_SSCAN_CHT 16
#else
#define M2R_SSCAN_CHT 32
#endif
#endif
constexpr int kChT = M2R_SSCAN_CHT;
// state elements per lane (a channel takes dstate / kPer lanes) and tokens of the recurrence
// unrolled; build-time knobs for measuring, the defaults the measured best on the H100 at the
// single-row shapes (16 / 2; 8 lanes-halves won only where few channels fill the GPU, by 4-8%);
// the host's _CH_PER must match
#ifndef M2R_SSCAN_PER
#define M2R_SSCAN_PER 16
#endif
#ifndef M2R_SSCAN_UNROLL
#define M2R_SSCAN_UNROLL 2
#endif
// 1: the channel form requests the next chunk's tiles (u, step, B, C, z) before the current
// chunk's recurrence, and the current chunk's z with its other tiles, so that a block's round
// trip to memory overlaps its own exps (few blocks a multiprocessor, the narrow widths, leave
// nothing else to overlap it with). A build-time knob for measuring; 0: each chunk loads after
// the last one's stores, and z after the recurrence (the code is then as without the knob).
#ifndef M2R_SSCAN_PIPE
#define M2R_SSCAN_PIPE 0
#endif
#define M2R_STR_(x) #x
#define M2R_PRAGMA_UNROLL(n) _Pragma(M2R_STR_(unroll n))

// kMaxPer: state elements per lane at most; the _ch2 / _ch4 kernels take half / a quarter of
// M2R_SSCAN_PER, so 2 / 4 times the lanes a channel and as many times fewer channels a block:
// more blocks where few channels leave the GPU idle (the host chooses, ops/selective_scan.py
// channel_lane_split)
template <typename T, int kN, bool kStates, int kMaxPer = M2R_SSCAN_PER>
M2R_DEVICE void scan_channels(const SelectiveScanParams& p) {
  constexpr int kPer = kN < kMaxPer ? kN : kMaxPer;  // state elements per lane
  constexpr int kLanes = kN / kPer;        // lanes per channel
  constexpr int kCh = kChThreads / kLanes;
  typedef typename T::storage S;
  constexpr int kE = 16 / static_cast<int>(sizeof(S));  // elements per 16-byte vector
  constexpr int kRowVec = kChT / kE;                     // vectors per tile row
  constexpr int kTot = kCh * kRowVec;                    // vectors in a tile
  constexpr int kJ = (kTot + kChThreads - 1) / kChThreads;  // tile vectors per thread (at most)
  constexpr int kQ = kN * kChT / 4 / kChThreads;         // B / C quads per thread
  static_assert(kRowVec * kE == kChT, "whole vectors");
  static_assert(kPer % 4 == 0, "B / C read 4 state elements at a time");
  static_assert(kQ * kChThreads * 4 == kN * kChT, "whole B / C quads per thread");
  // tile rows padded by one word: a warp reading one token of 32 channels hits 32 banks. With
  // one lane per channel the output tile is the step tile: a thread overwrites its own row's
  // step with its output after reading it
  constexpr bool kAlias = kLanes == 1;
  __shared__ float s_u[kCh][kChT + 1];
  __shared__ float s_dt[kCh][kChT + 1];
  __shared__ float s_y_own[kStates || kAlias ? 1 : kLanes][kStates || kAlias ? 1 : kCh][kChT + 1];
  __shared__ __align__(16) float s_b[kChT][kN];
  __shared__ __align__(16) float s_c[kStates ? 1 : kChT][kN];
  __shared__ float s_bias[kCh], s_dcoef[kCh];
  auto y_at = [&](int l, int r) -> float* {
    if constexpr (kAlias) return &s_dt[r][0];
    else return &s_y_own[l][r][0];
  };

  const int tid = threadIdx.x;
  const int lane = tid % kLanes, ch = tid / kLanes;
  const int b = blockIdx.y;
  const int d0 = blockIdx.x * kCh;
  const int dim = p.dim;
  const int last_row = min(kCh, dim - d0) - 1;  // the block's last channel (rows past it read it)
  const bool live = ch <= last_row;
  const int L = p.seqlen, nst = p.dstate;
  const int seg_len = p.seg_len > 0 ? p.seg_len : L;
  const int nseg = (L + seg_len - 1) / seg_len;
  const int seg = blockIdx.z;
  const int t_begin = seg * seg_len;
  const int t_end = min(t_begin, L - seg_len) + seg_len;  // min(t_begin + seg_len, L), no overflow

  for (int c = tid; c < kCh; c += kChThreads) {
    const int dc = d0 + min(c, last_row);
    s_bias[c] = p.delta_bias ? load_as_float(p.delta_bias, p.delta_bias_dtype, dc) : 0.f;
    s_dcoef[c] = p.D ? load_as_float(p.D, p.d_dtype, dc) : 0.f;
  }
  const int dd = d0 + min(ch, last_row);
  // the lane's first state element, opaque to AMD's uniformity analysis: with one lane per
  // channel every index below is uniform, and the compiler kept the 16 predicates n < dstate as
  // 64-bit scalar masks until the last state's stores (and spilled them)
  const int n0 = per_lane(lane * kPer);
  // the channel's A (log2 units; 0 past dstate, where B is 0 too: the element stays 0)
  float a2[kPer], h[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int n = n0 + i;
    const float a = p.A[static_cast<int64_t>(dd) * nst + min(n, nst - 1)];  // no branch
    a2[i] = n < nst ? a * kLog2e : 0.f;
    h[i] = 0.f;
  }
  // segment maps: (batch, dim, nseg, kN) end states, then (batch, dim, nseg) step sums
  const int64_t seg_row = (static_cast<int64_t>(b) * dim + dd) * nseg;
  float* const seg_h = p.seg_state;
  float* const seg_dt = p.seg_state + static_cast<int64_t>(p.batch) * dim * nseg * kN;
  if (!kStates) {  // the composition of the earlier segments' maps
    for (int s = 0; s < seg; ++s) {
      const float sum_dt = seg_dt[seg_row + s];
#pragma unroll
      for (int i = 0; i < kPer; ++i)
        h[i] = fmaf(fast_exp2(a2[i] * sum_dt), h[i], seg_h[(seg_row + s) * kN + n0 + i]);
    }
  }

  // per-block bases and, per thread, the 32-bit offsets of the tile vectors and B / C quads it
  // moves (the host keeps kCh * seqlen and dstate * seqlen under 2^31): the loop holds few
  // uniform 64-bit values, which AMD's compiler keeps in scalar registers (102 at most)
  // (the bases themselves in vector registers on AMD: with them in scalar ones, wave64 targets
  // ran out of the 102)
  const int64_t x0 = (static_cast<int64_t>(b) * dim + d0) * L;
  const S* const u_blk = per_lane(static_cast<const S*>(p.u) + x0);
  const S* const dl_blk = per_lane(static_cast<const S*>(p.delta) + x0);
  const S* const z_blk = p.z ? per_lane(static_cast<const S*>(p.z) + x0) : nullptr;
  S* const o_blk = per_lane(static_cast<S*>(p.out) + x0);
  const float* const bp = per_lane(
      p.B + (static_cast<int64_t>(b) * p.b_groups + d0 / (dim / p.b_groups)) * nst * L);
  const float* const cp = per_lane(
      p.C + (static_cast<int64_t>(b) * p.c_groups + d0 / (dim / p.c_groups)) * nst * L);
  // every row starts 16-byte aligned when the block's first does and a row is whole vectors
  const bool vec_x = ((reinterpret_cast<uintptr_t>(u_blk) | reinterpret_cast<uintptr_t>(dl_blk) |
                       reinterpret_cast<uintptr_t>(z_blk) | reinterpret_cast<uintptr_t>(o_blk)) &
                      15) == 0 &&
                     L % kE == 0;
  const bool vec_bc =
      ((reinterpret_cast<uintptr_t>(bp) | reinterpret_cast<uintptr_t>(cp)) & 15) == 0 && L % 4 == 0;
  // tile vector j of this thread: row q / kRowVec, tokens (q % kRowVec) kE on (q = tid + j
  // threads; consecutive threads on consecutive 16 bytes of a row); past the tile: none
  int x_off[kJ];
#pragma unroll
  for (int j = 0; j < kJ; ++j) {
    const int q = tid + j * kChThreads;
    x_off[j] = min(q / kRowVec, last_row) * L + (q % kRowVec) * kE;
  }
  auto x_slot = [&](int j) { return kTot % kChThreads == 0 || tid + j * kChThreads < kTot; };
  // B / C quad j: state element q % kN, tokens (q / kN) 4 on (consecutive threads on
  // consecutive elements: the transposed LDS stores hit distinct banks)
  int bc_off[kQ];
#pragma unroll
  for (int j = 0; j < kQ; ++j) {
    const int q = tid + j * kChThreads;
    bc_off[j] = min(q % kN, nst - 1) * L + (q / kN) * 4;
  }
  const bool softplus_on = p.delta_softplus != 0;
  float sum_dt = 0.f;

  // kE elements of a row from token t on, as raw bits in a 16-byte word (0 past t_end): one load
  // where the chunk is whole and rows aligned, else element loads
  auto load_x = [&](const S* q, int t, bool whole) -> uint4 {
    if (whole) return *reinterpret_cast<const uint4*>(q);
    uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int k = 0; k < kE; ++k) {
      if (t + k < t_end) {
        if constexpr (sizeof(S) == 4) {
          w[k] = __float_as_uint(q[k]);
        } else {
          w[k / 2] |= static_cast<uint32_t>(q[k]) << (16 * (k % 2));
        }
      }
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  };
  auto load_q = [&](const float* q, int t, bool whole) -> float4 {
    if (whole) return *reinterpret_cast<const float4*>(q);
    float v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = t + k < t_end ? q[k] : 0.f;
    return make_float4(v[0], v[1], v[2], v[3]);
  };

  // kPipe: the next chunk's raw tiles (z too, without kStates), requested one chunk ahead
  constexpr bool kPipe = M2R_SSCAN_PIPE != 0;
  constexpr int kNJ = kPipe ? kJ : 1, kNQ = kPipe ? kQ : 1;
  uint4 nu[kNJ], nd[kNJ], nz[kNJ];
  float4 nb[kNQ], nc[kNQ];
  auto fetch_next = [&, u_blk, dl_blk, z_blk, bp, cp](int t0) {  // pointers by value
    const bool full = t0 + kChT <= t_end;  // uniform
    const bool whole_x = full && vec_x, whole_bc = full && vec_bc;
#pragma unroll
    for (int j = 0; j < kNJ; ++j) {
      if (!x_slot(j)) continue;
      const int t = t0 + (tid + j * kChThreads) % kRowVec * kE;
      nu[j] = load_x(u_blk + x_off[j] + t0, t, whole_x);
      nd[j] = load_x(dl_blk + x_off[j] + t0, t, whole_x);
      if (!kStates && z_blk) nz[j] = load_x(z_blk + x_off[j] + t0, t, whole_x);
    }
#pragma unroll
    for (int j = 0; j < kNQ; ++j) {
      const int t = t0 + (tid + j * kChThreads) / kN * 4;
      nb[j] = load_q(bp + bc_off[j] + t0, t, whole_bc);
      if (!kStates) nc[j] = load_q(cp + bc_off[j] + t0, t, whole_bc);
    }
  };
  if constexpr (kPipe) fetch_next(t_begin);

#pragma unroll 1
  for (int t0 = t_begin; t0 < t_end; t0 += kChT) {
    const bool full = t0 + kChT <= t_end;  // uniform
    const bool whole_x = full && vec_x, whole_bc = full && vec_bc;
    __syncthreads();  // the previous chunk's tiles are consumed
    // stage u and the step (bias, softplus; 0 past the end: the identity), B / C transposed;
    // every load issued before any is used
    uint4 wu[kJ], wd[kJ], zc[kNJ];
    float4 wb[kQ], wc[kQ];
    if constexpr (kPipe) {
#pragma unroll
      for (int j = 0; j < kJ; ++j) wu[j] = nu[j], wd[j] = nd[j], zc[j] = nz[j];
#pragma unroll
      for (int j = 0; j < kQ; ++j) wb[j] = nb[j], wc[j] = nc[j];
      if (t0 + kChT < t_end) fetch_next(t0 + kChT);  // in flight through this chunk
    } else {  // fetch_next's loads, written out: through the lambda the sm_90 code changed
#pragma unroll
      for (int j = 0; j < kJ; ++j) {
        if (!x_slot(j)) continue;
        const int t = t0 + (tid + j * kChThreads) % kRowVec * kE;
        wu[j] = load_x(u_blk + x_off[j] + t0, t, whole_x);
        wd[j] = load_x(dl_blk + x_off[j] + t0, t, whole_x);
      }
#pragma unroll
      for (int j = 0; j < kQ; ++j) {
        const int t = t0 + (tid + j * kChThreads) / kN * 4;
        wb[j] = load_q(bp + bc_off[j] + t0, t, whole_bc);
        if (!kStates) wc[j] = load_q(cp + bc_off[j] + t0, t, whole_bc);
      }
    }
#pragma unroll
    for (int j = 0; j < kJ; ++j) {
      if (!x_slot(j)) continue;
      const int q = tid + j * kChThreads;
      const int r = q / kRowVec, k0 = (q % kRowVec) * kE;
      const uint4 w1[1] = {wu[j]}, w2[1] = {wd[j]};
      const float bias = s_bias[r];
#pragma unroll
      for (int k = 0; k < kE; ++k) {
        const float v = element<T>(w2, k) + bias;
        const float sv = softplus_on ? softplus_select(v) : v;
        s_dt[r][k0 + k] = t0 + k0 + k < t_end ? sv : 0.f;
        s_u[r][k0 + k] = element<T>(w1, k);
      }
    }
#pragma unroll
    for (int j = 0; j < kQ; ++j) {
      const int q = tid + j * kChThreads;
      const int n = q % kN, k0 = (q / kN) * 4;
      const float in = n < nst ? 1.f : 0.f;
      s_b[k0][n] = in * wb[j].x, s_b[k0 + 1][n] = in * wb[j].y;
      s_b[k0 + 2][n] = in * wb[j].z, s_b[k0 + 3][n] = in * wb[j].w;
      if (!kStates) {
        s_c[k0][n] = in * wc[j].x, s_c[k0 + 1][n] = in * wc[j].y;
        s_c[k0 + 2][n] = in * wc[j].z, s_c[k0 + 3][n] = in * wc[j].w;
      }
    }
    __syncthreads();
    // the recurrence, token by token (a constant trip count: the tail's tokens are identities)
    float* const y_row = y_at(lane, ch);
    M2R_PRAGMA_UNROLL(M2R_SSCAN_UNROLL)
    for (int t = 0; t < kChT; ++t) {
      const float dt = s_dt[ch][t];
      const float du = dt * s_u[ch][t];
      sum_dt += dt;
      float bq[kPer], cq[kPer];
#pragma unroll
      for (int i = 0; i < kPer; i += 4) {
        const float4 x = *reinterpret_cast<const float4*>(&s_b[t][n0 + i]);
        bq[i] = x.x, bq[i + 1] = x.y, bq[i + 2] = x.z, bq[i + 3] = x.w;
        if (!kStates) {
          const float4 y = *reinterpret_cast<const float4*>(&s_c[t][n0 + i]);
          cq[i] = y.x, cq[i + 1] = y.y, cq[i + 2] = y.z, cq[i + 3] = y.w;
        }
      }
      float y0 = 0.f, y1 = 0.f;
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        h[i] = fmaf(fast_exp2(dt * a2[i]), h[i], du * bq[i]);
        if (!kStates) {
          if (i % 2) y1 = fmaf(h[i], cq[i], y1); else y0 = fmaf(h[i], cq[i], y0);
        }
      }
      if (!kStates) y_row[t] = y0 + y1;
    }
    if (kStates) continue;
    __syncthreads();
    // outputs: the lanes' partial sums, D u, the gate; the thread's tile vectors as staged
    uint4 wz[kJ];
#pragma unroll
    for (int j = 0; j < kJ; ++j) {
      if constexpr (kPipe) {  // z came with the chunk
        wz[j] = zc[j];
        continue;
      }
      if (!x_slot(j) || !z_blk) continue;
      const int t = t0 + (tid + j * kChThreads) % kRowVec * kE;
      wz[j] = load_x(z_blk + x_off[j] + t0, t, whole_x);
    }
#pragma unroll
    for (int j = 0; j < kJ; ++j) {
      const int q = tid + j * kChThreads;
      const int r = q / kRowVec, k0 = (q % kRowVec) * kE;
      if (!x_slot(j) || r > last_row) continue;
      const uint4 w1[1] = {z_blk ? wz[j] : make_uint4(0, 0, 0, 0)};
      float y[kE];
#pragma unroll
      for (int k = 0; k < kE; ++k) {
        float acc = 0.f;
#pragma unroll
        for (int l = 0; l < kLanes; ++l) acc += y_at(l, r)[k0 + k];
        y[k] = fmaf(s_dcoef[r], s_u[r][k0 + k], acc);
        if (z_blk) y[k] *= silu(element<T>(w1, k));
      }
      S* const o = o_blk + x_off[j] + t0;
      if (whole_x) {
        uint32_t w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          if constexpr (sizeof(S) == 4) {
            w[i] = __float_as_uint(y[i]);
          } else {
            w[i] = static_cast<uint32_t>(T::from_float(y[2 * i])) |
                   (static_cast<uint32_t>(T::from_float(y[2 * i + 1])) << 16);
          }
        }
        *reinterpret_cast<uint4*>(o) = make_uint4(w[0], w[1], w[2], w[3]);
      } else {
#pragma unroll
        for (int k = 0; k < kE; ++k)
          if (t0 + k0 + k < t_end) o[k] = T::from_float(y[k]);
      }
    }
  }
  if (!live) return;
  if (kStates) {  // this segment's map: its end state from zero and its steps' sum
#pragma unroll
    for (int i = 0; i < kPer; ++i) seg_h[(seg_row + seg) * kN + n0 + i] = h[i];
    if (lane == 0) seg_dt[seg_row + seg] = sum_dt;
  } else if (p.last_state != nullptr && seg == nseg - 1) {
    // without a predicate per element (AMD's compiler kept those as 64-bit masks from the start
    // of the kernel): elements past dstate, all 0, go to the lane's last real one, which is
    // written after them (the stores of a thread land in order)
    float* const ls = p.last_state + (static_cast<int64_t>(b) * dim + dd) * nst;
    if (n0 < nst) {
#pragma unroll
      for (int i = kPer - 1; i >= 0; --i) ls[min(n0 + i, nst - 1)] = h[i];
    }
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
// the channel form (variable B / C) for the same tiers: outputs (_ch) and segment states (_chs),
// and the same with half / a quarter of the state elements a lane (_ch2, _ch2s / _ch4, _ch4s)
#define M2R_SSCAN_CH(DT, T, N)                                                                   \
  M2R_KERNEL(m2r::sscan::kChThreads) m2r_selective_scan_##DT##_n##N##_ch(SelectiveScanParams p) { \
    m2r::sscan::scan_channels<m2r::T, N, false>(p);                                              \
  }                                                                                              \
  M2R_KERNEL(m2r::sscan::kChThreads)                                                             \
  m2r_selective_scan_##DT##_n##N##_chs(SelectiveScanParams p) {                                  \
    m2r::sscan::scan_channels<m2r::T, N, true>(p);                                               \
  }                                                                                              \
  M2R_KERNEL(m2r::sscan::kChThreads)                                                             \
  m2r_selective_scan_##DT##_n##N##_ch2(SelectiveScanParams p) {                                  \
    m2r::sscan::scan_channels<m2r::T, N, false, M2R_SSCAN_PER / 2>(p);                           \
  }                                                                                              \
  M2R_KERNEL(m2r::sscan::kChThreads)                                                             \
  m2r_selective_scan_##DT##_n##N##_ch2s(SelectiveScanParams p) {                                 \
    m2r::sscan::scan_channels<m2r::T, N, true, M2R_SSCAN_PER / 2>(p);                            \
  }                                                                                              \
  M2R_KERNEL(m2r::sscan::kChThreads)                                                             \
  m2r_selective_scan_##DT##_n##N##_ch4(SelectiveScanParams p) {                                  \
    m2r::sscan::scan_channels<m2r::T, N, false, M2R_SSCAN_PER / 4>(p);                           \
  }                                                                                              \
  M2R_KERNEL(m2r::sscan::kChThreads)                                                             \
  m2r_selective_scan_##DT##_n##N##_ch4s(SelectiveScanParams p) {                                 \
    m2r::sscan::scan_channels<m2r::T, N, true, M2R_SSCAN_PER / 4>(p);                            \
  }
#define M2R_SSCAN_N(DT, T)                                                                        \
  M2R_SSCAN(DT, T, 16) M2R_SSCAN(DT, T, 32) M2R_SSCAN(DT, T, 64) M2R_SSCAN(DT, T, 128)            \
  M2R_SSCAN(DT, T, 256) M2R_SSCAN_SEG(DT, T, 16) M2R_SSCAN_SEG(DT, T, 32) M2R_SSCAN_SEG(DT, T, 64) \
  M2R_SSCAN_CH(DT, T, 16) M2R_SSCAN_CH(DT, T, 32) M2R_SSCAN_CH(DT, T, 64)

M2R_SSCAN_N(f32, F32)
M2R_SSCAN_N(f16, F16)
M2R_SSCAN_N(bf16, BF16)
