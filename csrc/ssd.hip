// Mamba2 SSD chunked scan, forward (mamba_chunk_scan_combined). Semantics and workspaces in
// params.h (SsdParams); the reference is mamba2_rocm/reference/ssd.py:ssd_chunked. Five stages:
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

// ---- 1. chunk cumsum ----------------------------------------------------------------------

// A wavefront per head: lane j owns the run of kCumsumPer tokens from j * kCumsumPer, loads them
// together and sums them in order; one shuffle scan joins the runs (wave_runs_segmented_scan).
// The block's waves share its kHeadsPerCumsum heads. Where the block's heads' 16-bit dt lie as
// one aligned 16-byte run per token (unit head stride, as a Mamba2 block passes dt), each
// thread loads one token's run and the runs go to the waves through LDS (one barrier): one
// 16-byte load per token instead of one 2-byte gather per token and head, where ncu had the
// kernel's largest stall.
constexpr int kCumsumPer = kMaxChunk / kWavefront;
static_assert(kHeadsPerCumsum == 8 && kThreads >= kMaxChunk, "a thread's token run: 8 heads of 16-bit dt");

M2R_DEVICE void chunk_cumsum(const SsdParams& p) {
  __shared__ float dt_runs[kHeadsPerCumsum][kMaxChunk];  // [head - h0][token]
  const int lane = static_cast<int>(threadIdx.x) % kWavefront, wave = static_cast<int>(threadIdx.x) / kWavefront;
  const int c = blockIdx.x, b = blockIdx.z, t0 = lane * kCumsumPer, h0 = blockIdx.y * kHeadsPerCumsum;
  const int64_t pos0 = static_cast<int64_t>(c) * p.chunk_size + t0;
  const uint16_t* dt_run = static_cast<const uint16_t*>(p.dt) + b * p.dt_batch_stride + h0;
  const bool runs = p.dt_dtype != M2R_DTYPE_F32 && p.dt_h_stride == 1 && h0 + kHeadsPerCumsum <= p.nheads &&
                    p.dt_l_stride % 8 == 0 && reinterpret_cast<uintptr_t>(dt_run) % 16 == 0;
  const int s_own = static_cast<int>(threadIdx.x);  // this thread's token of the runs
  const bool own = runs && s_own < p.chunk_size && static_cast<int64_t>(c) * p.chunk_size + s_own < p.seqlen;
  const uint4 run = own ? *reinterpret_cast<const uint4*>(dt_run + (static_cast<int64_t>(c) * p.chunk_size + s_own) * p.dt_l_stride)
                        : make_uint4(0u, 0u, 0u, 0u);
  bool valid[kCumsumPer], start[kCumsumPer];
  float change[kCumsumPer];  // seq_idx changes at this token (from the implicit id 0 before token 0)
#pragma unroll
  for (int e = 0; e < kCumsumPer; ++e) {
    valid[e] = t0 + e < p.chunk_size && pos0 + e < p.seqlen;
    change[e] = 0.f;
  }
  if (p.seq_idx) {
    const int32_t* row = p.seq_idx + b * p.seq_idx_batch_stride;
    int32_t prev = pos0 == 0 || !valid[0] ? 0 : row[(pos0 - 1) * p.seq_idx_l_stride];
#pragma unroll
    for (int e = 0; e < kCumsumPer; ++e) {
      const int32_t id = valid[e] ? row[(pos0 + e) * p.seq_idx_l_stride] : prev;
      change[e] = valid[e] && id != prev ? 1.f : 0.f;
      prev = id;
    }
  }
#pragma unroll
  for (int e = 0; e < kCumsumPer; ++e) start[e] = t0 + e > 0 && change[e] != 0.f;

  // chunk_state's chain (which runs two kernels later): the ticket counter, and the flags of this
  // chunk and block of heads
  if (p.chain) {
    for (int i = threadIdx.x; i < state_tiles(p) * kHeadsPerCumsum; i += kThreads) {
      const int h = blockIdx.y * kHeadsPerCumsum + i % kHeadsPerCumsum;
      if (h < p.nheads) *chain_flag(p, b, c, i / kHeadsPerCumsum, h) = 0;
    }
    if (c == 0 && b == 0 && blockIdx.y == 0 && threadIdx.x == 0) p.chain[0] = 0;
  }

  if (blockIdx.y == 0 && wave == 0) {  // segments: changes of seq_idx since the token before the chunk
    const bool none[kCumsumPer] = {};
    wave_runs_segmented_scan(change, none);
    int32_t* seg = p.seg + (static_cast<int64_t>(b) * p.nchunks + c) * p.chunk_size + t0;
#pragma unroll
    for (int e = 0; e < kCumsumPer; ++e)
      if (t0 + e < p.chunk_size) seg[e] = static_cast<int32_t>(change[e]);
  }
  // this wave's heads' dt_bias and A, requested before the barrier (not a round trip after it)
  constexpr int kWavesCs = kThreads / kWavefront, kPerWave = (kHeadsPerCumsum + kWavesCs - 1) / kWavesCs;
  float bias_w[kPerWave], a_w[kPerWave];
#pragma unroll
  for (int k = 0; k < kPerWave; ++k) {
    const int h = min(h0 + wave + k * kWavesCs, p.nheads - 1);  // (heads past nheads: unused)
    bias_w[k] = p.dt_bias ? load_as_float(p.dt_bias, p.dt_bias_dtype, h * p.dt_bias_stride) : 0.f;
    a_w[k] = load_as_float(p.A, p.a_dtype, h * p.A_stride);
  }
  if (runs) {
    if (s_own < p.chunk_size) {
      const uint32_t w[4] = {run.x, run.y, run.z, run.w};
#pragma unroll
      for (int j = 0; j < kHeadsPerCumsum / 2; ++j) {
        const float2 v = p.dt_dtype == M2R_DTYPE_F16 ? fp16x2_to_float2(w[j]) : bf16x2_to_float2(w[j]);
        dt_runs[2 * j][s_own] = v.x;
        dt_runs[2 * j + 1][s_own] = v.y;
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int k = 0; k < kPerWave; ++k) {
    const int i = wave + k * kWavesCs, h = h0 + i;
    if (i >= kHeadsPerCumsum || h >= p.nheads) break;  // uniform over the wave
    float d[kCumsumPer], cum[kCumsumPer];
    if (runs) {
#pragma unroll
      for (int e = 0; e < kCumsumPer; ++e) d[e] = valid[e] ? dt_runs[i][t0 + e] : 0.f;
    } else {
      load_as_float_n(p.dt, p.dt_dtype, b * p.dt_batch_stride + pos0 * p.dt_l_stride + h * p.dt_h_stride, p.dt_l_stride, valid, d);
    }
    const float bias = bias_w[k], a = a_w[k];
#pragma unroll
    for (int e = 0; e < kCumsumPer; ++e) {
      if (valid[e]) {
        d[e] += bias;
        if (p.dt_softplus) d[e] = softplus(d[e]);
        // fminf/fmaxf return the other operand for a NaN: clamp only numbers, so a NaN dt
        // stays NaN (contained to its sequence by the scan) instead of vanishing
        if (!isnan(d[e])) d[e] = fminf(fmaxf(d[e], p.dt_min), p.dt_max);
      }
      cum[e] = d[e] * a;
    }
    // dA_cs restarts at every sequence start inside the chunk (its readers only take
    // differences within a segment, and the first segment's values from the chunk start)
    wave_runs_segmented_scan(cum, start);
    const int64_t o = chunk_row(p, b, h, c) + t0;
    if (t0 + kCumsumPer <= p.chunk_size) {  // chunk rows are 16-byte aligned (chunk_size % 16 == 0)
#pragma unroll
      for (int e = 0; e < kCumsumPer; e += 4) {
        *reinterpret_cast<float4*>(p.dt_out + o + e) = make_float4(d[e], d[e + 1], d[e + 2], d[e + 3]);
        *reinterpret_cast<float4*>(p.dA_cs + o + e) = make_float4(cum[e], cum[e + 1], cum[e + 2], cum[e + 3]);
      }
    }
  }
}

// ---- 2. C·Bᵀ --------------------------------------------------------------------------------

template <typename T>
M2R_DEVICE void bmm_fma(const SsdParams& p) {
  typedef typename T::storage S;
  constexpr int kLd = 64 + kPad;
  __shared__ __align__(16) float Bs[kSlab * kLd];
  __shared__ __align__(16) float Cs[kSlab * kLd];
  // blockIdx.x: (chunk, group) major, then the lower-triangular tile pairs (ts <= tt)
  const int tiles = p.chunk_size / 64, pairs = tiles * (tiles + 1) / 2;
  int tt = 0, rem = blockIdx.x % pairs;
  while (rem > tt) rem -= ++tt;
  const int ts = rem;
  const int cg = blockIdx.x / pairs, c = cg / p.ngroups, g = cg % p.ngroups, b = blockIdx.z;
  const int64_t l0 = static_cast<int64_t>(c) * p.chunk_size;
  const int rows = static_cast<int>(min(static_cast<int64_t>(p.chunk_size), p.seqlen - l0));
  const S* Bp = static_cast<const S*>(p.B) + b * p.B_batch_stride + l0 * p.B_l_stride + g * p.B_g_stride;
  const S* Cp = static_cast<const S*>(p.C) + b * p.C_batch_stride + l0 * p.C_l_stride + g * p.C_g_stride;
  const int s_off = 4 * (threadIdx.x / 16), t_off = 4 * (threadIdx.x % 16);

  float acc[4][4] = {};
  for (int n0 = 0; n0 < p.dstate; n0 += kSlab) {
    stage_transposed<T, 64, kLd>(Bs, Bp, p.B_l_stride, ts * 64, rows, n0, p.dstate);
    stage_transposed<T, 64, kLd>(Cs, Cp, p.C_l_stride, tt * 64, rows, n0, p.dstate);
    __syncthreads();
    slab_product<1, 1, kLd, kLd>(acc, Bs, Cs, s_off, t_off);
    __syncthreads();
  }
  const int64_t cs = p.chunk_size;
  float* out = p.cb + ((static_cast<int64_t>(b) * p.nchunks + c) * p.ngroups + g) * cs * cs;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int s = ts * 64 + s_off + i, t = tt * 64 + t_off;
    *reinterpret_cast<float4*>(out + s * cs + t) = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
  }
}

// ---- 3. chunk states ------------------------------------------------------------------------

// chunk_state's weights: w[s] = exp(dA_cs[end] - dA_cs[s]) dt[s] for the positions s <= end of
// end's segment, 0 elsewhere; and `first`, where that segment starts in the chunk (tokens before
// it belong to earlier sequences: never read, since 0 x NaN would be NaN). A block barrier.
struct ChunkWeights {
  float a_end;
  int seg_end, first;
};
M2R_DEVICE ChunkWeights chunk_weights(const SsdParams& p, int b, int h, int c, int end, float* w) {
  const float* acs = p.dA_cs + chunk_row(p, b, h, c);
  const float* dts = p.dt_out + chunk_row(p, b, h, c);
  const int32_t* seg = p.seg + (static_cast<int64_t>(b) * p.nchunks + c) * p.chunk_size;
  const float a_end = acs[end];
  const int seg_end = seg[end];
  for (int s = threadIdx.x; s < p.chunk_size; s += kThreads) {
    // acs and dts read with seg whatever the segment: one memory round trip, not two
    const float as = load_now(acs + s), ds = load_now(dts + s);
    w[s] = s <= end && seg[s] == seg_end ? __expf(a_end - as) * ds : 0.f;
  }
  return {a_end, seg_end, first_of_segment(seg, seg_end, p.chunk_size)};
}

// The state passing, chained into chunk_state. The block of chunk c (one batch, tile, head)
// computes chunk c's own state: then it waits until the block of chunk c - 1 has written
// states[c], the state entering chunk c, writes states[c + 1] = carry_c states[c] + own_c and
// flags it for the block of chunk c + 1. carry_c = exp(dA_cs[c][last]) when the chunk's last
// token continues the segment of the token before the chunk, else the own state alone is taken
// (a sequence began inside the chunk; selected, never 0 x state). Chunk 0 writes states[0] (the
// initial states, or 0), the last chunk final_states. The own states never go through memory
// (stage 4 reads them back and writes the entering states: a third of the SSD's memory traffic at
// Falcon-H1's shapes), but each chain is a sequence of dependent links of a few µs: the host takes
// this form only where enough chains run side by side to hide them. Blocks take their (chunk, batch,
// tile, head) from an atomic ticket, chunk-major (heads fastest: a group's heads read the same B
// rows side by side), so a block only waits on one that started before it, whatever order the
// hardware dispatches the grid in. The link takes one of two forms (the host picks, by the chains
// per multiprocessor): from the accumulators where they are (one round trip a link; 2 blocks per
// multiprocessor on NVIDIA, the registers beside the accumulators), or through LDS, 64 rows at a
// time (two round trips; 3 blocks: better where many short chains run, worse on long ones).
struct StateBlock {
  int b, c, h, tile;
  M2R_DEVICE int p0(const SsdParams& p) const { return tile / ((p.dstate + kStateN - 1) / kStateN) * kStateP; }
  M2R_DEVICE int n0(const SsdParams& p) const { return tile % ((p.dstate + kStateN - 1) / kStateN) * kStateN; }
};
// The block's ticket, kept in LDS: the kernels decode it again after their products (a volatile
// read), instead of holding its four fields in registers through them (NVIDIA spilled).
M2R_DEVICE int take_ticket(const SsdParams& p, int* slot) {
  if (threadIdx.x == 0) *slot = atomicAdd(p.chain, 1);
  __syncthreads();
  return *static_cast<volatile int*>(slot);
}
// U: the divisions' type. unsigned (every term is non-negative) takes about half the
// instructions of int's division by a run-time value; the register link's kernels and the FMA
// path's one link form take it (the matrix cores' LDS-link kernel, held to 80 registers, spilled
// with it and keeps int)
template <typename U = int>
M2R_DEVICE StateBlock state_block(const SsdParams& p, int ticket) {
  const U tiles = state_tiles(p), heads = p.nheads, per_chunk = p.batch * tiles * heads;
  const U t = ticket, c = t / per_chunk, r = t % per_chunk;
  return {static_cast<int>(r / (tiles * heads)), static_cast<int>(c), static_cast<int>(r % heads),
          static_cast<int>(r / heads % tiles)};
}

// A chunk_state block's (batch, chunk, head, tile) and the last position `end` it sums up to.
// kVarlen: sequence blockIdx.x / (tiles * nheads)'s last token (cu_seqlens); kChain: from the
// ticket (taken into *ticket, in LDS); else the grid's, heads fastest (the heads of a group,
// which read the same B rows, run side by side).
template <bool kVarlen, bool kChain, typename U = int>
M2R_DEVICE StateBlock chunk_state_block(const SsdParams& p, int* ticket, int& end) {
  const int tiles = state_tiles(p), h = blockIdx.x % p.nheads, tile = blockIdx.x / p.nheads % tiles;
  const int item = blockIdx.x / p.nheads / tiles;
  end = p.chunk_size - 1;
  if constexpr (kVarlen) {
    const int last = p.cu_seqlens[item + 1] - 1;
    end = last % p.chunk_size;
    return {0, last / p.chunk_size, h, tile};
  } else if constexpr (kChain) {
    return state_block<U>(p, take_ticket(p, ticket));
  } else {
    return {static_cast<int>(blockIdx.z), item, h, tile};
  }
}

// states[0]'s (p0, n0) tile of head h: the initial states, or 0 (a chained block of chunk 0)
M2R_DEVICE void write_initial_tile(const SsdParams& p, int b, int h, int p0, int n0) {
  float* in = p.states + states_at(p, b, 0, h);
  const int pcols = min(kStateP, p.headdim - p0), ncols = min(kStateN, p.dstate - n0);
  for (int o = threadIdx.x; o < pcols * ncols; o += kThreads) {
    const int pp = p0 + o % pcols, n = n0 + o / pcols;
    in[static_cast<int64_t>(n) * p.headdim + pp] = initial_state(p, b, h, n, pp);
  }
}

struct Chain {
  int b, c, h, p0, n0;
  float carry;  // chunk_carry: < 0, the chunk's own state alone
  float* in;    // states[c] of the head
  int* flag;    // states[c]'s flag (written by chunk c - 1's block; unused for chunk 0)

  M2R_DEVICE bool last(const SsdParams& p) const { return c + 1 == p.nchunks; }
  // states[c + 1] of the head (not the last chunk), and its flag: one chunk on
  M2R_DEVICE float* next(const SsdParams& p) const { return in + static_cast<int64_t>(p.nheads) * p.dstate * p.headdim; }
  M2R_DEVICE int* next_flag(const SsdParams& p) const { return flag + state_tiles(p) * p.nheads; }
  // block-wide: states[c] is written (by the block of chunk c - 1; chunk 0: by this block,
  // write_initial_tile), and this block may read it
  M2R_DEVICE void wait() const {
    if (c > 0) return flag_wait(flag);
    __syncthreads();  // (global memory too, within the block)
  }
  M2R_DEVICE void publish(const SsdParams& p) const {  // block-wide: states[c + 1] is written
    if (!last(p)) flag_publish(next_flag(p));
  }
  M2R_DEVICE float step(float entering, float own) const { return carry < 0.f ? own : fmaf(carry, entering, own); }
};
// The link of chunk_state block sb (chained), whose chunk carries the state by `carry`. Fields
// and not pointers where they can be derived: the kernels hold these beside their accumulators
M2R_DEVICE Chain chain_of(const SsdParams& p, const StateBlock& sb, float carry) {
  return {sb.b, sb.c, sb.h, sb.p0(p), sb.n0(p), carry, p.states + states_at(p, sb.b, sb.c, sb.h),
          chain_flag(p, sb.b, sb.c, sb.tile, sb.h)};
}

// A (headdim-tile 64) x (dstate-tile 128) block of one chunk's state, summed over the chunk's
// positions up to `end` that share its segment, each weighted by exp(dA_cs[end] - dA_cs[s]) dt[s];
// kChain: then the state passing's step (Chain). kVarlen: the state right after the last token of
// sequence blockIdx.x / tiles (cu_seqlens), which adds the state entering that chunk and is
// written (headdim, dstate) in state_dtype.
template <typename T, bool kVarlen, bool kChain>
M2R_DEVICE void chunk_state_fma(const SsdParams& p) {
  typedef typename T::storage S;
  constexpr int kLdX = 64 + kPad, kLdB = 128 + kPad;
  __shared__ __align__(16) float Xs[kSlab * kLdX];
  __shared__ __align__(16) float Bs[kSlab * kLdB];
  __shared__ float w[kMaxChunk];
  const int item = blockIdx.x / p.nheads / state_tiles(p);  // kVarlen: the sequence
  __shared__ int ticket;
  int end;
  const StateBlock sb = chunk_state_block<kVarlen, kChain, unsigned>(p, &ticket, end);
  const int b = sb.b, c = sb.c, h = sb.h, g = h / p.heads_per_group, p0 = sb.p0(p), n0 = sb.n0(p);
  const int64_t l0 = static_cast<int64_t>(c) * p.chunk_size;
  const int rows = static_cast<int>(min(static_cast<int64_t>(end + 1), p.seqlen - l0));
  const ChunkWeights cw = chunk_weights(p, b, h, c, end, w);
  const float a_end = cw.a_end;
  const int seg_end = cw.seg_end, first = cw.first;

  const S* xp = static_cast<const S*>(p.x) + b * p.x_batch_stride + l0 * p.x_l_stride + h * p.x_h_stride;
  const S* Bp = static_cast<const S*>(p.B) + b * p.B_batch_stride + l0 * p.B_l_stride + g * p.B_g_stride;
  const int p_off = 4 * (threadIdx.x / 16), n_off = 4 * (threadIdx.x % 16);
  float acc[4][8] = {};
  for (int s0 = first; s0 < rows; s0 += kSlab) {
    stage_rows<T, 64, kLdX>(Xs, xp + s0 * p.x_l_stride, p.x_l_stride, 0, rows - s0, p0, p.headdim, nullptr);
    stage_rows<T, 128, kLdB>(Bs, Bp + s0 * p.B_l_stride, p.B_l_stride, 0, rows - s0, n0, p.dstate, w + s0);
    __syncthreads();
    slab_product<1, 2, kLdX, kLdB>(acc, Xs, Bs, p_off, n_off);
    __syncthreads();
  }

  if constexpr (kVarlen) {
    const float* entering = p.states + states_at(p, b, c, h);
    const bool carries = seg_end == 0;  // the sequence began before this chunk
    const float carry = __expf(a_end);
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int pp = p0 + p_off + i, n = n0 + n_off + (j % 4) + 64 * (j / 4);
        if (pp >= p.headdim || n >= p.dstate) continue;
        const float v = carries ? fmaf(carry, entering[static_cast<int64_t>(n) * p.headdim + pp], acc[i][j]) : acc[i][j];
        store_as(p.varlen_states, p.state_dtype, ((static_cast<int64_t>(item) * p.nheads + h) * p.headdim + pp) * p.dstate + n, v);
      }
  } else if constexpr (!kChain) {
    float* out = p.states + states_at(p, b, c, h);
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int pp = p0 + p_off + i, n = n0 + n_off + (j % 4) + 64 * (j / 4);
        if (pp < p.headdim && n < p.dstate) out[static_cast<int64_t>(n) * p.headdim + pp] = acc[i][j];
      }
  } else {
    // decoded again from the ticket, the carry read from global memory, instead of holding
    // these through the products (chunk_state spilled on NVIDIA)
    const StateBlock sc = state_block<unsigned>(p, *static_cast<volatile int*>(&ticket));
    const Chain ch = chain_of(p, sc, chunk_carry(p, sc.b, sc.h, sc.c));
    if (ch.c == 0) write_initial_tile(p, ch.b, ch.h, ch.p0, ch.n0);
    ch.wait();
    float e[4][8];  // all loads before the first store (which they could alias): one round trip
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int pp = ch.p0 + p_off + i, n = ch.n0 + n_off + (j % 4) + 64 * (j / 4);
        e[i][j] = pp < p.headdim && n < p.dstate ? load_fresh<float>(ch.in + static_cast<int64_t>(n) * p.headdim + pp) : 0.f;
      }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int pp = ch.p0 + p_off + i, n = ch.n0 + n_off + (j % 4) + 64 * (j / 4);
        if (pp >= p.headdim || n >= p.dstate) continue;
        const float v = ch.step(e[i][j], acc[i][j]);
        if (!ch.last(p)) ch.next(p)[static_cast<int64_t>(n) * p.headdim + pp] = v;
        else if (p.final_states) store_final(p, ch.b, ch.h, n, pp, v);
      }
    ch.publish(p);
  }
}

