// Gated RMSNorm and LayerNorm, backward (semantics: RmsNormBwdParams in params.h).
//
// With v the norm's input (x, times silu(z) when the gate comes first), xhat = (v - mean) rstd,
// y = xhat w + b and out = y (times silu(z) when the gate comes after), for dout:
//   dy    = dout (times silu(z) when the gate comes after; then dz = dout y silu'(z))
//   dw   += dy xhat, db += dy                      (over rows: per-block partials, fp32)
//   dxhat = dy w
//   dv    = rstd (dxhat - c2 - xhat c1),  c1 = mean(dxhat xhat), c2 = mean(dxhat) (LayerNorm)
//   dx    = dv (times silu(z) when the gate comes first; then dz = dv x silu'(z))
// Two passes: the per-(row, group) reductions (mean, rstd, c1, c2) come from the stats kernel,
// so the gradient kernel is a streaming pass over columns, any group size and hidden size alike.
// One pass (bf16 x, groups up to 4096 elements, no bias): a block per item holds its elements
// in registers through its reductions, reading x, z and dout once instead of twice.
#include "platform.h"
#include "block_reduce.h"

namespace m2r {
namespace rmsnorm_bwd {

constexpr int kThreads = 256;

// One element's terms of the stats' sums: v (the norm's input) and dy (dxhat = dy w). silu_fast
// and dsilu_fast here and below: silu's and dsilu's bits on NVIDIA, without the exponential's
// denormal path (3 instructions each; the one-pass kernel is bound by its instruction issue)
M2R_DEVICE void sum_terms(float x, float z, float g, bool gate_first, bool gate_after, float& v, float& dy) {
  v = x, dy = g;
  if (gate_first) v *= silu_fast(z);
  if (gate_after) dy *= silu_fast(z);
}

// One element's gradients (the formulas above) from its item's stats st = (mean, rstd, c1, c2):
// dx and dz (dz where there is a z), dw / db accumulated
M2R_DEVICE void element_grads(float x, float z, float g, float w, float b, const float4& st, bool has_z,
                              bool gate_first, bool gate_after, float& dw, float& db, float& dx, float& dz) {
  const float mean = st.x, rstd = st.y, c1 = st.z, c2 = st.w;
  const float sz = has_z ? silu_fast(z) : 1.f;
  const float v = gate_first ? x * sz : x;
  const float xhat = (v - mean) * rstd;
  float dy = g;
  if (gate_after) {
    const float y = fmaf(xhat, w, b);
    dz = dy * y * dsilu_fast(z);
    dy *= sz;
  }
  dw = fmaf(dy, xhat, dw);
  db += dy;
  const float dv = rstd * (dy * w - c2 - xhat * c1);
  if (gate_first) {
    dz = dv * x * dsilu_fast(z);
    dx = dv * sz;
  } else {
    dx = dv;
  }
}

// ---- per (row, group): mean, rstd, c1, c2 ---------------------------------------------------
// kWave: one wavefront per item, kThreads / kWavefront items a block, grid (ceil(items /
// that), 1, 1), for groups up to a few thousand elements; else one block per item, grid
// (items, 1, 1). One pass over the group for RMSNorm (sum v^2, sum dxhat v), two for LayerNorm
// (the mean first, then sums around it, as accurate as the forward's two passes); 16-byte loads
// where the rows and the group are aligned.
template <int kWidth>
M2R_DEVICE float item_sum(float v, float* partial) {
  if constexpr (kWidth == kThreads) {
    return block_sum<kThreads>(v, partial);
  } else {
    return wave_sum(v);
  }
}

// item_sum of three values at once: one barrier for the block form (block_sums), not three
// pairs; partial3: 3 * kThreads / kWavefront floats
template <int kWidth>
M2R_DEVICE void item_sums3(float (&v)[3], float* partial3) {
  if constexpr (kWidth == kThreads) {
    block_sums<kThreads>(v, partial3);
  } else {
    wave_sums(v);
  }
}

// A run of kN weights as raw bits, one word each (a float's, or a 16-bit value's): the loads
// are issued with the run's activations, the conversion comes when the run is worked out. One
// or two 16-byte loads (8 bytes for 4 16-bit weights) where the weight vector is 16-byte aligned
// (idx is a multiple of kN), else element loads.
template <int kN>
M2R_DEVICE void fetch_weight_bits(const void* w, int dtype, bool aligned, int64_t idx, uint32_t (&bits)[kN]) {
  if (!aligned) {
#pragma unroll
    for (int e = 0; e < kN; ++e) bits[e] = load_bits(w, dtype, idx + e);
  } else if (dtype == M2R_DTYPE_F32) {
#pragma unroll
    for (int q = 0; q < kN / 4; ++q) {
      const uint4 u = *reinterpret_cast<const uint4*>(static_cast<const float*>(w) + idx + 4 * q);
      bits[4 * q] = u.x, bits[4 * q + 1] = u.y, bits[4 * q + 2] = u.z, bits[4 * q + 3] = u.w;
    }
  } else {
    uint32_t words[kN / 2];
    const uint16_t* h = static_cast<const uint16_t*>(w) + idx;
    if constexpr (kN == 8) {
      const uint4 u = *reinterpret_cast<const uint4*>(h);
      words[0] = u.x, words[1] = u.y, words[2] = u.z, words[3] = u.w;
    } else {
#pragma unroll
      for (int q = 0; q < kN / 4; ++q) {
        const uint2 u = *reinterpret_cast<const uint2*>(h + 4 * q);
        words[2 * q] = u.x, words[2 * q + 1] = u.y;
      }
    }
#pragma unroll
    for (int e = 0; e < kN; ++e) bits[e] = (words[e / 2] >> (16 * (e % 2))) & 0xffffu;
  }
}

// the item's sums of f(v, dxhat) over its elements. Each 16-byte run's activations and
// weights are requested together, then worked out. (Keeping the next run in flight in a second
// set of registers was slower: 86-96 registers a thread, half the resident wavefronts; 2.7b
// 130 against 92 us, H200.)
template <typename T, int kWidth, typename F>
M2R_DEVICE void walk(const RmsNormBwdParams& p, int lane, int64_t start, const typename T::storage* x,
                     const typename T::storage* z, const typename T::storage* dout, bool vec, F&& f) {
  typedef typename T::storage S;
  constexpr int kN = 16 / sizeof(S);
  const int gs = p.group_size, wdt = p.weight_dtype;
  const bool gate_first = z != nullptr && !p.norm_before_gate;
  const bool gate_after = z != nullptr && p.norm_before_gate;
  const int vec_end = vec ? gs / kN * kN : 0;
  const bool w_aligned = reinterpret_cast<uintptr_t>(p.weight) % 16 == 0;
  for (int i = lane * kN; i < vec_end; i += kWidth * kN) {
    typename Vec16<T>::U ux, ug, uz;
    uint32_t wbits[kN];
    ux.v = load_stream(reinterpret_cast<const vec16_t*>(x + i));
    ug.v = load_stream(reinterpret_cast<const vec16_t*>(dout + i));
    if (z != nullptr) uz.v = load_stream(reinterpret_cast<const vec16_t*>(z + i));
    fetch_weight_bits<kN>(p.weight, wdt, w_aligned, start + i, wbits);
    float xv[kN], gv[kN], zv[kN];
    Vec16<T>::unpack(ux, xv);
    Vec16<T>::unpack(ug, gv);
    if (z != nullptr) Vec16<T>::unpack(uz, zv);
#pragma unroll
    for (int e = 0; e < kN; ++e) {
      float v, dy;
      sum_terms(xv[e], zv[e], gv[e], gate_first, gate_after, v, dy);
      f(v, dy * bits_to_float(wbits[e], wdt));
    }
  }
  for (int i = vec_end + lane; i < gs; i += kWidth) {
    float v = T::to_float(x[i]), dy = T::to_float(dout[i]);
    if (gate_first) v *= silu_fast(T::to_float(z[i]));
    if (gate_after) dy *= silu_fast(T::to_float(z[i]));
    f(v, dy * load_as_float(p.weight, wdt, start + i));
  }
}

template <typename T, bool kWave>
M2R_DEVICE void stats(const RmsNormBwdParams& p) {
  typedef typename T::storage S;
  constexpr int kWidth = kWave ? kWavefront : kThreads;  // threads per item
  constexpr int kN = 16 / sizeof(S);
  __shared__ float partial[kThreads / kWavefront], partial3[3 * kThreads / kWavefront];
  const int gs = p.group_size, groups = p.hidden / gs;
  const int lane = static_cast<int>(threadIdx.x) % kWidth;
  // 32-bit item arithmetic (the host checks rows * groups < 2^31): a 64-bit division is a
  // called routine with a stack frame on NVIDIA
  const int item = static_cast<int>(blockIdx.x) * (kThreads / kWidth) + static_cast<int>(threadIdx.x) / kWidth;
  if (kWave && item >= p.rows * groups) return;  // (whole wavefronts; no block barrier in this form)
  const int64_t row = item / groups, start = static_cast<int64_t>(item % groups) * gs;
  const S* x = static_cast<const S*>(p.x) + row * p.x_row_stride + start;
  const S* z = p.z ? static_cast<const S*>(p.z) + row * p.z_row_stride + start : nullptr;
  const S* dout = static_cast<const S*>(p.dout) + row * p.dout_row_stride + start;
  const bool vec = p.vec != 0 && gs % kN == 0;  // (rows aligned: the host; groups: whole vectors)
  const float inv_gs = 1.0f / static_cast<float>(gs);
  float mean = 0.f;
  if (p.layer_norm) {
    float sum = 0.f;
    walk<T, kWidth>(p, lane, start, x, z, dout, vec, [&](float v, float) { sum += v; });
    mean = item_sum<kWidth>(sum, partial) * inv_gs;
  }
  // around the mean: sum (v - mean)^2, sum dxhat (v - mean), sum dxhat
  float s[3] = {0.f, 0.f, 0.f};
  walk<T, kWidth>(p, lane, start, x, z, dout, vec, [&](float v, float dxhat) {
    v -= mean;
    s[0] = fmaf(v, v, s[0]);
    s[1] = fmaf(dxhat, v, s[1]);
    s[2] += dxhat;
  });
  item_sums3<kWidth>(s, partial3);
  const float rstd = rsqrtf(s[0] * inv_gs + p.eps);
  if (lane == 0) {
    float* st = p.stats + 4 * static_cast<int64_t>(item);
    st[0] = mean, st[1] = rstd;
    st[2] = s[1] * inv_gs * rstd;                  // c1 = mean(dxhat xhat)
    st[3] = p.layer_norm ? s[2] * inv_gs : 0.f;  // c2 = mean(dxhat)
  }
}

// ---- dx, dz and the dweight / dbias partials ------------------------------------------------
// grid (ceil(hidden / (kThreads * kN)), row blocks, 1): a thread owns kN consecutive columns
// (one 16-byte vector) and walks its block's rows; its columns' groups are the same every row.
// kVec (the _v kernels): every row 16-byte aligned and the group size whole 16-byte runs (the
// host checks), so each thread's run is whole, lies in one group and moves in one load or
// store, and the thread requests row r + 1 while it works out row r (one row at a time left
// its loads idle through its arithmetic and stores). The element-wise kernel keeps one row in
// flight: its predicated loads and stores' lane masks, with the prefetch's state, spilled scalar
// registers on the wave64 targets.
template <typename T, bool kVec>
M2R_DEVICE void grads(const RmsNormBwdParams& p) {
  typedef typename T::storage S;
  constexpr int kN = 16 / sizeof(S);
  const int hidden = p.hidden, gs = p.group_size, groups = hidden / gs;
  const int64_t col0 = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * kN;
  const bool gate_first = p.z != nullptr && !p.norm_before_gate;
  const bool gate_after = p.z != nullptr && p.norm_before_gate;
  float w[kN], bias[kN], dw[kN], db[kN];
  int grp[kN];
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const int64_t c = min(col0 + i, static_cast<int64_t>(hidden) - 1);
    w[i] = load_as_float(p.weight, p.weight_dtype, c);
    bias[i] = p.bias ? load_as_float(p.bias, p.bias_dtype, c) : 0.f;
    grp[i] = static_cast<int>(c) / gs;  // (32-bit: hidden < 2^31)
    dw[i] = 0.f, db[i] = 0.f;
  }
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * p.rows_per_block;
  const int64_t r1 = min(static_cast<int64_t>(p.rows), r0 + p.rows_per_block);
  if (col0 < hidden) {
    const S* const zbase = gate_first || gate_after ? static_cast<const S*>(p.z) : nullptr;
    const float* const st_base = p.stats + 4 * static_cast<int64_t>(grp[0]);
    // row r's dy, dweight / dbias terms and dx, dz from its elements (st0: its first column's
    // group's stats)
    const auto row = [&](int64_t r, const float (&xv)[kN], const float (&gv)[kN], const float (&zv)[kN],
                         float4 st0) {
      float dxv[kN], dzv[kN];
      const float* st_row = p.stats + 4 * r * groups;
      float4 st = st0;
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        if (!kVec && i > 0 && grp[i] != grp[i - 1])
          st = *reinterpret_cast<const float4*>(st_row + 4 * grp[i]);
        element_grads(xv[i], zv[i], gv[i], w[i], bias[i], st, zbase != nullptr, gate_first, gate_after, dw[i], db[i],
                      dxv[i], dzv[i]);
      }
      S* dx = static_cast<S*>(p.dx) + r * p.dx_row_stride + col0;
      S* dz = zbase != nullptr ? static_cast<S*>(p.dz) + r * p.dz_row_stride + col0 : nullptr;
      if constexpr (kVec) {
        typename Vec16<T>::U u;
        Vec16<T>::pack(dxv, u);
        store_stream(reinterpret_cast<vec16_t*>(dx), u.v);
        if (dz != nullptr) {
          Vec16<T>::pack(dzv, u);
          store_stream(reinterpret_cast<vec16_t*>(dz), u.v);
        }
      } else {
#pragma unroll
        for (int i = 0; i < kN; ++i) {
          if (col0 + i >= hidden) break;
          dx[i] = T::from_float(dxv[i]);
          if (dz != nullptr) dz[i] = T::from_float(dzv[i]);
        }
      }
    };
    if constexpr (kVec) {  // 16-byte runs, one row ahead
      typedef typename Vec16<T>::U U;
      const auto at = [&](const void* base, int64_t stride, int64_t r) {
        return reinterpret_cast<const vec16_t*>(static_cast<const S*>(base) + r * stride + col0);
      };
      const auto fetch = [&](int64_t r, U& ux, U& ug, U& uz, float4& st) {
        ux.v = load_stream(at(p.x, p.x_row_stride, r));
        ug.v = load_stream(at(p.dout, p.dout_row_stride, r));
        if (zbase != nullptr) uz.v = load_stream(at(zbase, p.z_row_stride, r));
        st = *reinterpret_cast<const float4*>(st_base + 4 * r * groups);
      };
      U ux, ug, uz;
      float4 st;
      uz.v = vec16_t{};
      if (r0 < r1) fetch(r0, ux, ug, uz, st);
      for (int64_t r = r0; r < r1; ++r) {
        float xv[kN], zv[kN], gv[kN];
        Vec16<T>::unpack(ux, xv);
        Vec16<T>::unpack(ug, gv);
        Vec16<T>::unpack(uz, zv);
        const float4 st_r = st;
        if (r + 1 < r1) fetch(r + 1, ux, ug, uz, st);
        row(r, xv, gv, zv, st_r);
      }
    } else {
      for (int64_t r = r0; r < r1; ++r) {
        const S* x = static_cast<const S*>(p.x) + r * p.x_row_stride + col0;
        const S* z = zbase != nullptr ? zbase + r * p.z_row_stride + col0 : nullptr;
        const S* dout = static_cast<const S*>(p.dout) + r * p.dout_row_stride + col0;
        float xv[kN], zv[kN], gv[kN];
#pragma unroll
        for (int i = 0; i < kN; ++i) {
          const bool in = col0 + i < hidden;
          xv[i] = in ? T::to_float(x[i]) : 0.f;
          gv[i] = in ? T::to_float(dout[i]) : 0.f;
          zv[i] = in && z != nullptr ? T::to_float(z[i]) : 0.f;
        }
        row(r, xv, gv, zv, *reinterpret_cast<const float4*>(st_base + 4 * r * groups));
      }
    }
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      if (col0 + i >= hidden) break;
      p.partial[(static_cast<int64_t>(blockIdx.y) * 2) * hidden + col0 + i] = dw[i];
      p.partial[(static_cast<int64_t>(blockIdx.y) * 2 + 1) * hidden + col0 + i] = db[i];
    }
  }
}

