// One 16x16x16 matrix-core step, fp16/bf16 operands and fp32 accumulation, behind one interface
// for every target that has matrix cores. Kernels stage both operands in LDS as 16-bit
// [row][k] tiles (k contiguous: A is M x K, B is N x K), load 16x16 fragments with
// `load_lane` (at the tile plus `lane_off`; a B operand's at `lane_off_b`, which may order
// the sub-matrices differently), multiply with `mma<T>` and find the (row, col) of
// each accumulator register with `acc_row` / `acc_col`, so no kernel depends on a vendor's
// register layout. An operand whose reduction dim is the slow one in LDS ([k][row]) is read
// with `load_lane_t` / `lane_off_t` (`lane_off_bt`) instead, so kernels stage every operand as
// its rows lie in memory. BlockTile wraps these for a block-wide product.
//
//   M2R_MMA 1  NVIDIA sm_80+: ldmatrix.x4 + two mma.sync.m16n8k16 per step (the build we run)
//   M2R_MMA 2  AMD CDNA2/3/4 (gfx90a, gfx94x, gfx950), wave64: v_mfma_f32_16x16x16{f16,bf16_1k}
//   M2R_MMA 3  AMD RDNA3/3.5 (gfx11), wave32: v_wmma_f32_16x16x16_{f16,bf16}, the two half-waves
//              holding the same operand rows
//   M2R_MMA 4  AMD RDNA4 (gfx12), wave32: v_wmma_f32_16x16x16_{f16,bf16} (gfx12 layout)
//   M2R_MMA 0  no matrix cores (gfx10.3): kernels keep their fp32 FMA path; also an NVIDIA
//              build with M2R_EMULATE_GFX1030 (`build --emulate gfx1030`: never shipped), so
//              the gfx10.3 path runs and is tested on the NVIDIA machine
//
// Emulation builds of the matrix-core paths (`build --emulate gfx11|gfx12|gfx9`, clang for
// sm_90, never shipped) take M2R_MMA 3 / 4 / 2 with everything below compiled as for AMD; only
// the `__builtin_amdgcn_wmma_*` / `_mfma_*` calls become mma_emu.h's exact emulation (warp
// shuffles; for wave64, two warps exchanging through shared memory, platform.h).
//
// The AMD layouts follow the ISA documents; they are compiled and statically verified here but
// executed only by the GPU test gate on AMD runners (no AMD GPU is reachable from CI).
//
// LDS operand tiles: row stride `ld` a multiple of 8 elements, tile origins 16-byte aligned.
#pragma once

#include "platform.h"

#if M2R_CUDA && defined(M2R_EMULATE_GFX1030)
#define M2R_MMA 0  // an NVIDIA build of gfx10.3's world: the FMA path, run on real silicon
#elif M2R_CUDA && defined(M2R_EMULATE_GFX11)
#define M2R_MMA 3
#define M2R_WMMA_EMULATED 1
#elif M2R_CUDA && defined(M2R_EMULATE_GFX12)
#define M2R_MMA 4
#define M2R_WMMA_EMULATED 1
#elif M2R_CUDA && defined(M2R_EMULATE_GFX9)
#define M2R_MMA 2
#define M2R_MFMA_EMULATED 1
#elif M2R_CUDA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define M2R_MMA 1
#elif M2R_AMD && (defined(__gfx90a__) || defined(__gfx942__) || defined(__gfx950__) || \
                  defined(__gfx9_4_generic__))
#define M2R_MMA 2
#elif M2R_AMD && defined(__GFX11__)
#define M2R_MMA 3
#elif M2R_AMD && defined(__GFX12__)
#define M2R_MMA 4
#else
#define M2R_MMA 0
#endif

