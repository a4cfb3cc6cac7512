// Mamba2 SSD forward, stage 2: C·Bᵀ (bmm) (the stages and their grids: ssd_common.h).
#include "ssd_common.h"

namespace m2r {
namespace ssd {

// ---- 2. C·Bᵀ --------------------------------------------------------------------------------

template <typename T>
M2R_DEVICE void bmm_fma(const SsdParams& p) {
  typedef typename T::storage S;
  constexpr int kLd = 64 + kPad;
  __shared__ __align__(16) float Bs[kSlab * kLd];
  __shared__ __align__(16) float Cs[kSlab * kLd];
  // blockIdx.x: (chunk, group) major, then the lower-triangular tile pairs (ts <= tt)
  const int tiles = p.chunk_size / 64, pairs = tiles * (tiles + 1) / 2;
  int tt = 0, rem = blockIdx.x % pairs;
  while (rem > tt) rem -= ++tt;
  const int ts = rem;
  const int cg = blockIdx.x / pairs, c = cg / p.ngroups, g = cg % p.ngroups, b = blockIdx.z;
  const int64_t l0 = static_cast<int64_t>(c) * p.chunk_size;
  const int rows = static_cast<int>(min(static_cast<int64_t>(p.chunk_size), p.seqlen - l0));
  const S* Bp = static_cast<const S*>(p.B) + b * p.B_batch_stride + l0 * p.B_l_stride + g * p.B_g_stride;
  const S* Cp = static_cast<const S*>(p.C) + b * p.C_batch_stride + l0 * p.C_l_stride + g * p.C_g_stride;
  const int s_off = 4 * (threadIdx.x / 16), t_off = 4 * (threadIdx.x % 16);

  float acc[4][4] = {};
  for (int n0 = 0; n0 < p.dstate; n0 += kSlab) {
    stage_transposed<T, 64, kLd>(Bs, Bp, p.B_l_stride, ts * 64, rows, n0, p.dstate);
    stage_transposed<T, 64, kLd>(Cs, Cp, p.C_l_stride, tt * 64, rows, n0, p.dstate);
    __syncthreads();
    slab_product<1, 1, kLd, kLd>(acc, Bs, Cs, s_off, t_off);
    __syncthreads();
  }
  const int64_t cs = p.chunk_size;
  float* out = p.cb + ((static_cast<int64_t>(b) * p.nchunks + c) * p.ngroups + g) * cs * cs;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int s = ts * 64 + s_off + i, t = tt * 64 + t_off;
    *reinterpret_cast<float4*>(out + s * cs + t) = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
  }
}

#if M2R_MMA != 0
// bmm's slabs in flight (kSlab each): 2 took it from 71.0 to 67.2 us at b1 l16384 h64 g8 on an
// H200 (4, all of dstate 128 at once, 82.0 us: 96 registers, 2 blocks per multiprocessor)
constexpr int kBmmDepth = 2;

template <typename T>
M2R_DEVICE void bmm_mma(const SsdParams& p) {
  constexpr int kOperands = 2 * 64 * kLdH, kOut = 64 * kLdO * 2;
  __shared__ __align__(16) uint16_t smem[kOperands > kOut ? kOperands : kOut];
  uint16_t* Bs = smem;
  uint16_t* Cs = smem + 64 * kLdH;
  const int tiles = p.chunk_size / 64, pairs = tiles * (tiles + 1) / 2;
  int tt = 0, rem = blockIdx.x % pairs;
  while (rem > tt) rem -= ++tt;
  const int ts = rem;
  const int cg = blockIdx.x / pairs, c = cg / p.ngroups, g = cg % p.ngroups, b = blockIdx.z;
  const int64_t l0 = static_cast<int64_t>(c) * p.chunk_size;
  const int rows = static_cast<int>(min(static_cast<int64_t>(p.chunk_size), p.seqlen - l0));
  const int bl = static_cast<int>(p.B_l_stride), cl = static_cast<int>(p.C_l_stride);
  const uint16_t* Bp = static_cast<const uint16_t*>(p.B) + b * p.B_batch_stride + l0 * p.B_l_stride + g * p.B_g_stride + ts * 64 * bl;
  const uint16_t* Cp = static_cast<const uint16_t*>(p.C) + b * p.C_batch_stride + l0 * p.C_l_stride + g * p.C_g_stride + tt * 64 * cl;
  const bool bvec = aligned(Bp, 2 * bl, 16), cvec = aligned(Cp, 2 * cl, 16);
  const int brows = rows - ts * 64, crows = rows - tt * 64;

  mma::BlockTile<kThreads, 64, 64, 2> tile;  // rows s, cols t: the [s][t] layout chunk_scan reads
  // kBmmDepth slabs in flight (a ring of register buffers): each slab's product is far shorter
  // than a load, so with one slab ahead every slab waited for its loads
  Rows16<64, kSlab> bf[kBmmDepth], cf[kBmmDepth];
  const auto fetch = [&](int d, int n) {
    if (n < p.dstate) bf[d].fetch(Bp + n, bl, brows, p.dstate - n, bvec), cf[d].fetch(Cp + n, cl, crows, p.dstate - n, cvec);
  };
#pragma unroll
  for (int d = 0; d < kBmmDepth; ++d) fetch(d, d * kSlab);
  for (int n0 = 0; n0 < p.dstate; n0 += kBmmDepth * kSlab) {
#pragma unroll
    for (int d = 0; d < kBmmDepth; ++d) {
      const int n = n0 + d * kSlab;
      if (n >= p.dstate) break;
      bf[d].put(Bs, kLdH), cf[d].put(Cs, kLdH);
      __syncthreads();
      fetch(d, n + kBmmDepth * kSlab);
      tile.template product<T, kSlab, false, false>(Bs, kLdH, Cs, kLdH);
      __syncthreads();
    }
  }
  // through LDS (over the operands, free after the loop's last barrier): 16-byte row stores
  const int64_t cs = p.chunk_size;
  float* out = p.cb + ((static_cast<int64_t>(b) * p.nchunks + c) * p.ngroups + g) * cs * cs + (ts * 64) * cs + tt * 64;
  float* O = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int i = 0; i < tile.kFm; ++i)
#pragma unroll
    for (int j = 0; j < tile.kFn; ++j)
#pragma unroll
      for (int r = 0; r < mma::kAccRegs; ++r) O[tile.row(i, r) * kLdO + tile.col(j, r)] = tile.acc[i][j].v[r];
  __syncthreads();
  const int cq = 4 * (threadIdx.x % 16);
#pragma unroll
  for (int rr = threadIdx.x / 16; rr < 64; rr += kThreads / 16)
    *reinterpret_cast<float4*>(out + rr * cs + cq) = *reinterpret_cast<const float4*>(O + rr * kLdO + cq);
}
#endif

template <typename T>
M2R_DEVICE void bmm(const SsdParams& p) {
#if M2R_MMA != 0
  if constexpr (mma::kEnabled<T>) return bmm_mma<T>(p);
  else
#endif
  bmm_fma<T>(p);
}

}  // namespace ssd
}  // namespace m2r

#define M2R_SSD_BMM(DT, T) \
  M2R_KERNEL(m2r::ssd::kThreads) m2r_ssd_bmm_##DT(SsdParams p) { m2r::ssd::bmm<m2r::T>(p); }
M2R_SSD_BMM(f32, F32)
M2R_SSD_BMM(f16, F16)
M2R_SSD_BMM(bf16, BF16)
