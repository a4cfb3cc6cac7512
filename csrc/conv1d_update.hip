// Causal depthwise conv1d, decode step: new tokens against a rolling conv_state, in place.
// update / update_tile: one thread per (batch, channel), grid (ceil(dim / kUpdateThreads), batch);
// update_vec: a few channels a thread (VecChannels). Semantics in params.h.
#include "platform.h"
#include "state_rows.h"

namespace m2r {
namespace conv1d {

constexpr int kUpdateThreads = 128;

// i mod n in [0, n), in 32-bit arithmetic (a 64-bit remainder is a subroutine call on NVIDIA,
// whose saved registers showed up as spills): i = h + t with h in [0, n) and t >= 0, both
// below 2^31, so the unsigned sum cannot wrap.
M2R_DEVICE int wrap(int h, int t, int n) {
  return static_cast<int>((static_cast<uint32_t>(h) + static_cast<uint32_t>(t)) % static_cast<uint32_t>(n));
}

// A rejected batch entry's outputs: zeros for a padding slot (row -1), NaN for an index out of
// range or duplicated (-2); its state is not touched.
template <typename T>
M2R_DEVICE void fill_out(const ConvUpdateParams& p, int64_t row, typename T::storage* out) {
  const float fill = row == -1 ? 0.f : __int_as_float(0x7fc00000);
  for (int t = 0; t < p.seqlen; ++t) out[t * p.out_l_stride] = T::from_float(fill);
}

// Channel c's kW weights into w, and its bias (0 without one).
template <int kW>
M2R_DEVICE float load_taps(const ConvUpdateParams& p, int64_t c, float (&w)[kW]) {
#pragma unroll
  for (int k = 0; k < kW; ++k)
    w[k] = load_as_float(p.weight, p.weight_dtype, c * p.weight_c_stride + k * p.weight_w_stride);
  return p.bias ? load_as_float(p.bias, p.bias_dtype, c) : 0.f;
}

// The outputs for the seqlen new tokens x after win[0 .. kW - 1) (the stored ones, as floats).
template <typename T, int kW>
M2R_DEVICE void conv_tokens(const ConvUpdateParams& p, const float (&w)[kW], float bias, float (&win)[kW],
                            const typename T::storage* x, typename T::storage* out) {
  for (int t = 0; t < p.seqlen; ++t) {
    win[kW - 1] = T::to_float(x[t * p.x_l_stride]);
    float acc = bias;
#pragma unroll
    for (int k = 0; k < kW; ++k) acc = fmaf(w[k], win[k], acc);
    out[t * p.out_l_stride] = T::from_float(p.silu ? silu(acc) : acc);
#pragma unroll
    for (int k = 0; k < kW - 1; ++k) win[k] = win[k + 1];
  }
}

// Slot j of a kW - 1 slot state after the step: the last kW - 1 entries of [hist, x], as stored.
template <typename T, int kW>
M2R_DEVICE typename T::storage shifted_slot(const ConvUpdateParams& p, int j,
                                            const typename T::storage (&hist)[kW - 1],
                                            const typename T::storage* x) {
  const int64_t src = j + p.seqlen;
  typename T::storage v = src >= kW - 1 ? x[(src - (kW - 1)) * p.x_l_stride] : hist[0];
#pragma unroll
  for (int k = 1; k < kW - 1; ++k) v = src == k ? hist[k] : v;  // constant indices only
  return v;
}

template <typename T, int kW>
M2R_DEVICE void update(const ConvUpdateParams& p) {
  typedef typename T::storage S;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kUpdateThreads + threadIdx.x;
  const int64_t b = blockIdx.y;
  // (before any lane leaves: the duplicate search is wave-wide)
  const int64_t row = checked_state_row(p.state_indices, p.indices_stride, p.indices_int64, p.batch, p.num_states, b);
  if (c >= p.dim) return;

  const S* x = static_cast<const S*>(p.x) + b * p.x_batch_stride + c * p.x_c_stride;
  S* out = static_cast<S*>(p.out) + b * p.out_batch_stride + c * p.out_c_stride;
  if (row < 0) {
    fill_out<T>(p, row, out);
    return;
  }
  S* state = static_cast<S*>(p.conv_state) + row * p.state_batch_stride + c * p.state_c_stride;

  float w[kW];
  const float bias = load_taps<kW>(p, c, w);

  const int64_t L = p.state_len;
  const bool circular = p.cache_seqlens != nullptr;
  // next write slot (circular), in [0, L); the kW - 1 slots before it hold the window
  const int head = circular ? ((p.cache_seqlens[b] % p.state_len) + p.state_len) % p.state_len : 0;

  // win[k]: input at step t - (kW-1) + k; the first kW-1 come from the state (kept as stored,
  // so the shift below can write them back bit for bit without reading the state again).
  S hist[kW - 1];
  float win[kW];
#pragma unroll
  for (int k = 0; k < kW - 1; ++k) {
    const int64_t slot = circular ? wrap(head, p.state_len - (kW - 1) + k, p.state_len) : L - (kW - 1) + k;
    hist[k] = state[slot * p.state_l_stride];
    win[k] = T::to_float(hist[k]);
  }
  conv_tokens<T, kW>(p, w, bias, win, x, out);

  if (circular) {
    // Later tokens win when seqlen > state_len, as a sequential write would.
    for (int t = 0; t < p.seqlen; ++t)
      state[static_cast<int64_t>(wrap(head, t, p.state_len)) * p.state_l_stride] = x[t * p.x_l_stride];
  } else if (L == kW - 1) {
    // The common case: the whole state is in hist.
#pragma unroll
    for (int j = 0; j < kW - 1; ++j) state[j * p.state_l_stride] = shifted_slot<T, kW>(p, j, hist, x);
  } else {
    // Shift register: state <- last state_len entries of [state, x]. Reading ahead of the
    // write index keeps the in-place shift safe.
    const int64_t n = p.seqlen;
    for (int64_t j = 0; j < L; ++j) {
      const int64_t src = j + n;
      state[j * p.state_l_stride] =
          src < L ? state[src * p.state_l_stride] : x[(src - L) * p.x_l_stride];
    }
  }
}

// The block's states through LDS (the _tile kernels): the usual decode layout -- a state of
// exactly kW - 1 slots, no circular cache, each batch row's states (dim, kW - 1) contiguous and
// 16-byte aligned (the host checks) -- puts the block's kUpdateThreads channels' states in one
// contiguous run. It is read and written back in 16-byte pieces by the whole block, where each
// thread of `update` moved its own 2-byte slots, kW - 1 apart (a partial sector per access:
// b256 d10240, bf16, width 4 ran at 43% of copy bandwidth on the H100).
// n slots from src to dst (both 16-byte aligned) by the whole block, 16 bytes a thread and
// access, the tail slot by slot.
template <typename S>
M2R_DEVICE void copy_slots(S* dst, const S* src, int n) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(S));
  for (int i = threadIdx.x * kVec; i < n; i += kUpdateThreads * kVec) {
    if (i + kVec <= n) {
      *reinterpret_cast<uint4*>(dst + i) = *reinterpret_cast<const uint4*>(src + i);
    } else {
      for (int e = i; e < n; ++e) dst[e] = src[e];
    }
  }
}

