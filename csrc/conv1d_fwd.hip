// Causal depthwise conv1d, forward. Three layouts per (dtype, width), each with and without
// seq_idx ("_seq"):
//   *_vec      x and out (batch, dim, seqlen) with unit stride along seqlen, 16-byte aligned:
//              four 16-byte loads per thread in flight; neighbours' taps exchanged in LDS.
//   *_cl_vec   channel-last (unit stride along dim), 4-byte aligned: a thread owns one 32-bit
//              word of channels and walks kClPosPerThread positions; *_cl_cf the same with the
//              blocks in another order (channel blocks fastest; the host picks by rows' length).
//   *_strided  any strides (sliced, transposed, misaligned): one thread per output, simple and
//              correct everywhere; the host uses it only when neither fast layout applies.
// The host picks the layout; all variants compute the same function (tested against each other).
#include <type_traits>

#include "platform.h"

namespace m2r {
namespace conv1d {

constexpr int kThreads = 128;
constexpr int kLongThreads = 64;     // seqlen-contiguous, long rows: threads
constexpr int kRowVecs = 4;          // and 16-byte vectors per thread
constexpr int kClPosPerThread = 16;  // channel-last: positions per thread
constexpr int kShortThreads = 64;    // seqlen-contiguous, short rows: threads
constexpr int kShortVecs = 2;        // and vectors each (one vector each spilled on sm_90)
constexpr int kMultiRows = 8;        // seqlen-contiguous, rows of at most 512 16-bit tokens:
constexpr int kMultiVecs = 4;        // rows per block (kThreads / kMultiRows threads each) and
                                     // vectors per thread

// x at position pos < seqlen of row (b, c), with the history rule for pos < 0.
template <typename T, int kW>
M2R_DEVICE float x_at(const ConvFwdParams& p, int64_t b, int64_t c, int64_t pos) {
  typedef typename T::storage S;
  if (pos >= 0) {
    const S* x = static_cast<const S*>(p.x);
    return T::to_float(x[b * p.x_batch_stride + c * p.x_c_stride + pos * p.x_l_stride]);
  }
  if (p.initial_states == nullptr) return 0.f;
  const S* init = static_cast<const S*>(p.initial_states);
  return T::to_float(
      init[b * p.init_batch_stride + c * p.init_c_stride + (kW - 1 + pos) * p.init_l_stride]);
}

M2R_DEVICE int seq_at(const ConvFwdParams& p, int64_t b, int64_t pos) {
  return pos >= 0 ? p.seq_idx[b * p.seq_idx_batch_stride + pos * p.seq_idx_l_stride] : -1;
}

// final_states[b, c, j] = the last W-1 entries of [initial_states, x] (zero-padded on the left).
template <typename T, int kW>
M2R_DEVICE void write_final_states(const ConvFwdParams& p, int64_t b, int64_t c) {
  typedef typename T::storage S;
  S* fin = static_cast<S*>(p.final_states);
#pragma unroll
  for (int j = 0; j < kW - 1; ++j) {
    const int64_t pos = static_cast<int64_t>(p.seqlen) - (kW - 1) + j;
    const float v = pos >= -(kW - 1) ? x_at<T, kW>(p, b, c, pos) : 0.f;
    fin[b * p.final_batch_stride + c * p.final_c_stride + j * p.final_l_stride] = T::from_float(v);
  }
}

// ---- layout: seqlen-contiguous ---------------------------------------------------------------
// grid (ceil(seqlen / (kThreads / kRows * kRowVecs * kN)), ceil(dim / kRows), batch). Thread t
// of a row (kThreads / kRows threads) owns vectors v = 0..kRowVecs-1 at positions
// blk0 + (v * kThreads / kRows + t) * kN: every load instruction is coalesced across the
// wavefront, and all kRowVecs loads are in flight before the first use. A vector's kW-1 taps
// of history come from its left neighbour through LDS; thread 0 fetches the block's history.
//
// Three instantiations: "vec" (kLongThreads threads, kRowVecs vectors each: 2048 16-bit tokens
// a block), "vec_s" for short rows (kShortThreads threads, kShortVecs vectors each: 1024 16-bit
// tokens), which the host takes where a row is at most half the long tile (most of a long
// block's threads would idle: b8 d4352 l512 moved 33% of copy bandwidth that way on the H100),
// and "vec_m" for rows up to 512 16-bit tokens: kMultiRows rows a block (grid.y over groups of
// kMultiRows channels), kThreads / kMultiRows threads a row, kMultiVecs vectors each. A 512-token
// row filled half of a vec_s block, and the multiprocessors' cap on resident blocks then left
// them short of loads in flight (b8 d4352 l512: 76% of copy on the H100).
// Tiles measured on the H200 (graph µs; bf16, width 4; every form on the same inputs, outputs
// bitwise equal): vec on 64 threads instead of 128 (a 2048-token tile instead of 4096) ran the
// same on long rows (8192 / 16384 tokens: within 0.5% at every model width) and took the rows
// of 1025-2048 tokens from vec_s's two blocks a row to one block of 4 vectors a thread:
// Codestral b4 l2048 100.7 -> 93.9 µs (80 -> 86% of a graph-timed copy of the same bytes), Bamba
// b4 l2048 83.8 -> 78.7, b8 d5376 l1536 82.2 -> 74.7. vec_m with 8 rows of 16 threads, 4
// vectors each, instead of 4 rows of 32 threads, 2 vectors each: Codestral b8 l512 52.6 -> 49.6,
// Bamba b8 l512 43.6 -> 41.5, b16 d5376 l256 40.9 -> 34.7, b32 d5376 l128 91.1 -> 57.3 (a thread
// with twice the loads in flight). vec_s with 4 vectors a thread ran slower at the rows it keeps
// (b8 d5376 l768 45.3 -> 60.0, l1024 49.2 -> 60.0); 128 threads x 2 vectors and 256-thread
// blocks ran slower than these everywhere.
template <typename T, int kW, bool kSeq, int kThreads = conv1d::kThreads, int kRowVecs = conv1d::kRowVecs,
          int kRows = 1>
M2R_DEVICE void fwd_rows(const ConvFwdParams& p) {
  typedef typename T::storage S;
  constexpr int kN = Vec16<T>::kN;
  constexpr int kRowThreads = kThreads / kRows;  // the threads of one row
  static_assert(kRowThreads * kRows == kThreads, "rows split the block");
  constexpr int kTile = kRowThreads * kRowVecs * kN;
  // indexed by the block's thread (slot); a row's threads are neighbours
  __shared__ float sh_x[kRowVecs][kThreads][kW - 1];
  __shared__ int sh_s[kRowVecs][kThreads][kW - 1];

  const int slot = threadIdx.x;
  const int tid = kRows == 1 ? slot : slot % kRowThreads;  // the thread's place in its row
  const int64_t b = blockIdx.z;
  // (one row a block: the block's channel, uniform; a per-thread one cost vec and vec_s 10% of
  // their bandwidth in registers and addressing)
  const int64_t c = kRows == 1 ? static_cast<int64_t>(blockIdx.y) : static_cast<int64_t>(blockIdx.y) * kRows + slot / kRowThreads;
  // a multi-row block's rows past dim: nothing read or written (seqlen 0 for them), and every
  // thread still reaches the barrier
  const bool row_in = kRows == 1 || c < p.dim;
  const int32_t seqlen = row_in ? p.seqlen : 0;
  const int64_t cw = row_in ? c : 0;  // the channel whose weights are read
  const int64_t blk0 = static_cast<int64_t>(blockIdx.x) * kTile;
  constexpr bool has_seq = kSeq;  // seq_idx given: a separate instantiation, no cost otherwise
  const S* x = static_cast<const S*>(p.x) + b * p.x_batch_stride + cw * p.x_c_stride;

  // The taps and bias are requested before x's vectors, so all of the block's loads are in flight
  // at once (requested after x's vectors had arrived, their latency had been added to each
  // block's lifetime: H200, mamba2-370m b1 l8192, 84 -> 91% of a same-size copy), and converted
  // once x's are in. (The seq_idx kernels request them after the seq ids: early, two of them
  // spilled on sm_90.)
  uint32_t wbits[kW], bbits = 0;
  if constexpr (!kSeq) {
#pragma unroll
    for (int k = 0; k < kW; ++k) wbits[k] = load_bits(p.weight, p.weight_dtype, cw * p.weight_c_stride + k * p.weight_w_stride);
    if (p.bias) bbits = load_bits(p.bias, p.bias_dtype, cw);
  }
  // Kept in storage format until used: half the registers for 16-bit types.
  typename Vec16<T>::U xv[kRowVecs];
#pragma unroll
  for (int v = 0; v < kRowVecs; ++v) {
    const int64_t t0 = blk0 + static_cast<int64_t>(v * kRowThreads + tid) * kN;
    if (t0 + kN <= seqlen) {
      xv[v].v = load_stream(reinterpret_cast<const vec16_t*>(x + t0));
    } else {
#pragma unroll
      for (int i = 0; i < kN; ++i) xv[v].s[i] = t0 + i < seqlen ? x[t0 + i] : S(0);
    }
  }
  float halo[kW - 1];
  int halo_s[kW - 1];
  if (tid == 0 && row_in) {
#pragma unroll
    for (int j = 0; j < kW - 1; ++j) {
      const int64_t pos = blk0 - (kW - 1) + j;
      halo[j] = x_at<T, kW>(p, b, c, pos);
      halo_s[j] = has_seq ? seq_at(p, b, pos) : 0;
    }
  }
  int sid[kRowVecs][kN];
  if (has_seq) {
#pragma unroll
    for (int v = 0; v < kRowVecs; ++v) {
      const int64_t t0 = blk0 + static_cast<int64_t>(v * kRowThreads + tid) * kN;
#pragma unroll
      for (int i = 0; i < kN; ++i) sid[v][i] = t0 + i < seqlen ? seq_at(p, b, t0 + i) : -2;
    }
  }
  float xf[kRowVecs][kN];
#pragma unroll
  for (int v = 0; v < kRowVecs; ++v) Vec16<T>::unpack(xv[v], xf[v]);
#pragma unroll
  for (int v = 0; v < kRowVecs; ++v) {
#pragma unroll
    for (int j = 0; j < kW - 1; ++j) {
      sh_x[v][slot][j] = xf[v][kN - (kW - 1) + j];
      if (has_seq) sh_s[v][slot][j] = sid[v][kN - (kW - 1) + j];
    }
  }
  float w[kW], bias = 0.f;
  if constexpr (kSeq) {
#pragma unroll
    for (int k = 0; k < kW; ++k)
      w[k] = load_as_float(p.weight, p.weight_dtype, cw * p.weight_c_stride + k * p.weight_w_stride);
    if (p.bias) bias = load_as_float(p.bias, p.bias_dtype, cw);
  } else {
#pragma unroll
    for (int k = 0; k < kW; ++k) w[k] = bits_to_float(wbits[k], p.weight_dtype);
    if (p.bias) bias = bits_to_float(bbits, p.bias_dtype);
  }
  __syncthreads();

  S* out = static_cast<S*>(p.out) + b * p.out_batch_stride + cw * p.out_c_stride;
#pragma unroll
  for (int v = 0; v < kRowVecs; ++v) {
    const int64_t t0 = blk0 + static_cast<int64_t>(v * kRowThreads + tid) * kN;
    if (t0 >= seqlen) break;
    float win[kW - 1 + kN];
    int ws[kW - 1 + kN];
#pragma unroll
    for (int j = 0; j < kW - 1; ++j) {
      if (tid > 0) {
        win[j] = sh_x[v][slot - 1][j];
        if (has_seq) ws[j] = sh_s[v][slot - 1][j];
      } else if (v > 0) {  // the last thread of the row (slot - tid: its first), one vector back
        win[j] = sh_x[v - 1][slot - tid + kRowThreads - 1][j];
        if (has_seq) ws[j] = sh_s[v - 1][slot - tid + kRowThreads - 1][j];
      } else {
        win[j] = halo[j];
        if (has_seq) ws[j] = halo_s[j];
      }
    }
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      win[kW - 1 + i] = xf[v][i];
      if (has_seq) ws[kW - 1 + i] = sid[v][i];
    }
    float yv[kN];
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      float acc = bias;
#pragma unroll
      for (int k = 0; k < kW; ++k)
        if (!has_seq || ws[i + k] == ws[i + kW - 1]) acc = fmaf(w[k], win[i + k], acc);
      // silu_fast, as in the other layouts' kernels (their outputs agree bit for bit): this kernel
      // is issue-bound, and silu's __expf cost it 8-9% (H200, ncu: 67% of issue slots busy, DRAM
      // at 70%; b4 d4096 l4096 76.5 -> 69.8 us)
      yv[i] = has_seq && ws[i + kW - 1] < 0 ? 0.f : p.silu ? silu_fast(acc) : acc;  // padding token: 0
    }
    if (t0 + kN <= seqlen) {
      typename Vec16<T>::U u;
      Vec16<T>::pack(yv, u);
      store_stream(reinterpret_cast<vec16_t*>(out + t0), u.v);
    } else {
#pragma unroll
      for (int i = 0; i < kN; ++i)
        if (t0 + i < seqlen) out[t0 + i] = T::from_float(yv[i]);
    }
  }
  if (p.final_states != nullptr && tid == 0 && row_in && blockIdx.x == gridDim.x - 1)
    write_final_states<T, kW>(p, b, c);
}

