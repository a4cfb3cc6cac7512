// The matrix-core interface's self-test (mma.h), run by tests/gpu/test_mma_probe_gpu.py on
// whatever GPU and build it meets: the NVIDIA build, each emulation variant, and an AMD
// runner's own GPU. One wave computes D = C + A B^T for a single 16x16x16 step through exactly
// what the kernels use (load_lane / load_lane_t from an LDS tile, or an A fragment built in
// registers with a_row / a_k / make_a; mma<T>, acc_row / acc_col)
// and writes every accumulator register to the (row, col) acc_row / acc_col name, counting the
// writes per cell. The test chooses operands whose product says which source element reached
// which cell, so a wrong lane -> (row, col) formula fails naming the formula and the cells.
// info[] tells the test which matrix-core path the code object holds, so a build that silently
// took another path (a wrong emulation flag, a target that lost its matrix cores) fails too.
#include "mma.h"

namespace m2r {
namespace probe {

constexpr int kLd = 24;  // LDS row stride in elements: a multiple of 8, rows 16-byte aligned
constexpr int kThreads = 64;  // one wave64, or two wave32 (the second only helps stage)

template <typename T>
M2R_DEVICE void mma_probe(const MmaProbeParams& p) {
  const int t = static_cast<int>(threadIdx.x);
  if (t == 0) {
    p.info[0] = M2R_MMA;
    p.info[1] = kWavefront;
#ifdef M2R_MMA_EMULATED
    p.info[2] = 1;
#else
    p.info[2] = 0;
#endif
  }
#if M2R_MMA != 0
  __shared__ alignas(16) uint16_t As[16 * kLd];
  __shared__ alignas(16) uint16_t Bs[16 * kLd];
  const bool ta = p.mode & 1, tb = p.mode & 2;  // stage k-major: read with load_lane_t
  for (int e = t; e < 256; e += kThreads) {
    const int row = e / 16, k = e % 16;
    As[ta ? k * kLd + row : row * kLd + k] = p.a[e];
    Bs[tb ? k * kLd + row : row * kLd + k] = p.b[e];
  }
  __syncthreads();
  if (t >= kWavefront) return;  // wave32: the step is one wave's
  mma::Frag fa = ta ? mma::load_lane_t(As + mma::lane_off_t(kLd), kLd)
                    : mma::load_lane(As + mma::lane_off(kLd), kLd);
  if (p.mode & 4) {  // A built in registers: element e from (a_row(e), a_k(e)), then make_a
    float v[mma::kAElems];
#pragma unroll
    for (int e = 0; e < mma::kAElems; ++e) v[e] = T::to_float(p.a[mma::a_row(e) * 16 + mma::a_k(e)]);
    fa = mma::make_a<T>(v);
  }
  const mma::Frag fb = tb ? mma::load_lane_t(Bs + mma::lane_off_bt(kLd), kLd)
                          : mma::load_lane(Bs + mma::lane_off_b(kLd), kLd);
  mma::Acc acc;
#pragma unroll
  for (int r = 0; r < mma::kAccRegs; ++r) acc.v[r] = p.c[mma::acc_row(r) * 16 + mma::acc_col(r)];
  mma::mma<T>(acc, fa, fb);
#pragma unroll
  for (int r = 0; r < mma::kAccRegs; ++r) {
    const int cell = mma::acc_row(r) * 16 + mma::acc_col(r);
    p.d[cell] = acc.v[r];
    atomicAdd(p.hits + cell, 1);
  }
#endif
}

}  // namespace probe
}  // namespace m2r

// One block of kThreads (on the gfx9 emulation, its wave64 is two warps).
M2R_KERNEL(m2r::probe::kThreads) m2r_mma_probe_f16(MmaProbeParams p) { m2r::probe::mma_probe<m2r::F16>(p); }
M2R_KERNEL(m2r::probe::kThreads) m2r_mma_probe_bf16(MmaProbeParams p) { m2r::probe::mma_probe<m2r::BF16>(p); }