// ---- one pass: dx, dz and the dweight partials with the stats ---------------------------------
// grid (groups, row blocks, 1), blockDim.x threads (a multiple of 64, at most kRowMaxThreads)
// per (row, group) item: block (g, y) walks rows [y, y + 1) * rows_per_block of group g, a thread
// owning one 16-byte run of the group (the runs past it idle). x, z and dout are read once,
// where the two passes read them for the stats and again for the gradients: the run stays in
// registers through the group's sums (the waves' partial sums in LDS, added in a fixed order),
// and the next row's run is requested before this row's sums. The thread's columns are the same
// every row, so its weights and dweight sums stay in registers. For bf16 x with 16-byte aligned
// rows (x, z, dout, dx, dz) and weight, groups of whole runs up to 8 kRowMaxThreads elements,
// no bias (the host checks; else the two passes).
constexpr int kRowMaxThreads = 512;
constexpr int kRowMaxWaves = kRowMaxThreads / kWavefront;

// the sums of v[0..N) over the block (blockDim.x / kWavefront waves), in a fixed order: the
// butterfly in each wavefront, then the waves' sums in order, read 4 at a time (16-byte LDS
// reads: the kernel is bound by its instruction issue, ncu). part: N * kRowMaxWaves floats,
// 16-byte aligned, the slots past the block's waves zero (the caller's), not reused by the next
// call (the caller alternates two): one barrier.
template <int N>
M2R_DEVICE void row_sums(float (&v)[N], float* part, int waves) {
  static_assert(kRowMaxWaves % 4 == 0, "whole 16-byte reads");
  wave_sums(v);
  if (threadIdx.x % kWavefront == 0) {
#pragma unroll
    for (int k = 0; k < N; ++k) part[k * kRowMaxWaves + threadIdx.x / kWavefront] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < N; ++k) {
    float t = 0.f;
    for (int w = 0; w < waves; w += 4) {
      const float4 q = *reinterpret_cast<const float4*>(part + k * kRowMaxWaves + w);
      t += q.x, t += q.y, t += q.z, t += q.w;
    }
    v[k] = t;
  }
}

