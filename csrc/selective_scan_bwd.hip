// Mamba1's selective scan, backward (parameters and outputs: params.h, SelectiveScanBwdParams).
//
// The forward (params.h, SelectiveScanParams): with the decay a[t][n] = exp(delta'[t] A[n]),
//   h[t] = a[t] h[t-1] + delta'[t] B[t] u[t],   y[t] = sum_n C[t] h[t] + D u[t],
//   out[t] = y[t] silu(z[t]).
// Going backward, dy = dout silu(z), and the state's adjoint g[t] = C[t] dy[t] + a[t+1] g[t+1]
// (past the last token: the last state's gradient) gives
//   du[t] = delta'[t] sum_n g B + D dy[t]          ddelta'[t] = sum_n g (A a h[t-1] + B u[t])
//   dA[n] = sum_t g delta' a h[t-1]                 dB[t][n] = g delta' u,  dC[t][n] = dy h[t]
//   dD = sum_t dy u                                 dz[t] = dout y dsilu(z)
// and ddelta through softplus and the bias; dB / dC summed over the channels of a group
// (variable B / C) or over the tokens (fixed ones).
//
// Work split: a channel takes a wavefront (32 lanes, 64 on CDNA), a block of 128 threads kCh = 4
// (2) channels of one group of B and of C. The sequence goes in chunks of kChunk tokens, lane j
// owning the kTok consecutive tokens from j * kTok (kTok 8 on NVIDIA: 256 tokens a chunk; 4 on
// AMD wave32, 2 on wave64: 128). Two kernels:
//   1. carries (m2r_selective_scan_bwd_carry_*): per channel, the state entering every chunk,
//      forward over the chunks (the lanes' maps h -> P h + hl, P the product of the decays, hl
//      the state from zero, composed by a prefix scan over the lanes), to ckpt; and, where the
//      gradients run in more than one chunk range, the adjoint entering each range's last chunk
//      from the right, backward over the chunks from the last state's gradient (the lanes' maps
//      w -> P w + wl of w = a g, composed right to left), to wckpt (dstate floats per chunk and
//      channel each). Both walks are short (a scan per chunk and state element); they are all
//      that chains the ranges.
//   2. the gradients (m2r_selective_scan_bwd_*): every (channel slice, chunk range) a block
//      (blockIdx.x = group * slices + slice, blockIdx.z the range: the ranges are independent
//      once their carries are known, so narrow calls still fill the GPU; the host takes one
//      range where the slices alone fill it, and the carries then skip their backward walk).
//      Per chunk, last first, and state element: the lane's decays and states again from the
//      chunk's entering state (the prefix scan), then the adjoint through the lanes' maps from
//      the carry entering the chunk (the suffix scan; the range's own for its last chunk, then
//      each chunk's carry out, kept in LDS), then every token's terms. The sums over state
//      elements (du, ddelta, y) stay in the lane's registers (y in LDS); dA and fixed dB / dC
//      are summed over the wave per (chunk, element) and written per chunk (the host sums the
//      chunks); variable dB / dC are summed over the block's channels in LDS, in channel order,
//      and added to the block's slice of the partial at the chunk's tokens (read-modify-write:
//      no other block touches them; the host zeroes it and sums the slices); dD and ddelta_bias
//      per channel and range.
// No per-token state is stored, and nothing is atomic: every sum has a fixed order, runs are
// bit-identical. Tokens past seqlen (the last chunk's tail) take step 0, u 0 and dy 0: the
// identity, contributing nothing. Variable B / C rows (and their partials) are padded by the
// host to ld tokens, so their loads need no tail.
//
// Kernels: m2r_selective_scan_bwd_[carry_]<dtype>_<B><C>[_z], B / C variable (v) or fixed (f),
// with z or without. AMD's compiler keeps uniform flags and base pointers in scalar registers (masks
// of two on wave64) through the loops: the variants are kernels of their own, absent D /
// delta_bias / last-state gradient come as zeros, lane conditions are bit selects (pick) and
// pointers sit in vector registers (per_lane); so every recipe target compiles without spills.
#include "platform.h"
#include "token_runs.h"

