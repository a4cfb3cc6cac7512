// The few primitives that differ between HIP (clang, AMD targets) and CUDA (nvcc), so that
// every kernel source compiles unchanged for both. The NVIDIA build exists to execute and
// measure the kernels on the hardware we have; AMD targets are what we ship.
//
// Contract with the build driver:
//   M2R_WAVEFRONT_SIZE  wavefront width of the target: 32 (gfx10/11/12, NVIDIA) or 64 (gfx9).
//                       Always given on the command line; never assumed.
#pragma once

#include "params.h"

#ifndef M2R_WAVEFRONT_SIZE
#error "M2R_WAVEFRONT_SIZE must be defined by the build driver (32 or 64)"
#endif
#if M2R_WAVEFRONT_SIZE != 32 && M2R_WAVEFRONT_SIZE != 64
#error "M2R_WAVEFRONT_SIZE must be 32 or 64"
#endif

#if defined(__HIP__) || defined(__HIPCC__)
#define M2R_AMD 1
#include <hip/hip_fp16.h>
#include <hip/hip_runtime.h>
#else
#define M2R_CUDA 1
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#endif

#define M2R_DEVICE __device__ __forceinline__
// Every kernel is extern "C" so the loader finds it by a stable, unmangled name.
#define M2R_KERNEL(threads) extern "C" __global__ void __launch_bounds__(threads)
// NVIDIA (nvcc): at least nv_blocks blocks per SM, a register cap chosen against ptxas' spills.
// AMD reads launch bounds' 2nd argument differently (waves per EU), and clang's CUDA codegen
// (the emulation builds, never shipped) spills under nvcc's caps: both get the plain bound.
#if M2R_AMD || defined(__clang__)
#define M2R_KERNEL_MIN_BLOCKS(threads, nv_blocks) M2R_KERNEL(threads)
#else
#define M2R_KERNEL_MIN_BLOCKS(threads, nv_blocks) extern "C" __global__ void __launch_bounds__(threads, nv_blocks)
#endif

