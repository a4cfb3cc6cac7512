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
//   5. chunk_scan    out = decayed C·(entering state) + (masked, decayed C·Bᵀ)·x + D x, then
//                    the z gate;                                    grid (chunks*tiles*h, 1, b)
//
// Every product is accumulated in fp32. Stages 2, 3 and 5 are tiled matrix products: operand
// slabs of 32 along the reduction dim go through LDS (k-major, padded), and each thread owns a
// register tile read with 16-byte LDS loads. LDS per workgroup stays under 32 KiB, well inside
// RDNA's 64 KiB. Positions past seqlen in the last chunk behave as dt' = 0 tokens and are never
// stored. Masked terms are selected away (never multiplied by 0), so workspace entries that are
// never written (C·Bᵀ above the diagonal) cannot leak NaN into a result.
#include "platform.h"

namespace m2r {
namespace ssd {

constexpr int kThreads = 256;
constexpr int kSlab = 32;           // reduction-dim slab staged in LDS
constexpr int kPad = 4;             // LDS row padding (floats); keeps rows 16-byte aligned
constexpr int kHeadsPerCumsum = 8;  // heads per chunk_cumsum block
constexpr int kMaxChunk = 256;

// ---- shared pieces -------------------------------------------------------------------------

// Inclusive prefix sum over the block (kThreads threads); `wsum` holds one float per wavefront.
M2R_DEVICE float block_inclusive_scan(float v, float* wsum) {
  const int lane = threadIdx.x % kWavefront, wave = threadIdx.x / kWavefront;
#pragma unroll
  for (int off = 1; off < kWavefront; off <<= 1) {
    const float u = shfl_up(v, off);
    if (lane >= off) v += u;
  }
  if (lane == kWavefront - 1) wsum[wave] = v;
  __syncthreads();
  float prefix = 0.f;
  for (int i = 0; i < wave; ++i) prefix += wsum[i];
  __syncthreads();
  return v + prefix;
}

M2R_DEVICE void store_as(void* p, int dtype, int64_t idx, float v) {
  if (dtype == M2R_DTYPE_F32) {
    static_cast<float*>(p)[idx] = v;
  } else {
    static_cast<uint16_t*>(p)[idx] = dtype == M2R_DTYPE_F16 ? float_to_fp16(v) : float_to_bf16(v);
  }
}

// acc[i][j] += sum_k A[k][row_i] * B[k][col_j] over one LDS slab. A thread's rows are
// kRowGroups runs of 4 at row0 + 64 g, its columns kColGroups runs of 4 at col0 + 64 g, so a
// quarter-wavefront reads consecutive 16-byte words (no bank conflicts) or one broadcast word.
template <int kRowGroups, int kColGroups, int kLdA, int kLdB>
M2R_DEVICE void slab_product(float (&acc)[4 * kRowGroups][4 * kColGroups], const float* As,
                             const float* Bs, int row0, int col0) {
#pragma unroll
  for (int k = 0; k < kSlab; ++k) {
    float a[4 * kRowGroups], b[4 * kColGroups];
#pragma unroll
    for (int g = 0; g < kRowGroups; ++g) {
      const float4 v = *reinterpret_cast<const float4*>(As + k * kLdA + row0 + 64 * g);
      a[4 * g] = v.x, a[4 * g + 1] = v.y, a[4 * g + 2] = v.z, a[4 * g + 3] = v.w;
    }
#pragma unroll
    for (int g = 0; g < kColGroups; ++g) {
      const float4 v = *reinterpret_cast<const float4*>(Bs + k * kLdB + col0 + 64 * g);
      b[4 * g] = v.x, b[4 * g + 1] = v.y, b[4 * g + 2] = v.z, b[4 * g + 3] = v.w;
    }
#pragma unroll
    for (int i = 0; i < 4 * kRowGroups; ++i)
#pragma unroll
      for (int j = 0; j < 4 * kColGroups; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
  }
}

// Stage rows [row0, row0 + kRows) x cols [col0, col0 + kSlab) of a row-major global matrix
// (unit stride along cols) into LDS transposed: dst[col][row]. Out-of-range entries are 0.
template <typename T, int kRows, int kLd>
M2R_DEVICE void stage_transposed(float* dst, const typename T::storage* src, int row_stride,
                                 int row0, int rows, int col0, int cols) {
#pragma unroll 4  // more keeps every address live: 3x the registers
  for (int i = 0; i < kRows * kSlab / kThreads; ++i) {
    const int idx = threadIdx.x + i * kThreads;
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

M2R_DEVICE int64_t chunk_row(const SsdParams& p, int b, int h, int c) {  // dt_out / dA_cs row
  return ((static_cast<int64_t>(b) * p.nheads + h) * p.nchunks + c) * p.chunk_size;
}

M2R_DEVICE int64_t states_at(const SsdParams& p, int b, int c, int h) {
  return ((static_cast<int64_t>(b) * p.nchunks + c) * p.nheads + h) * p.dstate * p.headdim;
}

// ---- 1. chunk cumsum ----------------------------------------------------------------------

M2R_DEVICE void chunk_cumsum(const SsdParams& p) {
  __shared__ float wsum[kThreads / kWavefront];
  const int t = threadIdx.x, c = blockIdx.x, b = blockIdx.z;
  const int64_t pos = static_cast<int64_t>(c) * p.chunk_size + t;
  const bool valid = t < p.chunk_size && pos < p.seqlen;

  if (blockIdx.y == 0) {  // segments: changes of seq_idx since the token before the chunk
    float change = 0.f;
    if (valid && p.seq_idx) {
      const int32_t* row = p.seq_idx + b * p.seq_idx_batch_stride;
      const int32_t prev = pos == 0 ? 0 : row[(pos - 1) * p.seq_idx_l_stride];
      change = row[pos * p.seq_idx_l_stride] != prev ? 1.f : 0.f;
    }
    const float seg = block_inclusive_scan(change, wsum);
    if (t < p.chunk_size) p.seg[(static_cast<int64_t>(b) * p.nchunks + c) * p.chunk_size + t] = static_cast<int32_t>(seg);
  }
  for (int i = 0; i < kHeadsPerCumsum; ++i) {
    const int h = blockIdx.y * kHeadsPerCumsum + i;
    if (h >= p.nheads) break;  // uniform over the block
    float d = 0.f;
    if (valid) {
      d = load_as_float(p.dt, p.dt_dtype, b * p.dt_batch_stride + pos * p.dt_l_stride + h * p.dt_h_stride);
      if (p.dt_bias) d += load_as_float(p.dt_bias, p.dt_bias_dtype, h * p.dt_bias_stride);
      if (p.dt_softplus) d = softplus(d);
      d = fminf(fmaxf(d, p.dt_min), p.dt_max);
    }
    const float a = load_as_float(p.A, p.a_dtype, h * p.A_stride);
    const float cum = block_inclusive_scan(d * a, wsum);
    if (t < p.chunk_size) {
      const int64_t o = chunk_row(p, b, h, c) + t;
      p.dt_out[o] = d;
      p.dA_cs[o] = cum;
    }
  }
}

// ---- 2. C·Bᵀ --------------------------------------------------------------------------------

template <typename T>
M2R_DEVICE void bmm(const SsdParams& p) {
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

// A (headdim-tile 64) x (dstate-tile 128) block of one chunk's state, summed over the chunk's
// positions up to `end` that share its segment, each weighted by exp(dA_cs[end] - dA_cs[s]) dt[s].
// kVarlen: the state right after the last token of sequence blockIdx.x / tiles (cu_seqlens),
// which adds the state entering that chunk and is written (headdim, dstate) in state_dtype.
template <typename T, bool kVarlen>
M2R_DEVICE void chunk_state(const SsdParams& p) {
  typedef typename T::storage S;
  constexpr int kLdX = 64 + kPad, kLdB = 128 + kPad;
  __shared__ __align__(16) float Xs[kSlab * kLdX];
  __shared__ __align__(16) float Bs[kSlab * kLdB];
  __shared__ float w[kMaxChunk];
  // heads fastest: the heads of a group, which read the same B rows, run side by side
  const int tiles_n = (p.dstate + 127) / 128, tiles = tiles_n * ((p.headdim + 63) / 64);
  const int h = blockIdx.x % p.nheads, g = h / p.heads_per_group;
  const int tile = (blockIdx.x / p.nheads) % tiles, item = blockIdx.x / p.nheads / tiles;
  const int p0 = (tile / tiles_n) * 64, n0 = (tile % tiles_n) * 128;
  int b, c, end;
  if constexpr (kVarlen) {
    const int last = p.cu_seqlens[item + 1] - 1;
    b = 0, c = last / p.chunk_size, end = last % p.chunk_size;
  } else {
    b = blockIdx.z, c = item, end = p.chunk_size - 1;
  }
  const int64_t l0 = static_cast<int64_t>(c) * p.chunk_size;
  const int rows = static_cast<int>(min(static_cast<int64_t>(end + 1), p.seqlen - l0));
  const float* acs = p.dA_cs + chunk_row(p, b, h, c);
  const float* dts = p.dt_out + chunk_row(p, b, h, c);
  const int32_t* seg = p.seg + (static_cast<int64_t>(b) * p.nchunks + c) * p.chunk_size;
  const float a_end = acs[end];
  const int seg_end = seg[end];
  for (int s = threadIdx.x; s < p.chunk_size; s += kThreads)
    w[s] = s <= end && seg[s] == seg_end ? __expf(a_end - acs[s]) * dts[s] : 0.f;
  __syncthreads();

  const S* xp = static_cast<const S*>(p.x) + b * p.x_batch_stride + l0 * p.x_l_stride + h * p.x_h_stride;
  const S* Bp = static_cast<const S*>(p.B) + b * p.B_batch_stride + l0 * p.B_l_stride + g * p.B_g_stride;
  const int p_off = 4 * (threadIdx.x / 16), n_off = 4 * (threadIdx.x % 16);
  float acc[4][8] = {};
  for (int s0 = 0; s0 < rows; s0 += kSlab) {
    stage_rows<T, 64, kLdX>(Xs, xp + s0 * p.x_l_stride, p.x_l_stride, 0, rows - s0, p0, p.headdim, nullptr);
    stage_rows<T, 128, kLdB>(Bs, Bp + s0 * p.B_l_stride, p.B_l_stride, 0, rows - s0, n0, p.dstate, w + s0);
    __syncthreads();
    slab_product<1, 2, kLdX, kLdB>(acc, Xs, Bs, p_off, n_off);
    __syncthreads();
  }

  if constexpr (kVarlen) {
    const float* entering = p.states + states_at(p, b, c, h);
    const float carry = seg_end == 0 ? __expf(a_end) : 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int pp = p0 + p_off + i, n = n0 + n_off + (j % 4) + 64 * (j / 4);
        if (pp >= p.headdim || n >= p.dstate) continue;
        const float v = acc[i][j] + carry * entering[static_cast<int64_t>(n) * p.headdim + pp];
        store_as(p.varlen_states, p.state_dtype, ((static_cast<int64_t>(item) * p.nheads + h) * p.headdim + pp) * p.dstate + n, v);
      }
  } else {
    float* out = p.states + states_at(p, b, c, h);
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int pp = p0 + p_off + i, n = n0 + n_off + (j % 4) + 64 * (j / 4);
        if (pp < p.headdim && n < p.dstate) out[static_cast<int64_t>(n) * p.headdim + pp] = acc[i][j];
      }
  }
}

// ---- 4. state passing -----------------------------------------------------------------------

// kPassVec (n, p) elements of a head's state per thread: entering[c] = state; state = carry_c
// state + own_c, with carry_c = exp(dA_cs[c][last]) when the chunk's last token continues the
// segment of the token before the chunk, else 0 (a sequence started inside the chunk). The
// carries of up to kThreads chunks at a time come through LDS, and each chunk's own state is
// loaded one chunk ahead, so the loop waits on memory once, not once per chunk.
constexpr int kPassVec = 4;

M2R_DEVICE void state_passing(const SsdParams& p) {
  __shared__ float carry[kThreads];
  const int h = blockIdx.y, b = blockIdx.z;
  const int64_t pn = static_cast<int64_t>(p.headdim) * p.dstate;
  const int64_t e0 = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * kPassVec;
  const int64_t chunk_stride = static_cast<int64_t>(p.nheads) * pn;
  float* base = p.states + states_at(p, b, 0, h) + e0;
  float s[kPassVec], own[kPassVec], next[kPassVec];
#pragma unroll
  for (int v = 0; v < kPassVec; ++v) {
    const int64_t e = e0 + v;
    const int n = static_cast<int>(e / p.headdim), pp = static_cast<int>(e % p.headdim);
    s[v] = e < pn && p.initial_states
               ? load_as_float(p.initial_states, p.init_dtype, b * p.init_batch_stride + h * p.init_h_stride +
                                                                   pp * p.init_p_stride + n * p.init_n_stride)
               : 0.f;
    own[v] = e < pn ? base[v] : 0.f;
  }
  const int last = p.chunk_size - 1;
  for (int c0 = 0; c0 < p.nchunks; c0 += kThreads) {
    __syncthreads();
    const int cc = c0 + threadIdx.x;
    if (cc < p.nchunks) {
      const bool carries = p.seg[(static_cast<int64_t>(b) * p.nchunks + cc) * p.chunk_size + last] == 0;
      carry[threadIdx.x] = carries ? __expf(p.dA_cs[chunk_row(p, b, h, cc) + last]) : 0.f;
    }
    __syncthreads();
    const int count = min(kThreads, p.nchunks - c0);
    for (int i = 0; i < count; ++i) {
      float* at = base + (c0 + i) * chunk_stride;
      const bool more = c0 + i + 1 < p.nchunks;
#pragma unroll
      for (int v = 0; v < kPassVec; ++v) next[v] = more && e0 + v < pn ? at[chunk_stride + v] : 0.f;
#pragma unroll
      for (int v = 0; v < kPassVec; ++v) {
        if (e0 + v < pn) at[v] = s[v];
        s[v] = carry[i] * s[v] + own[v];
        own[v] = next[v];
      }
    }
  }
  if (p.final_states) {
#pragma unroll
    for (int v = 0; v < kPassVec; ++v) {
      const int64_t e = e0 + v;
      if (e >= pn) continue;
      const int n = static_cast<int>(e / p.headdim), pp = static_cast<int>(e % p.headdim);
      store_as(p.final_states, p.state_dtype, ((static_cast<int64_t>(b) * p.nheads + h) * p.headdim + pp) * p.dstate + n, s[v]);
    }
  }
}

// ---- 5. chunk scan --------------------------------------------------------------------------

// A (kRows positions) x (64 headdim) tile of one chunk and head:
//   y[t] = exp(dA_cs[t]) [seg[t] == 0] C[t]·entering  +  sum_{s <= t, seg[s] == seg[t]}
//          C[t]·B[s] exp(dA_cs[t] - dA_cs[s]) dt[s] x[s]  +  D x[t],   then y * silu(z[t]).
template <typename T, int kRows, bool kHasZ>
M2R_DEVICE void chunk_scan(const SsdParams& p) {
  typedef typename T::storage S;
  constexpr int kRowGroups = kRows / 64;
  constexpr int kLdA = kRows + kPad, kLdB = 64 + kPad;
  __shared__ __align__(16) float As[kSlab * kLdA];
  __shared__ __align__(16) float Bs[kSlab * kLdB];
  __shared__ float acs[kMaxChunk], dts[kMaxChunk];
  __shared__ int32_t seg[kMaxChunk];
  // heads fastest: the heads of a group, which read the same C rows and C·Bᵀ, run side by side
  const int tiles_t = p.chunk_size / kRows, tiles = tiles_t * ((p.headdim + 63) / 64);
  const int h = blockIdx.x % p.nheads, g = h / p.heads_per_group, b = blockIdx.z;
  const int tile = (blockIdx.x / p.nheads) % tiles, c = blockIdx.x / p.nheads / tiles;
  const int t0 = (tile % tiles_t) * kRows, p0 = (tile / tiles_t) * 64;
  const int64_t l0 = static_cast<int64_t>(c) * p.chunk_size;
  const int rows = static_cast<int>(min(static_cast<int64_t>(p.chunk_size), p.seqlen - l0));
  {
    const float* a = p.dA_cs + chunk_row(p, b, h, c);
    const float* d = p.dt_out + chunk_row(p, b, h, c);
    const int32_t* sg = p.seg + (static_cast<int64_t>(b) * p.nchunks + c) * p.chunk_size;
    for (int s = threadIdx.x; s < p.chunk_size; s += kThreads) acs[s] = a[s], dts[s] = d[s], seg[s] = sg[s];
  }
  __syncthreads();
  const int t_off = 4 * (threadIdx.x / 16), p_off = 4 * (threadIdx.x % 16);
  float acc[4 * kRowGroups][4] = {};

  // the entering state, read through C (it is zero for chunk 0 without initial states)
  if (c > 0 || p.initial_states) {
    const S* Cp = static_cast<const S*>(p.C) + b * p.C_batch_stride + l0 * p.C_l_stride + g * p.C_g_stride;
    const float* E = p.states + states_at(p, b, c, h);
    for (int n0 = 0; n0 < p.dstate; n0 += kSlab) {
      stage_transposed<T, kRows, kLdA>(As, Cp, p.C_l_stride, t0, rows, n0, p.dstate);
#pragma unroll 4  // more keeps every address live: 3x the registers
      for (int i = 0; i < 64 * kSlab / kThreads; ++i) {
        const int idx = threadIdx.x + i * kThreads;
        const int col = idx % 64, k = idx / 64;
        Bs[k * kLdB + col] = n0 + k < p.dstate && p0 + col < p.headdim
                                 ? E[static_cast<int64_t>(n0 + k) * p.headdim + p0 + col] : 0.f;
      }
      __syncthreads();
      slab_product<kRowGroups, 1, kLdA, kLdB>(acc, As, Bs, t_off, p_off);
      __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4 * kRowGroups; ++i) {
      const int t = t0 + t_off + (i % 4) + 64 * (i / 4);
      const float f = seg[t] == 0 ? __expf(acs[t]) : 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] *= f;
    }
  }

  // within the chunk: positions s <= t of the same segment
  const S* xp = static_cast<const S*>(p.x) + b * p.x_batch_stride + l0 * p.x_l_stride + h * p.x_h_stride;
  const float* cb = p.cb + ((static_cast<int64_t>(b) * p.nchunks + c) * p.ngroups + g) *
                               static_cast<int64_t>(p.chunk_size) * p.chunk_size;
  const int s_end = min(t0 + kRows, rows);
  for (int s0 = 0; s0 < s_end; s0 += kSlab) {
#pragma unroll 4  // more keeps every address live: 3x the registers
    for (int i = 0; i < kRows * kSlab / kThreads; ++i) {
      const int idx = threadIdx.x + i * kThreads;
      const int t = idx % kRows, k = idx / kRows;
      const int s = s0 + k, tt = t0 + t;
      float v = 0.f;
      if (s <= tt && s < rows && seg[s] == seg[tt])
        v = cb[static_cast<int64_t>(s) * p.chunk_size + tt] * __expf(acs[tt] - acs[s]) * dts[s];
      As[k * kLdA + t] = v;
    }
    stage_rows<T, 64, kLdB>(Bs, xp + s0 * static_cast<int>(p.x_l_stride), static_cast<int>(p.x_l_stride), 0, rows - s0, p0, p.headdim, nullptr);
    __syncthreads();
    slab_product<kRowGroups, 1, kLdA, kLdB>(acc, As, Bs, t_off, p_off);
    __syncthreads();
  }

  // D, the gate, the store
  // in-chunk offsets are 32-bit (the host checks chunk_size * stride < 2^31): fewer scalar
  // registers live here, which gfx90a otherwise runs out of
  S* out = static_cast<S*>(p.out) + b * p.out_batch_stride + l0 * p.out_l_stride + h * p.out_h_stride;
  const S* zp = kHasZ ? static_cast<const S*>(p.z) + b * p.z_batch_stride + l0 * p.z_l_stride + h * p.z_h_stride : nullptr;
  const int xl = static_cast<int>(p.x_l_stride), zl = static_cast<int>(p.z_l_stride);
  const int ol = static_cast<int>(p.out_l_stride);
#pragma unroll
  for (int i = 0; i < 4 * kRowGroups; ++i) {
    const int t = t0 + t_off + (i % 4) + 64 * (i / 4);
    if (t >= rows) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int pp = p0 + p_off + j;
      if (pp >= p.headdim) continue;
      float y = acc[i][j];
      if (p.D) y = fmaf(load_as_float(p.D, p.d_dtype, h * p.D_h_stride + pp * p.D_p_stride),
                        T::to_float(xp[t * xl + pp]), y);
      if constexpr (kHasZ) y *= silu(T::to_float(zp[t * zl + pp]));
      out[t * ol + pp] = T::from_float(y);
    }
  }
}

}  // namespace ssd
}  // namespace m2r

