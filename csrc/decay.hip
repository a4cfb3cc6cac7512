// Every Mamba layer's decay rates -exp(A_log), for one decode step of a whole model, in one
// launch (semantics in params.h: DecayParams). A decode step captured in a graph needs the rates
// computed inside the graph (a kept copy would be replayed stale after A_log changes in place);
// per layer that is two small kernels, each about a microsecond of a graph's time. Block l
// reads layer l's A_log (any float dtype) and writes its rates as float32, expf like torch's
// exp on float32: the same bits as -torch.exp(A_log.float()).
#include "platform.h"

namespace m2r {
namespace decay {

constexpr int kThreads = 256;

M2R_DEVICE void rates(const DecayParams& p) {
  const int64_t* row = p.table + 3 * static_cast<int64_t>(blockIdx.x);
  const void* a_log = reinterpret_cast<const void*>(static_cast<uintptr_t>(row[0]));
  const int64_t n = row[1], first = row[2];
  for (int64_t i = threadIdx.x; i < n; i += kThreads) p.out[first + i] = -expf(load_as_float(a_log, p.a_dtype, i));
}

}  // namespace decay
}  // namespace m2r

M2R_KERNEL(m2r::decay::kThreads) m2r_decay_rates(DecayParams p) { m2r::decay::rates(p); }