#if M2R_MMA == 2 && M2R_WAVEFRONT_SIZE != 64
#error "MFMA fragments assume wave64"
#endif
#if (M2R_MMA == 3 || M2R_MMA == 4) && M2R_WAVEFRONT_SIZE != 32
#error "WMMA fragments assume wave32"
#endif
#if defined(M2R_WMMA_EMULATED) || defined(M2R_MFMA_EMULATED)
#define M2R_MMA_EMULATED 1
#ifndef __clang__
#error "the matrix-core emulation builds need clang (AMD vector types on NVPTX); nvcc drops them"
#endif
#include "mma_emu.h"
#endif

namespace m2r {
namespace mma {

constexpr bool kAvailable = M2R_MMA != 0;

// Whether element type T runs on matrix cores (fp32 stays on FMA: no fp32-exact matrix op).
template <typename T>
constexpr bool kEnabled = kAvailable && T::kDType != M2R_DTYPE_F32;

M2R_DEVICE int lane() { return static_cast<int>(threadIdx.x % kWavefront); }

#if M2R_AMD || defined(M2R_MMA_EMULATED)
// kN 16-bit values p[0], p[ld], p[2 ld], ...: a fragment row read down a k-major LDS tile.
template <typename V, int kN>
M2R_DEVICE V gather(const uint16_t* p, int ld) {
  V v;
#pragma unroll
  for (int i = 0; i < kN; ++i) v[i] = static_cast<short>(p[i * ld]);
  return v;
}
#endif

#if M2R_MMA == 1  // ---------------------------------------------------------------- NVIDIA
struct Frag {
  uint32_t r[4];  // 8x8 sub-matrices (rows 0-7|8-15) x (k 0-7|8-15): A r[h + 2 kh], B r[2 h + kh]
};
struct Acc {
  float v[8];  // two m16n8 halves: v[4 j + i] is column half j
};
constexpr int kAccRegs = 8;

// This lane's first element of a fragment in a [row][k] tile / a k-major [k][row] tile: the
// row address it gives ldmatrix.
M2R_DEVICE int lane_off(int ld) {
  const int l = lane(), mi = l / 8;
  return ((l % 8) + 8 * (mi & 1)) * ld + 8 * (mi >> 1);
}
M2R_DEVICE int lane_off_t(int ld) {
  const int l = lane(), mi = l / 8;
  return (8 * (mi >> 1) + l % 8) * ld + 8 * (mi & 1);
}
// The same for a B operand: its sub-matrices in the order (rows 0-7 | 8-15) x (k 0-7 | 8-15)
// r[2 h + kh], so each n8 half's two registers are neighbours, as mma.sync takes them (the
// A order made ptxas copy two registers per mma: a quarter of chunk_scan's instructions).
M2R_DEVICE int lane_off_b(int ld) {
  const int l = lane(), mi = l / 8;
  return ((l % 8) + 8 * (mi >> 1)) * ld + 8 * (mi & 1);
}
M2R_DEVICE int lane_off_bt(int ld) {
  const int l = lane(), mi = l / 8;
  return (8 * (mi & 1) + l % 8) * ld + 8 * (mi >> 1);
}

M2R_DEVICE Frag load_lane(const uint16_t* p, int) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  Frag f;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(f.r[0]), "=r"(f.r[1]), "=r"(f.r[2]), "=r"(f.r[3])
               : "r"(addr));
  return f;
}

M2R_DEVICE Frag load_lane_t(const uint16_t* p, int) {  // ldmatrix transposes
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  Frag f;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(f.r[0]), "=r"(f.r[1]), "=r"(f.r[2]), "=r"(f.r[3])
               : "r"(addr));
  return f;
}

template <typename T>
M2R_DEVICE void mma(Acc& c, const Frag& a, const Frag& b) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    float* d = c.v + 4 * j;
    if constexpr (T::kDType == M2R_DTYPE_BF16) {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
          "{%8,%9}, {%0,%1,%2,%3};"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[2 * j]), "r"(b.r[2 * j + 1]));
    } else {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
          "{%8,%9}, {%0,%1,%2,%3};"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[2 * j]), "r"(b.r[2 * j + 1]));
    }
  }
}

