// Mamba2 SSD backward, stage 3: state passing, reversed (the stages and their grids: ssd_bwd_common.h).
#include "ssd_bwd_common.h"

namespace m2r {
namespace ssd_bwd {

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

}  // namespace ssd_bwd
}  // namespace m2r

// ptxas' register cap (NVIDIA only): 2 blocks per SM
#define M2R_SSD_BWD_PASSING(DT, T) \
  M2R_KERNEL_MIN_BLOCKS(m2r::ssd_bwd::kThreads, 2) m2r_ssd_bwd_state_passing_##DT(SsdBwdParams p) { m2r::ssd_bwd::state_passing<m2r::T>(p); }
M2R_SSD_BWD_PASSING(f32, F32)
M2R_SSD_BWD_PASSING(f16, F16)
M2R_SSD_BWD_PASSING(bf16, BF16)