template <typename T, int kW>
M2R_DEVICE void update_tile(const ConvUpdateParams& p) {
  typedef typename T::storage S;
  constexpr int kL = kW - 1;
  __shared__ __align__(16) S tile[kUpdateThreads * kL];
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kUpdateThreads, c = c0 + threadIdx.x;
  const int64_t b = blockIdx.y;
  const int64_t row = checked_state_row(p.state_indices, p.indices_stride, p.indices_int64, p.batch, p.num_states, b);
  const S* x = static_cast<const S*>(p.x) + b * p.x_batch_stride + c * p.x_c_stride;
  S* out = static_cast<S*>(p.out) + b * p.out_batch_stride + c * p.out_c_stride;
  if (row < 0) {  // uniform over the block (one batch row)
    if (c < p.dim) fill_out<T>(p, row, out);
    return;
  }
  const int n = static_cast<int>(min(static_cast<int64_t>(kUpdateThreads), p.dim - c0)) * kL;  // block's slots
  S* state = static_cast<S*>(p.conv_state) + row * p.state_batch_stride + c0 * kL;
  copy_slots(tile, state, n);
  __syncthreads();
  if (c < p.dim) {
    float w[kW];
    const float bias = load_taps<kW>(p, c, w);
    S* mine = tile + threadIdx.x * kL;
    S hist[kL];
    float win[kW];
#pragma unroll
    for (int k = 0; k < kL; ++k) hist[k] = mine[k], win[k] = T::to_float(hist[k]);
    conv_tokens<T, kW>(p, w, bias, win, x, out);
#pragma unroll
    for (int j = 0; j < kL; ++j) mine[j] = shifted_slot<T, kW>(p, j, hist, x);
  }
  __syncthreads();
  copy_slots(state, tile, n);
}

