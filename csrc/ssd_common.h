// Mamba2 SSD chunked scan, forward (mamba_chunk_scan_combined). Semantics and workspaces in
// params.h (SsdParams); the reference is mamba2_rocm/reference/ssd.py:ssd_chunked. Five stages,
// one source each (csrc/ssd_<stage>.hip; this header holds what two or more of them share):
//
//   1. chunk_cumsum  dt' = clamp(softplus?(dt + dt_bias)), its cumsum times A per chunk, and
//                    the seq_idx segments of each chunk;            grid (nchunks, head groups, b)
//   2. bmm           C·Bᵀ per chunk and group, lower-triangular 64x64 tiles only;
//                                                                   grid (chunks*g*tiles, 1, b)
//   3. chunk_state   each chunk's own final state: x^T (w ∘ B), w the decay to the chunk end;
//                    also, as a variant, the state after the last token of each varlen sequence;
//                                                                   grid (chunks*tiles*h, 1, b)
//   4. state_passing the state entering each chunk, a loop over chunks; writes final_states;
//                                                                   grid (p*n / 1024, h, b)
//      or 3+4 chained: chunk_state's blocks pass the states along the chunks themselves (Chain),
//                    where the GPU runs enough chains side by side (the host's choice)
//   5. chunk_scan    out = decayed C·(entering state) + (masked, decayed C·Bᵀ)·x + D x, then
//                    the z gate;                                    grid (chunks*tiles*h, 1, b)
//
// Every product is accumulated in fp32. Stages 2, 3 and 5 are tiled matrix products: operand
// slabs of 32 along the reduction dim go through LDS (k-major, padded), and each thread owns a
// register tile read with 16-byte LDS loads. LDS per workgroup stays under 32 KiB, well inside
// RDNA's 64 KiB. Positions past seqlen in the last chunk behave as dt' = 0 tokens and are never
// stored. Masked terms are selected away (never multiplied by 0), so workspace entries that are
#pragma once

// never written (C·Bᵀ above the diagonal) cannot leak NaN into a result.
#include "block_reduce.h"
#include "fma_tile.h"
#include "mma.h"
#include "platform.h"

#include <type_traits>  // std::conditional_t (compile time only)

