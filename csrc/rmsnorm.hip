// Gated RMSNorm (mamba_ssm's layernorm_gated.rmsnorm_fn), forward. Semantics in params.h.
// grid (hidden / group_size, rows); a block reduces one (row, group): the sum of squares over
// the wavefront by butterfly, across wavefronts through LDS, then a second pass writes.
#include "platform.h"

namespace m2r {
namespace rmsnorm {

constexpr int kThreads = 256;
constexpr int kWaves = kThreads / kWavefront;

template <typename T>
M2R_DEVICE void forward(const RmsNormParams& p) {
  typedef typename T::storage S;
  __shared__ float partial[kWaves];
  const int tid = threadIdx.x;
  const int64_t row = blockIdx.y;
  const int64_t start = static_cast<int64_t>(blockIdx.x) * p.group_size;
  const S* x = static_cast<const S*>(p.x) + row * p.x_row_stride + start;
  const S* z = p.z ? static_cast<const S*>(p.z) + row * p.z_row_stride + start : nullptr;
  const bool gate_first = z != nullptr && !p.norm_before_gate;

  float ss = 0.f;
  for (int i = tid; i < p.group_size; i += kThreads) {
    float v = T::to_float(x[i]);
    if (gate_first) v *= silu(T::to_float(z[i]));
    ss = fmaf(v, v, ss);
  }
#pragma unroll
  for (int off = kWavefront / 2; off > 0; off /= 2) ss += shfl_xor(ss, off);
  if (tid % kWavefront == 0) partial[tid / kWavefront] = ss;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kWaves; ++w) total += partial[w];
  const float rstd = rsqrtf(total / static_cast<float>(p.group_size) + p.eps);

  S* out = static_cast<S*>(p.out) + row * p.out_row_stride + start;
  for (int i = tid; i < p.group_size; i += kThreads) {
    float v = T::to_float(x[i]);
    if (gate_first) v *= silu(T::to_float(z[i]));
    float y = v * rstd * load_as_float(p.weight, p.weight_dtype, start + i);
    if (p.bias) y += load_as_float(p.bias, p.bias_dtype, start + i);
    if (z != nullptr && p.norm_before_gate) y *= silu(T::to_float(z[i]));
    out[i] = T::from_float(y);
  }
}

}  // namespace rmsnorm
}  // namespace m2r

#define M2R_RMSNORM(DT, T)                                                                   \
  M2R_KERNEL(m2r::rmsnorm::kThreads) m2r_rmsnorm_fwd_##DT(RmsNormParams p) {                \
    m2r::rmsnorm::forward<m2r::T>(p);                                                         \
  }
M2R_RMSNORM(f32, F32)
M2R_RMSNORM(f16, F16)
M2R_RMSNORM(bf16, BF16)