// The decode layouts of the models' own caches, in whole words (the _vec kernels): x and out
// channel-contiguous (a decode step's (batch, dim) slice, as a Mamba2 block passes it), the
// states of each batch row one 16-byte aligned (dim, kS) block in one of two orders -- each
// channel's kS slots together (kSlotMajor false: transformers' (batch, dim, width) cache,
// causal-conv1d's (batch, dim, width - 1)) or each slot's channels together (kSlotMajor true:
// mamba_ssm's and vLLM's (batch, width [- 1], dim) caches seen through a transposed view) --
// and kS, the slots, width - 1 or width. Each thread owns kCh consecutive channels (VecChannels),
// so its states, x, out, bias and taps (where they lie as (dim, width) in x's type) are one run
// each (one per slot in slot order), moved in 16- / 8- / 4-byte pieces: no LDS, no barrier, and
// x, the taps and the bias are requested before the state row (a pool index, then its duplicate
// search) is known. In channel order where a channel's kS slots divide 16 bytes (4 bf16 slots)
// a thread's channels are those of one 16-byte word, so a warp's state accesses are one
// contiguous run; else (and in slot order) 8 bytes' channels (4 bf16 channels: 8 bytes of each
// slot, or 24 bytes of 3-slot states). H100, bf16, width 4, graph-timed: 8 bytes took 0.4 us off
// batch 1 and 10% off batch 256 against 16 in slot order (4 bytes: slower at batch 256). The
// _tile kernel covered only the (batch, dim, width - 1) order and moved each block's states
// through LDS behind two barriers: 50% of copy bandwidth at Codestral's b256 update.
// (build knob, for measuring: bytes of each slot a thread of the _vec kernels moves where its
// channels are not one 16-byte word of states)
#ifndef M2R_CONV_VEC_BYTES
#define M2R_CONV_VEC_BYTES 8
#endif
template <typename S, int kS, bool kSlotMajor>
struct VecChannels {  // (mamba2_rocm/ops/conv1d.py, _vec_channels, mirrors it)
  static constexpr int kRun = kS * static_cast<int>(sizeof(S));
  static constexpr int value = !kSlotMajor && 16 % kRun == 0 ? 16 / kRun : M2R_CONV_VEC_BYTES / static_cast<int>(sizeof(S));
};

// A run of kN elements of S, moved in pieces of the largest of 16 / 8 / 4 / 2 bytes that
// divides its size: p must be aligned to that piece (a run at a multiple of its size from a
// 16-byte aligned start is).
template <int kPiece> struct PieceType;
template <> struct PieceType<16> { typedef uint4 type; };
template <> struct PieceType<8> { typedef uint2 type; };
template <> struct PieceType<4> { typedef uint32_t type; };
template <> struct PieceType<2> { typedef uint16_t type; };
template <int kBytes>
struct RunPiece {
  static constexpr int kPiece = kBytes % 16 == 0 ? 16 : kBytes % 8 == 0 ? 8 : kBytes % 4 == 0 ? 4 : 2;
  typedef typename PieceType<kPiece>::type type;
  static constexpr int kN = kBytes / kPiece;
};