// An A fragment built in registers (make_a) instead of read from LDS: element e of kAElems is
// at row a_row(e), k a_k(e) of the 16x16 fragment (registers r[h + 2 kh]: rows g + 8 h, k
// 8 kh + 2 q and the next, g = lane / 4, q = lane % 4).
constexpr int kAElems = 8;
M2R_DEVICE int a_row(int e) { return lane() / 4 + 8 * ((e >> 1) & 1); }
M2R_DEVICE int a_k(int e) { return 8 * (e >> 2) + 2 * (lane() % 4) + (e & 1); }
template <typename T>
M2R_DEVICE Frag make_a(const float (&v)[kAElems]) {
  Frag f;
#pragma unroll
  for (int i = 0; i < 4; ++i) f.r[i] = T::pack(v + 2 * i);
  return f;
}

M2R_DEVICE int acc_row(int r) { return lane() / 4 + 8 * ((r >> 1) & 1); }
M2R_DEVICE int acc_col(int r) { return 8 * (r >> 2) + 2 * (lane() % 4) + (r & 1); }
// The rows of a lane's accumulator registers (for sums along a row): kAccRows of them, register
// r in slot acc_slot(r), slot s in row acc_row(acc_slot_reg(s)); the lanes that hold a row's
// columns differ in their low log2(kRowLanes) bits.
constexpr int kAccRows = 2, kRowLanes = 4;
M2R_DEVICE int acc_slot(int r) { return (r >> 1) & 1; }
M2R_DEVICE int acc_slot_reg(int s) { return 2 * s; }
constexpr bool kAccColPairs = true;  // registers 2q, 2q + 1: neighbouring columns of one row

#elif M2R_MMA == 2  // ------------------------------------------------------- AMD MFMA, wave64
typedef short s16x4 __attribute__((ext_vector_type(4)));
typedef _Float16 h16x4 __attribute__((ext_vector_type(4)));
typedef float f32x4 __attribute__((ext_vector_type(4)));
struct Frag {
  s16x4 r;  // row lane % 16, k 4 (lane / 16) .. + 3
};
struct Acc {
  f32x4 v;  // rows 4 (lane / 16) .. + 3, column lane % 16
};
constexpr int kAccRegs = 4;

M2R_DEVICE int lane_off(int ld) { return (lane() % 16) * ld + 4 * (lane() / 16); }
M2R_DEVICE int lane_off_t(int ld) { return 4 * (lane() / 16) * ld + lane() % 16; }
M2R_DEVICE Frag load_lane(const uint16_t* p, int) { return Frag{*reinterpret_cast<const s16x4*>(p)}; }
M2R_DEVICE Frag load_lane_t(const uint16_t* p, int ld) { return Frag{gather<s16x4, 4>(p, ld)}; }

template <typename T>
M2R_DEVICE void mma(Acc& c, const Frag& a, const Frag& b) {
#ifdef M2R_MFMA_EMULATED
  c.v = emu::mfma_gfx9<T::kDType == M2R_DTYPE_BF16>(__builtin_bit_cast(emu::u32x2, a.r),
                                                     __builtin_bit_cast(emu::u32x2, b.r), c.v);
#else
  if constexpr (T::kDType == M2R_DTYPE_BF16) {
    c.v = __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(a.r, b.r, c.v, 0, 0, 0);
  } else {
    c.v = __builtin_amdgcn_mfma_f32_16x16x16f16(__builtin_bit_cast(h16x4, a.r),
                                                __builtin_bit_cast(h16x4, b.r), c.v, 0, 0, 0);
  }
#endif
}

constexpr int kAElems = 4;  // (make_a: row lane % 16, k 4 (lane / 16) + e)
M2R_DEVICE int a_row(int) { return lane() % 16; }
M2R_DEVICE int a_k(int e) { return 4 * (lane() / 16) + e; }