namespace m2r {
namespace sscan_bwd {

// A channel per wavefront: its lanes' shuffles are the wave's own (on wave64 the scans take six
// steps), and per-channel values are wave-uniform.
constexpr int kSeg = kWavefront;
// tokens per lane and chunk: 8 on NVIDIA (16-byte runs of half-precision rows, the measured
// form); 4 on AMD wave32 and 2 on wave64 (chunks of 128 tokens), and so in the NVIDIA builds that
// emulate them: AMD's compiler holds about twice the vector registers for the same code (8
// spilled on every recipe target), and on wave64 a chunk of 256 tokens needed two reduction
// passes per thread, which spilled scalar registers on gfx90a
#ifndef M2R_SSCAN_BWD_TOK
#if M2R_AMD || defined(M2R_EMULATE_GFX1030) || defined(M2R_EMULATE_GFX11) || \
    defined(M2R_EMULATE_GFX12) || defined(M2R_EMULATE_GFX9)
#define M2R_SSCAN_BWD_TOK (M2R_WAVEFRONT_SIZE == 64 ? 2 : 4)
#else
#define M2R_SSCAN_BWD_TOK 8
#endif
#endif
constexpr int kTok = M2R_SSCAN_BWD_TOK;
constexpr int kChunk = kSeg * kTok;  // 256 (NVIDIA) or 128 (AMD): the host sizes for both
// state elements a step of the backward walk (a build-time knob for measuring): 1, the measured
// best (H100, b8 d4096 l2048 n16 bf16: 6.9 ms; 2 elements a step at 2 blocks per multiprocessor,
// their registers' cost: 8.3 ms)
#ifndef M2R_SSCAN_BWD_INTER
#define M2R_SSCAN_BWD_INTER 1
#endif
constexpr int kInter = M2R_SSCAN_BWD_INTER;
// state elements of the forward walk (step 1 below) unrolled together, their chains of
// shuffles interleaved (a build-time knob for measuring; 1: one element after the other)
#ifndef M2R_SSCAN_BWD_UNROLL1
#define M2R_SSCAN_BWD_UNROLL1 1
#endif
#define M2R_BWD_STR_(x) #x
#define M2R_BWD_PRAGMA_UNROLL(n) _Pragma(M2R_BWD_STR_(unroll n))
static_assert(kInter == 1 || kInter == 2, "one or two elements a step");
// NVIDIA: blocks per multiprocessor the registers are capped for (3: 168 registers, no spills)
#ifndef M2R_SSCAN_BWD_MIN_BLOCKS
#define M2R_SSCAN_BWD_MIN_BLOCKS 3
#endif
constexpr int kThreads = 128;  // 3 blocks per multiprocessor on the H100 (168 registers)
constexpr int kCh = kThreads / kSeg;  // channels per block: 4, or 2 on wave64
// NVIDIA: blocks per multiprocessor the carries' kernel is built for (8: 64 registers; without
// the bound ptxas took 56 and spilled in the gfx1030 emulation build)
constexpr int kCarryBlocks = 8;
constexpr int kMaxN = 256;  // dstate

// a where the lane mask m is all ones, b where it is 0: bit operations on a mask held in a
// vector register. A compare would give a scalar mask per condition, which AMD's compiler
// hoists out of the loops and keeps (wave64: two scalar registers each) until it runs out.
M2R_DEVICE float pick(int m, float a, float b) {
  return __int_as_float((__float_as_int(a) & m) | (__float_as_int(b) & ~m));
}

// Inclusive prefix scan of the maps x -> P x + v over a channel's lanes (lane j: lanes 0..j,
// the later map applied last). j: the lane in the channel, opaque (per_lane).
M2R_DEVICE void scan_up(int j, float& P, float& v) {
#pragma unroll
  for (int s = 1; s < kSeg; s *= 2) {
    const float vp = shfl_up(v, s);
    const float Pp = shfl_up(P, s);
    const int m = -min(j / s, 1);  // lanes j >= s take the map below
    v = pick(m, fmaf(P, vp, v), v);
    P = pick(m, P * Pp, P);
  }
}

// Both scans at once (independent chains, interleaved): the prefix of (P, v) as scan_up, and
// the inclusive suffix of (Pw, w) (lane j: lanes j..last, lane j's map applied last).
M2R_DEVICE void scan_both(int j, float& P, float& v, float& Pw, float& w) {
#pragma unroll
  for (int s = 1; s < kSeg; s *= 2) {
    const float vp = shfl_up(v, s), Pp = shfl_up(P, s);
    const float wn = shfl_down(w, s), Pn = shfl_down(Pw, s);
    const int mu = -min(j / s, 1), md = ((j + s) / kSeg) - 1;
    v = pick(mu, fmaf(P, vp, v), v);
    P = pick(mu, P * Pp, P);
    w = pick(md, fmaf(Pw, wn, w), w);
    Pw = pick(md, Pw * Pn, Pw);
  }
}

// The sum over a channel's lanes (butterfly: the same order every run), in every lane.
M2R_DEVICE float lane_sum(float v) {
#pragma unroll
  for (int s = kSeg / 2; s > 0; s /= 2) v += shfl_xor(v, s);
  return v;
}

// The composition of a channel's lanes' maps x -> P x + v, right to left (lane j's map applied
// after lane j + 1's), in lane 0: a tree over the lanes, no masks (a lane whose partner is past
// the wave composes garbage that no lane 0 reads).
M2R_DEVICE void compose_down(float& P, float& v) {
#pragma unroll
  for (int s = 1; s < kSeg; s *= 2) {
    const float vn = shfl_down(v, s), Pn = shfl_down(P, s);
    v = fmaf(P, vn, v);
    P *= Pn;
  }
}

// step' (bias, then softplus where the mask sp is all ones) of kTok tokens from t on; 0 past the
// sequence (the identity step)
M2R_DEVICE void steps(const float* raw, float dbias, int sp, int t, int L, float* dt) {
#pragma unroll
  for (int k = 0; k < kTok; ++k) {
    const float v = raw[k] + dbias;
    dt[k] = t + k < L ? pick(sp, softplus(v), v) : 0.f;
  }
}

// B or C of state element n at the lane's tokens: a group's row (variable; rows of ld floats,
// padded to whole chunks and 16-byte aligned by the host: whole-run loads, no tail) or the
// channel's fixed value
template <bool kVar>
M2R_DEVICE void load_bc(const float* blk, const float* fixed, int n, int t, int ld,
                        float* out) {
  if constexpr (kVar && kTok == 2) {
    const float2 w = *reinterpret_cast<const float2*>(blk + static_cast<int64_t>(n) * ld + t);
    out[0] = w.x, out[1] = w.y;
  } else if constexpr (kVar) {
    const float4* q = reinterpret_cast<const float4*>(blk + static_cast<int64_t>(n) * ld + t);
#pragma unroll
    for (int i = 0; i < kTok / 4; ++i) {
      const float4 w = q[i];
      out[4 * i] = w.x, out[4 * i + 1] = w.y, out[4 * i + 2] = w.z, out[4 * i + 3] = w.w;
    }
  } else {
    const float v = fixed[n];
#pragma unroll
    for (int k = 0; k < kTok; ++k) out[k] = v;
  }
}

// Chunks a range of the gradients' kernel: ``ranges`` ranges of equal length (the last ones may
// be short or empty). The carries' kernel writes wckpt at the same range ends.
M2R_DEVICE int chunks_per_range(int nchunks, int ranges) { return (nchunks + ranges - 1) / ranges; }

// A block's share of either kernel's grid (blockIdx.x = group * slices + slice, blockIdx.y the
// batch row): its slice [c_begin, c_end) of the group's channels, and the group's rows of
// variable B / C (every channel of the block reads the same ones; a fixed one: the tensor).
// 32-bit indices (channels, tokens, chunks all < 2^31); 64-bit only in offsets: fewer scalar
// registers on AMD.
struct BlockSlice {
  int b, g, slice, c_begin, c_end;
  const float* b_blk;
  const float* c_blk;
};

template <bool kVarB, bool kVarC>
M2R_DEVICE BlockSlice block_slice(const SelectiveScanBwdParams& p) {
  BlockSlice s;
  s.b = blockIdx.y;
  s.g = blockIdx.x / p.slices;
  s.slice = blockIdx.x % p.slices;
  const int gdim = p.dim / p.groups;
  s.c_begin = s.g * gdim + s.slice * p.slice_ch;
  s.c_end = min(s.c_begin + p.slice_ch, (s.g + 1) * gdim);
  const int nst = p.dstate, ld = p.ld;
  s.b_blk = kVarB ? p.B + static_cast<int64_t>(s.b * p.b_groups + s.c_begin / (p.dim / p.b_groups)) * nst * ld : p.B;
  s.c_blk = kVarC ? p.C + static_cast<int64_t>(s.b * p.c_groups + s.c_begin / (p.dim / p.c_groups)) * nst * ld : p.C;
  return s;
}

// 1. The carries: ckpt, the state entering every chunk (chunk 0: zero), and wckpt, the
// adjoint entering every chunk from the right (the last chunk: the last state's gradient).
// Grid and channels as the gradients' kernel, one chunk range (blockIdx.z unused).
template <typename T, bool kZ, bool kVarB, bool kVarC>
M2R_DEVICE void carries(const SelectiveScanBwdParams& params) {
  typedef typename T::storage S;
  SelectiveScanBwdParams p = params;
  if constexpr (kWavefront == 64) {
    p.u = per_lane(p.u), p.delta = per_lane(p.delta), p.dout = per_lane(p.dout);
    p.z = per_lane(p.z);
  }
  p.A = per_lane(p.A), p.B = per_lane(p.B), p.C = per_lane(p.C);
  p.delta_bias = per_lane(p.delta_bias), p.dlast = per_lane(p.dlast);
  p.ckpt = per_lane(p.ckpt), p.wckpt = per_lane(p.wckpt);
  __shared__ float s_carry[kCh][kMaxN];  // per channel and element, the carry between chunks
  const int tid = threadIdx.x;
  const int j0 = per_lane(static_cast<int>(tid % kSeg));
  const int ch = tid / kSeg;
  const BlockSlice bs = block_slice<kVarB, kVarC>(p);
  const int b = bs.b, c_begin = bs.c_begin, c_end = bs.c_end;
  const float* const b_blk = bs.b_blk;
  const float* const c_blk = bs.c_blk;
  const int L = p.seqlen;
  const int nst = p.dstate;
  const int nchunks = (L + kChunk - 1) / kChunk;
  const int ld = p.ld;
  const int sp_m = per_lane(p.delta_softplus != 0 ? -1 : 0);
#pragma unroll 1
  for (int o = c_begin; o < c_end; o += kCh) {
    const int d = o + ch;
    const int dd = d < c_end ? d : o;  // a channel past the slice recomputes channel o: same values
    const int64_t cd = static_cast<int64_t>(b) * p.dim + dd;
    const int64_t row = per_lane(cd * L);
    const auto in = [&](const void* base) { return static_cast<const S*>(base) + per_lane(row); };
    const bool vec_x = (row * static_cast<int64_t>(sizeof(S))) % 16 == 0 && aligned16(params.u) &&
                       aligned16(params.delta) && aligned16(params.dout) &&
                       (!kZ || aligned16(params.z));
    const float dbias = load_as_float(p.delta_bias, p.delta_bias_dtype, dd);
    const float* const a_row = per_lane(p.A + dd * nst);
    const float* const b_fix = per_lane(p.B + dd * nst);  // read only when fixed
    const float* const c_fix = per_lane(p.C + dd * nst);
    const int64_t crow = cd * p.nck * nst;
    float* const ck = per_lane(p.ckpt + crow);
    float* const wk = per_lane(p.wckpt + crow);

    // the states, forward. Every lane keeps the carries in LDS alike: it reads the old one,
    // the wave syncs, every lane writes the same new one (so a lane's later read finds the new
    // value whichever lane's write it sees); the wave syncs again before the carries start over.
    wave_sync();
    for (int n = 0; n < nst; ++n) s_carry[ch][n] = 0.f;
    if (j0 == 0) {
      for (int n = 0; n < nst; ++n) ck[n] = 0.f;
    }
#pragma unroll 1
    for (int c = 0; c + 1 < nchunks; ++c) {
      const int t0 = c * kChunk + j0 * kTok;
      float u[kTok], dt[kTok];
      load_seg<T, kTok>(in(p.u), t0, L, vec_x, u);
      load_seg<T, kTok>(in(p.delta), t0, L, vec_x, dt);
      steps(dt, dbias, sp_m, t0, L, dt);
      M2R_BWD_PRAGMA_UNROLL(M2R_SSCAN_BWD_UNROLL1)
      for (int n = 0; n < nst; ++n) {
        const float a2 = a_row[n] * kLog2e;
        float bv[kTok];
        load_bc<kVarB>(b_blk, b_fix, n, t0, ld, bv);
        float P = 1.f, v = 0.f;
#pragma unroll
        for (int k = 0; k < kTok; ++k) {
          const float dec = fast_exp2(a2 * dt[k]);
          v = fmaf(dec, v, dt[k] * u[k] * bv[k]);
          P *= dec;
        }
        scan_up(j0, P, v);
        const float P_all = shfl_idx(P, kSeg - 1);
        const float v_all = shfl_idx(v, kSeg - 1);
        const float prev = s_carry[ch][n];
        wave_sync();
        const float h = fmaf(P_all, prev, v_all);
        s_carry[ch][n] = h;
        ck[(c + 1) * nst + n] = h;
      }
    }
    // the adjoint, backward, from the last state's gradient: the carry out of chunk c (w = a g
    // at its first token) enters c - 1, and goes to wckpt where c - 1 ends a range. The last
    // range starts from dlast, and each range chains the carry through its other chunks
    // itself: so the walk stops at the first range's end, and one range needs none.
    const int per_range = chunks_per_range(nchunks, p.ranges);
    if (per_range >= nchunks) continue;  // (uniform)
    const float* const dl = per_lane(p.dlast + cd * nst);
    wave_sync();
    for (int n = 0; n < nst; ++n) s_carry[ch][n] = dl[n];
#pragma unroll 1
    for (int c = nchunks - 1; c >= per_range; --c) {
      const bool range_end = c % per_range == 0;  // c - 1 is the last chunk of a range
      const int t0 = c * kChunk + j0 * kTok;
      float dt[kTok], dy[kTok];
      load_seg<T, kTok>(in(p.delta), t0, L, vec_x, dt);
      steps(dt, dbias, sp_m, t0, L, dt);
      load_seg<T, kTok>(in(p.dout), t0, L, vec_x, dy);
      if constexpr (kZ) {
        float zv[kTok];
        load_seg<T, kTok>(in(p.z), t0, L, vec_x, zv);
#pragma unroll
        for (int k = 0; k < kTok; ++k) dy[k] *= silu(zv[k]);
      }
      M2R_BWD_PRAGMA_UNROLL(M2R_SSCAN_BWD_UNROLL1)
      for (int n = 0; n < nst; ++n) {
        const float a2 = a_row[n] * kLog2e;
        float cv[kTok];
        load_bc<kVarC>(c_blk, c_fix, n, t0, ld, cv);
        float P = 1.f, w = 0.f;
#pragma unroll
        for (int k = kTok - 1; k >= 0; --k) {
          const float dec = fast_exp2(a2 * dt[k]);
          w = dec * fmaf(cv[k], dy[k], w);
          P *= dec;
        }
        compose_down(P, w);
        const float P_all = shfl_idx(P, 0);
        const float w_all = shfl_idx(w, 0);
        const float prev = s_carry[ch][n];
        wave_sync();
        const float carry = fmaf(P_all, prev, w_all);
        s_carry[ch][n] = carry;
        if (range_end) wk[(c - 1) * nst + n] = carry;
      }
    }
  }
}

// 2. The gradients, chunk by chunk from the carries (blockIdx.z: a range of chunks).
template <typename T, bool kZ, bool kVarB, bool kVarC>
M2R_DEVICE void scan_bwd(const SelectiveScanBwdParams& params) {
  typedef typename T::storage S;
  // every pointer in vector registers from the start (per_lane): AMD's compiler keeps the
  // whole argument struct in scalar registers otherwise, and ran out of them
  // z is a kernel of its own; every other optional tensor is always there (the host passes
  // zeros for an absent D, delta_bias or last state's gradient and always takes dD / ddelta_bias
  // partials): no flags, whose masks AMD's compiler keeps in scalar registers throughout
  constexpr bool has_z = kZ;
  SelectiveScanBwdParams p = params;
  if constexpr (kWavefront == 64) {  // wave64: the row bases too (the masks there are 64-bit)
    p.u = per_lane(p.u), p.delta = per_lane(p.delta), p.dout = per_lane(p.dout);
    p.z = per_lane(p.z), p.du = per_lane(p.du), p.ddelta = per_lane(p.ddelta), p.dz = per_lane(p.dz);
  }
  p.A = per_lane(p.A), p.B = per_lane(p.B), p.C = per_lane(p.C), p.D = per_lane(p.D);
  p.delta_bias = per_lane(p.delta_bias), p.ckpt = per_lane(p.ckpt), p.wckpt = per_lane(p.wckpt);
  p.dA_part = per_lane(p.dA_part), p.dB_part = per_lane(p.dB_part);
  p.dC_part = per_lane(p.dC_part), p.dD_part = per_lane(p.dD_part);
  p.ddb_part = per_lane(p.ddb_part);
  // one (chunk, n)'s variable dB / dC terms per channel, two buffers taken in turns by the
  // block's element steps, counted across chunks and channels (one barrier per step: the
  // buffer a step writes was last read before the previous step's barrier)
  __shared__ float s_red[2][kInter][2][kCh][kChunk];
  // the thread's tokens' y (sum over the state elements of C h) in the backward walk, for dz: a
  // column per thread (AMD's compiler ran out of vector registers with y in them)
  __shared__ float s_y[kTok][kThreads];
  // per channel and element, the adjoint entering the chunk from the right: the range's own
  // (wckpt, or dlast for the last range) for its last chunk, then each chunk's carry out
  __shared__ float s_wc[kCh][kMaxN];
  const int tid = threadIdx.x;
  const int j0 = per_lane(static_cast<int>(tid % kSeg));
  const int ch = tid / kSeg;
  const BlockSlice bs = block_slice<kVarB, kVarC>(p);
  const int b = bs.b, g = bs.g, slice = bs.slice, c_begin = bs.c_begin, c_end = bs.c_end;
  const int L = p.seqlen;
  const int nst = p.dstate;  // <= kMaxN
  const int nchunks = (L + kChunk - 1) / kChunk;  // <= p.nck
  const int ld = p.ld;  // row length of variable B / C and their partials (>= nchunks * kChunk)
  // this block's chunks: p.ranges (the grid's z) ranges of equal length (the host sizes the
  // grid by its own chunk length; a range past the last chunk runs no chunk and writes zero
  // partials)
  const int per_range = chunks_per_range(nchunks, p.ranges);
  const int c_lo = static_cast<int>(blockIdx.z) * per_range;
  const int c_hi = min(nchunks, c_lo + per_range);
  constexpr bool b_var = kVarB, c_var = kVarC;  // kernels of their own, as z
  // softplus on or off as a lane mask (bit selects, no scalar mask live across the loops)
  const int sp_m = per_lane(p.delta_softplus != 0 ? -1 : 0);
  // the group's B / C rows and the block's slices of the dB / dC partials
  const float* const b_blk = bs.b_blk;
  const float* const c_blk = bs.c_blk;
  const int64_t part = (static_cast<int64_t>(b * p.groups + g) * p.slices + slice) * nst * ld;

  int step = 0;  // the block's element steps so far (uniform): s_red's buffer is its parity
#pragma unroll 1
  for (int o = c_begin; o < c_end; o += kCh) {  // the slice's channels, kCh at a time
    const int d = o + ch;
    const bool live = d < c_end;
    const int live_m = per_lane(live ? -1 : 0);
    const int dd = live ? d : o;  // a channel past the slice computes on channel o, adds 0
    const int64_t cd = static_cast<int64_t>(b) * p.dim + dd;  // the (batch row, channel)
    const int64_t row = per_lane(cd * L);
    // the rows of u, delta, dout, z and the outputs: the scalar base pointers plus the row's
    // offset, made again at every use (an opaque offset: AMD's compiler would otherwise keep
    // seven 64-bit row pointers live through the loops)
    const auto in = [&](const void* base) { return static_cast<const S*>(base) + per_lane(row); };
    const auto out = [&](void* base) { return static_cast<S*>(base) + per_lane(row); };
    const bool vec_x = (row * static_cast<int64_t>(sizeof(S))) % 16 == 0 && aligned16(params.u) &&
                       aligned16(params.delta) && aligned16(params.dout) && aligned16(params.du) &&
                       aligned16(params.ddelta) &&
                       (!has_z || (aligned16(params.z) && aligned16(params.dz)));
    const float dbias = load_as_float(p.delta_bias, p.delta_bias_dtype, dd);
    const float dcoef = load_as_float(p.D, p.d_dtype, dd);
    const float* const a_row = per_lane(p.A + dd * nst);
    const float* const b_fix = per_lane(p.B + dd * nst);  // read only when fixed
    const float* const c_fix = per_lane(p.C + dd * nst);
    // this channel's rows of ckpt and the per-chunk partials: (nck, dstate) each
    const int64_t crow = cd * p.nck * nst;
    const float* const ck = per_lane(p.ckpt + crow);
    // the adjoint entering the range from the right; a lane an element at a time. The wave
    // syncs before (the previous channels' last reads) and after (every lane reads them all)
    const float* const w_end = c_hi == nchunks ? per_lane(p.dlast + cd * nst)
                                               : per_lane(p.wckpt + crow + (c_hi - 1) * nst);
    wave_sync();
    for (int n = j0; n < nst; n += kSeg) s_wc[ch][n] = w_end[n];
    wave_sync();

    float dD_l = 0.f, ddb_l = 0.f;
#pragma unroll 1
    for (int c = c_hi - 1; c >= c_lo; --c) {
      const int t0 = c * kChunk + j0 * kTok;
      const int t = t0;
      float u[kTok], dt[kTok], dy[kTok];
      load_seg<T, kTok>(in(p.u), t, L, vec_x, u);
      load_seg<T, kTok>(in(p.delta), t, L, vec_x, dt);
      steps(dt, dbias, sp_m, t, L, dt);
      load_seg<T, kTok>(in(p.dout), t, L, vec_x, dy);
      if constexpr (has_z) {
        float zv[kTok];
        load_seg<T, kTok>(in(p.z), t, L, vec_x, zv);
#pragma unroll
        for (int k = 0; k < kTok; ++k) dy[k] *= silu(zv[k]);
      }
      float du_acc[kTok], ddt_acc[kTok];
#pragma unroll
      for (int k = 0; k < kTok; ++k) du_acc[k] = 0.f, ddt_acc[k] = 0.f, s_y[k][tid] = 0.f;
      // kInter state elements a step (their chains interleave, one barrier for all); their B / C,
      // A and entering state are loaded one step ahead: the block meets at a barrier every
      // step, so a load issued at its start would stall every wave at once. An element past
      // dstate (odd dstate, kInter 2) runs on zeros: A 0, B = C = 0, zero state and carry
      constexpr int kI = kInter;
      constexpr int kPass = (kChunk + kThreads - 1) / kThreads;
      float nb[kI][kTok], nc[kI][kTok], n_an[kI], n_hin[kI];
      const auto fetch = [&](int n, float* bq, float* cq, float& an, float& hin) {
        const int m = min(n, nst - 1);
        load_bc<kVarB>(b_blk, b_fix, m, t, ld, bq);
        load_bc<kVarC>(c_blk, c_fix, m, t, ld, cq);
        const bool ok = n < nst;
        an = ok ? a_row[m] : 0.f, hin = ok ? ck[c * nst + m] : 0.f;
        if (!ok) {
#pragma unroll
          for (int k = 0; k < kTok; ++k) bq[k] = 0.f, cq[k] = 0.f;
        }
      };
#pragma unroll
      for (int i = 0; i < kI; ++i) fetch(i, nb[i], nc[i], n_an[i], n_hin[i]);
#pragma unroll 1
      for (int n0 = 0; n0 < nst; n0 += kI) {
        const int j = j0;
        const int buf = step & 1;
        // this thread's tokens of the dB / dC partials' rows (the reduction below): their old
        // values are read here, ahead of the step's work
        int64_t prow[kI];
        float db_old[kI][kPass], dc_old[kI][kPass];
        float bv[kI][kTok], cv[kI][kTok], an[kI], h_in[kI];
#pragma unroll
        for (int i = 0; i < kI; ++i) {
          prow[i] = part + static_cast<int64_t>(min(n0 + i, nst - 1)) * ld + c * kChunk;
#pragma unroll
          for (int e = 0; e < kPass; ++e) {
            const int q = tid + e * kThreads;
            db_old[i][e] = kVarB && q < kChunk ? p.dB_part[prow[i] + q] : 0.f;
            dc_old[i][e] = kVarC && q < kChunk ? p.dC_part[prow[i] + q] : 0.f;
          }
          an[i] = n_an[i], h_in[i] = n_hin[i];
#pragma unroll
          for (int k = 0; k < kTok; ++k) bv[i][k] = nb[i][k], cv[i][k] = nc[i][k];
        }
        if (n0 + kI < nst) {
#pragma unroll
          for (int i = 0; i < kI; ++i) fetch(n0 + kI + i, nb[i], nc[i], n_an[i], n_hin[i]);
        }
#pragma unroll
        for (int i = 0; i < kI; ++i) {
          const int n = n0 + i;
          const bool valid = kI == 1 || n < nst;
          const float a2 = an[i] * kLog2e;
          float dec[kTok], hk[kTok];
          // the lane's maps: the state's over its tokens (P, v) and the adjoint's right to left
          // (w = a g); then the prefix of the lanes' state maps (the state entering the lane's
          // first token, from the chunk's entering state) and the suffix of the adjoint's
          // (entering its last token from the right, from the carry out of the next chunk),
          // both scans at once
          float P = 1.f, v = 0.f, w = 0.f;
#pragma unroll
          for (int k = 0; k < kTok; ++k) {
            dec[k] = fast_exp2(a2 * dt[k]);
            v = fmaf(dec[k], v, dt[k] * u[k] * bv[i][k]);
            P *= dec[k];
          }
#pragma unroll
          for (int k = kTok - 1; k >= 0; --k) w = dec[k] * fmaf(cv[i][k], dy[k], w);
          float Pw = P;
          scan_both(j, P, v, Pw, w);
          const float P_ex = shfl_up(P, 1);
          const float v_ex = shfl_up(v, 1);
          const float w_nx = shfl_down(w, 1);
          const float P_nx = shfl_down(Pw, 1);
          const float hs = pick(-min(j, 1), fmaf(P_ex, h_in[i], v_ex), h_in[i]);  // lane 0: h_in
          float h = hs;
#pragma unroll
          for (int k = 0; k < kTok; ++k) {
            h = fmaf(dec[k], h, dt[k] * u[k] * bv[i][k]);
            hk[k] = h;
            if (has_z) s_y[k][tid] = fmaf(cv[i][k], h, s_y[k][tid]);
          }
          // the adjoint entering the chunk from the right (from LDS at its use: held from the
          // step before, as the other operands are, it made ptxas spill)
          const float carry = valid ? s_wc[ch][n] : 0.f;
          float wv = pick((j + 1) / kSeg - 1, fmaf(P_nx, carry, w_nx), carry);  // the last lane: carry
          // every token's terms, right to left; variable dB / dC terms go to LDS (0 from a
          // channel past the slice), fixed ones are summed over the lane's tokens
          float dA_l = 0.f, sb = 0.f, sc = 0.f;
#pragma unroll
          for (int k = kTok - 1; k >= 0; --k) {
            const float gk = fmaf(cv[i][k], dy[k], wv);
            const float hp = dec[k] * (k > 0 ? hk[k - 1] : hs);  // a h[t-1]
            du_acc[k] = fmaf(gk, bv[i][k], du_acc[k]);
            ddt_acc[k] = fmaf(gk, fmaf(an[i], hp, bv[i][k] * u[k]), ddt_acc[k]);
            dA_l = fmaf(gk * dt[k], hp, dA_l);
            const float rb = gk * dt[k] * u[k], rc = dy[k] * hk[k];
            // both kinds kept whichever B / C are (no branch in the loop): a variable one's
            // terms are read from s_red below, a fixed one's sum from sb / sc
            s_red[buf][i][0][ch][j * kTok + k] = pick(live_m, rb, 0.f);
            s_red[buf][i][1][ch][j * kTok + k] = pick(live_m, rc, 0.f);
            sb += rb, sc += rc;
            wv = dec[k] * gk;
          }
          // the carry out of the chunk (lane 0's adjoint at its first token) enters the range's
          // next chunk: every lane writes it, once every lane has read the old one (above)
          const float w_out = shfl_idx(wv, 0);
          wave_sync();
          if (valid) s_wc[ch][n] = w_out;
          dA_l = lane_sum(dA_l);
          if constexpr (!b_var) sb = lane_sum(sb);
          if constexpr (!c_var) sc = lane_sum(sc);
          // the chunk's sums over its tokens, per element (every lane writes the same value):
          // the host sums the chunks
          if (valid) {
            const int64_t at = crow + static_cast<int64_t>(c) * nst + n;
            p.dA_part[at] = dA_l;
            if constexpr (!b_var) p.dB_part[at] = sb;
            if constexpr (!c_var) p.dC_part[at] = sc;
          }
        }
        if constexpr (b_var || c_var) {  // the block's channels' terms of each token, in order
          // (the other buffer's readers of the previous step are past this barrier too)
          __syncthreads();
#pragma unroll
          for (int i = 0; i < kI; ++i) {
            if (kI > 1 && n0 + i >= nst) break;
#pragma unroll
            for (int e = 0; e < kPass; ++e) {  // a thread per token of the chunk, kPass passes
              const int q = tid + e * kThreads;
              if (q >= kChunk) break;
              if constexpr (b_var) {  // the partial's rows are padded as B's: no tail
                float sum = 0.f;
#pragma unroll
                for (int k = 0; k < kCh; ++k) sum += s_red[buf][i][0][k][q];
                p.dB_part[prow[i] + q] = db_old[i][e] + sum;  // zeroed by the host; read ahead
              }
              if constexpr (c_var) {
                float sum = 0.f;
#pragma unroll
                for (int k = 0; k < kCh; ++k) sum += s_red[buf][i][1][k][q];
                p.dC_part[prow[i] + q] = dc_old[i][e] + sum;
              }
            }
          }
        }
        ++step;
      }
      // the chunk's outputs: du, ddelta (through softplus and the bias), dz
      float raw[kTok], gout[kTok];
      load_seg<T, kTok>(in(p.delta), t, L, vec_x, raw);
      load_seg<T, kTok>(in(p.dout), t, L, vec_x, gout);
      float dz[kTok];
      if constexpr (has_z) {
        float zv[kTok];
        load_seg<T, kTok>(in(p.z), t, L, vec_x, zv);
#pragma unroll
        for (int k = 0; k < kTok; ++k) dz[k] = gout[k] * fmaf(dcoef, u[k], s_y[k][tid]) * dsilu(zv[k]);
      }
#pragma unroll
      for (int k = 0; k < kTok; ++k) {
        dD_l = fmaf(dy[k], u[k], dD_l);
        du_acc[k] = fmaf(dt[k], du_acc[k], dcoef * dy[k]);
        // through softplus: its derivative, the sigmoid (1 above torch's threshold 20)
        const float x = raw[k] + dbias;
        const float sig = x <= 20.f ? __fdividef(1.f, 1.f + __expf(-x)) : 1.f;
        const float ddt = ddt_acc[k] * pick(sp_m, sig, 1.f);
        ddt_acc[k] = ddt;
        if (t + k < L) ddb_l += ddt;
      }
      if (live) {
        store_seg<T, kTok>(out(p.du), t, L, vec_x, du_acc);
        store_seg<T, kTok>(out(p.ddelta), t, L, vec_x, ddt_acc);
        if constexpr (has_z) store_seg<T, kTok>(out(p.dz), t, L, vec_x, dz);
      }
    }
    // the channel's sums over the tokens
    dD_l = lane_sum(dD_l);
    ddb_l = lane_sum(ddb_l);
    if (live && j0 == 0) {  // (range, batch row, channel)
      const int64_t at = static_cast<int64_t>(blockIdx.z) * p.batch * p.dim + cd;
      p.dD_part[at] = dD_l;
      p.ddb_part[at] = ddb_l;
    }
  }
}

}  // namespace sscan_bwd
}  // namespace m2r