// ---- layout: channel-last --------------------------------------------------------------------
// grid (ceil(seqlen / kClPosPerThread), ceil(dim / (kThreads * kPerWord)), batch), or with
// kChannelsFastest (ceil(seqlen / kClPosPerThread) * ceil(dim / (kThreads * kPerWord)), 1, batch),
// channel blocks fastest: the blocks resident at once then read whole rows. A thread owns
// one 32-bit word of channels (2 for 16-bit types, 1 for fp32) and kClPosPerThread positions: a
// wavefront reads whole 128-byte rows, and all kClPosPerThread + kW - 1 words are loaded before
// the first output is computed. Few registers (no per-channel weight arrays), so many waves.
template <typename T, int kW, bool kSeq, bool kChannelsFastest>
M2R_DEVICE void fwd_channel_last(const ConvFwdParams& p) {
  typedef typename T::storage S;
  constexpr int kC = T::kPerWord;
  constexpr int kP = kClPosPerThread;
  constexpr int kJ = kP + kW - 1;  // inputs: kW - 1 of history, then kP positions
  const int64_t b = blockIdx.z;
  // the block's channel block and position tile: kChannelsFastest (the _cl_cf kernels) walks
  // the channel blocks of one position tile with consecutive blocks (a 1-D grid), else the
  // position tiles of one channel block (_cl_vec, blockIdx.y)
  unsigned cb = blockIdx.y, tile = blockIdx.x;
  if constexpr (kChannelsFastest) {
    const unsigned ncb = (static_cast<unsigned>(p.dim) + kThreads * kC - 1) / (kThreads * kC);
    cb = blockIdx.x % ncb, tile = blockIdx.x / ncb;
  }
  const int64_t c0 = (static_cast<int64_t>(cb) * kThreads + threadIdx.x) * kC;
  const int64_t t0 = static_cast<int64_t>(tile) * kP;
  // seq ids are the same for the whole block: staged once in LDS (kept out of scalar
  // registers, which RDNA would otherwise run out of), before any thread leaves.
  __shared__ int sh_sid[kSeq ? kJ : 1];
  if (kSeq) {
    if (threadIdx.x < kJ) {
      const int64_t pos = t0 - (kW - 1) + threadIdx.x;
      sh_sid[threadIdx.x] = pos < p.seqlen ? seq_at(p, b, pos) : -2;
    }
    __syncthreads();
  }
  if (c0 >= p.dim) return;
  const bool full_c = c0 + kC <= p.dim;
  const S* x = static_cast<const S*>(p.x) + b * p.x_batch_stride + c0;

  // Inputs j in [j_lo, j_hi) are inside the sequence; a running pointer keeps the per-position
  // offsets out of scalar registers.
  const int j_lo = static_cast<int>(max(static_cast<int64_t>(0), (kW - 1) - t0));
  const int j_hi = static_cast<int>(min(static_cast<int64_t>(kJ), p.seqlen - t0 + (kW - 1)));
  const S* px = x + (t0 - (kW - 1)) * p.x_l_stride;
  // an interior block's thread (its kJ inputs inside the sequence, both channels in range, no
  // seq_idx): one word per input through a running pointer, no per-position checks (the checks
  // and 64-bit offsets had made this kernel issue-bound, not memory-bound: H100, ncu)
  const bool interior = !kSeq && full_c && j_lo == 0 && j_hi == kJ;
  uint32_t raw[kJ];
  if (interior) {
#pragma unroll
    for (int j = 0; j < kJ; ++j, px += p.x_l_stride) raw[j] = load_stream(reinterpret_cast<const uint32_t*>(px));
  } else {
#pragma unroll
    for (int j = 0; j < kJ; ++j, px += p.x_l_stride) {
      const int64_t pos = t0 - (kW - 1) + j;
      if (full_c && j >= j_lo && j < j_hi) {
        raw[j] = load_stream(reinterpret_cast<const uint32_t*>(px));
      } else {
        float f[kC];
#pragma unroll
        for (int i = 0; i < kC; ++i) f[i] = c0 + i < p.dim && pos < p.seqlen ? x_at<T, kW>(p, b, c0 + i, pos) : 0.f;
        raw[j] = T::pack(f);
      }
    }
  }
  // the taps and bias: every load issued before the first conversion (through load_as_float_n
  // a channel at a time, the _seq kernels spilled on sm_90). Taps and bias of x's dtype (as
  // every caller passes them) take straight-line loads: the dtype switch per element (load_bits),
  // which no compiler hoisted, and the per-position checks below together were a quarter of the
  // kernel's instructions (ncu, H200, b4 d4096 l4096: 52.4M -> 39.7M)
  float w[kC][kW], bias[kC];
  if (p.weight_dtype == T::kDType && (!p.bias || p.bias_dtype == T::kDType)) {
    const S* wp = static_cast<const S*>(p.weight);
    const S* bp = static_cast<const S*>(p.bias);
    S ws[kC][kW], bs[kC];
#pragma unroll
    for (int i = 0; i < kC; ++i) {
      const int64_t c = min(c0 + i, static_cast<int64_t>(p.dim) - 1);
#pragma unroll
      for (int k = 0; k < kW; ++k) ws[i][k] = wp[c * p.weight_c_stride + k * p.weight_w_stride];
      bs[i] = bp ? bp[c] : S{};
    }
#pragma unroll
    for (int i = 0; i < kC; ++i) {
#pragma unroll
      for (int k = 0; k < kW; ++k) w[i][k] = T::to_float(ws[i][k]);
      bias[i] = bp ? T::to_float(bs[i]) : 0.f;
    }
  } else {
    uint32_t wb[kC][kW], bb[kC];
#pragma unroll
    for (int i = 0; i < kC; ++i) {
      const int64_t c = min(c0 + i, static_cast<int64_t>(p.dim) - 1);
#pragma unroll
      for (int k = 0; k < kW; ++k) wb[i][k] = load_bits(p.weight, p.weight_dtype, c * p.weight_c_stride + k * p.weight_w_stride);
      bb[i] = p.bias ? load_bits(p.bias, p.bias_dtype, c) : 0u;
    }
#pragma unroll
    for (int i = 0; i < kC; ++i) {
#pragma unroll
      for (int k = 0; k < kW; ++k) w[i][k] = bits_to_float(wb[i][k], p.weight_dtype);
      bias[i] = p.bias ? bits_to_float(bb[i], p.bias_dtype) : 0.f;
    }
  }
  // position j's channel i, unpacked where it is used, not all kJ x kC up front: 2-3% more
  // bandwidth on the H100 (bf16 b4 d4096 l4096 86.0 -> 88.4% of copy, b8 d10240 l512 82.3 -> 85.3%)
  const auto xf = [&](int j, int i) {
    float f[kC];
    T::unpack(raw[j], f);
    return f[i];
  };

  // (position t0, channel c0): a running pointer
  S* const out0 = static_cast<S*>(p.out) + b * p.out_batch_stride + t0 * p.out_l_stride + c0;
  // the outputs, as their own code for an interior thread (all kP positions, both channels, no
  // seq_idx: no check per position) and for the rest
  const auto outputs = [&](auto interior_tag) {
    constexpr bool kIn = decltype(interior_tag)::value;
    const int n_out = kIn ? kP : static_cast<int>(min(static_cast<int64_t>(kP), p.seqlen - t0));
    S* out = out0;
#pragma unroll
    for (int s = 0; s < kP; ++s, out += p.out_l_stride) {
      if (!kIn && s >= n_out) break;
      float y[kC];
#pragma unroll
      for (int i = 0; i < kC; ++i) {
        float acc = bias[i];
#pragma unroll
        for (int k = 0; k < kW; ++k)
          if (kIn || !kSeq || sh_sid[s + k] == sh_sid[s + kW - 1]) acc = fmaf(w[i][k], xf(s + k, i), acc);
        y[i] = !kIn && kSeq && sh_sid[s + kW - 1] < 0 ? 0.f : p.silu ? silu_fast(acc) : acc;  // padding token: 0
      }
      if (kIn || full_c) {
        store_stream(reinterpret_cast<uint32_t*>(out), T::pack(y));
      } else {
#pragma unroll
        for (int i = 0; i < kC; ++i)
          if (c0 + i < p.dim) out[(c0 + i) * p.out_c_stride - c0] = T::from_float(y[i]);
      }
    }
  };
  if (interior) outputs(std::true_type{});
  else outputs(std::false_type{});
  if (p.final_states != nullptr && t0 + kP >= p.seqlen) {
#pragma unroll
    for (int i = 0; i < kC; ++i)
      if (c0 + i < p.dim) write_final_states<T, kW>(p, b, c0 + i);
  }
}

