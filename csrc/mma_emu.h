// Exact emulation of AMD's 16x16x16 matrix instructions on NVIDIA warps, for the emulation
// builds `build --emulate gfx11|gfx12|gfx9` (never shipped): RDNA's WMMA (wave32, one warp)
// and CDNA's MFMA (wave64: two warps acting as one wave, platform.h's M2R_EMULATE_WAVE64). mma.h compiles its AMD fragment types,
// `load_lane` / `load_lane_t`, `acc_row` / `acc_col` unchanged for such a build (clang, which
// keeps ext_vector_type on NVPTX); only the `__builtin_amdgcn_wmma_*` calls are replaced by the
// functions below. Each computes, from the registers every lane holds, what the instruction
// computes: D = A x B + C, D and C 16x16 fp32, A (M x K) and B (K x N) 16x16 fp16 or bf16.
// Products of two 16-bit values are exact in fp32; they are summed in k order with fused
// multiply-adds onto C (the hardware's summation order is not documented; fp32 accumulation
// is what the ISA promises).
//
// Register layouts, wave32: AMD's "RDNA3 Instruction Set Architecture Reference Guide" and "AMD
// RDNA4 Instruction Set Architecture Reference Guide", the section "Wave Matrix Multiply
// Accumulate (WMMA)" of the vector ALU chapter and its matrix VGPR layout tables (the same
// mappings `--register-layout` of AMD's Matrix Instruction Calculator prints for RDNA3):
//   gfx11 v_wmma_f32_16x16x16_{f16,bf16} (w32): lane l holds A row l % 16 and B column l % 16,
//     all 16 k in 8 VGPRs (k = 2 v, 2 v + 1 in VGPR v); lanes 16-31 must hold the same values
//     as lanes 0-15 (the hardware reads one copy). D/C VGPR r of lane l: row 2 r + l / 16,
//     column l % 16.
//   gfx12 v_wmma_f32_16x16x16_{f16,bf16} (w32): lane l holds A row l % 16 and B column l % 16,
//     k 8 (l / 16) .. 8 (l / 16) + 7 in 4 VGPRs. D/C VGPR r of lane l: row r + 8 (l / 16),
//     column l % 16.
// In mma.h B is staged as N x K rows, so "B column n" is the fragment row n: D[m][n] =
// sum_k A[m][k] B[n][k] + C[m][n].
//
// gfx11's replication is checked: if a lane and its partner 16 lanes away hold different A or
// B registers, real hardware would silently use one copy, so the emulation traps (the kernel
// fails with an illegal-instruction error instead of returning a plausible number).
#pragma once

#if !(M2R_CUDA && (defined(M2R_EMULATE_GFX11) || defined(M2R_EMULATE_GFX12) || \
                   defined(M2R_EMULATE_GFX9)))
#error "mma_emu.h is for the NVIDIA emulation builds of gfx11 / gfx12 / gfx9 only"
#endif

