// Mamba2 SSD forward, stage 1: chunk_cumsum (the stages and their grids: ssd_common.h).
#include "ssd_common.h"

namespace m2r {
namespace ssd {

// ---- 1. chunk cumsum ----------------------------------------------------------------------

// A wavefront per head: lane j owns the run of kCumsumPer tokens from j * kCumsumPer, loads them
// together and sums them in order; one shuffle scan joins the runs (wave_runs_segmented_scan).
// The block's waves share its kHeadsPerCumsum heads. Where the block's heads' 16-bit dt lie as
// one aligned 16-byte run per token (unit head stride, as a Mamba2 block passes dt), each
// thread loads one token's run and the runs go to the waves through LDS (one barrier): one
// 16-byte load per token instead of one 2-byte gather per token and head, where ncu had the
// kernel's largest stall.
constexpr int kCumsumPer = kMaxChunk / kWavefront;
static_assert(kHeadsPerCumsum == 8 && kThreads >= kMaxChunk, "a thread's token run: 8 heads of 16-bit dt");

M2R_DEVICE void chunk_cumsum(const SsdParams& p) {
  __shared__ float dt_runs[kHeadsPerCumsum][kMaxChunk];  // [head - h0][token]
  const int lane = static_cast<int>(threadIdx.x) % kWavefront, wave = static_cast<int>(threadIdx.x) / kWavefront;
  const int c = blockIdx.x, b = blockIdx.z, t0 = lane * kCumsumPer, h0 = blockIdx.y * kHeadsPerCumsum;
  const int64_t pos0 = static_cast<int64_t>(c) * p.chunk_size + t0;
  const uint16_t* dt_run = static_cast<const uint16_t*>(p.dt) + b * p.dt_batch_stride + h0;
  const bool runs = p.dt_dtype != M2R_DTYPE_F32 && p.dt_h_stride == 1 && h0 + kHeadsPerCumsum <= p.nheads &&
                    p.dt_l_stride % 8 == 0 && reinterpret_cast<uintptr_t>(dt_run) % 16 == 0;
  const int s_own = static_cast<int>(threadIdx.x);  // this thread's token of the runs
  const bool own = runs && s_own < p.chunk_size && static_cast<int64_t>(c) * p.chunk_size + s_own < p.seqlen;
  const uint4 run = own ? *reinterpret_cast<const uint4*>(dt_run + (static_cast<int64_t>(c) * p.chunk_size + s_own) * p.dt_l_stride)
                        : make_uint4(0u, 0u, 0u, 0u);
  bool valid[kCumsumPer], start[kCumsumPer];
  float change[kCumsumPer];  // seq_idx changes at this token (from the implicit id 0 before token 0)
#pragma unroll
  for (int e = 0; e < kCumsumPer; ++e) {
    valid[e] = t0 + e < p.chunk_size && pos0 + e < p.seqlen;
    change[e] = 0.f;
  }
  if (p.seq_idx) {
    const int32_t* row = p.seq_idx + b * p.seq_idx_batch_stride;
    int32_t prev = pos0 == 0 || !valid[0] ? 0 : row[(pos0 - 1) * p.seq_idx_l_stride];
#pragma unroll
    for (int e = 0; e < kCumsumPer; ++e) {
      const int32_t id = valid[e] ? row[(pos0 + e) * p.seq_idx_l_stride] : prev;
      change[e] = valid[e] && id != prev ? 1.f : 0.f;
      prev = id;
    }
  }
#pragma unroll
  for (int e = 0; e < kCumsumPer; ++e) start[e] = t0 + e > 0 && change[e] != 0.f;

  // chunk_state's chain (which runs two kernels later): the ticket counter, and the flags of this
  // chunk and block of heads
  if (p.chain) {
    for (int i = threadIdx.x; i < state_tiles(p) * kHeadsPerCumsum; i += kThreads) {
      const int h = blockIdx.y * kHeadsPerCumsum + i % kHeadsPerCumsum;
      if (h < p.nheads) *chain_flag(p, b, c, i / kHeadsPerCumsum, h) = 0;
    }
    if (c == 0 && b == 0 && blockIdx.y == 0 && threadIdx.x == 0) p.chain[0] = 0;
  }

  if (blockIdx.y == 0 && wave == 0) {  // segments: changes of seq_idx since the token before the chunk
    const bool none[kCumsumPer] = {};
    wave_runs_segmented_scan(change, none);
    int32_t* seg = p.seg + (static_cast<int64_t>(b) * p.nchunks + c) * p.chunk_size + t0;
#pragma unroll
    for (int e = 0; e < kCumsumPer; ++e)
      if (t0 + e < p.chunk_size) seg[e] = static_cast<int32_t>(change[e]);
  }
  // this wave's heads' dt_bias and A, requested before the barrier (not a round trip after it)
  constexpr int kWavesCs = kThreads / kWavefront, kPerWave = (kHeadsPerCumsum + kWavesCs - 1) / kWavesCs;
  float bias_w[kPerWave], a_w[kPerWave];
#pragma unroll
  for (int k = 0; k < kPerWave; ++k) {
    const int h = min(h0 + wave + k * kWavesCs, p.nheads - 1);  // (heads past nheads: unused)
    bias_w[k] = p.dt_bias ? load_as_float(p.dt_bias, p.dt_bias_dtype, h * p.dt_bias_stride) : 0.f;
    a_w[k] = load_as_float(p.A, p.a_dtype, h * p.A_stride);
  }
  if (runs) {
    if (s_own < p.chunk_size) {
      const uint32_t w[4] = {run.x, run.y, run.z, run.w};
#pragma unroll
      for (int j = 0; j < kHeadsPerCumsum / 2; ++j) {
        const float2 v = p.dt_dtype == M2R_DTYPE_F16 ? fp16x2_to_float2(w[j]) : bf16x2_to_float2(w[j]);
        dt_runs[2 * j][s_own] = v.x;
        dt_runs[2 * j + 1][s_own] = v.y;
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int k = 0; k < kPerWave; ++k) {
    const int i = wave + k * kWavesCs, h = h0 + i;
    if (i >= kHeadsPerCumsum || h >= p.nheads) break;  // uniform over the wave
    float d[kCumsumPer], cum[kCumsumPer];
    if (runs) {
#pragma unroll
      for (int e = 0; e < kCumsumPer; ++e) d[e] = valid[e] ? dt_runs[i][t0 + e] : 0.f;
    } else {
      load_as_float_n(p.dt, p.dt_dtype, b * p.dt_batch_stride + pos0 * p.dt_l_stride + h * p.dt_h_stride, p.dt_l_stride, valid, d);
    }
    const float bias = bias_w[k], a = a_w[k];
#pragma unroll
    for (int e = 0; e < kCumsumPer; ++e) {
      if (valid[e]) {
        d[e] += bias;
        if (p.dt_softplus) d[e] = softplus(d[e]);
        // fminf/fmaxf return the other operand for a NaN: clamp only numbers, so a NaN dt
        // stays NaN (contained to its sequence by the scan) instead of vanishing
        if (!isnan(d[e])) d[e] = fminf(fmaxf(d[e], p.dt_min), p.dt_max);
      }
      cum[e] = d[e] * a;
    }
    // dA_cs restarts at every sequence start inside the chunk (its readers only take
    // differences within a segment, and the first segment's values from the chunk start)
    wave_runs_segmented_scan(cum, start);
    const int64_t o = chunk_row(p, b, h, c) + t0;
    if (t0 + kCumsumPer <= p.chunk_size) {  // chunk rows are 16-byte aligned (chunk_size % 16 == 0)
#pragma unroll
      for (int e = 0; e < kCumsumPer; e += 4) {
        *reinterpret_cast<float4*>(p.dt_out + o + e) = make_float4(d[e], d[e + 1], d[e + 2], d[e + 3]);
        *reinterpret_cast<float4*>(p.dA_cs + o + e) = make_float4(cum[e], cum[e + 1], cum[e + 2], cum[e + 3]);
      }
    }
  }
}

}  // namespace ssd
}  // namespace m2r

M2R_KERNEL(m2r::ssd::kThreads) m2r_ssd_chunk_cumsum(SsdParams p) { m2r::ssd::chunk_cumsum(p); }