// ---- layout: any strides ---------------------------------------------------------------------
// grid (ceil(batch * dim * seqlen / kThreads)); one thread per output. Consecutive threads walk
// the dimension with the smaller input stride (p.channels_fastest = 1: channels), so loads coalesce
// for both sliced seqlen-major and misaligned channel-last inputs.
template <typename T, int kW, bool kSeq>
M2R_DEVICE void fwd_strided(const ConvFwdParams& p) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t n = static_cast<int64_t>(p.batch) * p.dim * p.seqlen;
  if (idx >= n) return;
  int64_t b, c, t;
  if (p.channels_fastest) {
    c = idx % p.dim, t = (idx / p.dim) % p.seqlen;
  } else {
    t = idx % p.seqlen, c = (idx / p.seqlen) % p.dim;
  }
  b = idx / (static_cast<int64_t>(p.dim) * p.seqlen);
  const int sid_t = kSeq ? seq_at(p, b, t) : 0;
  float acc = p.bias ? load_as_float(p.bias, p.bias_dtype, c) : 0.f;
#pragma unroll
  for (int k = 0; k < kW; ++k) {
    const int64_t pos = t - (kW - 1) + k;
    if (kSeq && seq_at(p, b, pos) != sid_t) continue;
    const float w = load_as_float(p.weight, p.weight_dtype, c * p.weight_c_stride + k * p.weight_w_stride);
    acc = fmaf(w, x_at<T, kW>(p, b, c, pos), acc);
  }
  typedef typename T::storage S;
  S* out = static_cast<S*>(p.out);
  const float y = kSeq && sid_t < 0 ? 0.f : p.silu ? silu_fast(acc) : acc;  // padding token: 0
  out[b * p.out_batch_stride + c * p.out_c_stride + t * p.out_l_stride] = T::from_float(y);
  if (p.final_states != nullptr && t == p.seqlen - 1) write_final_states<T, kW>(p, b, c);
}

}  // namespace conv1d
}  // namespace m2r