M2R_KERNEL(m2r::ssd::kThreads) m2r_ssd_chunk_cumsum(SsdParams p) { m2r::ssd::chunk_cumsum(p); }
M2R_KERNEL(m2r::ssd::kThreads) m2r_ssd_state_passing(SsdParams p) { m2r::ssd::state_passing(p); }

#define M2R_SSD(DT, T)                                                                           \
  M2R_KERNEL(m2r::ssd::kThreads) m2r_ssd_bmm_##DT(SsdParams p) { m2r::ssd::bmm<m2r::T>(p); }     \
  M2R_KERNEL(m2r::ssd::kThreads) m2r_ssd_chunk_state_##DT(SsdParams p) {                         \
    m2r::ssd::chunk_state<m2r::T, false>(p);                                                     \
  }                                                                                              \
  M2R_KERNEL(m2r::ssd::kThreads) m2r_ssd_varlen_state_##DT(SsdParams p) {                        \
    m2r::ssd::chunk_state<m2r::T, true>(p);                                                      \
  }                                                                                              \
  M2R_KERNEL(m2r::ssd::kThreads) m2r_ssd_chunk_scan_##DT##_t64(SsdParams p) {                    \
    m2r::ssd::chunk_scan<m2r::T, 64, false>(p);                                                  \
  }                                                                                              \
  M2R_KERNEL(m2r::ssd::kThreads) m2r_ssd_chunk_scan_##DT##_t64_z(SsdParams p) {                  \
    m2r::ssd::chunk_scan<m2r::T, 64, true>(p);                                                   \
  }                                                                                              \
  M2R_KERNEL(m2r::ssd::kThreads) m2r_ssd_chunk_scan_##DT##_t128(SsdParams p) {                   \
    m2r::ssd::chunk_scan<m2r::T, 128, false>(p);                                                 \
  }                                                                                              \
  M2R_KERNEL(m2r::ssd::kThreads) m2r_ssd_chunk_scan_##DT##_t128_z(SsdParams p) {                 \
    m2r::ssd::chunk_scan<m2r::T, 128, true>(p);                                                  \
  }
M2R_SSD(f32, F32)
M2R_SSD(f16, F16)
M2R_SSD(bf16, BF16)
