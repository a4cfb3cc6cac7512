// Runs of consecutive row elements as 16-byte loads (csrc/selective_scan.hip's segment form and
// csrc/selective_scan_bwd.hip: a lane owns kTok consecutive tokens of a row).
#pragma once
#include "platform.h"

namespace m2r {

// 32-bit word i of a run of 16-byte words (i a compile-time constant after unrolling: no
// indexed register arrays, which AMD's compiler would put in scratch memory)
template <int kWords>
M2R_DEVICE uint32_t word(const uint4 (&w)[kWords], int i) {
  const uint4 q = w[i / 4];
  return (i & 3) == 0 ? q.x : (i & 3) == 1 ? q.y : (i & 3) == 2 ? q.z : q.w;
}

// element k of a run of 16-byte words holding kTok elements of T's storage, as float
template <typename T, int kWords>
M2R_DEVICE float element(const uint4 (&w)[kWords], int k) {
  if constexpr (sizeof(typename T::storage) == 4) {
    return __uint_as_float(word(w, k));
  } else {
    return T::to_float(static_cast<typename T::storage>((word(w, k / 2) >> (16 * (k & 1))) & 0xffffu));
  }
}

// kTok consecutive elements of a row from token t on, as float (0 past len): 16-byte loads, or
// one 8- or 4-byte load for a shorter run
template <typename T, int kTok>
M2R_DEVICE void load_seg(const typename T::storage* row, int64_t t, int64_t len, bool vec,
                         float* out) {
  constexpr int kBytes = kTok * static_cast<int>(sizeof(typename T::storage));
  static_assert(kBytes % 16 == 0 || kBytes == 8 || kBytes == 4,
                "whole 16-byte loads, or one 8- or 4-byte load");
  if (vec && t + kTok <= len) {
    if constexpr (kBytes == 4) {
      const uint4 w[1] = {make_uint4(*reinterpret_cast<const uint32_t*>(row + t), 0u, 0u, 0u)};
#pragma unroll
      for (int k = 0; k < kTok; ++k) out[k] = element<T>(w, k);
    } else if constexpr (kBytes == 8) {
      const uint2 q = *reinterpret_cast<const uint2*>(row + t);
      const uint4 w[1] = {make_uint4(q.x, q.y, 0u, 0u)};
#pragma unroll
      for (int k = 0; k < kTok; ++k) out[k] = element<T>(w, k);
    } else {
      constexpr int kWords = kBytes / 16;
      uint4 w[kWords];
#pragma unroll
      for (int i = 0; i < kWords; ++i) w[i] = reinterpret_cast<const uint4*>(row + t)[i];
#pragma unroll
      for (int k = 0; k < kTok; ++k) out[k] = element<T>(w, k);
    }
  } else {
#pragma unroll
    for (int k = 0; k < kTok; ++k) out[k] = t + k < len ? T::to_float(row[t + k]) : 0.f;
  }
}

// kTok floats to consecutive elements of a row from token t on, in T's storage (none past len)
template <typename T, int kTok>
M2R_DEVICE void store_seg(typename T::storage* row, int64_t t, int64_t len, bool vec,
                          const float* v) {
  typedef typename T::storage S;
  constexpr int kBytes = kTok * static_cast<int>(sizeof(S));
  static_assert(kBytes % 16 == 0 || kBytes == 8 || kBytes == 4,
                "whole 16-byte stores, or one 8- or 4-byte store");
  if (vec && t + kTok <= len) {
    constexpr int kU32 = kBytes / 4;
    uint32_t w[kU32];
#pragma unroll
    for (int i = 0; i < kU32; ++i) {
      if constexpr (sizeof(S) == 4) {
        w[i] = __float_as_uint(v[i]);
      } else {
        w[i] = static_cast<uint32_t>(T::from_float(v[2 * i])) |
               (static_cast<uint32_t>(T::from_float(v[2 * i + 1])) << 16);
      }
    }
    if constexpr (kBytes == 4) {
      *reinterpret_cast<uint32_t*>(row + t) = w[0];
    } else if constexpr (kBytes == 8) {
      *reinterpret_cast<uint2*>(row + t) = make_uint2(w[0], w[1]);
    } else {
#pragma unroll
      for (int i = 0; i < kU32 / 4; ++i)
        reinterpret_cast<uint4*>(row + t)[i] = make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < kTok; ++k)
      if (t + k < len) row[t + k] = T::from_float(v[k]);
  }
}

M2R_DEVICE bool aligned16(const void* q) { return (reinterpret_cast<uintptr_t>(q) & 15) == 0; }

}  // namespace m2r