// m2r_selective_scan_bwd_[carry_]<dtype>_<B><C>[_z]: B / C variable (v) or fixed (f), with z or
// not
#define M2R_SSCAN_BWD1(DT, T, BC, VB, VC)                                                    \
  M2R_KERNEL_MIN_BLOCKS(m2r::sscan_bwd::kThreads, m2r::sscan_bwd::kCarryBlocks)             \
  m2r_selective_scan_bwd_carry_##DT##_##BC(SelectiveScanBwdParams p) {                       \
    m2r::sscan_bwd::carries<m2r::T, false, VB, VC>(p);                                       \
  }                                                                                          \
  M2R_KERNEL_MIN_BLOCKS(m2r::sscan_bwd::kThreads, m2r::sscan_bwd::kCarryBlocks)             \
  m2r_selective_scan_bwd_carry_##DT##_##BC##_z(SelectiveScanBwdParams p) {                   \
    m2r::sscan_bwd::carries<m2r::T, true, VB, VC>(p);                                        \
  }                                                                                          \
  M2R_KERNEL_MIN_BLOCKS(m2r::sscan_bwd::kThreads, M2R_SSCAN_BWD_MIN_BLOCKS)                  \
  m2r_selective_scan_bwd_##DT##_##BC(SelectiveScanBwdParams p) {                             \
    m2r::sscan_bwd::scan_bwd<m2r::T, false, VB, VC>(p);                                      \
  }                                                                                          \
  M2R_KERNEL_MIN_BLOCKS(m2r::sscan_bwd::kThreads, M2R_SSCAN_BWD_MIN_BLOCKS)                  \
  m2r_selective_scan_bwd_##DT##_##BC##_z(SelectiveScanBwdParams p) {                         \
    m2r::sscan_bwd::scan_bwd<m2r::T, true, VB, VC>(p);                                       \
  }
#define M2R_SSCAN_BWD(DT, T)                                                          \
  M2R_SSCAN_BWD1(DT, T, vv, true, true) M2R_SSCAN_BWD1(DT, T, vf, true, false)        \
  M2R_SSCAN_BWD1(DT, T, fv, false, true) M2R_SSCAN_BWD1(DT, T, ff, false, false)

M2R_SSCAN_BWD(f32, F32)
M2R_SSCAN_BWD(f16, F16)
M2R_SSCAN_BWD(bf16, BF16)