namespace m2r {

constexpr int kWavefront = M2R_WAVEFRONT_SIZE;
typedef uint64_t lane_mask_t;  // 64-bit on every target so wave64 code is never truncated

// 16 bytes moved by one load instruction.
#if M2R_AMD
typedef unsigned int vec16_t __attribute__((ext_vector_type(4)));
#else
typedef uint4 vec16_t;
#endif

// Read-only global loads of data that is read once (streaming): non-temporal on AMD so it
// does not evict reusable lines, the read-only path on NVIDIA.
template <typename T>
M2R_DEVICE T load_stream(const T* p) {
#if M2R_AMD
  return __builtin_nontemporal_load(p);
#else
  return __ldg(p);
#endif
}

template <typename T>
M2R_DEVICE void store_stream(T* p, T v) {
#if M2R_AMD
  __builtin_nontemporal_store(v, p);
#else
  *p = v;
#endif
}

// A float read from global memory where the code reads it: LLVM sinks a load whose value only
// one branch uses into that branch, after the branch's own condition was loaded (two memory
// round trips in a row: chunk_state's weights). NVIDIA: a volatile PTX load; AMD: plain.
M2R_DEVICE float load_now(const float* p) {
#if M2R_CUDA
  float v;
  asm volatile("ld.global.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
#else
  return *p;
#endif
}

// Four floats to global memory in one 16-byte store (p 16-byte aligned). nvcc turned a float4
// store into four 4-byte ones where a neighbouring branch stored the same elements one by one
// (state_passing's entering states); the PTX store stays one instruction.
M2R_DEVICE void store_float4(float* p, float a, float b, float c, float d) {
#if M2R_CUDA
  asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
#else
  *reinterpret_cast<float4*>(p) = make_float4(a, b, c, d);
#endif
}

// One block hands data to a later one of the same grid (ssd_chunk_state.hip's chained chunk_state): the
// producer's threads store it, then call flag_publish; the consumer calls flag_wait, then reads
// it with load_fresh. Both are block-wide (a barrier each). NVIDIA: one thread's release store
// after the barrier and one thread's acquire loads before it (PTX's memory model makes the
// barrier carry the order to the other threads: CUTLASS's semaphore does the same), and the
// data is read from L2 (ld.global.cg). AMD: each thread's device-scope fence, which also writes
// back / invalidates the non-coherent vector L1. A consumer must only wait on a block that is
// already running or done (ssd_chunk_state.hip takes its chunks from an atomic ticket), or the wait could
// hold the multiprocessor the producer needs.
M2R_DEVICE void flag_publish(int* flag) {
#if M2R_AMD
  __threadfence();  // this thread's stores are visible device-wide ...
  __syncthreads();  // ... for every thread of the block, before the flag is
  if (threadIdx.x == 0) __hip_atomic_store(flag, 1, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
#else
  __syncthreads();
  if (threadIdx.x == 0) asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(flag), "r"(1) : "memory");
#endif
}

M2R_DEVICE void flag_wait(const int* flag) {
#if M2R_AMD
  if (threadIdx.x == 0)
    while (__hip_atomic_load(flag, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT) == 0) __builtin_amdgcn_s_sleep(1);
  __syncthreads();
  __threadfence();  // the loads after this see what the producer stored before its flag
#else
  if (threadIdx.x == 0) {
    int v;
    do asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
    while (v == 0);
  }
  __syncthreads();
#endif
}

// V = float, float2 or float4, p aligned to sizeof(V)
template <typename V>
M2R_DEVICE V load_fresh(const float* p) {
#if M2R_AMD
  return *reinterpret_cast<const V*>(p);
#else
  return __ldcg(reinterpret_cast<const V*>(p));
#endif
}

#if M2R_CUDA && defined(M2R_EMULATE_GFX9) && !defined(M2R_EMULATE_WAVE64)
#define M2R_EMULATE_WAVE64 1  // the gfx9 emulation is a wave64 world
#endif
#if M2R_CUDA && defined(M2R_EMULATE_WAVE64)
// ---- wave64 on NVIDIA (the gfx9 emulation build, never shipped) ----------------------------
// Two warps (threads 64 w .. 64 w + 63 of the block) act as AMD wave w. Every cross-lane
// primitive below gives what the wave64 instruction gives: within one warp it is the warp's
// own shuffle (the same lanes, the same result); across the two warps the values go through
// shared memory between two 64-thread named barriers (barrier 1 + w), so both warps see the
// whole wave. As on AMD, all 64 lanes must take part (kernels call these in converged code).
#if M2R_WAVEFRONT_SIZE != 64
#error "M2R_EMULATE_WAVE64 needs M2R_WAVEFRONT_SIZE=64"
#endif
namespace wave64 {
constexpr int kMaxWaves = 8;  // blocks of up to 512 threads (the one-pass norm backward: kRowMaxThreads)
M2R_DEVICE int wave() { return static_cast<int>(threadIdx.x) / 64; }
M2R_DEVICE int lane() { return static_cast<int>(threadIdx.x) % 64; }
M2R_DEVICE void sync() { asm volatile("bar.sync %0, 64;" ::"r"(1 + wave()) : "memory"); }
// lane src's value (0 <= src < 64) of this wave
M2R_DEVICE float from_lane(float v, int src) {
  __shared__ float slot[kMaxWaves][64];
  if (wave() >= kMaxWaves) __trap();  // (a larger block: its slots would lie past the array)
  sync();  // the previous exchange's readers are done
  slot[wave()][lane()] = v;
  sync();
  return slot[wave()][src];
}
}  // namespace wave64
#endif

// Orders the wave's shared-memory accesses before it against those after it, across its lanes:
// NVIDIA's lanes may run apart (a warp barrier); an AMD wave's lanes never do (a compiler
// barrier: the accesses stay in program order).
M2R_DEVICE void wave_sync() {
#if M2R_AMD
  __builtin_amdgcn_wave_barrier();
#elif defined(M2R_EMULATE_WAVE64)
  wave64::sync();
#else
  __syncwarp();
#endif
}

M2R_DEVICE float shfl_xor(float v, int lane_mask) {
#if M2R_AMD
  return __shfl_xor(v, lane_mask, kWavefront);
#elif defined(M2R_EMULATE_WAVE64)
  if (lane_mask < 32) return __shfl_xor_sync(0xffffffffu, v, lane_mask, 32);
  return wave64::from_lane(v, wave64::lane() ^ lane_mask);
#else
  return __shfl_xor_sync(0xffffffffu, v, lane_mask, kWavefront);
#endif
}

// Butterfly within aligned groups of `width` lanes (width <= the wavefront).
M2R_DEVICE float shfl_xor_width(float v, int lane_mask, int width) {
#if M2R_AMD
  return __shfl_xor(v, lane_mask, width);
#elif defined(M2R_EMULATE_WAVE64)
  if (width <= 32) return __shfl_xor_sync(0xffffffffu, v, lane_mask, width);
  return shfl_xor(v, lane_mask);
#else
  return __shfl_xor_sync(0xffffffffu, v, lane_mask, width);
#endif
}

// v of the lane delta below (a lane below delta keeps its own v).
M2R_DEVICE float shfl_up(float v, unsigned delta) {
#if M2R_AMD
  return __shfl_up(v, delta, kWavefront);
#elif defined(M2R_EMULATE_WAVE64)
  const int l = wave64::lane();
  return wave64::from_lane(v, l >= static_cast<int>(delta) ? l - static_cast<int>(delta) : l);
#else
  return __shfl_up_sync(0xffffffffu, v, delta, kWavefront);
#endif
}

// v of the lane delta above (a lane within delta of the wave's end keeps its own v).
M2R_DEVICE float shfl_down(float v, unsigned delta) {
#if M2R_AMD
  return __shfl_down(v, delta, kWavefront);
#elif defined(M2R_EMULATE_WAVE64)
  const int l = wave64::lane();
  return wave64::from_lane(v, l + static_cast<int>(delta) < 64 ? l + static_cast<int>(delta) : l);
#else
  return __shfl_down_sync(0xffffffffu, v, delta, kWavefront);
#endif
}

// v of lane src of the wave.
M2R_DEVICE float shfl_idx(float v, int src) {
#if M2R_AMD
  return __shfl(v, src, kWavefront);
#elif defined(M2R_EMULATE_WAVE64)
  return wave64::from_lane(v, src);
#else
  return __shfl_sync(0xffffffffu, v, src, kWavefront);
#endif
}

// Within aligned groups of `width` lanes (width <= 32: one warp even where wave64 is emulated):
// v of the lane delta below (a lane below delta keeps its own v), and v of lane src of the group.
M2R_DEVICE float shfl_up_width(float v, unsigned delta, int width) {
#if M2R_AMD
  return __shfl_up(v, delta, width);
#else
  return __shfl_up_sync(0xffffffffu, v, delta, width);
#endif
}
M2R_DEVICE float shfl_width(float v, int src, int width) {
#if M2R_AMD
  return __shfl(v, src, width);
#else
  return __shfl_sync(0xffffffffu, v, src, width);
#endif
}

M2R_DEVICE lane_mask_t ballot(bool pred) {
#if M2R_AMD
  return static_cast<lane_mask_t>(__ballot(pred));
#elif defined(M2R_EMULATE_WAVE64)
  const unsigned mine = __ballot_sync(0xffffffffu, pred);  // this warp's 32 lanes
  const unsigned other = __float_as_uint(wave64::from_lane(__uint_as_float(mine),
                                                           wave64::lane() ^ 32));
  const bool low = wave64::lane() < 32;
  return static_cast<lane_mask_t>(low ? mine : other) |
         (static_cast<lane_mask_t>(low ? other : mine) << 32);
#else
  return static_cast<lane_mask_t>(__ballot_sync(0xffffffffu, pred));
#endif
}

// ---- element types: storage <-> fp32 ------------------------------------------------------
// Storage is plain bits so no vendor half/bfloat16 class (with its differing operators) leaks
// into kernel code; arithmetic is always fp32.

M2R_DEVICE float bf16_to_float(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}

M2R_DEVICE uint16_t float_to_bf16(float f) {  // round to nearest even, NaN stays NaN
#if M2R_AMD
  return __builtin_bit_cast(uint16_t, static_cast<__bf16>(f));  // hardware cvt where the ISA has one
#else
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#endif
}

M2R_DEVICE float fp16_to_float(uint16_t bits) { return __half2float(__ushort_as_half(bits)); }
M2R_DEVICE uint16_t float_to_fp16(float f) { return __half_as_ushort(__float2half_rn(f)); }

// Two 16-bit values in one 32-bit word <-> two floats (the low half is the first element).
M2R_DEVICE float2 bf16x2_to_float2(uint32_t w) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}
M2R_DEVICE uint32_t float2_to_bf16x2(float a, float b) {
#if M2R_AMD
  return static_cast<uint32_t>(float_to_bf16(a)) | (static_cast<uint32_t>(float_to_bf16(b)) << 16);
#else
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);  // one instruction for both
  return *reinterpret_cast<const uint32_t*>(&h);
#endif
}
M2R_DEVICE float2 fp16x2_to_float2(uint32_t w) {
  return make_float2(fp16_to_float(static_cast<uint16_t>(w)), fp16_to_float(static_cast<uint16_t>(w >> 16)));
}
M2R_DEVICE uint32_t float2_to_fp16x2(float a, float b) {
  return static_cast<uint32_t>(float_to_fp16(a)) | (static_cast<uint32_t>(float_to_fp16(b)) << 16);
}