// ---- 4. state passing -----------------------------------------------------------------------

// kPassVec (n, p) elements of a head's state per thread: entering[c] = state; state = carry_c
// state + own_c, with carry_c = exp(dA_cs[c][last]) when the chunk's last token continues the
// segment of the token before the chunk, else 0 (a sequence started inside the chunk). The
// carries of up to kThreads chunks at a time come through LDS, and each chunk's own state is
// loaded kPassAhead chunks ahead (one 16-byte load when p * n allows), so the loop's chain of
// dependent steps does not wait on memory.
// H200, scripts/profile_ssd.py: 8 elements a thread (768 blocks at mamba2-130m b8 l512, not 1536)
// were slower, 2 or 4 chunks ahead: 9.7 -> 11.6 us there, 12.8 -> 18.1 at 130m b4 l2048.
constexpr int kPassVec = 4;
// H100, state_passing us, before -> 4 chunks ahead with one 16-byte store (below): b1 l16384
// h64 g8 98.2 -> 96.0, b2 l4096 h32 23.0 -> 20.7, Nemotron-H b1 l8192 198.4 -> 192.5. 8 ahead
// held 68 registers (3 blocks per multiprocessor, not 4) and ran slower than either.
constexpr int kPassAhead = 4;
static_assert(kThreads % kPassAhead == 0, "a block of carries holds whole rounds of the ring");