M2R_DEVICE int acc_row(int r) { return 4 * (lane() / 16) + r; }
M2R_DEVICE int acc_col(int) { return lane() % 16; }

#elif M2R_MMA == 3  // ------------------------------------------------- AMD WMMA gfx11, wave32
typedef short s16x16 __attribute__((ext_vector_type(16)));
typedef _Float16 h16x16 __attribute__((ext_vector_type(16)));
typedef float f32x8 __attribute__((ext_vector_type(8)));
typedef short s16x8 __attribute__((ext_vector_type(8)));
struct Frag {
  s16x16 r;  // row lane % 16, all 16 k; lanes 16-31 repeat lanes 0-15
};
struct Acc {
  f32x8 v;  // register r: row 2 r + lane / 16, column lane % 16
};
constexpr int kAccRegs = 8;

M2R_DEVICE int lane_off(int ld) { return (lane() % 16) * ld; }
M2R_DEVICE int lane_off_t(int) { return lane() % 16; }
M2R_DEVICE Frag load_lane(const uint16_t* p, int) {
  const s16x8* q = reinterpret_cast<const s16x8*>(p);
  return Frag{__builtin_shufflevector(q[0], q[1], 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)};
}
M2R_DEVICE Frag load_lane_t(const uint16_t* p, int ld) { return Frag{gather<s16x16, 16>(p, ld)}; }

template <typename T>
M2R_DEVICE void mma(Acc& c, const Frag& a, const Frag& b) {
#ifdef M2R_WMMA_EMULATED
  c.v = emu::wmma_gfx11<T::kDType == M2R_DTYPE_BF16>(__builtin_bit_cast(emu::u32x8, a.r),
                                                      __builtin_bit_cast(emu::u32x8, b.r), c.v);
#else
  if constexpr (T::kDType == M2R_DTYPE_BF16) {
    c.v = __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32(a.r, b.r, c.v);
  } else {
    c.v = __builtin_amdgcn_wmma_f32_16x16x16_f16_w32(__builtin_bit_cast(h16x16, a.r),
                                                     __builtin_bit_cast(h16x16, b.r), c.v);
  }
#endif
}

constexpr int kAElems = 16;  // (make_a: row lane % 16, every k; both half-waves alike)
M2R_DEVICE int a_row(int) { return lane() % 16; }
M2R_DEVICE int a_k(int e) { return e; }

M2R_DEVICE int acc_row(int r) { return 2 * r + lane() / 16; }
M2R_DEVICE int acc_col(int) { return lane() % 16; }

#elif M2R_MMA == 4  // ------------------------------------------------- AMD WMMA gfx12, wave32
typedef short s16x8 __attribute__((ext_vector_type(8)));
typedef _Float16 h16x8 __attribute__((ext_vector_type(8)));
typedef float f32x8 __attribute__((ext_vector_type(8)));
struct Frag {
  s16x8 r;  // row lane % 16, k 8 (lane / 16) .. + 7
};
struct Acc {
  f32x8 v;  // register r: row r + 8 (lane / 16), column lane % 16
};
constexpr int kAccRegs = 8;

M2R_DEVICE int lane_off(int ld) { return (lane() % 16) * ld + 8 * (lane() / 16); }
M2R_DEVICE int lane_off_t(int ld) { return 8 * (lane() / 16) * ld + lane() % 16; }
M2R_DEVICE Frag load_lane(const uint16_t* p, int) { return Frag{*reinterpret_cast<const s16x8*>(p)}; }
M2R_DEVICE Frag load_lane_t(const uint16_t* p, int ld) { return Frag{gather<s16x8, 8>(p, ld)}; }