template <typename S, int kN>
M2R_DEVICE void load_run(const S* p, S (&e)[kN]) {
  typedef RunPiece<kN * static_cast<int>(sizeof(S))> R;
  typename R::type q[R::kN];
#pragma unroll
  for (int i = 0; i < R::kN; ++i) q[i] = reinterpret_cast<const typename R::type*>(p)[i];
  __builtin_memcpy(e, q, sizeof(q));
}

template <typename S, int kN>
M2R_DEVICE void store_run(S* p, const S (&e)[kN]) {
  typedef RunPiece<kN * static_cast<int>(sizeof(S))> R;
  typename R::type q[R::kN];
  __builtin_memcpy(q, e, sizeof(q));
#pragma unroll
  for (int i = 0; i < R::kN; ++i) reinterpret_cast<typename R::type*>(p)[i] = q[i];
}

template <typename T, int kW, int kS, bool kSlotMajor>
M2R_DEVICE void update_vec(const ConvUpdateParams& p) {
  typedef typename T::storage S;
  constexpr int kCh = VecChannels<S, kS, kSlotMajor>::value;
  static_assert(kS == kW - 1 || kS == kW, "a state of width - 1 or width slots");
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * kUpdateThreads + threadIdx.x) * kCh;
  const int64_t b = blockIdx.y;
  const bool mine = c < p.dim;  // (the host: dim % kCh == 0)
  const S* x = static_cast<const S*>(p.x) + b * p.x_batch_stride + c;
  S* out = static_cast<S*>(p.out) + b * p.out_batch_stride + c;
  S xe[kCh];
  float w[kCh][kW], bias[kCh];
  // kLate: taps and bias of x's type, 16-byte aligned, are held as loaded and converted once the
  // state row's loads are out; converted first, the thread waits for them before it asks for its
  // states (two memory round trips in a row). H200, bf16, width 4, graph us, the better of two
  // rounds: 0.5-8% faster at the 16 update cases of bench conv1d in causal-conv1d's and
  // mamba_ssm's caches (mamba2-1.3b b1 2.23 -> 2.07, b256 5.58 -> 5.34, Codestral b64 4.16 ->
  // 3.90); transformers' (batch, dim, width) cache (channel order, width slots, 2 channels a
  // thread) ran 3-4% slower that way at Codestral b64 / b256 (47 registers against 40), so it
  // keeps the first order (its code as before).
  constexpr bool kLate = kSlotMajor || kS != kW;
  typedef RunPiece<kCh * kW * static_cast<int>(sizeof(S))> WP;
  typedef RunPiece<kCh * static_cast<int>(sizeof(S))> BP;
  typename WP::type wq[WP::kN];  // (held as the loads' words: as S arrays nvcc put them on the stack)
  typename BP::type bq[BP::kN];
  bool taps_raw = false, bias_raw = false;  // kLate: wq / bq hold the taps / bias until then
  if constexpr (kLate) {
    taps_raw = p.weight_dtype == T::kDType && p.weight_c_stride == kW && p.weight_w_stride == 1 &&
               reinterpret_cast<uintptr_t>(p.weight) % 16 == 0;
    bias_raw = p.bias && p.bias_dtype == T::kDType && reinterpret_cast<uintptr_t>(p.bias) % 16 == 0;
    if (mine) {
      load_run(x, xe);
      if (taps_raw) {
        const auto* src = reinterpret_cast<const typename WP::type*>(static_cast<const S*>(p.weight) + c * kW);
#pragma unroll
        for (int i = 0; i < WP::kN; ++i) wq[i] = src[i];
      } else {
#pragma unroll
        for (int j = 0; j < kCh; ++j)
#pragma unroll
          for (int k = 0; k < kW; ++k)
            w[j][k] = load_as_float(p.weight, p.weight_dtype, (c + j) * p.weight_c_stride + k * p.weight_w_stride);
      }
      if (bias_raw) {
        const auto* src = reinterpret_cast<const typename BP::type*>(static_cast<const S*>(p.bias) + c);
#pragma unroll
        for (int i = 0; i < BP::kN; ++i) bq[i] = src[i];
      } else {
#pragma unroll
        for (int j = 0; j < kCh; ++j) bias[j] = p.bias ? load_as_float(p.bias, p.bias_dtype, c + j) : 0.f;
      }
    }
  } else if (mine) {
    load_run(x, xe);
    // the taps as one run where they lie as (dim, width) in x's type, 16-byte aligned
    if (p.weight_dtype == T::kDType && p.weight_c_stride == kW && p.weight_w_stride == 1 &&
        reinterpret_cast<uintptr_t>(p.weight) % 16 == 0) {
      S we[kCh * kW];
      load_run(static_cast<const S*>(p.weight) + c * kW, we);
#pragma unroll
      for (int j = 0; j < kCh; ++j)
#pragma unroll
        for (int k = 0; k < kW; ++k) w[j][k] = T::to_float(we[j * kW + k]);
    } else {
#pragma unroll
      for (int j = 0; j < kCh; ++j)
#pragma unroll
        for (int k = 0; k < kW; ++k)
          w[j][k] = load_as_float(p.weight, p.weight_dtype, (c + j) * p.weight_c_stride + k * p.weight_w_stride);
    }
    if (p.bias && p.bias_dtype == T::kDType && reinterpret_cast<uintptr_t>(p.bias) % 16 == 0) {
      S be[kCh];
      load_run(static_cast<const S*>(p.bias) + c, be);
#pragma unroll
      for (int j = 0; j < kCh; ++j) bias[j] = T::to_float(be[j]);
    } else {
#pragma unroll
      for (int j = 0; j < kCh; ++j) bias[j] = p.bias ? load_as_float(p.bias, p.bias_dtype, c + j) : 0.f;
    }
  }
  // (every lane of the wave: the duplicate search is wave-wide)
  const int64_t row = checked_state_row(p.state_indices, p.indices_stride, p.indices_int64, p.batch, p.num_states, b);
  if (!mine) return;
  if (row < 0) {
    const S fill = T::from_float(row == -1 ? 0.f : __int_as_float(0x7fc00000));
    S f[kCh];
#pragma unroll
    for (int j = 0; j < kCh; ++j) f[j] = fill;
    for (int t = 0; t < p.seqlen; ++t) store_run(out + t * p.out_l_stride, f);
    return;
  }
  // se[kSlotMajor ? slot * kCh + j : j * kS + slot]: slot `slot` of channel c + j
  S* state = static_cast<S*>(p.conv_state) + row * p.state_batch_stride + (kSlotMajor ? c : c * kS);
  S se[kS * kCh];
  if constexpr (kSlotMajor) {
#pragma unroll
    for (int i = 0; i < kS; ++i) {
      S part[kCh];
      load_run(state + i * p.state_l_stride, part);
#pragma unroll
      for (int j = 0; j < kCh; ++j) se[i * kCh + j] = part[j];
    }
  } else {
    load_run(state, se);
  }
  if (taps_raw) {
    S we[kCh * kW];
    __builtin_memcpy(we, wq, sizeof(wq));
#pragma unroll
    for (int j = 0; j < kCh; ++j)
#pragma unroll
      for (int k = 0; k < kW; ++k) w[j][k] = T::to_float(we[j * kW + k]);
  }
  if (bias_raw) {
    S be[kCh];
    __builtin_memcpy(be, bq, sizeof(bq));
#pragma unroll
    for (int j = 0; j < kCh; ++j) bias[j] = T::to_float(be[j]);
  }
  // win[j][k]: channel j's last kW - 1 inputs as stored (slot kS - kW + 1 + k), oldest first
  S win[kCh][kW - 1];
