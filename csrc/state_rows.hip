// Decode-state row indices, checked on the device before an update kernel reads them
// (semantics in params.h: StateRowsParams). One thread per batch entry; the entries are
// compared in tiles staged through LDS, so each thread reads batch / kThreads tiles, not batch
// scattered indices. Duplicates are found by counting, per entry, the entries equal to it.
#include "platform.h"

namespace m2r {
namespace rows {

constexpr int kThreads = 256;

M2R_DEVICE int64_t load_index(const StateRowsParams& p, int64_t i) {
  return p.in_int64 ? static_cast<const int64_t*>(p.in)[i * p.in_stride]
                    : static_cast<int64_t>(static_cast<const int32_t*>(p.in)[i * p.in_stride]);
}

M2R_DEVICE void state_rows(const StateRowsParams& p) {
  __shared__ int64_t tile[kThreads];
  const int64_t b = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t row = b < p.batch ? load_index(p, b) : -1;
  int hits = 0;  // entries naming `row`, this one included
  for (int64_t t0 = 0; t0 < p.batch; t0 += kThreads) {  // uniform over the block
    __syncthreads();
    tile[threadIdx.x] = t0 + threadIdx.x < p.batch ? load_index(p, t0 + threadIdx.x) : -1;
    __syncthreads();
    const int n = static_cast<int>(min(static_cast<int64_t>(kThreads), p.batch - t0));
    for (int i = 0; i < n; ++i) hits += tile[i] == row;
  }
  if (b >= p.batch) return;
  int32_t out = static_cast<int32_t>(row);
  if (row != -1 && (row < 0 || row >= p.num_states || hits > 1)) out = -2;
  p.out[b] = out;
}

}  // namespace rows
}  // namespace m2r

M2R_KERNEL(m2r::rows::kThreads) m2r_state_rows(StateRowsParams p) { m2r::rows::state_rows(p); }