namespace m2r {
namespace mma {
namespace emu {

typedef unsigned int u32x8 __attribute__((ext_vector_type(8)));
typedef unsigned int u32x4 __attribute__((ext_vector_type(4)));

// A 16-bit element (the low or high half of a 32-bit register) as fp32.
template <bool kBf16>
M2R_DEVICE float widen(unsigned int word, int high) {
  const unsigned int bits = high ? word >> 16 : word & 0xffffu;
  if constexpr (kBf16) return __uint_as_float(bits << 16);
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}

M2R_DEVICE unsigned int from_lane(unsigned int v, int src) {
  return __shfl_sync(0xffffffffu, v, src, 32);
}

// gfx11: a and b are this lane's 8 registers (16 k values) of A row / B column lane % 16.
template <bool kBf16, typename F>
M2R_DEVICE F wmma_gfx11(u32x8 a, u32x8 b, F c) {
  const int l = static_cast<int>(threadIdx.x % 32);
  bool same = true;
#pragma unroll
  for (int v = 0; v < 8; ++v) {
    same &= __shfl_xor_sync(0xffffffffu, a[v], 16, 32) == a[v];
    same &= __shfl_xor_sync(0xffffffffu, b[v], 16, 32) == b[v];
  }
  if (!__all_sync(0xffffffffu, same)) __trap();  // the half-waves disagree: see the header
  float bn[16];  // B column l % 16: this lane's own registers
#pragma unroll
  for (int v = 0; v < 8; ++v) {
    bn[2 * v] = widen<kBf16>(b[v], 0);
    bn[2 * v + 1] = widen<kBf16>(b[v], 1);
  }
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    const int m = 2 * r + l / 16;  // this lane's output row in VGPR r; A row m is in lane m
    float acc = c[r];
#pragma unroll
    for (int v = 0; v < 8; ++v) {
      const unsigned int w = from_lane(a[v], m);
      acc = fmaf(widen<kBf16>(w, 0), bn[2 * v], acc);
      acc = fmaf(widen<kBf16>(w, 1), bn[2 * v + 1], acc);
    }
    c[r] = acc;
  }
  return c;
}

// gfx12: a and b are this lane's 4 registers (k 8 (lane / 16) .. + 7) of A row / B column
// lane % 16; the other 8 k of each row are in the lane 16 away.
template <bool kBf16, typename F>
M2R_DEVICE F wmma_gfx12(u32x4 a, u32x4 b, F c) {
  const int l = static_cast<int>(threadIdx.x % 32), n = l % 16;
  float bn[16];  // B column n, k 0..15, from lanes n (k 0-7) and n + 16 (k 8-15)
#pragma unroll
  for (int half = 0; half < 2; ++half)
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const unsigned int w = from_lane(b[v], n + 16 * half);
      bn[8 * half + 2 * v] = widen<kBf16>(w, 0);
      bn[8 * half + 2 * v + 1] = widen<kBf16>(w, 1);
    }
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    const int m = r + 8 * (l / 16);  // this lane's output row in VGPR r
    float acc = c[r];
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        const unsigned int w = from_lane(a[v], m + 16 * half);
        acc = fmaf(widen<kBf16>(w, 0), bn[8 * half + 2 * v], acc);
        acc = fmaf(widen<kBf16>(w, 1), bn[8 * half + 2 * v + 1], acc);
      }
    c[r] = acc;
  }
  return c;
}

#ifdef M2R_EMULATE_GFX9
// gfx9 (CDNA2/3/4) v_mfma_f32_16x16x16f16 / v_mfma_f32_16x16x16bf16_1k, wave64 (AMD, "AMD
// Instinct MI200 / MI300 Instruction Set Architecture", the MFMA chapter's register layouts;
// `--register-layout` of the Matrix Instruction Calculator): lane l holds A row l % 16 and
// B column l % 16, k 4 (l / 16) .. + 3 in 2 VGPRs; D/C VGPR r of lane l: row 4 (l / 16) + r,
// column l % 16. The 64 lanes span two warps, so the operands are exchanged through shared
// memory between the wave's two barriers (platform.h: wave64::sync).
typedef unsigned int u32x2 __attribute__((ext_vector_type(2)));

template <bool kBf16, typename F>
M2R_DEVICE F mfma_gfx9(u32x2 a, u32x2 b, F c) {
  constexpr int kWaves = 4;  // (the matrix-core kernels' blocks: at most 256 threads)
  __shared__ u32x2 s_a[kWaves][64], s_b[kWaves][64];
  const int l = wave64::lane(), w = wave64::wave(), n = l % 16;
  wave64::sync();  // the previous step's readers are done
  s_a[w][l] = a;
  s_b[w][l] = b;
  wave64::sync();
  float bn[16];  // B column n: k 4 q .. 4 q + 3 from lane n + 16 q
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const u32x2 v = s_b[w][n + 16 * q];
    bn[4 * q] = widen<kBf16>(v[0], 0), bn[4 * q + 1] = widen<kBf16>(v[0], 1);
    bn[4 * q + 2] = widen<kBf16>(v[1], 0), bn[4 * q + 3] = widen<kBf16>(v[1], 1);
  }
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int m = 4 * (l / 16) + r;
    float acc = c[r];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const u32x2 v = s_a[w][m + 16 * q];
      acc = fmaf(widen<kBf16>(v[0], 0), bn[4 * q], acc);
      acc = fmaf(widen<kBf16>(v[0], 1), bn[4 * q + 1], acc);
      acc = fmaf(widen<kBf16>(v[1], 0), bn[4 * q + 2], acc);
      acc = fmaf(widen<kBf16>(v[1], 1), bn[4 * q + 3], acc);
    }
    c[r] = acc;
  }
  return c;
}
#endif

}  // namespace emu
}  // namespace mma
}  // namespace m2r