struct PassVec {
  float v[kPassVec];
};

M2R_DEVICE PassVec pass_load(const float* at, int64_t valid, bool vec) {  // valid: elements in range
  PassVec r;
  if (vec && valid >= kPassVec) {
    const float4 q = *reinterpret_cast<const float4*>(at);
    r.v[0] = q.x, r.v[1] = q.y, r.v[2] = q.z, r.v[3] = q.w;
  } else {
#pragma unroll
    for (int v = 0; v < kPassVec; ++v) r.v[v] = v < valid ? at[v] : 0.f;
  }
  return r;
}

M2R_DEVICE void state_passing(const SsdParams& p) {
  __shared__ float carry[kThreads];
  const int h = blockIdx.y, b = blockIdx.z;
  const int64_t pn = static_cast<int64_t>(p.headdim) * p.dstate;
  const int64_t e0 = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * kPassVec;
  const int64_t chunk_stride = static_cast<int64_t>(p.nheads) * pn, valid = pn - e0;
  const bool vec = pn % kPassVec == 0;  // then e0 and every chunk's block are 16-byte aligned
  float* base = p.states + states_at(p, b, 0, h) + e0;
  PassVec s = {};
  if (p.initial_states) {  // (n, pp) of the thread's first element: one division, not one each
    const int hd = p.headdim, e_first = static_cast<int>(e0);  // pn: at most 128 x MAX_DSTATE
    int n = e_first / hd, pp = e_first - n * hd;
#pragma unroll
    for (int v = 0; v < kPassVec; ++v, ++pp) {
      if (pp == hd) ++n, pp = 0;
      if (v < valid) s.v[v] = initial_state(p, b, h, n, pp);
    }
  }
  // a ring of own states: chunk c's in own[c % kPassAhead], loaded kPassAhead chunks before its
  // step (2 ahead left the loop waiting on the loads)
  PassVec own[kPassAhead];
#pragma unroll
  for (int j = 0; j < kPassAhead; ++j) own[j] = j < p.nchunks ? pass_load(base + j * chunk_stride, valid, vec) : PassVec{};
  for (int c0 = 0; c0 < p.nchunks; c0 += kThreads) {
    __syncthreads();
    const int cc = c0 + threadIdx.x;
    if (cc < p.nchunks) carry[threadIdx.x] = chunk_carry(p, b, h, cc);
    __syncthreads();
    const int count = min(kThreads, p.nchunks - c0);
    float* at = base + c0 * chunk_stride;  // chunk c0 + i's entering state (one running pointer)
    for (int i0 = 0; i0 < count; i0 += kPassAhead) {
#pragma unroll
      for (int j = 0; j < kPassAhead; ++j, at += chunk_stride) {  // chunk c0 + i0 + j, own[j]
        const int i = i0 + j;
        if (i >= count) break;
        if (vec && valid >= kPassVec) {
          store_float4(at, s.v[0], s.v[1], s.v[2], s.v[3]);
        } else {
#pragma unroll
          for (int v = 0; v < kPassVec; ++v)
            if (v < valid) at[v] = s.v[v];
        }
        const float k = carry[i];
#pragma unroll
        for (int v = 0; v < kPassVec; ++v) s.v[v] = k < 0.f ? own[j].v[v] : fmaf(k, s.v[v], own[j].v[v]);  // select, not 0 x state
        if (c0 + i + kPassAhead < p.nchunks) own[j] = pass_load(at + kPassAhead * chunk_stride, valid, vec);
      }
    }
  }
  if (!p.final_states) return;  // uniform over the block
  constexpr int kSpan = kThreads * kPassVec;  // the block's elements e: whole n rows when
  if (kSpan % p.headdim == 0) {                // headdim divides kSpan
    // final_states is [p][n]: through LDS, so neighbouring threads write neighbouring n
    // (rows padded to headdim + 1 floats: conflict-free reads down a column)
    // (every index below from one run-time division per thread: per element, they had made the
    // kernel's fixed work most of its time at 2 chunks)
    __shared__ float fin[2 * kSpan];
    const int hd = p.headdim, rows_all = kSpan / hd;  // a power of 2: hd divides kSpan
    const int n_first = static_cast<int>(blockIdx.x) * rows_all;
    const int rows = min(rows_all, p.dstate - n_first);
    {
      const int el = static_cast<int>(threadIdx.x) * kPassVec;
      int n = el / hd, pp = el - n * hd;
#pragma unroll
      for (int v = 0; v < kPassVec; ++v, ++pp) {
        if (pp == hd) ++n, pp = 0;
        if (n < rows) fin[n * (hd + 1) + pp] = s.v[v];
      }
    }
    __syncthreads();
    // thread: row n = its index mod rows_all, columns pp from its index / rows_all on, a step of
    // kThreads / rows_all (rows_all > kThreads: headdim under 4, one column and row at a time)
    const int64_t out0 = (static_cast<int64_t>(b) * p.nheads + h) * hd * p.dstate + n_first;
    const int n_rows = rows_all <= kThreads ? rows_all : kThreads;
    const int n = static_cast<int>(threadIdx.x) & (n_rows - 1), pp_step = kThreads / n_rows;
    for (int n_at = n; n_at < rows; n_at += n_rows) {
      const float* src = fin + n_at * (hd + 1);
      for (int pp = static_cast<int>(threadIdx.x) / n_rows; pp < hd; pp += pp_step)
        store_as(p.final_states, p.state_dtype, out0 + n_at + static_cast<int64_t>(pp) * p.dstate, src[pp]);
    }
  } else {
#pragma unroll
    for (int v = 0; v < kPassVec; ++v) {
      const int64_t e = e0 + v;
      if (e >= pn) continue;
      const int n = static_cast<int>(e / p.headdim), pp = static_cast<int>(e % p.headdim);
      store_final(p, b, h, n, pp, s.v[v]);
    }
  }
}

// ---- 5. chunk scan --------------------------------------------------------------------------

// Non-finite x entries of one chunk and headdim tile (32 kWords columns). chunk_scan multiplies
// x by a weight matrix whose masked entries (later positions, other sequences) are 0, and 0 x
// NaN is NaN: so x enters the product with those entries as 0, and every output they reach --
// same column, same sequence, at or after them -- is set to NaN afterwards. Entries beyond the
// first are found only when an x value is not finite; the clean path pays one flag test per
// row. Both live in LDS: `cols` (kMaxChunk x kWords words) may be scratch space the kernel
// does not use while x is staged.
template <int kWords = 2>
struct NonFinite {
  uint32_t* cols;  // per position s: cols[kWords s ...], the tile columns of bad x
  int* any;
  template <int kNT = kThreads>
  M2R_DEVICE void clear(int chunk_size) const {  // then a barrier
    for (int s = threadIdx.x; s < kWords * chunk_size; s += kNT) cols[s] = 0u;
    if (threadIdx.x == 0) *any = 0;
  }
  // bits: columns col, col + 1, ... (within one word)
  M2R_DEVICE void mark(int s, int col, uint32_t bits) const {
    atomicOr(&cols[kWords * s + col / 32], bits << (col % 32));
    *any = 1;
  }
  // the columns cq .. cq + 3 (cq a multiple of 4) of output row t that a non-finite x reaches, as
  // 4 bits (after a barrier; callers test *any first, so the clean path never walks the segment)
  M2R_DEVICE uint32_t reaching4(int t, const int32_t* seg, int cq) const {
    uint32_t m = 0;
    for (int s = t; s >= 0 && seg[s] == seg[t]; --s) m |= cols[kWords * s + cq / 32];
    return m >> (cq % 32) & 0xfu;
  }
};

// The last step of chunk_scan for one element: out[t][pp] = (y + D x[t][pp]) silu(z[t][pp]).
// In-chunk offsets are 32-bit (the host checks chunk_size * stride < 2^31): fewer scalar
// registers live, which gfx90a otherwise runs out of.
template <typename T, bool kHasZ>
struct OutRows {
  typedef typename T::storage S;
  const S* xp;
  const S* zp;
  S* out;
  int xl, zl, ol;
  M2R_DEVICE OutRows(const SsdParams& p, int b, int h, int64_t l0, const S* x_chunk)
      : xp(x_chunk),
        zp(kHasZ ? static_cast<const S*>(p.z) + b * p.z_batch_stride + l0 * p.z_l_stride + h * p.z_h_stride : nullptr),
        out(static_cast<S*>(p.out) + b * p.out_batch_stride + l0 * p.out_l_stride + h * p.out_h_stride),
        xl(static_cast<int>(p.x_l_stride)), zl(static_cast<int>(p.z_l_stride)), ol(static_cast<int>(p.out_l_stride)) {}
  M2R_DEVICE void store(const SsdParams& p, int h, int t, int pp, float y) const {
    if (p.D) y = fmaf(load_as_float(p.D, p.d_dtype, h * p.D_h_stride + pp * p.D_p_stride), T::to_float(xp[t * xl + pp]), y);
    if constexpr (kHasZ) y *= silu(T::to_float(zp[t * zl + pp]));
    out[t * ol + pp] = T::from_float(y);
  }
};