// One kernel per (dtype, width, layout), each with and without seq_idx ("_seq"): FN's template
// arguments are (T, W, seq_idx, then the layout's own ones).
#define M2R_CONV_FWD_PAIR(DT, T, W, NAME, NT, FN, ...)                                          \
  M2R_KERNEL(NT) m2r_conv1d_fwd_##DT##_w##W##_##NAME(ConvFwdParams p) {                         \
    m2r::conv1d::FN<m2r::T, W, false, ##__VA_ARGS__>(p);                                         \
  }                                                                                             \
  M2R_KERNEL(NT) m2r_conv1d_fwd_##DT##_w##W##_##NAME##_seq(ConvFwdParams p) {                   \
    m2r::conv1d::FN<m2r::T, W, true, ##__VA_ARGS__>(p);                                          \
  }
// seqlen-contiguous long (vec), short (vec_s) and multi-row (vec_m) rows; channel-last with
// position tiles (cl_vec) or channel blocks (cl_cf) fastest in the grid (the host picks by
// rows' length); any strides
#define M2R_CONV_FWD(DT, T, W)                                                                   \
  M2R_CONV_FWD_PAIR(DT, T, W, vec, m2r::conv1d::kLongThreads, fwd_rows, m2r::conv1d::kLongThreads) \
  M2R_CONV_FWD_PAIR(DT, T, W, vec_s, m2r::conv1d::kShortThreads, fwd_rows, m2r::conv1d::kShortThreads, \
                    m2r::conv1d::kShortVecs)                                                      \
  M2R_CONV_FWD_PAIR(DT, T, W, vec_m, m2r::conv1d::kThreads, fwd_rows, m2r::conv1d::kThreads,      \
                    m2r::conv1d::kMultiVecs, m2r::conv1d::kMultiRows)                             \
  M2R_CONV_FWD_PAIR(DT, T, W, cl_vec, m2r::conv1d::kThreads, fwd_channel_last, false)             \
  M2R_CONV_FWD_PAIR(DT, T, W, cl_cf, m2r::conv1d::kThreads, fwd_channel_last, true)               \
  M2R_CONV_FWD_PAIR(DT, T, W, strided, m2r::conv1d::kThreads, fwd_strided)

#define M2R_CONV_FWD_WIDTHS(DT, T) M2R_CONV_FWD(DT, T, 2) M2R_CONV_FWD(DT, T, 3) M2R_CONV_FWD(DT, T, 4)

M2R_CONV_FWD_WIDTHS(f32, F32)
M2R_CONV_FWD_WIDTHS(f16, F16)
M2R_CONV_FWD_WIDTHS(bf16, BF16)
