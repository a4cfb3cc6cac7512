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
#define M2R_SSCAN_N(DT, T) \
  M2R_SSCAN(DT, T, 16) M2R_SSCAN(DT, T, 32) M2R_SSCAN(DT, T, 64) M2R_SSCAN(DT, T, 128) M2R_SSCAN(DT, T, 256)

M2R_SSCAN_N(f32, F32)
M2R_SSCAN_N(f16, F16)
M2R_SSCAN_N(bf16, BF16)
