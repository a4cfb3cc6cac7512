// Mamba2 SSD backward, stage 7: cumsum (the stages and their grids: ssd_bwd_common.h).
#include "ssd_bwd_common.h"

namespace m2r {
namespace ssd_bwd {

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