// after a reduction: the run's words made opaque, so that the floats unpacked from them before
// need not stay in registers through it (unpacked again after: 12 registers, not 24)
template <typename U>
M2R_DEVICE void keep_packed(U& a, U& b, U& c) {
#pragma unroll
  for (int q = 0; q < 4; ++q) opaque(a.w[q]), opaque(b.w[q]), opaque(c.w[q]);
}

template <typename T>
M2R_DEVICE void one_pass(const RmsNormBwdParams& p) {
  typedef typename T::storage S;
  typedef typename Vec16<T>::U U;
  constexpr int kN = 8;
  static_assert(sizeof(S) == 2, "16-bit element types");
  __shared__ __align__(16) float part[2][3 * kRowMaxWaves];
  const int waves = static_cast<int>(blockDim.x) / kWavefront, gs = p.group_size;
  // row_sums' slots past the block's waves: zeros, read with the last 16 bytes of sums (never
  // written after: no barrier needed before the first row_sums' one)
  if (threadIdx.x < 3 * kRowMaxWaves && static_cast<int>(threadIdx.x) % kRowMaxWaves >= waves)
    part[0][threadIdx.x] = part[1][threadIdx.x] = 0.f;  // (blocks of at least 64 threads)
  const int col = kN * static_cast<int>(threadIdx.x);  // the run's first column in the group
  const bool in = col < gs;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * gs + col;  // ... in the row
  const bool has_z = p.z != nullptr;
  const bool gate_first = has_z && !p.norm_before_gate, gate_after = has_z && p.norm_before_gate;
  float w[kN], dw[kN];
  {
    uint32_t bits[kN];
    if (in) fetch_weight_bits<kN>(p.weight, p.weight_dtype, true, c0, bits);  // (aligned: the host)
#pragma unroll
    for (int e = 0; e < kN; ++e) w[e] = in ? bits_to_float(bits[e], p.weight_dtype) : 0.f, dw[e] = 0.f;
  }
  const float inv_gs = 1.0f / static_cast<float>(gs);
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * p.rows_per_block;
  const int64_t r1 = min(static_cast<int64_t>(p.rows), r0 + p.rows_per_block);
  const auto fetch = [&](int64_t r, U& ux, U& ug, U& uz) {
    const auto at = [&](const void* base, int64_t stride) {
      return reinterpret_cast<const vec16_t*>(static_cast<const S*>(base) + r * stride + c0);
    };
    ux.v = ug.v = uz.v = vec16_t{};
    if (in) {
      ux.v = load_stream(at(p.x, p.x_row_stride));
      ug.v = load_stream(at(p.dout, p.dout_row_stride));
      if (has_z) uz.v = load_stream(at(p.z, p.z_row_stride));
    }
  };
  U nx, ng, nz;  // the next row's run, in flight
  if (r0 < r1) fetch(r0, nx, ng, nz);
  int buf = 0;  // row_sums' LDS, alternated
  for (int64_t r = r0; r < r1; ++r) {
    U ux = nx, ug = ng, uz = nz;
    if (r + 1 < r1) fetch(r + 1, nx, ng, nz);
    float mean = 0.f;
    if (p.layer_norm) {  // the mean first, then the sums around it (as the stats kernel)
      float xv[kN], zv[kN], s[1] = {0.f};
      Vec16<T>::unpack(ux, xv);
      Vec16<T>::unpack(uz, zv);
#pragma unroll
      for (int e = 0; e < kN; ++e) s[0] += gate_first ? xv[e] * silu_fast(zv[e]) : xv[e];
      row_sums<1>(s, part[buf], waves);
      buf ^= 1;
      mean = s[0] * inv_gs;
      keep_packed(ux, uz, ug);
    }
    float s[3] = {0.f, 0.f, 0.f};  // sum (v - mean)^2, sum dxhat (v - mean), sum dxhat
    {
      float xv[kN], zv[kN], gv[kN];
      Vec16<T>::unpack(ux, xv);
      Vec16<T>::unpack(uz, zv);
      Vec16<T>::unpack(ug, gv);
#pragma unroll
      for (int e = 0; e < kN; ++e) {
        float v, dy;
        sum_terms(xv[e], zv[e], gv[e], gate_first, gate_after, v, dy);
        const float dxhat = dy * w[e];
        v = in ? v - mean : 0.f;  // (an idle thread's zeros, without the mean)
        s[0] = fmaf(v, v, s[0]);
        s[1] = fmaf(dxhat, v, s[1]);
        s[2] += dxhat;
      }
    }
    row_sums<3>(s, part[buf], waves);
    buf ^= 1;
    keep_packed(ux, uz, ug);
    const float rstd = rsqrtf(s[0] * inv_gs + p.eps);
    // (mean, rstd, c1, c2), as the stats kernel stores them
    const float4 st = make_float4(mean, rstd, s[1] * inv_gs * rstd, p.layer_norm ? s[2] * inv_gs : 0.f);
    S* dx = static_cast<S*>(p.dx) + r * p.dx_row_stride + c0;
    S* dz = has_z ? static_cast<S*>(p.dz) + r * p.dz_row_stride + c0 : nullptr;
    if (!in) continue;
    float xv[kN], zv[kN], gv[kN], dxv[kN], dzv[kN], db = 0.f;
    Vec16<T>::unpack(ux, xv);
    Vec16<T>::unpack(uz, zv);
    Vec16<T>::unpack(ug, gv);
#pragma unroll
    for (int e = 0; e < kN; ++e)
      element_grads(xv[e], zv[e], gv[e], w[e], 0.f, st, has_z, gate_first, gate_after, dw[e], db, dxv[e], dzv[e]);
    U u;
    Vec16<T>::pack(dxv, u);
    store_stream(reinterpret_cast<vec16_t*>(dx), u.v);
    if (has_z) {
      Vec16<T>::pack(dzv, u);
      store_stream(reinterpret_cast<vec16_t*>(dz), u.v);
    }
  }
  if (in) {
    float4* o = reinterpret_cast<float4*>(p.partial + static_cast<int64_t>(blockIdx.y) * 2 * p.hidden + c0);
    o[0] = make_float4(dw[0], dw[1], dw[2], dw[3]);
    o[1] = make_float4(dw[4], dw[5], dw[6], dw[7]);
  }
}