// Whether a non-finite x[s][pp] with s <= t in t's segment reaches out[t][pp]: the FMA
// variant's form of NonFinite::reaching4, reading x again (only once a non-finite x was seen).
template <typename T>
M2R_DEVICE bool reached(const typename T::storage* xp, int xl, int t, int pp, const int32_t* seg) {
  for (int s = t; s >= 0 && seg[s] == seg[t]; --s)
    if (!isfinite(T::to_float(xp[s * xl + pp]))) return true;
  return false;
}

// A (kRows positions) x (64 headdim) tile of one chunk and head:
//   y[t] = exp(dA_cs[t]) [seg[t] == 0] C[t]·entering  +  sum_{s <= t, seg[s] == seg[t]}
//          C[t]·B[s] exp(dA_cs[t] - dA_cs[s]) dt[s] x[s]  +  D x[t],   then y * silu(z[t]).
// kCols (64 or 128): the grid's headdim columns per block, taken 64 at a time (the matrix-core
// forms' tile widths, so that every form runs on every target)
template <typename T, int kRows, bool kHasZ, int kNT = kThreads, int kCols = 64>
M2R_DEVICE void chunk_scan_fma(const SsdParams& p) {
  typedef typename T::storage S;
  // a thread's rows: kRowGroups runs of 4, kRowSpan apart (the block's 16-thread rows cover
  // kRowSpan positions)
  constexpr int kRowSpan = kNT / 4, kRowGroups = kRows / kRowSpan;
  static_assert(kRowGroups >= 1 && kRowGroups * kRowSpan == kRows, "tile does not split over the block");
  constexpr int kLdA = kRows + kPad, kLdB = 64 + kPad;
  __shared__ __align__(16) float As[kSlab * kLdA];
  __shared__ __align__(16) float Bs[kSlab * kLdB];
  __shared__ float acs[kMaxChunk], dts[kMaxChunk];
  __shared__ int32_t seg[kMaxChunk];
  __shared__ int bad_any;  // a non-finite x in this tile's chunk (rare)
  const ScanBlock<kRows, kCols> blk(p);
  const int h = blk.h, g = blk.g, b = blk.b, c = blk.c, t0 = blk.t0, p_tile = blk.p0;
  const int64_t l0 = static_cast<int64_t>(c) * p.chunk_size;
  const int rows = static_cast<int>(min(static_cast<int64_t>(p.chunk_size), p.seqlen - l0));
  if (t0 >= rows) return;  // past the sequence's end: no output (as chunk_scan_mma)
  {
    const float* a = p.dA_cs + chunk_row(p, b, h, c);
    const float* d = p.dt_out + chunk_row(p, b, h, c);
    const int32_t* sg = p.seg + (static_cast<int64_t>(b) * p.nchunks + c) * p.chunk_size;
    for (int s = threadIdx.x; s < p.chunk_size; s += kNT) acs[s] = a[s], dts[s] = d[s], seg[s] = sg[s];
  }
  // 64 headdim columns from p0 (a lambda: the 64-column forms take it once, as they were written)
  const auto columns = [&](const int p0) {
    if (threadIdx.x == 0) bad_any = 0;
    __syncthreads();  // acs, dts, seg; bad_any
    const int t_off = 4 * (threadIdx.x / 16), p_off = 4 * (threadIdx.x % 16);
    float acc[4 * kRowGroups][4] = {};

    // the entering state, read through C (it is zero for chunk 0 without initial states)
    if (c > 0 || p.initial_states) {
      const S* Cp = static_cast<const S*>(p.C) + b * p.C_batch_stride + l0 * p.C_l_stride + g * p.C_g_stride;
      const float* E = p.states + states_at(p, b, c, h);
      for (int n0 = 0; n0 < p.dstate; n0 += kSlab) {
        stage_transposed<T, kRows, kLdA, kNT>(As, Cp, p.C_l_stride, t0, rows, n0, p.dstate);
#pragma unroll 4  // more keeps every address live: 3x the registers
        for (int i = 0; i < 64 * kSlab / kNT; ++i) {
          const int idx = threadIdx.x + i * kNT;
          const int col = idx % 64, k = idx / 64;
          Bs[k * kLdB + col] = n0 + k < p.dstate && p0 + col < p.headdim
                                   ? E[static_cast<int64_t>(n0 + k) * p.headdim + p0 + col] : 0.f;
        }
        __syncthreads();
        slab_product<kRowGroups, 1, kLdA, kLdB, kRowSpan>(acc, As, Bs, t_off, p_off);
        __syncthreads();
      }
#pragma unroll
      for (int i = 0; i < 4 * kRowGroups; ++i) {
        const int t = t0 + t_off + (i % 4) + kRowSpan * (i / 4);
        const bool from_before = seg[t] == 0;  // else a sequence that started in this chunk
        const float f = __expf(acs[t]);
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = from_before ? acc[i][j] * f : 0.f;
      }
    }

    // within the chunk: positions s <= t of the same segment
    const S* xp = static_cast<const S*>(p.x) + b * p.x_batch_stride + l0 * p.x_l_stride + h * p.x_h_stride;
    const float* cb = p.cb + ((static_cast<int64_t>(b) * p.nchunks + c) * p.ngroups + g) *
                                 static_cast<int64_t>(p.chunk_size) * p.chunk_size;
    const int s_end = min(t0 + kRows, rows);
    for (int s0 = 0; s0 < s_end; s0 += kSlab) {
#pragma unroll 4  // more keeps every address live: 3x the registers
      for (int i = 0; i < kRows * kSlab / kNT; ++i) {
        const int idx = threadIdx.x + i * kNT;
        const int t = idx % kRows, k = idx / kRows;
        const int s = s0 + k, tt = t0 + t;
        float v = 0.f;
        if (s <= tt && s < rows && seg[s] == seg[tt])
          v = cb[static_cast<int64_t>(s) * p.chunk_size + tt] * __expf(acs[tt] - acs[s]) * dts[s];
        As[k * kLdA + t] = v;
      }
      // x, non-finite entries as 0 and flagged (the masked weights are 0, and 0 x NaN is NaN).
      // Which outputs they reach is worked out from x itself, in the epilogue, only if any was.
      bool nonfinite = false;
#pragma unroll 4
      for (int i = 0; i < 64 * kSlab / kNT; ++i) {
        const int idx = threadIdx.x + i * kNT;
        const int col = idx % 64, r = idx / 64;
        float v = 0.f;
        if (s0 + r < rows && p0 + col < p.headdim) v = T::to_float(xp[(s0 + r) * static_cast<int>(p.x_l_stride) + p0 + col]);
        const bool finite = isfinite(v);
        nonfinite |= !finite;
        Bs[r * kLdB + col] = finite ? v : 0.f;
      }
      if (nonfinite) bad_any = 1;
      __syncthreads();
      slab_product<kRowGroups, 1, kLdA, kLdB, kRowSpan>(acc, As, Bs, t_off, p_off);
      __syncthreads();
    }

    const OutRows<T, kHasZ> o(p, b, h, l0, xp);
#pragma unroll
    for (int i = 0; i < 4 * kRowGroups; ++i) {
      const int t = t0 + t_off + (i % 4) + kRowSpan * (i / 4);
      if (t >= rows) continue;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int pp = p0 + p_off + j;
        if (pp < p.headdim) o.store(p, h, t, pp, bad_any && reached<T>(xp, static_cast<int>(p.x_l_stride), t, pp, seg) ? __int_as_float(0x7fc00000) : acc[i][j]);
      }
    }
  };
  if constexpr (kCols == 64) {
    columns(p_tile);
  } else {
#pragma unroll 1
    for (int p0 = p_tile; p0 < min(p_tile + kCols, p.headdim); p0 += 64) {  // uniform over the block
      columns(p0);
      __syncthreads();  // before the next columns' reset of bad_any and writes to LDS
    }
  }
}

// ---- matrix-core variants (fp16/bf16 where the target has matrix cores; see mma.h) -----------
// The same tiles, grids and semantics as the FMA variants above. Every operand is staged in
// LDS as 16-bit rows the way it lies in memory, 8 elements (16 bytes) per thread and load where
// the tensor is aligned for it, else element by element; an operand whose reduction dim is the
// sequence is then read k-major (mma::load_lane_t). The loops are software-pipelined: each
// thread loads its part of the next slab into registers (Rows16 / Rows32 fetch) right after
// the current slab reached LDS, so global latency overlaps the products instead of following
// them (the kernels were latency-bound at 2 blocks per SM). Operands computed in fp32 (the
// decay-weighted x and C·Bᵀ, the entering states) are split into a part rounded to the input
// dtype and its rounded remainder, two products each: about 16 mantissa bits instead of bf16's
// 8, so states and outputs keep close to fp32 accuracy (mamba_ssm's Triton kernels round these
// operands once).
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
// A chained block of the last chunk: final_states ([p][n]) from the 64 rows n of `half` staged in
// O, so that neighbouring threads write neighbouring n
M2R_DEVICE void store_final_half(const SsdParams& p, const Chain& ch, int pcols, const float* O, int half) {
  for (int o = threadIdx.x; o < 64 * pcols; o += kThreads) {
    const int rr = o % 64, pc = o / 64, n = ch.n0 + 64 * half + rr;
    if (n < p.dstate) store_final(p, ch.b, ch.h, n, ch.p0 + pc, O[rr * kLdO + pc]);
  }
}

// Build knobs (measurement only): M2R_SSD_SPLIT_SCAN / M2R_SSD_SPLIT_STATE = 0 round chunk_scan's /
// chunk_state's fp32-computed operands once, as mamba_ssm's Triton kernels do (half the products);
// M2R_SSD_SPLIT_SCAN_ENTER (default: M2R_SSD_SPLIT_SCAN) sets chunk_scan's entering-state product
// apart from its within-chunk one, so that each rounding's cost and error can be measured alone.
#ifndef M2R_SSD_SPLIT_SCAN
#define M2R_SSD_SPLIT_SCAN 1
#endif
#ifndef M2R_SSD_SPLIT_SCAN_ENTER
#define M2R_SSD_SPLIT_SCAN_ENTER M2R_SSD_SPLIT_SCAN
#endif
#ifndef M2R_SSD_SPLIT_STATE
#define M2R_SSD_SPLIT_STATE 1
#endif
constexpr bool kSplitScan = M2R_SSD_SPLIT_SCAN != 0, kSplitEnter = M2R_SSD_SPLIT_SCAN_ENTER != 0,
               kSplitState = M2R_SSD_SPLIT_STATE != 0;
