// Format 1 of the quantized Linear kernels (quantized_linear.cpp): integer dot products (AVX-512 VNNI's
// `vpdpbusd`) of int8-quantized activation rows with a panel's weight bytes, 1 to kPassRows rows a pass. Included by
// quantized_linear.cpp alone.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "panel_lanes.h"  // Lanes, load, group_params
#include "quantized_panels.h"

#ifdef HF_ACCEL_QLINEAR_VNNI
namespace {

// Each int4 32-input block asks for all of its lines kVnniPrefetch bytes ahead (the format-0 kernels ask for every
// line, kPrefetch ahead): with one line a block, a pass of several rows waited on the memory, its loads no longer
// overlapping its dot products. int8's blocks (8 lines each) stream faster on the hardware prefetcher alone: asking
// for them too slowed one row by 5-20% (docs/weight-quantization.md has the measured distances).
constexpr int64_t kVnniPrefetch = 8192;

inline void prefetch_block(const uint8_t* block, int lines) {
  for (int line = 0; line < lines; ++line)
    _mm_prefetch(reinterpret_cast<const char*>(block) + kVnniPrefetch + 64 * line, _MM_HINT_T0);
}

// x [M, K] quantized per row in blocks of kXBlock, laid out for the passes of over_panels: each pass of `count` <=
// kPassRows rows interleaves them, so a kernel reaches every row from one pointer at fixed offsets (a pointer a row
// and per-row index arithmetic spilled registers in the panel loop, and several-row passes fell behind the memory).
//   q     int8 [M * K]        pass rows first .. first + count: [K / 4, count, 4] from q + first * K
//   scale fp32 [M * K / 32]   block scales: [K / 32, count] from scale + first * K / 32
//   sum   fp32 [M * G]        `factor` * each row's quantized sum over each of G groups of K / G inputs (sum_k q_k
//                             * scale over its blocks): [G, count] from sum + first * G
// The panel loops read scales and sums with broadcast loads: a sum kept in a register per row costs a scalar add each
// block and a register broadcast each group on the pipes the dot products need.
struct QuantizedRows {
  at::Tensor q, scale, sum;
};

// Where item `index` of row `row`'s `per_row` items lies in the pass layout above, for M rows.
inline int64_t pass_offset(int64_t row, int64_t index, int64_t per_row, int64_t m) {
  const int64_t first = row - row % kPassRows, count = std::min<int64_t>(kPassRows, m - first);
  return first * per_row + index * count + row % kPassRows;
}

QuantizedRows quantize_rows(const at::Tensor& x, int64_t groups, float factor) {
  auto rows = x.to(at::kFloat).contiguous();
  const int64_t m = rows.size(0), k = rows.size(1), blocks = k / kXBlock, per_group = blocks / groups;
  QuantizedRows out{at::empty({m, k}, rows.options().dtype(at::kChar)), at::empty({m, blocks}, rows.options()),
                    at::empty({m, groups}, rows.options())};
  const float* src = rows.data_ptr<float>();
  int32_t* q = reinterpret_cast<int32_t*>(out.q.data_ptr<int8_t>());  // 4 inputs a word
  float* scale = out.scale.data_ptr<float>();
  float* sum = out.sum.data_ptr<float>();
  at::parallel_for(0, m * groups, std::max<int64_t>(1, 64 / per_group), [&](int64_t begin, int64_t end) {
    for (int64_t rg = begin; rg < end; ++rg) {  // row rg / groups, group rg % groups
      const int64_t row = rg / groups, group = rg % groups;
      float group_sum = 0.0f;
      for (int64_t b = group * per_group; b < (group + 1) * per_group; ++b) {
        const float* in = src + row * k + b * kXBlock;
        const __m512 low = _mm512_loadu_ps(in), high = _mm512_loadu_ps(in + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high)));
        const float d = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        // round to nearest even (the default rounding mode), |q| <= 127
        const __m512i q_low = _mm512_cvtps_epi32(_mm512_mul_ps(low, _mm512_set1_ps(inverse)));
        const __m512i q_high = _mm512_cvtps_epi32(_mm512_mul_ps(high, _mm512_set1_ps(inverse)));
        int32_t words[kXBlock / 4];
        _mm_storeu_si128(reinterpret_cast<__m128i*>(words), _mm512_cvtsepi32_epi8(q_low));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(words + 4), _mm512_cvtsepi32_epi8(q_high));
        for (int64_t word = 0; word < kXBlock / 4; ++word)
          q[pass_offset(row, b * (kXBlock / 4) + word, k / 4, m)] = words[word];
        scale[pass_offset(row, b, blocks, m)] = d;
        group_sum += static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q_low, q_high))) * d;
      }
      sum[pass_offset(row, group, groups, m)] = factor * group_sum;
    }
  });
  return out;
}

inline __m512i broadcast4(const int8_t* p) {  // 4 activation bytes into every lane
  int32_t word;
  std::memcpy(&word, p, sizeof(word));
  return _mm512_set1_epi32(word);
}