// ---- dweight / dbias from the partial rows --------------------------------------------------
// grid (ceil(columns / kColumnSumCols), 1, 1), columns = hidden (dweight), then hidden more (dbias)
// where there is a bias: column_sum over the partial rows, stored in the parameters' dtypes.

M2R_DEVICE void reduce_partials(const RmsNormBwdParams& p) {
  const int64_t stride = 2 * static_cast<int64_t>(p.hidden);  // a row of partial
  const int64_t cols = p.dbias != nullptr ? stride : p.hidden;
  int64_t j;
  const float acc = column_sum<kThreads>(p.partial, stride, p.partial_rows, cols, j);
  if (threadIdx.x < kColumnSumCols && j < cols) {
    if (j < p.hidden) store_as(p.dweight, p.weight_dtype, j, acc);
    else store_as(p.dbias, p.bias_dtype, j - p.hidden, acc);
  }
}

}  // namespace rmsnorm_bwd
}  // namespace m2r

#define M2R_RMSNORM_BWD(DT, T)                                                                  \
  M2R_KERNEL(m2r::rmsnorm_bwd::kThreads) m2r_rmsnorm_bwd_stats_##DT(RmsNormBwdParams p) {     \
    m2r::rmsnorm_bwd::stats<m2r::T, false>(p);                                                 \
  }                                                                                             \
  M2R_KERNEL(m2r::rmsnorm_bwd::kThreads) m2r_rmsnorm_bwd_stats_w_##DT(RmsNormBwdParams p) {   \
    m2r::rmsnorm_bwd::stats<m2r::T, true>(p);                                                  \
  }                                                                                             \
  M2R_KERNEL(m2r::rmsnorm_bwd::kThreads) m2r_rmsnorm_bwd_##DT(RmsNormBwdParams p) {           \
    m2r::rmsnorm_bwd::grads<m2r::T, false>(p);                                                 \
  }                                                                                             \
  M2R_KERNEL(m2r::rmsnorm_bwd::kThreads) m2r_rmsnorm_bwd_v_##DT(RmsNormBwdParams p) {        \
    m2r::rmsnorm_bwd::grads<m2r::T, true>(p);                                                  \
  }

// m2r_rmsnorm_bwd_row_bf16: the one-pass kernel, held to 2 blocks of kRowMaxThreads per SM on
// NVIDIA (64 registers a thread, no spills). An fp16 form spilled 48 bytes there and, unheld at
// 96 registers, ran slower than the two passes (16384 rows of d4096: 334.2 against 299.3 us,
// H200), so fp16 takes the two passes.
M2R_KERNEL_MIN_BLOCKS(m2r::rmsnorm_bwd::kRowMaxThreads, 2) m2r_rmsnorm_bwd_row_bf16(RmsNormBwdParams p) {
  m2r::rmsnorm_bwd::one_pass<m2r::BF16>(p);
}

M2R_KERNEL(m2r::rmsnorm_bwd::kThreads) m2r_rmsnorm_bwd_reduce(RmsNormBwdParams p) {
  m2r::rmsnorm_bwd::reduce_partials(p);
}

M2R_RMSNORM_BWD(f32, F32)
M2R_RMSNORM_BWD(f16, F16)
M2R_RMSNORM_BWD(bf16, BF16)