// chunk_state's waves along the tile's rows n (the rest go along p). On NVIDIA two: each wave
// then holds one p fragment of x and its remainder (8 registers, not 16) and the kernel fits
// 80 registers, kStateBlocks per multiprocessor (H100, b1 l16384 h64 g8: 195 -> 164 us; 4
// waves at 2 blocks before). The AMD targets keep 4 (wave32) / 2 (wave64).
constexpr int kStateWavesM = M2R_MMA == 1 ? 2 : kWaves == 8 ? 4 : 2;

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

// bmm's slabs in flight (kSlab each): 2 took it from 71.0 to 67.2 us at b1 l16384 h64 g8 on an
// H200 (4, all of dstate 128 at once, 82.0 us: 96 registers, 2 blocks per multiprocessor)
constexpr int kBmmDepth = 2;

template <typename T>
M2R_DEVICE void bmm_mma(const SsdParams& p) {
  constexpr int kOperands = 2 * 64 * kLdH, kOut = 64 * kLdO * 2;
  __shared__ __align__(16) uint16_t smem[kOperands > kOut ? kOperands : kOut];
  uint16_t* Bs = smem;
  uint16_t* Cs = smem + 64 * kLdH;
  const int tiles = p.chunk_size / 64, pairs = tiles * (tiles + 1) / 2;
  int tt = 0, rem = blockIdx.x % pairs;
  while (rem > tt) rem -= ++tt;
  const int ts = rem;
  const int cg = blockIdx.x / pairs, c = cg / p.ngroups, g = cg % p.ngroups, b = blockIdx.z;
  const int64_t l0 = static_cast<int64_t>(c) * p.chunk_size;
  const int rows = static_cast<int>(min(static_cast<int64_t>(p.chunk_size), p.seqlen - l0));
  const int bl = static_cast<int>(p.B_l_stride), cl = static_cast<int>(p.C_l_stride);
  const uint16_t* Bp = static_cast<const uint16_t*>(p.B) + b * p.B_batch_stride + l0 * p.B_l_stride + g * p.B_g_stride + ts * 64 * bl;
  const uint16_t* Cp = static_cast<const uint16_t*>(p.C) + b * p.C_batch_stride + l0 * p.C_l_stride + g * p.C_g_stride + tt * 64 * cl;
  const bool bvec = aligned(Bp, 2 * bl, 16), cvec = aligned(Cp, 2 * cl, 16);
  const int brows = rows - ts * 64, crows = rows - tt * 64;

  mma::BlockTile<kThreads, 64, 64, 2> tile;  // rows s, cols t: the [s][t] layout chunk_scan reads
  // kBmmDepth slabs in flight (a ring of register buffers): each slab's product is far shorter
  // than a load, so with one slab ahead every slab waited for its loads
  Rows16<64, kSlab> bf[kBmmDepth], cf[kBmmDepth];
  const auto fetch = [&](int d, int n) {
    if (n < p.dstate) bf[d].fetch(Bp + n, bl, brows, p.dstate - n, bvec), cf[d].fetch(Cp + n, cl, crows, p.dstate - n, cvec);
  };
#pragma unroll
  for (int d = 0; d < kBmmDepth; ++d) fetch(d, d * kSlab);
  for (int n0 = 0; n0 < p.dstate; n0 += kBmmDepth * kSlab) {
#pragma unroll
    for (int d = 0; d < kBmmDepth; ++d) {
      const int n = n0 + d * kSlab;
      if (n >= p.dstate) break;
      bf[d].put(Bs, kLdH), cf[d].put(Cs, kLdH);
      __syncthreads();
      fetch(d, n + kBmmDepth * kSlab);
      tile.template product<T, kSlab, false, false>(Bs, kLdH, Cs, kLdH);
      __syncthreads();
    }
  }
  // through LDS (over the operands, free after the loop's last barrier): 16-byte row stores
  const int64_t cs = p.chunk_size;
  float* out = p.cb + ((static_cast<int64_t>(b) * p.nchunks + c) * p.ngroups + g) * cs * cs + (ts * 64) * cs + tt * 64;
  float* O = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int i = 0; i < tile.kFm; ++i)
#pragma unroll
    for (int j = 0; j < tile.kFn; ++j)
#pragma unroll
      for (int r = 0; r < mma::kAccRegs; ++r) O[tile.row(i, r) * kLdO + tile.col(j, r)] = tile.acc[i][j].v[r];
  __syncthreads();
  const int cq = 4 * (threadIdx.x % 16);
#pragma unroll
  for (int rr = threadIdx.x / 16; rr < 64; rr += kThreads / 16)
    *reinterpret_cast<float4*>(out + rr * cs + cq) = *reinterpret_cast<const float4*>(O + rr * kLdO + cq);
}