// Element-type traits. kPerWord elements share one 32-bit word; unpack/pack convert a word.
struct F32 {
  typedef float storage;
  static constexpr int kPerWord = 1;
  static M2R_DEVICE void unpack(uint32_t w, float* f) { f[0] = __uint_as_float(w); }
  static M2R_DEVICE uint32_t pack(const float* f) { return __float_as_uint(f[0]); }
  static constexpr int kDType = M2R_DTYPE_F32;
  static M2R_DEVICE float to_float(float v) { return v; }
  static M2R_DEVICE float from_float(float v) { return v; }
};
struct F16 {
  typedef uint16_t storage;
  static constexpr int kPerWord = 2;
  static M2R_DEVICE void unpack(uint32_t w, float* f) {
    const float2 v = fp16x2_to_float2(w);
    f[0] = v.x, f[1] = v.y;
  }
  static M2R_DEVICE uint32_t pack(const float* f) { return float2_to_fp16x2(f[0], f[1]); }
  static constexpr int kDType = M2R_DTYPE_F16;
  static constexpr uint32_t kExpBits = 0x7c00u;  // all ones: inf or NaN
  static M2R_DEVICE float to_float(uint16_t v) { return fp16_to_float(v); }
  static M2R_DEVICE uint16_t from_float(float v) { return float_to_fp16(v); }
};
struct BF16 {
  typedef uint16_t storage;
  static constexpr int kPerWord = 2;
  static M2R_DEVICE void unpack(uint32_t w, float* f) {
    const float2 v = bf16x2_to_float2(w);
    f[0] = v.x, f[1] = v.y;
  }
  static M2R_DEVICE uint32_t pack(const float* f) { return float2_to_bf16x2(f[0], f[1]); }
  static constexpr int kDType = M2R_DTYPE_BF16;
  static constexpr uint32_t kExpBits = 0x7f80u;  // all ones: inf or NaN
  static M2R_DEVICE float to_float(uint16_t v) { return bf16_to_float(v); }
  static M2R_DEVICE uint16_t from_float(float v) { return float_to_bf16(v); }
};