// out[r, :16] = sum_g scale_g * (sum_{b in g} dx_b sum_{k in b} q_k (code_k + 128) - 128 * sum_{b in g} dx_b
// sum_{k in b} q_k), `group` inputs per scale (K for one per column); q, dx and offset: a pass of R rows as
// quantize_rows lays it out (offset: 128 * the rows' quantized sums over each group).
template <int R, typename Scale>
void int8_vnni_panel(const int8_t* q, const float* dx, const float* offset, int64_t k, const uint8_t* panel,
                     const Scale* scale, int64_t group, float* out, int64_t n) {
  const int64_t groups = k / group, per_group = group / kXBlock;
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      const uint8_t* bytes = panel + b * kXBlock * kPanel;  // 32 inputs x 16 columns: 8 lines of 64 bytes
      __m512i dot[R];
      for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int i = 0; i < kXBlock / 4; ++i) {
        const __m512i w = _mm512_loadu_si512(bytes + i * 64);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          dot[r] = _mm512_dpbusd_epi32(dot[r], w, broadcast4(q + ((b * kXBlock / 4 + i) * R + r) * 4));
      }
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_set1_ps(dx[b * R + r]), acc[r]);
      }
    }
    const __m512 columns = load(scale + g * kPanel).v;
    for (int r = 0; r < R; ++r) {
      const __m512 centered = _mm512_sub_ps(acc[r], _mm512_set1_ps(offset[g * R + r]));
      total[r] = _mm512_fmadd_ps(centered, columns, total[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * n, total[r]);
}

// out[r, :16] = sum_g (scale_g * sum_{b in g} dx_b sum_{k in b} q_k code_k + minimum_g * gsum[r, g]), gsum the
// rows' quantized sums over each group (sum_{k in g} dx q_k); q, dx and gsum: a pass of R rows as quantize_rows lays
// it out. At one to four rows the low and the high nibbles' products go to two accumulators: a single chain of
// dependent dot products would wait on their latency, not on the memory.
template <int R>
void int4_vnni_panel(const int8_t* q, const float* dx, const float* gsum, int64_t k, const uint8_t* panel,
                     const at::Half* qpanel, int64_t fields, int64_t group, float* out, int64_t n) {
  constexpr int S = R <= 4 ? 2 : 1;
  const int64_t groups = k / group, per_group = group / kXBlock;
  const __m512i nibble = _mm512_set1_epi8(15);
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      const uint8_t* bytes = panel + b * (kXBlock / 2) * kPanel;  // 32 inputs x 16 columns: 4 lines of 64 bytes
      prefetch_block(bytes, 4);
      __m512i dot[R][S];
      for (int r = 0; r < R; ++r)
        for (int s = 0; s < S; ++s) dot[r][s] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int i = 0; i < kXBlock / 8; ++i) {
        const __m512i packed = _mm512_loadu_si512(bytes + i * 64);
        const __m512i low = _mm512_and_si512(packed, nibble);
        const __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
        const int8_t* xi = q + (b * kXBlock / 4 + 2 * i) * R * 4;  // words 2i (low nibbles) and 2i + 1 (high)
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], low, broadcast4(xi + 4 * r));
          dot[r][S - 1] = _mm512_dpbusd_epi32(dot[r][S - 1], high, broadcast4(xi + 4 * (R + r)));
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512i sum = S == 2 ? _mm512_add_epi32(dot[r][0], dot[r][S - 1]) : dot[r][0];
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(dx[b * R + r]), acc[r]);
      }
    }
    Lanes scale, minimum;
    group_params(qpanel + g * fields * kPanel, fields, scale, minimum);
    for (int r = 0; r < R; ++r) {
      const __m512 rows_sum = _mm512_set1_ps(gsum[g * R + r]);
      total[r] = _mm512_fmadd_ps(minimum.v, rows_sum, _mm512_fmadd_ps(acc[r], scale.v, total[r]));
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * n, total[r]);
}

template <template <int> class Kernel, typename... Args>
void vnni_rows_dispatch(int64_t rows, Args... args) {
  switch (rows) {
    case 1: Kernel<1>::run(args...); break;
    case 2: Kernel<2>::run(args...); break;
    case 3: Kernel<3>::run(args...); break;
    case 4: Kernel<4>::run(args...); break;
    case 5: Kernel<5>::run(args...); break;
    case 6: Kernel<6>::run(args...); break;
    case 7: Kernel<7>::run(args...); break;
    default: Kernel<8>::run(args...); break;
  }
}

template <int R>
struct Int8Vnni {
  template <typename Scale>
  static void run(const int8_t* q, const float* dx, const float* offset, int64_t k, const uint8_t* panel,
                  const Scale* scale, int64_t group, float* out, int64_t n) {
    int8_vnni_panel<R, Scale>(q, dx, offset, k, panel, scale, group, out, n);
  }
};

template <int R>
struct Int4Vnni {
  static void run(const int8_t* q, const float* dx, const float* gsum, int64_t k, const uint8_t* panel,
                  const at::Half* qpanel, int64_t fields, int64_t group, float* out, int64_t n) {
    int4_vnni_panel<R>(q, dx, gsum, k, panel, qpanel, fields, group, out, n);
  }
};

}  // namespace
#endif  // HF_ACCEL_QLINEAR_VNNI