template <typename T, bool kVarlen, bool kChain, bool kLds>
M2R_DEVICE void chunk_state_mma(const SsdParams& p) {
  typedef KMajor<128> LB;
  typedef KMajor<64> LX;
  constexpr int kOperands = LB::kSize + 2 * LX::kSize, kOut = 64 * kLdO * 2;
  __shared__ __align__(16) uint16_t smem[kOperands > kOut ? kOperands : kOut];
  uint16_t* Bs = smem;                // [s][n]
  uint16_t* Xh = Bs + LB::kSize;      // [s][p], decay-weighted x rounded
  uint16_t* Xl = Xh + LX::kSize;      // its rounding remainder
  __shared__ float w[kMaxChunk];
  const int item = blockIdx.x / p.nheads / state_tiles(p);  // kVarlen: the sequence
  __shared__ int ticket;
  int end;
  const StateBlock sb = chunk_state_block<kVarlen, kChain, std::conditional_t<kLds, int, unsigned>>(p, &ticket, end);
  const int b = sb.b, c = sb.c, h = sb.h, g = h / p.heads_per_group, p0 = sb.p0(p), n0 = sb.n0(p);
  const int64_t l0 = static_cast<int64_t>(c) * p.chunk_size;
  const int rows = static_cast<int>(min(static_cast<int64_t>(end + 1), p.seqlen - l0));
  const uint16_t* xp = static_cast<const uint16_t*>(p.x) + b * p.x_batch_stride + l0 * p.x_l_stride + h * p.x_h_stride + p0;
  const uint16_t* Bp = static_cast<const uint16_t*>(p.B) + b * p.B_batch_stride + l0 * p.B_l_stride + g * p.B_g_stride + n0;
  const int xl = static_cast<int>(p.x_l_stride), bl = static_cast<int>(p.B_l_stride);
  const bool xvec = aligned(xp, 2 * xl, 16), bvec = aligned(Bp, 2 * bl, 16);
  const int pcols = min(64, p.headdim - p0), ncols = min(128, p.dstate - n0);
  Rows16<kSlab, 128> bf;
  Rows16<kSlab, 64> xf;
  bf.fetch(Bp, bl, rows, ncols, bvec);  // the first slab's loads go out before the weights
  xf.fetch(xp, xl, rows, pcols, xvec);

  const ChunkWeights cw = chunk_weights(p, b, h, c, end, w);
  const float a_end = cw.a_end;
  const int seg_end = cw.seg_end, first = cw.first;
  if (first > 0) {  // refetch from there (rare: a sequence starts inside the chunk)
    bf.fetch(Bp + first * bl, bl, rows - first, ncols, bvec);
    xf.fetch(xp + first * xl, xl, rows - first, pcols, xvec);
  }
  // kLds (3 blocks per multiprocessor on NVIDIA, so every register counts): chunk 0's block
  // writes states[0] now, before the accumulators live; the chunk carries the state entering it
  // by exp(dA_cs[end]) unless a sequence starts inside it (chunk_carry; end is the chunk's last
  // position here); the chunk index waits in LDS (held through the products beside the rest of
  // the block's position, it spilled)
  if (kLds && c == 0) write_initial_tile(p, b, h, p0, n0);
  const float chain_carry = seg_end == 0 ? __expf(a_end) : -1.f;
  __shared__ int held_c;
  if (kLds && threadIdx.x == 0) held_c = c;

  mma::BlockTile<kThreads, 128, 64, kStateWavesM> tile;  // rows n, cols p
  for (int s0 = first; s0 < rows; s0 += kSlab) {
    bf.put(Bs, LB::kLd);
#pragma unroll
    for (int i = 0; i < xf.kN; ++i) {  // x times its weight, split
      const int s = xf.row(i);
      float v[8];
      unpack8<T>(xf.q[i], v);
      const float ws = s0 + s < rows ? w[s0 + s] : 0.f;  // s0 need not be slab-aligned (first)
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] *= ws;
      store_split<T, kSplitState>(Xh + s * LX::kLd + xf.col(), Xl + s * LX::kLd + xf.col(), v);
    }
    __syncthreads();
    const int s1 = s0 + kSlab;
    if (s1 < rows) {
      if constexpr (kLds) {
        // 32-bit element offsets from the parameters' pointers: fewer registers held through
        // the loop (the host takes this form only where x's and B's offsets fit 32 bits)
        const uint16_t* B0 = static_cast<const uint16_t*>(p.B);
        const uint16_t* x0 = static_cast<const uint16_t*>(p.x);
        const uint32_t bo = static_cast<uint32_t>(Bp - B0), xo = static_cast<uint32_t>(xp - x0);
        bf.fetch(B0 + bo + s1 * bl, bl, rows - s1, ncols, bvec);
        xf.fetch(x0 + xo + s1 * xl, xl, rows - s1, pcols, xvec);
      } else {
        bf.fetch(Bp + s1 * bl, bl, rows - s1, ncols, bvec), xf.fetch(xp + s1 * xl, xl, rows - s1, pcols, xvec);
      }
    }
    if constexpr (kSplitState) tile.template product_split<T, kSlab, true, true, false>(Bs, nullptr, LB::kLd, Xh, Xl, LX::kLd);
    else tile.template product<T, kSlab, true, true>(Bs, LB::kLd, Xh, LX::kLd);
    __syncthreads();
  }

  if constexpr (!kVarlen && !kChain) {
    // through LDS, 64 rows n at a time (over the operand tiles), so each row of the state
    // ([n][p], p contiguous) is written by 16-byte stores of neighbouring threads
    float* st = p.states + states_at(p, b, c, h);
    float* O = reinterpret_cast<float*>(smem);
    const int cq = 4 * (threadIdx.x % 16), vec = p.headdim % 4 == 0;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      __syncthreads();
      stage_half(tile, O, half);
      __syncthreads();
      for (int rr = threadIdx.x / 16; rr < 64; rr += kThreads / 16) {
        const int n = n0 + 64 * half + rr;
        if (n >= p.dstate) break;
        const float4 v = *reinterpret_cast<const float4*>(O + rr * kLdO + cq);
        float* row = st + static_cast<int64_t>(n) * p.headdim + p0 + cq;
        if (vec && cq + 3 < pcols) {
          *reinterpret_cast<float4*>(row) = v;
        } else {
          const float e4[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (cq + e < pcols) row[e] = e4[e];
        }
      }
    }
    return;
  }
  if constexpr (kChain && !kLds) {
    // the state passing's step (Chain) on the accumulators where they are: between the wait and
    // the stores the chain's links wait on, one round trip of loads and no barrier (NVIDIA: 8-byte
    // accesses, a register pair's neighbouring columns; AMD: a row's 16 columns over 16 lanes).
    // The block's position decoded again from the ticket and the carry read from global memory,
    // instead of holding these through the products (chunk_state spilled on NVIDIA)
    const StateBlock sc = state_block<unsigned>(p, *static_cast<volatile int*>(&ticket));
    const Chain ch = chain_of(p, sc, chunk_carry(p, sc.b, sc.h, sc.c));
    const int p0 = ch.p0, n0 = ch.n0;
    if (ch.c == 0) write_initial_tile(p, ch.b, ch.h, p0, n0);
    constexpr int kStep = mma::kAccColPairs ? 2 : 1;
    const bool pairs = mma::kAccColPairs && p.headdim % 2 == 0;  // (then pp is even: 8-byte aligned)
    ch.wait();
    float e[tile.kFm][tile.kFn][mma::kAccRegs];
#pragma unroll
    for (int i = 0; i < tile.kFm; ++i)
#pragma unroll
      for (int j = 0; j < tile.kFn; ++j)
#pragma unroll
        for (int r = 0; r < mma::kAccRegs; r += kStep) {
          const int n = n0 + tile.row(i, r), pp = p0 + tile.col(j, r);
          const float* at = ch.in + static_cast<int64_t>(n) * p.headdim + pp;
          const bool in_n = n < p.dstate;
          if (kStep == 2 && pairs && in_n && pp + 1 < p.headdim) {
            const float2 q = load_fresh<float2>(at);
            e[i][j][r] = q.x, e[i][j][r + kStep - 1] = q.y;
          } else {
#pragma unroll
            for (int u = 0; u < kStep; ++u) e[i][j][r + u] = in_n && pp + u < p.headdim ? load_fresh<float>(at + u) : 0.f;
          }
        }
#pragma unroll
    for (int i = 0; i < tile.kFm; ++i)
#pragma unroll
      for (int j = 0; j < tile.kFn; ++j)
#pragma unroll
        for (int r = 0; r < mma::kAccRegs; ++r) tile.acc[i][j].v[r] = ch.step(e[i][j][r], tile.acc[i][j].v[r]);
    if (!ch.last(p)) {
      float* const next = ch.next(p);
#pragma unroll
      for (int i = 0; i < tile.kFm; ++i)
#pragma unroll
        for (int j = 0; j < tile.kFn; ++j)
#pragma unroll
          for (int r = 0; r < mma::kAccRegs; r += kStep) {
            const int n = n0 + tile.row(i, r), pp = p0 + tile.col(j, r);
            if (n >= p.dstate) continue;
            float* at = next + static_cast<int64_t>(n) * p.headdim + pp;
            if (kStep == 2 && pairs && pp + 1 < p.headdim) {
              *reinterpret_cast<float2*>(at) = make_float2(tile.acc[i][j].v[r], tile.acc[i][j].v[r + kStep - 1]);
            } else {
#pragma unroll
              for (int u = 0; u < kStep; ++u)
                if (pp + u < p.headdim) at[u] = tile.acc[i][j].v[r + u];
            }
          }
      ch.publish(p);
      return;
    }
    if (!p.final_states) return;
    // the last chunk: final_states ([p][n]) through LDS, 64 rows n at a time (over the operand
    // tiles), so that neighbouring threads write neighbouring n
    float* O = reinterpret_cast<float*>(smem);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      __syncthreads();
      stage_half(tile, O, half);
      __syncthreads();
      store_final_half(p, ch, min(kStateP, p.headdim - p0), O, half);
    }
    return;
  }
  if constexpr (kChain && kLds) {
    // the state passing's step (Chain), 64 rows n at a time through LDS (over the operand
    // tiles): the accumulators are free once staged, so the link's loads and stores take no
    // registers beside them (straight from the accumulators it spilled at kChainBlocks 3), and
    // neighbouring threads read and write 16-byte runs of a state row
    StateBlock sh = sb;
    sh.c = *static_cast<volatile int*>(&held_c);
    const Chain ch = chain_of(p, sh, chain_carry);
    float* O = reinterpret_cast<float*>(smem);
    const int p0 = ch.p0, n0 = ch.n0, pcols = min(kStateP, p.headdim - p0);
    const int cq = 4 * (threadIdx.x % 16);
    const bool vec = p.headdim % 4 == 0 && cq + 3 < pcols;  // (then the row's run is 16-byte aligned)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      __syncthreads();
      stage_half(tile, O, half);
      if (half == 0) ch.wait();  // (its barrier orders the staging too)
      else __syncthreads();
      for (int rr = threadIdx.x / 16; rr < 64; rr += kThreads / 16) {
        const int n = n0 + 64 * half + rr;
        if (n >= p.dstate) break;
        float* own = O + rr * kLdO + cq;
        const float* in = ch.in + static_cast<int64_t>(n) * p.headdim + p0 + cq;
        float e[4];
        if (vec) {
          const float4 q = load_fresh<float4>(in);
          e[0] = q.x, e[1] = q.y, e[2] = q.z, e[3] = q.w;
        } else {
#pragma unroll
          for (int u = 0; u < 4; ++u) e[u] = cq + u < pcols ? load_fresh<float>(in + u) : 0.f;
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) e[u] = ch.step(e[u], own[u]);
        if (ch.last(p)) {  // final_states, below
#pragma unroll
          for (int u = 0; u < 4; ++u) own[u] = e[u];
          continue;
        }
        float* out = ch.next(p) + static_cast<int64_t>(n) * p.headdim + p0 + cq;
        if (vec) {
          *reinterpret_cast<float4*>(out) = make_float4(e[0], e[1], e[2], e[3]);
        } else {
#pragma unroll
          for (int u = 0; u < 4; ++u)
            if (cq + u < pcols) out[u] = e[u];
        }
      }
      if (!ch.last(p) || !p.final_states) continue;
      __syncthreads();
      store_final_half(p, ch, pcols, O, half);  // the last chunk
    }
    ch.publish(p);
    return;
  }
  const float* st = p.states + states_at(p, b, c, h);  // the state entering the chunk
  const bool carries = seg_end == 0;  // varlen: the sequence began before this chunk
  const float carry = __expf(a_end);
#pragma unroll
  for (int i = 0; i < tile.kFm; ++i)
#pragma unroll
    for (int j = 0; j < tile.kFn; ++j)
#pragma unroll
      for (int r = 0; r < mma::kAccRegs; ++r) {
        const int n = n0 + tile.row(i, r), pp = p0 + tile.col(j, r);
        if (n >= p.dstate || pp >= p.headdim) continue;
        const float v = carries ? fmaf(carry, st[static_cast<int64_t>(n) * p.headdim + pp], tile.acc[i][j].v[r]) : tile.acc[i][j].v[r];
        store_as(p.varlen_states, p.state_dtype, ((static_cast<int64_t>(item) * p.nheads + h) * p.headdim + pp) * p.dstate + n, v);
      }
}