template <typename T>
M2R_DEVICE void mma(Acc& c, const Frag& a, const Frag& b) {
#ifdef M2R_WMMA_EMULATED
  c.v = emu::wmma_gfx12<T::kDType == M2R_DTYPE_BF16>(__builtin_bit_cast(emu::u32x4, a.r),
                                                      __builtin_bit_cast(emu::u32x4, b.r), c.v);
#else
  if constexpr (T::kDType == M2R_DTYPE_BF16) {
    c.v = __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32_gfx12(a.r, b.r, c.v);
  } else {
    c.v = __builtin_amdgcn_wmma_f32_16x16x16_f16_w32_gfx12(__builtin_bit_cast(h16x8, a.r),
                                                           __builtin_bit_cast(h16x8, b.r), c.v);
  }
#endif
}

constexpr int kAElems = 8;  // (make_a: row lane % 16, k 8 (lane / 16) + e)
M2R_DEVICE int a_row(int) { return lane() % 16; }
M2R_DEVICE int a_k(int e) { return 8 * (lane() / 16) + e; }

M2R_DEVICE int acc_row(int r) { return r + 8 * (lane() / 16); }
M2R_DEVICE int acc_col(int) { return lane() % 16; }
#endif

#if M2R_MMA >= 2  // AMD: each register its own row, a row's columns over 16 lanes
constexpr int kAccRows = kAccRegs, kRowLanes = 16;
constexpr bool kAccColPairs = false;
M2R_DEVICE int acc_slot(int r) { return r; }
M2R_DEVICE int acc_slot_reg(int s) { return s; }
#endif

#if M2R_MMA >= 2
// AMD layouts: a fragment's 16-bit elements in k order, packed two to a word
template <typename T>
M2R_DEVICE Frag make_a(const float (&v)[kAElems]) {
  struct Words {
    uint32_t w[kAElems / 2];
  } words;
#pragma unroll
  for (int i = 0; i < kAElems / 2; ++i) words.w[i] = T::pack(v + 2 * i);
  Frag f;
  f.r = __builtin_bit_cast(decltype(f.r), words);
  return f;
}
#endif

#if M2R_MMA != 0 && M2R_MMA != 1
// AMD layouts: a B fragment is read as an A fragment
M2R_DEVICE int lane_off_b(int ld) { return lane_off(ld); }
M2R_DEVICE int lane_off_bt(int ld) { return lane_off_t(ld); }
#endif

#if M2R_MMA != 0
// A block-wide product C (kM x kN) += A (kM x K) B (kN x K)^T, the waves of the block each
// owning a (kM / kWavesM) x (kN / kWavesN) sub-tile of 16x16 fragments.
template <int kThreads, int kM, int kN, int kWavesM>
struct BlockTile {
  static constexpr int kWaves = kThreads / kWavefront, kWavesN = kWaves / kWavesM;
  static constexpr int kFm = kM / kWavesM / 16, kFn = kN / kWavesN / 16;
  static_assert(kWaves % kWavesM == 0 && kFm >= 1 && kFn >= 1, "tile does not split over the waves");
  static_assert(kFm * kWavesM * 16 == kM && kFn * kWavesN * 16 == kN, "tile does not split over the waves");
  Acc acc[kFm][kFn];
  int m0, n0;  // this wave's sub-tile origin

  M2R_DEVICE BlockTile() {
    const int wave = static_cast<int>(threadIdx.x) / kWavefront;
    m0 = (wave % kWavesM) * kFm * 16;
    n0 = (wave / kWavesM) * kFn * 16;
#pragma unroll
    for (int i = 0; i < kFm; ++i)
#pragma unroll
      for (int j = 0; j < kFn; ++j)
#pragma unroll
        for (int r = 0; r < kAccRegs; ++r) acc[i][j].v[r] = 0.f;
  }