// The two 16-bit values of type T in w with their non-finite ones (exponent all ones) set to
// +0; bit 0 / bit 1 of `bad` say which were. Integer arithmetic only: a half's magnitude plus
// (0x8000 - kExpBits) carries into its bit 15 exactly when it is >= kExpBits.
template <typename T>
M2R_DEVICE uint32_t nonfinite_top2(uint32_t w) {  // bit 15 / bit 31: the low / high half is not finite
  constexpr uint32_t k = (0x8000u - T::kExpBits) * 0x10001u;
  return ((w & 0x7fff7fffu) + k) & 0x80008000u;
}
template <typename T>
M2R_DEVICE uint32_t zero_nonfinite2(uint32_t w, uint32_t& bad) {
  const uint32_t top = nonfinite_top2<T>(w);
  bad = (top >> 15 & 1u) | (top >> 30 & 2u);
  return w & ~((top >> 15) * 0xffffu);
}

// 8 consecutive 16-bit values of type T (one 16-byte load) as floats
template <typename T>
M2R_DEVICE void unpack8(const uint4& q, float (&v)[8]) {
  T::unpack(q.x, v), T::unpack(q.y, v + 2), T::unpack(q.z, v + 4), T::unpack(q.w, v + 6);
}

// Runs of a row of 16-bit elements, kept packed (the SSD kernels' operand and epilogue loads)
struct Packed4 {  // 4 16-bit values, 8 bytes
  uint32_t lo, hi;
};