// kCols: the tile's headdim columns (64, or 128: the entering state's C and the within-chunk
// weights, worked out per tile, then serve a 128-wide headdim once)
template <typename T, int kRows, bool kHasZ, int kNT = kThreads, int kCols = 64>
M2R_DEVICE void chunk_scan_mma(const SsdParams& p) {
  typedef KMajor<kRows> LM;
  typedef KMajor<kCols> LX;
  constexpr int kLdOut = kCols + 8;  // O's rows (kLdO for 64 columns)
  constexpr int kASize = kRows * kLdH > LM::kSize ? kRows * kLdH : LM::kSize;
  constexpr int kOperands = kASize + LM::kSize + 2 * LX::kSize, kOut = 64 * kLdOut * 2;
  __shared__ __align__(16) uint16_t smem[kOperands > kOut ? kOperands : kOut];
  uint16_t* As = smem;                   // C [t][n], then C·Bᵀ weighted [s][t]
  uint16_t* As_lo = As + kASize;         // the weighted C·Bᵀ's rounding remainder
  uint16_t* Bs = As_lo + LM::kSize;      // entering state [n][p], then x [s][p]
  uint16_t* Bs_lo = Bs + LX::kSize;      // the entering state's rounding remainder
  __shared__ float acs[kMaxChunk], dts[kMaxChunk];  // acs: dA_cs times log2(e)
  __shared__ int32_t seg[kMaxChunk];
  __shared__ int bad_any;
  // non-finite x marks: in Bs_lo, which holds nothing once the entering state is done
  constexpr int kWords = kCols / 32;
  static_assert(LX::kSize * sizeof(uint16_t) >= kWords * kMaxChunk * sizeof(uint32_t), "marks do not fit");
  const NonFinite<kWords> bad{reinterpret_cast<uint32_t*>(Bs_lo), &bad_any};
  const ScanBlock<kRows, kCols> blk(p);
  const int h = blk.h, g = blk.g, b = blk.b, c = blk.c, t0 = blk.t0, p0 = blk.p0;
  const int64_t l0 = static_cast<int64_t>(c) * p.chunk_size;
  const int rows = static_cast<int>(min(static_cast<int64_t>(p.chunk_size), p.seqlen - l0));
  const int xl = static_cast<int>(p.x_l_stride), cl = static_cast<int>(p.C_l_stride);
  const int pcols = min(kCols, p.headdim - p0), cs = p.chunk_size;
  // a tile wholly past the sequence's end (the last chunk's, when it is partial) has no output:
  // its entering-state and within-chunk products would only fill rows that are never stored
  if (t0 >= rows) return;
  mma::BlockTile<kNT, kRows, kCols, kRows == 128 && kNT / kWavefront == 8 ? 4 : 2> tile;  // rows t, cols p

  {
    const float* a = p.dA_cs + chunk_row(p, b, h, c);
    const float* d = p.dt_out + chunk_row(p, b, h, c);
    const int32_t* sg = p.seg + (static_cast<int64_t>(b) * p.nchunks + c) * p.chunk_size;
    // unrolled to the largest chunk: every load is requested before the first store waits (one
    // round trip, where a loop over kNT positions at a time made two at chunk 256 on 128 threads,
    // with nothing else in flight at the block's start)
    static_assert(kMaxChunk % kNT == 0, "the unrolled loop covers every position of the largest chunk");
#pragma unroll
    for (int u = 0; u < kMaxChunk / kNT; ++u) {
      const int s = static_cast<int>(threadIdx.x) + u * kNT;
      if (s < cs) acs[s] = a[s] * kLog2e, dts[s] = d[s], seg[s] = sg[s];
    }
  }
  // the entering state, read through C (it is zero for chunk 0 without initial states)
  if (c > 0 || p.initial_states) {
    const uint16_t* Cp = static_cast<const uint16_t*>(p.C) + b * p.C_batch_stride + l0 * p.C_l_stride + g * p.C_g_stride + t0 * cl;
    const bool cvec = aligned(Cp, 2 * cl, 16), evec = p.headdim % 4 == 0;
    const int crows = rows - t0;
    const float* E = p.states + states_at(p, b, c, h) + p0;
    Rows16<kRows, kSlab, kNT> cf;
    Rows32<kSlab, kCols, kNT> ef;
    cf.fetch(Cp, cl, crows, p.dstate, cvec), ef.fetch(E, p.headdim, p.dstate, pcols, evec);
    __syncthreads();  // acs, dts, seg
    for (int n0 = 0; n0 < p.dstate; n0 += kSlab) {
      cf.put(As, kLdH);
      ef.template put_split<T, kSplitEnter>(Bs, Bs_lo, LX::kLd);
      __syncthreads();
      const int n1 = n0 + kSlab;
      if (n1 < p.dstate)
        cf.fetch(Cp + n1, cl, crows, p.dstate - n1, cvec), ef.fetch(E + n1 * p.headdim, p.headdim, p.dstate - n1, pcols, evec);
      if constexpr (kSplitEnter) tile.template product_split<T, kSlab, false, true, false>(As, nullptr, kLdH, Bs, Bs_lo, LX::kLd);
      else tile.template product<T, kSlab, false, true>(As, kLdH, Bs, LX::kLd);
      __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < tile.kFm; ++i)
#pragma unroll
      for (int r = 0; r < mma::kAccRegs; ++r) {
        const int t = t0 + tile.row(i, r);
        const bool from_before = seg[t] == 0;  // else a sequence that started in this chunk
        const float f = fast_exp2(acs[t]);
#pragma unroll
        for (int j = 0; j < tile.kFn; ++j) tile.acc[i][j].v[r] = from_before ? tile.acc[i][j].v[r] * f : 0.f;
      }
    bad.template clear<kNT>(cs);  // Bs_lo is free now
  } else {
    bad.template clear<kNT>(cs);
    __syncthreads();  // acs (the entering state's product has barriers of its own)
  }
  // within the chunk: positions s <= t of the same segment, M[s][t] = C·Bᵀ[s][t] dt[s]
  // exp(dA_cs[t] - dA_cs[s]) staged [s][t] (split), times x [s][p]. Its first slab is requested
  // here, before the barrier below (after it, the loads went out with nothing else in flight:
  // H200, chunk_scan 1-3% slower)
  const uint16_t* xp = static_cast<const uint16_t*>(p.x) + b * p.x_batch_stride + l0 * p.x_l_stride + h * p.x_h_stride + p0;
  const bool xvec = aligned(xp, 2 * xl, 16);
  const float* cb = p.cb + ((static_cast<int64_t>(b) * p.nchunks + c) * p.ngroups + g) *
                               static_cast<int64_t>(cs) * cs + t0;
  Rows32<kSlab, kRows, kNT> mf;  // C·Bᵀ rows: the workspace is chunk_size^2, always in range
  Rows16<kSlab, kCols, kNT> xf;
  mf.fetch(cb, cs, kSlab, kRows, true);
  xf.fetch(xp, xl, rows, pcols, xvec);
  // whether dA_cs never rises over the chunk's tokens (dt A <= 0, as in every Mamba model),
  // read from acs in LDS (scaled by log2(e), the values the factored exponentials take) after
  // the entering state's product: a global re-read here cost 1% of chunk_scan (H100), and
  // worked out with acs above, held through the product, the flag spilled scalar registers on
  // the wave64 targets
  int rises = 0;
  for (int s = threadIdx.x + 1; s < rows; s += kNT) rises |= acs[s] > acs[s - 1];
  const bool decays = __syncthreads_count(rises) == 0;  // also the barrier for acs, dts, seg, marks

  const int s_end = min(t0 + kRows, rows);
  // the slabs wholly before the tile end here, where the decay factors (below) and there are no
  // segments (one value for the three)
  const int plain_end = decays && !p.seq_idx ? min(t0 + 1, rows) : 0;
  const int tq = t0 + mf.col();  // this thread's 4 positions t
  // In the slabs wholly before the tile (s <= t0 <= t) the decay factors about t0:
  // exp2(a_t - a_s) = exp2(a_t - a_t0) exp2(a_t0 - a_s), both at most 1 where dA_cs never rises:
  // an exponential per row s and per column t instead of one per element.
  const float a_0 = per_lane(acs[t0]);  // (per_lane: scalar registers, wave64)
  float a_t[4], f_t[4];
  int seg_t[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    a_t[e] = acs[tq + e], seg_t[e] = seg[tq + e];
    f_t[e] = tq + e < rows ? fast_exp2(a_t[e] - a_0) : 0.f;
  }
  for (int s0 = 0; s0 < s_end; s0 += kSlab) {
    // every s of the slab in range, at or before every t of the tile, no segments, the decay
    // factored: no masks
    const bool plain = s0 + kSlab <= plain_end;
#pragma unroll
    for (int i = 0; i < mf.kN; ++i) {
      const int k = mf.row(i), s = s0 + k;
      float v[4] = {mf.q[i].x, mf.q[i].y, mf.q[i].z, mf.q[i].w};
      const float as = acs[s], ds = dts[s];
      if (plain) {
        const float ws = ds * fast_exp2(a_0 - as);
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] *= ws * f_t[e];
      } else {
        const int sgs = seg[s];
#pragma unroll
        for (int e = 0; e < 4; ++e)
          v[e] = s < rows && s <= tq + e && sgs == seg_t[e] ? v[e] * ds * fast_exp2(a_t[e] - as) : 0.f;
      }
      store_split<T, kSplitScan>(As + k * LM::kLd + mf.col(), As_lo + k * LM::kLd + mf.col(), v);
    }
    xf.template put_finite<T>(Bs, LX::kLd, bad, s0);  // the masked weights are 0: no NaN x
    __syncthreads();
    const int s1 = s0 + kSlab;
    if (s1 < s_end) mf.fetch(cb + s1 * cs, cs, kSlab, kRows, true), xf.fetch(xp + s1 * xl, xl, rows - s1, pcols, xvec);
    // a wave whose rows t all precede the slab has only masked (0) terms in it: it skips the
    // product (in the diagonal slabs; uniform over the wave)
    if (s0 < t0 + tile.m0 + tile.kFm * 16) {
      if constexpr (kSplitScan) tile.template product_split<T, kSlab, true, true, true>(As, As_lo, LM::kLd, Bs, nullptr, LX::kLd);
      else tile.template product<T, kSlab, true, true>(As, LM::kLd, Bs, LX::kLd);
    }
    __syncthreads();
  }

  // D, the gate and the store, 64 rows at a time through LDS (over the operand tiles): each
  // thread then owns 4 consecutive headdim columns of every kRowStep-th row (kCols / 4 threads
  // a row: the 16th row on 256 threads at 64 columns), 8 bytes at a time.
  float* O = reinterpret_cast<float*>(smem);
  constexpr int kRowThreads = kCols / 4, kRowStep = kNT / kRowThreads, kOutRows = 64 / kRowStep;  // a thread's rows of each 64
  const int cq = 4 * (threadIdx.x % kRowThreads), r_first = threadIdx.x / kRowThreads;
  // which of those outputs a non-finite x reaches: 4 bits per row, read before O overwrites
  // the marks
  static_assert(kRows / 64 * kOutRows * 4 <= 32, "poison bits do not fit a word");
  uint32_t poison = 0;
  if (bad_any) {
#pragma unroll
    for (int half = 0; half < kRows / 64; ++half)
#pragma unroll
      for (int k = 0; k < kOutRows; ++k) {
        const int t = t0 + 64 * half + r_first + kRowStep * k;
        if (t < rows) poison |= bad.reaching4(t, seg, cq) << (16 * half + 4 * k);
      }
  }
  float dq[4] = {};
  if (p.D) {
    if (p.D_p_stride == 0) {  // one D per head (as a Mamba2 block passes it): one load
      const float d = load_as_float(p.D, p.d_dtype, h * p.D_h_stride);
#pragma unroll
      for (int e = 0; e < 4; ++e) dq[e] = d;
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (cq + e < pcols) dq[e] = load_as_float(p.D, p.d_dtype, h * p.D_h_stride + (p0 + cq + e) * p.D_p_stride);
    }
  }
  const uint16_t* xo = xp;
  const uint16_t* zo = kHasZ ? static_cast<const uint16_t*>(p.z) + b * p.z_batch_stride + l0 * p.z_l_stride + h * p.z_h_stride + p0 : nullptr;
  uint16_t* out = static_cast<uint16_t*>(p.out) + b * p.out_batch_stride + l0 * p.out_l_stride + h * p.out_h_stride + p0;
  const int zl = static_cast<int>(p.z_l_stride), ol = static_cast<int>(p.out_l_stride);
  // one flag for the three (fewer live scalars; gfx90a runs short of them): 8-byte accesses
  const bool vec = aligned(xo, 2 * xl, 8) && aligned(out, 2 * ol, 8) && (!kHasZ || aligned(zo, 2 * zl, 8));
  // this thread's 4 columns in range and 8-byte accesses: one flag for all its rows (checked per
  // row, nvcc kept it as a bit mask worked out row by row); row offsets unsigned 32-bit (t <
  // chunk_size: the host checks chunk_size * stride < 2^31), no sign extension per row
  const bool cvec = vec && cq + 3 < pcols;
