// The state row of a decode step's batch entry (causal_conv1d_update's conv_state_indices;
// selective_state_update's state_batch_indices in its contiguous-layout kernels at batches up to
// SSU_CHECK_IN_KERNEL_MAX_BATCH), checked inside the update kernel that reads it: no separate
// launch, no host sync. (selective_state_update's general kernel, and larger batches, read rows
// m2r_state_rows checked, csrc/state_rows.hip: inside the general kernel the search spilled
// AMD's scalar registers.) -1 (a padded row) stays -1; an index outside
// [0, num_states), or a row that another entry also names, is -2, for which the update writes
// NaN and leaves every state alone, so two entries never race on one state row. int64 indices
// are read as int64: never truncated into another row.
//
// Every lane of a wave must call it with the same b (a block serves one batch entry): each
// wave searches the batch for duplicates on its own, its lanes splitting the entries, and
// combines them with a ballot (no block barrier). Cost: batch / wavefront index loads per
// lane, from L1/L2 (the indices are tiny).
#pragma once
#include "platform.h"

namespace m2r {

M2R_DEVICE int64_t state_index(const void* indices, int64_t stride, int32_t is_int64, int64_t i) {
  return is_int64 ? static_cast<const int64_t*>(indices)[i * stride]
                  : static_cast<int64_t>(static_cast<const int32_t*>(indices)[i * stride]);
}

// (int: a valid row is below num_states, an int32)
M2R_DEVICE int checked_state_row(const void* indices, int64_t stride, int32_t is_int64,
                                 int32_t batch, int32_t num_states, int b) {
  if (!indices) return b;
  const int64_t row = state_index(indices, stride, is_int64, b);
  if (row == -1) return -1;
  if (row < 0 || row >= num_states) return -2;  // (uniform over the wave: no lane reaches the ballot)
  bool twice = false;
#pragma unroll 1
  for (int i = static_cast<int>(threadIdx.x) % kWavefront; i < batch; i += kWavefront)
    twice |= i != b && state_index(indices, stride, is_int64, i) == row;
  return ballot(twice) ? -2 : static_cast<int>(row);
}

}  // namespace m2r
