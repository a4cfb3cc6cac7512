// Mamba2 SSD forward, stage 3: chunk_state (and the chained 3+4, and the varlen states) (the stages and their grids: ssd_common.h).
#include "ssd_common.h"

namespace m2r {
namespace ssd {

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

#if M2R_MMA != 0
// A chained block of the last chunk: final_states ([p][n]) from the 64 rows n of `half` staged in
// O, so that neighbouring threads write neighbouring n
M2R_DEVICE void store_final_half(const SsdParams& p, const Chain& ch, int pcols, const float* O, int half) {
  for (int o = threadIdx.x; o < 64 * pcols; o += kThreads) {
    const int rr = o % 64, pc = o / 64, n = ch.n0 + 64 * half + rr;
    if (n < p.dstate) store_final(p, ch.b, ch.h, n, ch.p0 + pc, O[rr * kLdO + pc]);
  }
}

// chunk_state's waves along the tile's rows n (the rest go along p). On NVIDIA two: each wave
// then holds one p fragment of x and its remainder (8 registers, not 16) and the kernel fits
// 80 registers, kStateBlocks per multiprocessor (H100, b1 l16384 h64 g8: 195 -> 164 us; 4
// waves at 2 blocks before). The AMD targets keep 4 (wave32) / 2 (wave64).
constexpr int kStateWavesM = M2R_MMA == 1 ? 2 : kWaves == 8 ? 4 : 2;

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
#endif

// kLds: chained with the link through LDS (chunk_state_mma; the FMA path has one form)
template <typename T, bool kVarlen, bool kChain, bool kLds = false>
M2R_DEVICE void chunk_state(const SsdParams& p) {
#if M2R_MMA != 0
  if constexpr (mma::kEnabled<T>) return chunk_state_mma<T, kVarlen, kChain, kLds>(p);
  else
#endif
  chunk_state_fma<T, kVarlen, kChain>(p);
}

// the chained chunk_state's blocks per multiprocessor with the link through LDS (NVIDIA; the FMA
// path's one form keeps kChainBlocks)
template <typename T>
constexpr int kChainLdsBlocksOf = mma::kEnabled<T> ? kChainLdsBlocks : kChainBlocks;

}  // namespace ssd
}  // namespace m2r

#define M2R_SSD_STATE(DT, T)                                                                       \
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
  }
M2R_SSD_STATE(f32, F32)
M2R_SSD_STATE(f16, F16)
M2R_SSD_STATE(bf16, BF16)