#pragma unroll
  for (int j = 0; j < kCh; ++j)
#pragma unroll
    for (int k = 0; k < kW - 1; ++k) {
      const int slot = kS - (kW - 1) + k;
      win[j][k] = se[kSlotMajor ? slot * kCh + j : j * kS + slot];
    }
  // the input the last token shifted out of the window: a width-slot state's oldest slot after
  S drop[kCh];
#pragma unroll
  for (int j = 0; j < kCh; ++j) drop[j] = se[kSlotMajor ? j : j * kS];
  for (int t = 0; t < p.seqlen; ++t) {
    if (t > 0) load_run(x + t * p.x_l_stride, xe);
    S oe[kCh];
#pragma unroll
    for (int j = 0; j < kCh; ++j) {
      float acc = bias[j];
#pragma unroll
      for (int k = 0; k < kW - 1; ++k) acc = fmaf(w[j][k], T::to_float(win[j][k]), acc);
      acc = fmaf(w[j][kW - 1], T::to_float(xe[j]), acc);
      oe[j] = T::from_float(p.silu ? silu(acc) : acc);
      drop[j] = win[j][0];
#pragma unroll
      for (int k = 0; k < kW - 2; ++k) win[j][k] = win[j][k + 1];
      win[j][kW - 2] = xe[j];
    }
    store_run(out + t * p.out_l_stride, oe);
  }
  // the state after the step: the last kS inputs, as stored