  // This lane's offset into an A ([kM][lda], or kTrans: k-major [kK][lda]) or B tile, once per
  // product; fragment (k, i) of this wave's sub-tile is a constant offset from it.
  template <bool kTrans>
  M2R_DEVICE int lane_a(int lda) const { return kTrans ? lane_off_t(lda) + m0 : lane_off(lda) + m0 * lda; }
  template <bool kTrans>
  M2R_DEVICE int lane_b(int ldb) const { return kTrans ? lane_off_bt(ldb) + n0 : lane_off_b(ldb) + n0 * ldb; }
  template <bool kTrans>
  static M2R_DEVICE Frag frag(const uint16_t* a, int ld, int k, int i) {
    return kTrans ? load_lane_t(a + k * ld + 16 * i, ld) : load_lane(a + 16 * i * ld + k, ld);
  }

  // One LDS slab of kK along the reduction dim. A is [kM][lda] or, kTransA, k-major
  // [kK][lda]; B likewise with kN.
  template <typename T, int kK, bool kTransA, bool kTransB>
  M2R_DEVICE void product(const uint16_t* As, int lda, const uint16_t* Bs, int ldb) {
    const uint16_t* a = As + lane_a<kTransA>(lda);
    const uint16_t* b = Bs + lane_b<kTransB>(ldb);
#pragma unroll
    for (int k = 0; k < kK; k += 16) {
      Frag fb[kFn];
#pragma unroll
      for (int j = 0; j < kFn; ++j) fb[j] = frag<kTransB>(b, ldb, k, j);
#pragma unroll
      for (int i = 0; i < kFm; ++i) {
        const Frag fa = frag<kTransA>(a, lda, k, i);
#pragma unroll
        for (int j = 0; j < kFn; ++j) mma<T>(acc[i][j], fa, fb[j]);
      }
    }
  }

  // The two products of a split operand (its value rounded to T and the rounding remainder)
  // in one pass over the slab: acc += A·Bᵀ + A2·Bᵀ (kSplitA) or A·Bᵀ + A·B2ᵀ, the shared
  // operand's fragments loaded from LDS once instead of twice.
  template <typename T, int kK, bool kTransA, bool kTransB, bool kSplitA>
  M2R_DEVICE void product_split(const uint16_t* As, const uint16_t* As2, int lda, const uint16_t* Bs,
                                const uint16_t* Bs2, int ldb) {
    const int ao = lane_a<kTransA>(lda), bo = lane_b<kTransB>(ldb);
    const uint16_t *a = As + ao, *b = Bs + bo;
    const uint16_t* a2 = kSplitA ? As2 + ao : nullptr;  // (the other one is not given)
    const uint16_t* b2 = kSplitA ? nullptr : Bs2 + bo;
#pragma unroll
    for (int k = 0; k < kK; k += 16) {
      Frag fb[kFn], fb2[kSplitA ? 1 : kFn];
#pragma unroll
      for (int j = 0; j < kFn; ++j) {
        fb[j] = frag<kTransB>(b, ldb, k, j);
        if constexpr (!kSplitA) fb2[j] = frag<kTransB>(b2, ldb, k, j);
      }
#pragma unroll
      for (int i = 0; i < kFm; ++i) {
        const Frag fa = frag<kTransA>(a, lda, k, i);
#pragma unroll
        for (int j = 0; j < kFn; ++j) mma<T>(acc[i][j], fa, fb[j]);
        if constexpr (kSplitA) {
          const Frag fa2 = frag<kTransA>(a2, lda, k, i);
#pragma unroll
          for (int j = 0; j < kFn; ++j) mma<T>(acc[i][j], fa2, fb[j]);
        } else {
#pragma unroll
          for (int j = 0; j < kFn; ++j) mma<T>(acc[i][j], fa, fb2[j]);
        }
      }
    }
  }

  M2R_DEVICE int row(int i, int r) const { return m0 + 16 * i + acc_row(r); }
  M2R_DEVICE int col(int j, int r) const { return n0 + 16 * j + acc_col(r); }
};
#endif

}  // namespace mma
}  // namespace m2r