// 4 consecutive 16-bit elements r[c..c+3] of a row whose range is [0, n): one 8-byte load when
// `vec` (the row and the tensor are 8-byte aligned), else element by element; 0 past n.
M2R_DEVICE Packed4 load4(const uint16_t* r, int c, int n, bool vec) {
  if (vec && c + 3 < n) {
    const uint2 v = *reinterpret_cast<const uint2*>(r + c);
    return Packed4{v.x, v.y};
  }
  uint32_t e[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) e[i] = c + i < n ? r[c + i] : 0u;
  return Packed4{e[0] | (e[1] << 16), e[2] | (e[3] << 16)};
}

// 8 consecutive 16-bit elements r[c..c+7] of a row whose range is [0, n): one 16-byte load when
// `vec` allows it, else element by element; 0 past n (n = 0: nothing is read).
M2R_DEVICE uint4 load8(const uint16_t* r, int c, int n, bool vec) {
  if (vec && c + 7 < n) return *reinterpret_cast<const uint4*>(r + c);
  uint32_t e[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) e[i] = c + i < n ? r[c + i] : 0u;
  return make_uint4(e[0] | (e[1] << 16), e[2] | (e[3] << 16), e[4] | (e[5] << 16), e[6] | (e[7] << 16));
}

template <typename T>
M2R_DEVICE Packed4 pack4(const float (&v)[4]) {
  return Packed4{T::pack(v), T::pack(v + 2)};
}

template <typename T>
M2R_DEVICE void unpack4(const Packed4& q, float (&v)[4]) {
  T::unpack(q.lo, v), T::unpack(q.hi, v + 2);
}

// 16 bytes of element type T: one load or store (v), its elements (s) or words (w), and the
// conversion of all kN elements to / from floats.
template <typename T>
struct Vec16 {
  typedef typename T::storage S;
  static constexpr int kN = 16 / sizeof(S);
  union U {
    vec16_t v;
    S s[kN];
    uint32_t w[4];
  };
  static M2R_DEVICE void unpack(const U& u, float (&f)[kN]) {
#pragma unroll
    for (int q = 0; q < 4; ++q) T::unpack(u.w[q], f + q * T::kPerWord);
  }
  static M2R_DEVICE void pack(const float (&f)[kN], U& u) {
#pragma unroll
    for (int q = 0; q < 4; ++q) u.w[q] = T::pack(f + q * T::kPerWord);
  }
};

