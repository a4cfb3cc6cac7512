// Mamba2 SSD forward, stage 4: state_passing (the stages and their grids: ssd_common.h).
#include "ssd_common.h"

namespace m2r {
namespace ssd {

// ---- 4. state passing -----------------------------------------------------------------------

// kPassVec (n, p) elements of a head's state per thread: entering[c] = state; state = carry_c
// state + own_c, with carry_c = exp(dA_cs[c][last]) when the chunk's last token continues the
// segment of the token before the chunk, else 0 (a sequence started inside the chunk). The
// carries of up to kThreads chunks at a time come through LDS, and each chunk's own state is
// loaded kPassAhead chunks ahead (one 16-byte load when p * n allows), so the loop's chain of
// dependent steps does not wait on memory.
// H200, scripts/profile_ssd.py: 8 elements a thread (768 blocks at mamba2-130m b8 l512, not 1536)
// were slower, 2 or 4 chunks ahead: 9.7 -> 11.6 us there, 12.8 -> 18.1 at 130m b4 l2048.
constexpr int kPassVec = 4;
// H100, state_passing us, before -> 4 chunks ahead with one 16-byte store (below): b1 l16384
// h64 g8 98.2 -> 96.0, b2 l4096 h32 23.0 -> 20.7, Nemotron-H b1 l8192 198.4 -> 192.5. 8 ahead
// held 68 registers (3 blocks per multiprocessor, not 4) and ran slower than either.
constexpr int kPassAhead = 4;
static_assert(kThreads % kPassAhead == 0, "a block of carries holds whole rounds of the ring");

struct PassVec {
  float v[kPassVec];
};

M2R_DEVICE PassVec pass_load(const float* at, int64_t valid, bool vec) {  // valid: elements in range
  PassVec r;
  if (vec && valid >= kPassVec) {
    const float4 q = *reinterpret_cast<const float4*>(at);
    r.v[0] = q.x, r.v[1] = q.y, r.v[2] = q.z, r.v[3] = q.w;
  } else {
#pragma unroll
    for (int v = 0; v < kPassVec; ++v) r.v[v] = v < valid ? at[v] : 0.f;
  }
  return r;
}

M2R_DEVICE void state_passing(const SsdParams& p) {
  __shared__ float carry[kThreads];
  const int h = blockIdx.y, b = blockIdx.z;
  const int64_t pn = static_cast<int64_t>(p.headdim) * p.dstate;
  const int64_t e0 = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * kPassVec;
  const int64_t chunk_stride = static_cast<int64_t>(p.nheads) * pn, valid = pn - e0;
  const bool vec = pn % kPassVec == 0;  // then e0 and every chunk's block are 16-byte aligned
  float* base = p.states + states_at(p, b, 0, h) + e0;
  PassVec s = {};
  if (p.initial_states) {  // (n, pp) of the thread's first element: one division, not one each
    const int hd = p.headdim, e_first = static_cast<int>(e0);  // pn: at most 128 x MAX_DSTATE
    int n = e_first / hd, pp = e_first - n * hd;
#pragma unroll
    for (int v = 0; v < kPassVec; ++v, ++pp) {
      if (pp == hd) ++n, pp = 0;
      if (v < valid) s.v[v] = initial_state(p, b, h, n, pp);
    }
  }
  // a ring of own states: chunk c's in own[c % kPassAhead], loaded kPassAhead chunks before its
  // step (2 ahead left the loop waiting on the loads)
  PassVec own[kPassAhead];
#pragma unroll
  for (int j = 0; j < kPassAhead; ++j) own[j] = j < p.nchunks ? pass_load(base + j * chunk_stride, valid, vec) : PassVec{};
  for (int c0 = 0; c0 < p.nchunks; c0 += kThreads) {
    __syncthreads();
    const int cc = c0 + threadIdx.x;
    if (cc < p.nchunks) carry[threadIdx.x] = chunk_carry(p, b, h, cc);
    __syncthreads();
    const int count = min(kThreads, p.nchunks - c0);
    float* at = base + c0 * chunk_stride;  // chunk c0 + i's entering state (one running pointer)
    for (int i0 = 0; i0 < count; i0 += kPassAhead) {
#pragma unroll
      for (int j = 0; j < kPassAhead; ++j, at += chunk_stride) {  // chunk c0 + i0 + j, own[j]
        const int i = i0 + j;
        if (i >= count) break;
        if (vec && valid >= kPassVec) {
          store_float4(at, s.v[0], s.v[1], s.v[2], s.v[3]);
        } else {
#pragma unroll
          for (int v = 0; v < kPassVec; ++v)
            if (v < valid) at[v] = s.v[v];
        }
        const float k = carry[i];
#pragma unroll
        for (int v = 0; v < kPassVec; ++v) s.v[v] = k < 0.f ? own[j].v[v] : fmaf(k, s.v[v], own[j].v[v]);  // select, not 0 x state
        if (c0 + i + kPassAhead < p.nchunks) own[j] = pass_load(at + kPassAhead * chunk_stride, valid, vec);
      }
    }
  }
  if (!p.final_states) return;  // uniform over the block
  constexpr int kSpan = kThreads * kPassVec;  // the block's elements e: whole n rows when
  if (kSpan % p.headdim == 0) {                // headdim divides kSpan
    // final_states is [p][n]: through LDS, so neighbouring threads write neighbouring n
    // (rows padded to headdim + 1 floats: conflict-free reads down a column)
    // (every index below from one run-time division per thread: per element, they had made the
    // kernel's fixed work most of its time at 2 chunks)
    __shared__ float fin[2 * kSpan];
    const int hd = p.headdim, rows_all = kSpan / hd;  // a power of 2: hd divides kSpan
    const int n_first = static_cast<int>(blockIdx.x) * rows_all;
    const int rows = min(rows_all, p.dstate - n_first);
    {
      const int el = static_cast<int>(threadIdx.x) * kPassVec;
      int n = el / hd, pp = el - n * hd;
#pragma unroll
      for (int v = 0; v < kPassVec; ++v, ++pp) {
        if (pp == hd) ++n, pp = 0;
        if (n < rows) fin[n * (hd + 1) + pp] = s.v[v];
      }
    }
    __syncthreads();
    // thread: row n = its index mod rows_all, columns pp from its index / rows_all on, a step of
    // kThreads / rows_all (rows_all > kThreads: headdim under 4, one column and row at a time)
    const int64_t out0 = (static_cast<int64_t>(b) * p.nheads + h) * hd * p.dstate + n_first;
    const int n_rows = rows_all <= kThreads ? rows_all : kThreads;
    const int n = static_cast<int>(threadIdx.x) & (n_rows - 1), pp_step = kThreads / n_rows;
    for (int n_at = n; n_at < rows; n_at += n_rows) {
      const float* src = fin + n_at * (hd + 1);
      for (int pp = static_cast<int>(threadIdx.x) / n_rows; pp < hd; pp += pp_step)
        store_as(p.final_states, p.state_dtype, out0 + n_at + static_cast<int64_t>(pp) * p.dstate, src[pp]);
    }
  } else {
#pragma unroll
    for (int v = 0; v < kPassVec; ++v) {
      const int64_t e = e0 + v;
      if (e >= pn) continue;
      const int n = static_cast<int>(e / p.headdim), pp = static_cast<int>(e % p.headdim);
      store_final(p, b, h, n, pp, s.v[v]);
    }
  }
}

}  // namespace ssd
}  // namespace m2r

M2R_KERNEL(m2r::ssd::kThreads) m2r_ssd_state_passing(SsdParams p) { m2r::ssd::state_passing(p); }