#pragma unroll
  for (int half = 0; half < kRows / 64; ++half) {
    // the x and z of this thread's rows are requested before the accumulators go through LDS,
    // all at once: one memory round trip per half instead of one per row
    Packed4 xq[kOutRows], zq[kHasZ ? kOutRows : 1];
#pragma unroll
    for (int k = 0; k < kOutRows; ++k) {
      const int t = min(t0 + 64 * half + r_first + kRowStep * k, rows - 1);  // rows past seqlen: not stored
      const uint16_t* xr = xo + static_cast<uint32_t>(t * xl);
      xq[k] = load4(xr, cq, pcols, cvec);
      if constexpr (kHasZ) zq[k] = load4(zo + static_cast<uint32_t>(t * zl), cq, pcols, cvec);
    }
    __syncthreads();
    stage_half<decltype(tile), kLdOut>(tile, O, half);
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kOutRows; ++k) {
      const int rr = r_first + kRowStep * k, t = t0 + 64 * half + rr;
      if (t >= rows) break;
      const float4 a = *reinterpret_cast<const float4*>(O + rr * kLdOut + cq);
      float y[4] = {a.x, a.y, a.z, a.w}, xv[4];
      const uint32_t poisoned = poison >> (16 * half + 4 * k);
      if (poisoned & 0xfu) {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (poisoned >> e & 1u) y[e] = __int_as_float(0x7fc00000);
      }
      unpack4<T>(xq[k], xv);
#pragma unroll
      for (int e = 0; e < 4; ++e) y[e] = fmaf(dq[e], xv[e], y[e]);
      if constexpr (kHasZ) {
        float zv[4];
        unpack4<T>(zq[k], zv);
#pragma unroll
        for (int e = 0; e < 4; ++e) y[e] *= silu(zv[e]);
      }
      const Packed4 q = pack4<T>(y);
      uint16_t* const orow = out + static_cast<uint32_t>(t * ol);
      if (cvec) {
        // one 8-byte store: nvcc split a uint2 store of the two words into two 4-byte ones
        *reinterpret_cast<uint64_t*>(orow + cq) = static_cast<uint64_t>(q.hi) << 32 | q.lo;
      } else {
        const uint16_t e4[4] = {static_cast<uint16_t>(q.lo), static_cast<uint16_t>(q.lo >> 16),
                                static_cast<uint16_t>(q.hi), static_cast<uint16_t>(q.hi >> 16)};
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (cq + e < pcols) orow[cq + e] = e4[e];
      }
    }
  }
}
#endif

template <typename T>
M2R_DEVICE void bmm(const SsdParams& p) {
#if M2R_MMA != 0
  if constexpr (mma::kEnabled<T>) return bmm_mma<T>(p);
  else
#endif
  bmm_fma<T>(p);
}

// kLds: chained with the link through LDS (chunk_state_mma; the FMA path has one form)
template <typename T, bool kVarlen, bool kChain, bool kLds = false>
M2R_DEVICE void chunk_state(const SsdParams& p) {
#if M2R_MMA != 0
  if constexpr (mma::kEnabled<T>) return chunk_state_mma<T, kVarlen, kChain, kLds>(p);
  else
#endif
  chunk_state_fma<T, kVarlen, kChain>(p);
}

template <typename T, int kRows, bool kHasZ, int kNT = kThreads, int kCols = 64>
M2R_DEVICE void chunk_scan(const SsdParams& p) {
#if M2R_MMA != 0
  if constexpr (mma::kEnabled<T>) return chunk_scan_mma<T, kRows, kHasZ, kNT, kCols>(p);
  else
#endif
  chunk_scan_fma<T, kRows, kHasZ, kNT, kCols>(p);
}

// the chained chunk_state's blocks per multiprocessor with the link through LDS (NVIDIA; the FMA
// path's one form keeps kChainBlocks)
template <typename T>
constexpr int kChainLdsBlocksOf = mma::kEnabled<T> ? kChainLdsBlocks : kChainBlocks;

// chunk_scan's 64-row tile, blocks per multiprocessor (NVIDIA): 3 at 80 registers on the matrix
// cores (ptxas took 96 for the non-gated one without the bound), 4 at 64 on the fp32 FMA path
template <typename T>
constexpr int kScan64Blocks = mma::kEnabled<T> ? 3 : 4;

// The fp16 / bf16 chunk_scan on matrix cores, at every chunk size: the 64-row tile on a block
// of kScanBlock128 threads (4 waves of 32 along 2 x 2 sub-tiles of 32 x 32 on wave32 targets
// and NVIDIA, 2 waves of 64 on wave64 ones), kScanBlock128Blocks per multiprocessor on NVIDIA
// (128 registers, the 16 warps the 128-row tile's 2 blocks of 8 had), instead of the 64- / 128-
// row tile on 256 threads: half the waves meet at each slab's barrier, which the kernel was
// bound by (ncu, H100: 1.2 barrier stalls per issue against Triton's 0.22 in its 2-warp blocks).
// H100, profile_ssd, chunk_scan alone: 134 -> 124 us at b2 l4096 h32, 507 -> 463 at b1 l16384
// h64 g8, 443 -> 393 at Nemotron-H b1 l8192, 222 -> 204 at Codestral b8 l512, 219 -> 201 at
// Falcon-H1 l8192; at chunk 64 (against the 64-row tile on 256 threads) 120 -> 109 at b2 l4096
// h32, 437 -> 400 at Nemotron-H b1 l8192. The FMA path (gfx10.3, fp32) keeps 256 threads: its
// 128-thread form (a thread's rows two runs of 4, kNT / 4 apart) ran 1-6% slower than the
// 128-row tile in the gfx1030 emulation on the H100 at 5 of 6 shapes. At 3 blocks per
// multiprocessor (152 registers) chunk_scan ran 14-17% slower (H200: 122 -> 139 us at b2 l4096
// h32, 462 -> 541 at b1 l16384 h64 g8).
constexpr int kScanBlock128 = 128, kScanBlock128Blocks = 4;
constexpr int kScanP128 = 256, kScanP128Blocks = 2;  // (the same registers a thread)

}  // namespace ssd
}  // namespace m2r

M2R_KERNEL(m2r::ssd::kThreads) m2r_ssd_chunk_cumsum(SsdParams p) { m2r::ssd::chunk_cumsum(p); }
M2R_KERNEL(m2r::ssd::kThreads) m2r_ssd_state_passing(SsdParams p) { m2r::ssd::state_passing(p); }

#define M2R_SSD(DT, T)                                                                       \
  M2R_KERNEL(m2r::ssd::kThreads) m2r_ssd_bmm_##DT(SsdParams p) { m2r::ssd::bmm<m2r::T>(p); } \
  M2R_KERNEL_MIN_BLOCKS(m2r::ssd::kThreads, m2r::ssd::kStateBlocks)                          \
  m2r_ssd_chunk_state_##DT(SsdParams p) {                                                    \
    m2r::ssd::chunk_state<m2r::T, false, false>(p);                                          \
  }                                                                                          \
  M2R_KERNEL_MIN_BLOCKS(m2r::ssd::kThreads, m2r::ssd::kChainBlocks)                          \
  m2r_ssd_chunk_state_chain_##DT(SsdParams p) {                                              \
    m2r::ssd::chunk_state<m2r::T, false, true>(p);                                           \
  }                                                                                          \
  M2R_KERNEL_MIN_BLOCKS(m2r::ssd::kThreads, m2r::ssd::kChainLdsBlocksOf<m2r::T>)             \
  m2r_ssd_chunk_state_chain_lds_##DT(SsdParams p) {                                          \
    m2r::ssd::chunk_state<m2r::T, false, true, true>(p);                                     \
  }                                                                                          \
  M2R_KERNEL(m2r::ssd::kThreads) m2r_ssd_varlen_state_##DT(SsdParams p) {                    \
    m2r::ssd::chunk_state<m2r::T, true, false>(p);                                           \
  }                                                                                          \
  M2R_KERNEL_MIN_BLOCKS(m2r::ssd::kThreads, m2r::ssd::kScan64Blocks<m2r::T>)                 \
  m2r_ssd_chunk_scan_##DT##_t64(SsdParams p) {                                               \
    m2r::ssd::chunk_scan<m2r::T, 64, false>(p);                                              \
  }                                                                                          \
  M2R_KERNEL_MIN_BLOCKS(m2r::ssd::kThreads, m2r::ssd::kScan64Blocks<m2r::T>)                 \
  m2r_ssd_chunk_scan_##DT##_t64_z(SsdParams p) {                                             \
    m2r::ssd::chunk_scan<m2r::T, 64, true>(p);                                               \
  }                                                                                          \
  M2R_KERNEL(m2r::ssd::kThreads) m2r_ssd_chunk_scan_##DT##_t128(SsdParams p) {               \
    m2r::ssd::chunk_scan<m2r::T, 128, false>(p);                                             \
  }                                                                                          \
  M2R_KERNEL(m2r::ssd::kThreads) m2r_ssd_chunk_scan_##DT##_t128_z(SsdParams p) {             \
    m2r::ssd::chunk_scan<m2r::T, 128, true>(p);                                              \
  }
M2R_SSD(f32, F32)
M2R_SSD(f16, F16)
M2R_SSD(bf16, BF16)

// the 16-bit types' chunk_scan on matrix cores: the 64-row tile on kScanBlock128 threads (built
// for every target, so that every target has every form; the host takes it where the target has
// matrix cores: mamba2_rocm/ops/ssd.py, _scan_form)
#define M2R_SSD_SCAN_B128(DT, T)                                                \
  M2R_KERNEL_MIN_BLOCKS(m2r::ssd::kScanBlock128, m2r::ssd::kScanBlock128Blocks) \
  m2r_ssd_chunk_scan_##DT##_t64b128(SsdParams p) {                              \
    m2r::ssd::chunk_scan<m2r::T, 64, false, m2r::ssd::kScanBlock128>(p);        \
  }                                                                             \
  M2R_KERNEL_MIN_BLOCKS(m2r::ssd::kScanBlock128, m2r::ssd::kScanBlock128Blocks) \
  m2r_ssd_chunk_scan_##DT##_t64b128_z(SsdParams p) {                            \
    m2r::ssd::chunk_scan<m2r::T, 64, true, m2r::ssd::kScanBlock128>(p);         \
  }
M2R_SSD_SCAN_B128(f16, F16)
M2R_SSD_SCAN_B128(bf16, BF16)

// the same tile 128 headdim columns wide on kScanP128 threads (headdim 128, Falcon-H1's: the
// entering state's C and the within-chunk weights are worked out once for the whole headdim
// instead of once per 64 columns); each wave keeps the 64-column form's sub-tile. H200,
// profile_ssd, chunk_scan against t64b128: 91.6 -> 88.7 us at Falcon-H1 b8 l512, 191.5 -> 184.4
// at b4 l2048, 196.6 -> 190.4 at b1 l8192. The host takes it there on NVIDIA only (37 KB of LDS:
// half the blocks per CDNA compute unit)
#define M2R_SSD_SCAN_P128(DT, T)                                                    \
  M2R_KERNEL_MIN_BLOCKS(m2r::ssd::kScanP128, m2r::ssd::kScanP128Blocks)             \
  m2r_ssd_chunk_scan_##DT##_t64p128(SsdParams p) {                                  \
    m2r::ssd::chunk_scan<m2r::T, 64, false, m2r::ssd::kScanP128, 128>(p);           \
  }                                                                                 \
  M2R_KERNEL_MIN_BLOCKS(m2r::ssd::kScanP128, m2r::ssd::kScanP128Blocks)             \
  m2r_ssd_chunk_scan_##DT##_t64p128_z(SsdParams p) {                                \
    m2r::ssd::chunk_scan<m2r::T, 64, true, m2r::ssd::kScanP128, 128>(p);            \
  }
M2R_SSD_SCAN_P128(f16, F16)
M2R_SSD_SCAN_P128(bf16, BF16)