// A small tensor (weights, biases) whose dtype is a run-time parameter: one uniform branch,
// so callers may pass fp32 weights with bf16 activations without a conversion kernel.
M2R_DEVICE float load_as_float(const void* p, int dtype, int64_t idx) {
  if (dtype == M2R_DTYPE_F32) return static_cast<const float*>(p)[idx];
  const uint16_t bits = static_cast<const uint16_t*>(p)[idx];
  return dtype == M2R_DTYPE_F16 ? fp16_to_float(bits) : bf16_to_float(bits);
}

// v stored into such a tensor (load_as_float's counterpart; 16-bit types rounded to nearest even)
M2R_DEVICE void store_as(void* p, int dtype, int64_t idx, float v) {
  if (dtype == M2R_DTYPE_F32) static_cast<float*>(p)[idx] = v;
  else static_cast<uint16_t*>(p)[idx] = dtype == M2R_DTYPE_F16 ? float_to_fp16(v) : float_to_bf16(v);
}

// load_as_float in two steps, for a thread that reads several such tensors at once: the raw
// bits first (a float's, or a 16-bit value zero-extended), the conversion once every load is
// in flight. load_as_float converts inside its dtype branch, where the thread then waits for
// that one load before it reaches the next.
M2R_DEVICE uint32_t load_bits(const void* p, int dtype, int64_t idx) {
  return dtype == M2R_DTYPE_F32 ? __float_as_uint(static_cast<const float*>(p)[idx])
                                : static_cast<uint32_t>(static_cast<const uint16_t*>(p)[idx]);
}
M2R_DEVICE float bits_to_float(uint32_t v, int dtype) {
  if (dtype == M2R_DTYPE_F32) return __uint_as_float(v);
  return dtype == M2R_DTYPE_F16 ? fp16_to_float(static_cast<uint16_t>(v)) : bf16_to_float(static_cast<uint16_t>(v));
}

// out[e] = element idx0 + e * stride where valid[e], else 0 (as load_as_float): every load is
// issued before the first conversion, so their latencies overlap instead of adding up
template <int kN>
M2R_DEVICE void load_as_float_n(const void* p, int dtype, int64_t idx0, int64_t stride, const bool (&valid)[kN],
                                float (&out)[kN]) {
  if (dtype == M2R_DTYPE_F32) {
#pragma unroll
    for (int e = 0; e < kN; ++e) out[e] = valid[e] ? static_cast<const float*>(p)[idx0 + e * stride] : 0.f;
    return;
  }
  uint16_t bits[kN];
#pragma unroll
  for (int e = 0; e < kN; ++e) bits[e] = valid[e] ? static_cast<const uint16_t*>(p)[idx0 + e * stride] : 0;
#pragma unroll
  for (int e = 0; e < kN; ++e) out[e] = valid[e] ? (dtype == M2R_DTYPE_F16 ? fp16_to_float(bits[e]) : bf16_to_float(bits[e])) : 0.f;
}

// log2(e): exponents scaled by it once (e.g. a chunk's dA_cs as it goes to LDS) make each
// exp(a - b) of them one fast_exp2
constexpr float kLog2e = 1.4426950408889634f;