#pragma unroll
  for (int j = 0; j < kCh; ++j) {
    if constexpr (kS == kW) se[kSlotMajor ? j : j * kS] = drop[j];
#pragma unroll
    for (int k = 0; k < kW - 1; ++k) {
      const int slot = kS - (kW - 1) + k;
      se[kSlotMajor ? slot * kCh + j : j * kS + slot] = win[j][k];
    }
  }
  if constexpr (kSlotMajor) {
#pragma unroll
    for (int i = 0; i < kS; ++i) {
      S part[kCh];
#pragma unroll
      for (int j = 0; j < kCh; ++j) part[j] = se[i * kCh + j];
      store_run(state + i * p.state_l_stride, part);
    }
  } else {
    store_run(state, se);
  }
}

}  // namespace conv1d
}  // namespace m2r

// m2r_conv1d_update_<dt>_w<W>[_tile]: any layout, or (_tile) the block's states through LDS;
// m2r_conv1d_update_<dt>_w<W>_vec_{c,s}<S>: a few channels a thread in whole runs, states of S
// slots in channel (c) or slot (s) order (update_vec)
#define M2R_CONV_UPDATE_VEC(DT, T, W, ORDER, S, SLOT_MAJOR)                                       \
  M2R_KERNEL(m2r::conv1d::kUpdateThreads) m2r_conv1d_update_##DT##_w##W##_vec_##ORDER##S(ConvUpdateParams p) { \
    m2r::conv1d::update_vec<m2r::T, W, S, SLOT_MAJOR>(p);                                         \
  }
#define M2R_CONV_UPDATE(DT, T, W, WM1)                                                             \
  M2R_KERNEL(m2r::conv1d::kUpdateThreads) m2r_conv1d_update_##DT##_w##W(ConvUpdateParams p) {      \
    m2r::conv1d::update<m2r::T, W>(p);                                                             \
  }                                                                                                \
  M2R_KERNEL(m2r::conv1d::kUpdateThreads) m2r_conv1d_update_##DT##_w##W##_tile(ConvUpdateParams p) { \
    m2r::conv1d::update_tile<m2r::T, W>(p);                                                        \
  }                                                                                                \
  M2R_CONV_UPDATE_VEC(DT, T, W, c, WM1, false)                                                     \
  M2R_CONV_UPDATE_VEC(DT, T, W, c, W, false)                                                       \
  M2R_CONV_UPDATE_VEC(DT, T, W, s, WM1, true)                                                      \
  M2R_CONV_UPDATE_VEC(DT, T, W, s, W, true)
#define M2R_CONV_UPDATE_WIDTHS(DT, T) \
  M2R_CONV_UPDATE(DT, T, 2, 1) M2R_CONV_UPDATE(DT, T, 3, 2) M2R_CONV_UPDATE(DT, T, 4, 3)

M2R_CONV_UPDATE_WIDTHS(f32, F32)
M2R_CONV_UPDATE_WIDTHS(f16, F16)
M2R_CONV_UPDATE_WIDTHS(bf16, BF16)