namespace m2r {
namespace ssd {

constexpr int kThreads = 256;
constexpr int kSlab = kFmaSlab;     // reduction-dim slab staged in LDS (fma_tile.h)
constexpr int kPad = 4;             // LDS row padding (floats); keeps rows 16-byte aligned
constexpr int kHeadsPerCumsum = 8;  // heads per chunk_cumsum block
constexpr int kMaxChunk = 256;
constexpr int kStateBlocks = 3;     // chunk_state's blocks per multiprocessor (NVIDIA; kStateWavesM)
constexpr int kChainBlocks = 2;     // the same, chained (see Chain: at 3 the link spilled)
constexpr int kChainLdsBlocks = 3;  // the same, chained with the link through LDS (matrix cores)
constexpr int kStateP = 64;   // chunk_state's tile: headdim ...
constexpr int kStateN = 128;  // ... x dstate

// ---- shared pieces -------------------------------------------------------------------------

// Stage rows [row0, row0 + kRows) x cols [col0, col0 + kSlab) of a row-major global matrix
// (unit stride along cols) into LDS transposed: dst[col][row]. Out-of-range entries are 0.
// kNT: the block's threads.
template <typename T, int kRows, int kLd, int kNT = kThreads>
M2R_DEVICE void stage_transposed(float* dst, const typename T::storage* src, int row_stride,
                                 int row0, int rows, int col0, int cols) {
#pragma unroll 4  // more keeps every address live: 3x the registers
  for (int i = 0; i < kRows * kSlab / kNT; ++i) {
    const int idx = threadIdx.x + i * kNT;
    const int c = idx % kSlab, r = idx / kSlab;
    float v = 0.f;
    if (row0 + r < rows && col0 + c < cols) v = T::to_float(src[(row0 + r) * row_stride + col0 + c]);
    dst[c * kLd + r] = v;
  }
}

// Stage rows [row0, row0 + kSlab) x cols [col0, col0 + kCols) into LDS as they are:
// dst[row][col], times scale[row] when given. Out-of-range entries are 0.
template <typename T, int kCols, int kLd>
M2R_DEVICE void stage_rows(float* dst, const typename T::storage* src, int row_stride,
                           int row0, int rows, int col0, int cols, const float* scale) {
#pragma unroll 4  // more keeps every address live: 3x the registers
  for (int i = 0; i < kCols * kSlab / kThreads; ++i) {
    const int idx = threadIdx.x + i * kThreads;
    const int c = idx % kCols, r = idx / kCols;
    float v = 0.f;
    if (row0 + r < rows && col0 + c < cols) {
      v = T::to_float(src[(row0 + r) * row_stride + col0 + c]);
      if (scale) v *= scale[r];
    }
    dst[r * kLd + c] = v;
  }
}

// The first position of the chunk in segment `seg_end` (segments only grow along the chunk):
// the count of positions before it. A barrier for the whole block; chunk_size <= kThreads.
M2R_DEVICE int first_of_segment(const int32_t* seg, int seg_end, int chunk_size) {
  const int s = threadIdx.x;
  return __syncthreads_count(s < chunk_size && seg[s] < seg_end);
}

M2R_DEVICE int64_t chunk_row(const SsdParams& p, int b, int h, int c) {  // dt_out / dA_cs row
  return ((static_cast<int64_t>(b) * p.nheads + h) * p.nchunks + c) * p.chunk_size;
}

M2R_DEVICE int64_t states_at(const SsdParams& p, int b, int c, int h) {
  return ((static_cast<int64_t>(b) * p.nchunks + c) * p.nheads + h) * p.dstate * p.headdim;
}

// chunk_scan's block (both forms): heads fastest (the heads of a group, which read the same C
// rows and C·Bᵀ, run side by side), then the tiles of a chunk, then the chunks. A chunk's row
// tiles are taken last first: the tile of rows [t0, t0 + kRows) has (t0 + kRows) / kSlab slabs
// in the within-chunk product, so the longest blocks start first and the short ones fill the
// grid's tail (H200, profile_ssd, same bits: chunk_scan_mma 0.3-3.6% faster, 223.5 -> 215.5 us
// at Falcon-H1 b1 l8192; chunk_scan_fma in the gfx1030 emulation 0.2-1.7%). Not taken: every
// chunk's last tiles first, then the next-to-last ones (3-7% slower at calls of 8192 tokens and
// more, a chunk's blocks then apart), and two tiles a block, the last and the first (6-18%
// slower but at Falcon-H1 b1 l8192; 20-32 B spilled)
template <int kRows, int kCols>
struct ScanBlock {
  int h, g, b, c, t0, p0;
  M2R_DEVICE explicit ScanBlock(const SsdParams& p) {
    const int tiles_t = p.chunk_size / kRows, tiles = tiles_t * ((p.headdim + kCols - 1) / kCols);
    h = blockIdx.x % p.nheads, g = h / p.heads_per_group, b = blockIdx.z;
    const int tile = (blockIdx.x / p.nheads) % tiles;
    c = blockIdx.x / p.nheads / tiles;
    t0 = (tiles_t - 1 - tile % tiles_t) * kRows, p0 = (tile / tiles_t) * kCols;
  }
};

M2R_DEVICE int state_tiles(const SsdParams& p) {
  return ((p.headdim + kStateP - 1) / kStateP) * ((p.dstate + kStateN - 1) / kStateN);
}

// The state entering chunk 0 at (n, pp) of head h: initial_states, or 0
M2R_DEVICE float initial_state(const SsdParams& p, int b, int h, int n, int pp) {
  return p.initial_states ? load_as_float(p.initial_states, p.init_dtype,
                                          b * p.init_batch_stride + h * p.init_h_stride + pp * p.init_p_stride + n * p.init_n_stride)
                          : 0.f;
}

// The state passing's carry over chunk c: exp(dA_cs[c][last]) when the chunk's last token
// continues the segment of the token before the chunk, else -1 (a sequence began inside the
// chunk: the chunk's own state alone, selected, never 0 x state). The segment id and dA_cs are
// requested together: one round trip, not two.
M2R_DEVICE float chunk_carry(const SsdParams& p, int b, int h, int c) {
  const int last = p.chunk_size - 1;
  const int32_t sg = p.seg[(static_cast<int64_t>(b) * p.nchunks + c) * p.chunk_size + last];
  const float a = p.dA_cs[chunk_row(p, b, h, c) + last];
  return sg == 0 ? __expf(a) : -1.f;
}

// final_states (batch, nheads, headdim, dstate) at (n, pp) of head h, in state_dtype
M2R_DEVICE void store_final(const SsdParams& p, int b, int h, int n, int pp, float v) {
  store_as(p.final_states, p.state_dtype, ((static_cast<int64_t>(b) * p.nheads + h) * p.headdim + pp) * p.dstate + n, v);
}

// chunk_state's flag for "states[c] of this (batch, tile, head) is written" (see Chain)
M2R_DEVICE int* chain_flag(const SsdParams& p, int b, int c, int tile, int h) {
  return p.chain + 1 + ((static_cast<int64_t>(b) * p.nchunks + c) * state_tiles(p) + tile) * p.nheads + h;
}


// ---- matrix-core variants (fp16/bf16 where the target has matrix cores; see mma.h) -----------
// The same tiles, grids and semantics as the FMA variants above. Every operand is staged in
// LDS as 16-bit rows the way it lies in memory, 8 elements (16 bytes) per thread and load where
// the tensor is aligned for it, else element by element; an operand whose reduction dim is the
// sequence is then read k-major (mma::load_lane_t). The loops are software-pipelined: each
// thread loads its part of the next slab into registers (Rows16 / Rows32 fetch) right after
// the current slab reached LDS, so global latency overlaps the products instead of following
// them (the kernels were latency-bound at 2 blocks per SM). Operands computed in fp32 (the
// decay-weighted x, the entering states) are split into a part rounded to the input dtype and
// its rounded remainder, two products each: about 16 mantissa bits instead of bf16's 8, so
// states keep close to fp32 accuracy (mamba_ssm's Triton kernels round these operands once).
// chunk_scan's decay-weighted C·Bᵀ is rounded once, as Triton rounds it: issue #72's rule lets
// the forward round where its output error, in the output's dtype against the float64
// recurrence, stays at or below Triton's (`bench ssd-error`). Measured (H100, 2026-12-07):
// bf16 2.21-2.32e-3 against Triton's 2.33-2.44e-3 (split: 1.65-1.67e-3, the floor), fp16
// 2.77-2.87e-4 against 2.89-3.04e-4, in 8 of 8 cases each; chunk_scan 119.0 -> 108.6 us at
// b2 l4096 h32, 434.3 -> 405.1 at Nemotron-H b1 l8192 (bf16 1.3-7.9% under Triton's case by
// case). Rounding the entering state once too saved 5% more at bf16 2.29-2.35e-3, 0.4-3.7%
// under Triton's: level with it, no margin for other inputs, so the entering state stays split.
#if M2R_MMA != 0
constexpr int kWaves = kThreads / kWavefront;
constexpr int kLdH = kSlab + 8;  // [row][k] tiles with k = kSlab: rows 16-byte aligned
// fp32 output tiles staged in LDS for coalesced stores: 64 columns, rows padded to 72 floats
// (8 banks apart: the accumulators' 8-byte stores, 4 rows at a time, do not conflict)
constexpr int kLdO = 64 + 8;

// A block tile's accumulator rows [64 half, 64 half + 64) into O ([row - 64 half][kLd], fp32)
template <typename Tile, int kLd = kLdO>
M2R_DEVICE void stage_half(const Tile& tile, float* O, int half) {
#pragma unroll
  for (int i = 0; i < Tile::kFm; ++i) {
    if ((tile.m0 + 16 * i) / 64 != half) continue;  // uniform over the fragment
#pragma unroll
    for (int j = 0; j < Tile::kFn; ++j)
#pragma unroll
      for (int r = 0; r < mma::kAccRegs; ++r) O[(tile.row(i, r) - 64 * half) * kLd + tile.col(j, r)] = tile.acc[i][j].v[r];
  }
}

// Build knobs (measurement only): M2R_SSD_SPLIT_SCAN = 1 splits chunk_scan's within-chunk
// weights (C·Bᵀ, decay, dt) as it splits the other fp32-computed operands (half the products
// again, the output at the rounding floor); M2R_SSD_SPLIT_SCAN_ENTER / M2R_SSD_SPLIT_STATE = 0
// round chunk_scan's entering state / chunk_state's decay-weighted x once, as mamba_ssm's Triton
// kernels do, so that each rounding's cost and error can be measured alone.
#ifndef M2R_SSD_SPLIT_SCAN
#define M2R_SSD_SPLIT_SCAN 0
#endif
#ifndef M2R_SSD_SPLIT_SCAN_ENTER
#define M2R_SSD_SPLIT_SCAN_ENTER 1
#endif
#ifndef M2R_SSD_SPLIT_STATE
#define M2R_SSD_SPLIT_STATE 1
#endif
constexpr bool kSplitScan = M2R_SSD_SPLIT_SCAN != 0, kSplitEnter = M2R_SSD_SPLIT_SCAN_ENTER != 0,
               kSplitState = M2R_SSD_SPLIT_STATE != 0;

template <int kCols>
struct KMajor {  // a [kSlab][kCols] tile: rows 16-byte aligned, ldmatrix conflict-free
  static constexpr int kLd = kCols + 8, kSize = kSlab * kLd;
};

// v rounded to T at hi[0..kN); kSplit: the rounding remainder, rounded to T, at lo[0..kN)
// (hi + lo carries about 16 mantissa bits). kN = 4 or 8, both pointers kN * 2-byte aligned.
template <typename T, bool kSplit, int kN>
M2R_DEVICE void store_split(uint16_t* hi, uint16_t* lo, float (&v)[kN]) {
  static_assert(kN == 4 || kN == 8, "4 or 8 values");
  uint32_t w[kN / 2];
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) w[i] = T::pack(v + 2 * i);
  if constexpr (kN == 4) *reinterpret_cast<uint2*>(hi) = make_uint2(w[0], w[1]);
  else *reinterpret_cast<uint4*>(hi) = make_uint4(w[0], w[1], w[2], w[3]);
  if constexpr (kSplit) {
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) {
      float h[2];
      T::unpack(w[i], h);
      v[2 * i] -= h[0], v[2 * i + 1] -= h[1];
      w[i] = T::pack(v + 2 * i);
    }
    if constexpr (kN == 4) *reinterpret_cast<uint2*>(lo) = make_uint2(w[0], w[1]);
    else *reinterpret_cast<uint4*>(lo) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

M2R_DEVICE bool aligned(const void* p, int64_t row_stride_bytes, int bytes) {
  return ((reinterpret_cast<uintptr_t>(p) | static_cast<uintptr_t>(row_stride_bytes)) % bytes) == 0;
}

// A kRows x kCols operand tile on its way from global memory to LDS, kVec consecutive elements
// per thread and load. fetch() loads this thread's part into registers, put()
// (or the kernel, from q) stores it: kernels fetch the next slab before they multiply the
// current one, so global latency overlaps the matrix-core work (software pipelining).
template <int kRows, int kCols, int kVec, int kNT = kThreads>
struct Fetch {
  static constexpr int kPerRow = kCols / kVec, kStep = kNT / kPerRow, kN = kRows / kStep;
  static_assert(kNT % kPerRow == 0 && kN >= 1 && kN * kStep == kRows, "tile does not split over the block");
  static M2R_DEVICE int col() { return kVec * (static_cast<int>(threadIdx.x) % kPerRow); }
  static M2R_DEVICE int row(int i) { return static_cast<int>(threadIdx.x) / kPerRow + i * kStep; }
};

// 16-bit rows, 8 per load: rows [0, rows) x columns [0, cols) of src (row stride ld elements)
// are read, the rest is 0; vec: src and ld allow 16-byte loads.
template <int kRows, int kCols, int kNT = kThreads>
struct Rows16 : Fetch<kRows, kCols, 8, kNT> {
  typedef Fetch<kRows, kCols, 8, kNT> F;
  uint4 q[F::kN];
  M2R_DEVICE void fetch(const uint16_t* src, int ld, int rows, int cols, bool vec) {
    if (vec && rows >= kRows && cols >= kCols) {  // uniform over the block: no checks
#pragma unroll
      for (int i = 0; i < F::kN; ++i) q[i] = *reinterpret_cast<const uint4*>(src + F::row(i) * ld + F::col());
    } else {
#pragma unroll
      for (int i = 0; i < F::kN; ++i) q[i] = load8(src + F::row(i) * ld, F::col(), F::row(i) < rows ? cols : 0, vec);
    }
  }
  M2R_DEVICE void put(uint16_t* dst, int ld) const {
#pragma unroll
    for (int i = 0; i < F::kN; ++i) *reinterpret_cast<uint4*>(dst + F::row(i) * ld + F::col()) = q[i];
  }
  // put, with non-finite values stored as 0 and marked in `bad` at row0 + row
  template <typename T, typename Marks>
  M2R_DEVICE void put_finite(uint16_t* dst, int ld, Marks& bad, int row0) {
#pragma unroll
    for (int i = 0; i < F::kN; ++i) {
      uint4 v = q[i];
      // one test for the 8 values first: the zeroing and marks below cost three times as many
      // instructions, and x is finite almost always
      if ((nonfinite_top2<T>(v.x) | nonfinite_top2<T>(v.y) | nonfinite_top2<T>(v.z) | nonfinite_top2<T>(v.w)) == 0u) {
        *reinterpret_cast<uint4*>(dst + F::row(i) * ld + F::col()) = v;
        continue;
      }
      uint32_t b0, b1, b2, b3;
      v.x = zero_nonfinite2<T>(v.x, b0), v.y = zero_nonfinite2<T>(v.y, b1);
      v.z = zero_nonfinite2<T>(v.z, b2), v.w = zero_nonfinite2<T>(v.w, b3);
      const uint32_t bits = b0 | b1 << 2 | b2 << 4 | b3 << 6;
      if (bits) bad.mark(row0 + F::row(i), F::col(), bits);
      *reinterpret_cast<uint4*>(dst + F::row(i) * ld + F::col()) = v;
    }
  }
};

// fp32 rows, 4 per load, as Rows16; vec: 16-byte loads allowed.
template <int kRows, int kCols, int kNT = kThreads>
struct Rows32 : Fetch<kRows, kCols, 4, kNT> {
  typedef Fetch<kRows, kCols, 4, kNT> F;
  float4 q[F::kN];
  M2R_DEVICE void fetch(const float* src, int ld, int rows, int cols, bool vec) {
    if (vec && rows >= kRows && cols >= kCols) {
#pragma unroll
      for (int i = 0; i < F::kN; ++i) q[i] = *reinterpret_cast<const float4*>(src + F::row(i) * ld + F::col());
    } else {
#pragma unroll
      for (int i = 0; i < F::kN; ++i) {
        const int r = F::row(i), c = F::col();
        const float* s = src + r * ld + c;
        const bool in = r < rows;
        if (in && vec && c + 3 < cols) {
          q[i] = *reinterpret_cast<const float4*>(s);
        } else {
          q[i].x = in && c < cols ? s[0] : 0.f;
          q[i].y = in && c + 1 < cols ? s[1] : 0.f;
          q[i].z = in && c + 2 < cols ? s[2] : 0.f;
          q[i].w = in && c + 3 < cols ? s[3] : 0.f;
        }
      }
    }
  }
  // rounded to T at hi, the rounding remainder at lo (tiles with row stride ld)
  template <typename T, bool kSplit>
  M2R_DEVICE void put_split(uint16_t* hi, uint16_t* lo, int ld) const {
#pragma unroll
    for (int i = 0; i < F::kN; ++i) {
      float v[4] = {q[i].x, q[i].y, q[i].z, q[i].w};
      const int o = F::row(i) * ld + F::col();
      store_split<T, kSplit>(hi + o, lo + o, v);
    }
  }
};
#endif

}  // namespace ssd
}  // namespace m2r