// 2^x, approximate (a few ulp); results below 2^-126 flush to 0. One instruction on both
// vendors (MUFU.EX2 / v_exp_f32), where exp2f adds a denormal fix-up.
M2R_DEVICE float fast_exp2(float x) {
#if M2R_AMD
  return __builtin_amdgcn_exp2f(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

// A hint to bring the cache line at q towards this multiprocessor's L1, no register and no wait
// (NVIDIA: prefetch.global.L1); for loads a loop makes later, e.g. the next head's operands
// while this head's product runs, where holding them in registers would cost occupancy. No
// code on AMD (no L1 prefetch before gfx12).
M2R_DEVICE void prefetch_l1(const void* q) {
#if M2R_AMD
  (void)q;
#else
  asm volatile("prefetch.global.L1 [%0];" ::"l"(q));
#endif
}

// x, as a value the compiler must treat as differing between lanes. AMD's compiler moves values
// it proves uniform (an LDS read at a uniform address) into scalar registers, 102 at most per
// wave; a kernel whose every lane reads the same LDS row then spills them. No code on NVIDIA.
M2R_DEVICE int per_lane(int x) {
#if M2R_AMD
  asm volatile("" : "+v"(x));
#endif
  return x;
}
// the same for a float
M2R_DEVICE float per_lane(float x) {
#if M2R_AMD
  asm volatile("" : "+v"(x));
#endif
  return x;
}
// the same for a 64-bit integer (a stride): two vector registers instead of two scalar ones
M2R_DEVICE int64_t per_lane(int64_t x) {
#if M2R_AMD
  asm volatile("" : "+v"(x));
#endif
  return x;
}
// the same for a pointer: held in vector registers (two per lane) instead of two scalar ones
template <typename P>
M2R_DEVICE P* per_lane(P* q) {
#if M2R_AMD
  uint64_t v = reinterpret_cast<uint64_t>(q);
  asm volatile("" : "+v"(v));
  return reinterpret_cast<P*>(v);
#else
  return q;
#endif
}

// w, opaque to the compiler from here on: what it worked out from w before (a 16-bit run's
// unpacked floats) cannot stand in for the same work after, so those values need not stay live
// in registers through the code between (the one-pass norm backward keeps its runs packed
// through a row's reductions and unpacks them again after).
M2R_DEVICE void opaque(uint32_t& w) {
#if M2R_AMD
  asm volatile("" : "+v"(w));
#else
  asm volatile("" : "+r"(w));
#endif
}

// log2(x), approximate (a few ulp); one instruction (MUFU.LG2 / v_log_f32); denormals flush.
M2R_DEVICE float fast_log2(float x) {
#if M2R_AMD
  return __builtin_amdgcn_logf(x);
#else
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

// softplus as above without a branch: both sides computed, one select (two transcendental
// instructions; for staging loops, where softplus's branches around every element cost more)
M2R_DEVICE float softplus_select(float x) {
  const float sp = fast_log2(1.f + fast_exp2(x * kLog2e)) * 0.6931471805599453f;
  return x <= 20.f ? sp : x;
}

M2R_DEVICE float silu(float x) { return __fdividef(x, 1.0f + __expf(-x)); }
// silu with the exponential as one fast_exp2, for kernels whose issue rate bounds them (the
// channel-last conv forward): where fast_exp2 flushes (2^-126 and below) 1 + it is 1 in fp32
// anyway, so on NVIDIA the result is silu's bit for bit, 3 instructions fewer (no denormal path)
M2R_DEVICE float silu_fast(float x) { return __fdividef(x, 1.0f + fast_exp2(-x * kLog2e)); }
// d silu(x) / dx = s (1 + x (1 - s)), s = sigmoid(x)
M2R_DEVICE float dsilu(float x) {
  const float s = __fdividef(1.0f, 1.0f + __expf(-x));
  return s * fmaf(x, 1.0f - s, 1.0f);
}
// dsilu with the exponential as one fast_exp2 (the argument of silu_fast: on NVIDIA the same
// bits, 3 instructions fewer), for the conv backward, whose issue rate bounds it
M2R_DEVICE float dsilu_fast(float x) {
  const float s = __fdividef(1.0f, 1.0f + fast_exp2(-x * kLog2e));
  return s * fmaf(x, 1.0f - s, 1.0f);
}
// softplus with torch's threshold, in the form Triton's Mamba kernels use (no libm call).
M2R_DEVICE float softplus(float x) { return x <= 20.f ? __logf(1.f + __expf(x)) : x; }

}  // namespace m2r
