// The register-tiled inner loops of paged attention, over rows already found in the pool: one dot product per
// (key, query) for decodes, a 16-key block transposed once and scored against many query rows, and value rows
// accumulated into query-row tiles (16 lanes) or whole rows (a decode's head sizes 64 and 128). Included by
// paged_attention.cpp's tasks (attention_task.h) alone.
#pragma once
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace {

constexpr int64_t kPrefetchRows = 16;  // value rows fetched ahead of the one being accumulated

// Ask for the cache lines of one pool row (`dim` elements) ahead of their use.
template <typename scalar_t>
inline void prefetch_row(const scalar_t* row, int64_t dim) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < dim * static_cast<int64_t>(sizeof(scalar_t)); offset += 64)
    __builtin_prefetch(bytes + offset);
}

// One dot product per (key, query) for decodes. With AVX-512 (the kernel is built with -march=native) the lanes are
// summed by one reduction instruction, with AVX2 by three shuffles and adds in registers: a plain `omp simd reduction`
// left that last step to sixteen dependent scalar adds through the stack, the largest cost of a decode step's
// attention (AVX2, reference target's heads: a decode's attention 1.4-1.75x faster, a 64-sequence engine step 16%).
inline float dot(const float* a, const float* b, int64_t dim) {
#if defined(__AVX512F__)
  if (dim % 16 == 0) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 16) sum = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), sum);
    return _mm512_reduce_add_ps(sum);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (dim % 16 == 0) {  // two independent accumulators, then 8 lanes -> 4 -> 2 -> 1 in registers
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 16) {
      even = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), even);
      odd = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), odd);
    }
    const __m256 sum = _mm256_add_ps(even, odd);
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    half = _mm_add_ss(half, _mm_movehdup_ps(half));
    return _mm_cvtss_f32(half);
  }
#endif
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t d = 0; d < dim; ++d) total += a[d] * b[d];
  return total;
}

// Scores of R query rows `q` [R, dim] against one block transposed to `kt` [dim, BS] (its first `width` keys valid),
// into `scores` (row stride `columns`): each row's BS scores stay in registers while the block's dim rows stream past.
template <int64_t R, int64_t BS>
void score_rows(const float* q, int64_t dim, const float* kt, int64_t width, float* scores, int64_t columns) {
  float a[R][BS] = {};
  for (int64_t d = 0; d < dim; ++d) {
    const float* kd = kt + d * BS;
    for (int64_t r = 0; r < R; ++r) {
      const float qd = q[r * dim + d];
#pragma omp simd
      for (int64_t c = 0; c < BS; ++c) a[r][c] += qd * kd[c];
    }
  }
  for (int64_t r = 0; r < R; ++r) std::copy(a[r], a[r] + width, scores + r * columns);
}

// score_rows over all `num_q` rows: eight at a time (independent chains of FMAs: four waited on their latency), then
// four, then one.
template <int64_t BS>
void score_block(const float* q, int64_t num_q, int64_t dim, const float* kt, int64_t width, float* scores,
                 int64_t columns) {
  int64_t j = 0;
  for (; j + 8 <= num_q; j += 8) score_rows<8, BS>(q + j * dim, dim, kt, width, scores + j * columns, columns);
  for (; j + 4 <= num_q; j += 4) score_rows<4, BS>(q + j * dim, dim, kt, width, scores + j * columns, columns);
  for (; j < num_q; ++j) score_rows<1, BS>(q + j * dim, dim, kt, width, scores + j * columns, columns);
}

#if defined(__AVX512F__)
// dst [16, 16] (row stride `dst_stride`) = src [16, 16] (row stride `src_stride`) transposed, in registers: pairs of
// rows interleaved at 1, 2, 4 and 8 floats.
inline void transpose16(const float* src, int64_t src_stride, float* dst, int64_t dst_stride) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * src_stride);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4)
    for (int j = 0; j < 2; ++j) {
      r[i + 2 * j] = _mm512_shuffle_ps(t[i + j], t[i + j + 2], 0x44);
      r[i + 2 * j + 1] = _mm512_shuffle_ps(t[i + j], t[i + j + 2], 0xee);
    }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
  }
  for (int j = 0; j < 16; ++j) _mm512_storeu_ps(dst + j * dst_stride, r[j]);  // r[j]: column j of src
}
#endif

// kt [dim, 16] = the first `width` keys [width, dim] of a 16-key block transposed, zero past them; `rows` a
// [16 * dim] buffer for the keys as floats when the pool holds another dtype.
template <typename scalar_t>
void transpose_keys(const scalar_t* k, int64_t width, int64_t dim, float* rows, float* kt) {
#if defined(__AVX512F__)
  if (dim % 16 == 0) {
    const float* src = rows;
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (width == 16) src = k;
    }
    if (src == rows) {  // as floats, zero rows past `width`
      for (int64_t c = 0; c < width; ++c)
        for (int64_t d = 0; d < dim; ++d) rows[c * dim + d] = static_cast<float>(k[c * dim + d]);
      std::fill(rows + width * dim, rows + 16 * dim, 0.f);
    }
    for (int64_t d = 0; d < dim; d += 16) transpose16(src + d, dim, kt + d * 16, 16);
    return;
  }
#endif
  std::fill(kt, kt + dim * 16, 0.f);
  for (int64_t c = 0; c < width; ++c)
    for (int64_t d = 0; d < dim; ++d) kt[d * 16 + c] = static_cast<float>(k[c * dim + d]);
}

// Query rows of a value tile: 8 x 16 accumulators are 8 of AVX-512's 32 registers but all 16 of AVX2's (the loads
// would spill them), so there a tile has 4 rows.
#if defined(__AVX512F__)
constexpr int64_t kTileRows = 8;
#else
constexpr int64_t kTileRows = 4;
#endif

// acc [R, 16] (row stride `dim`) += weights [R, columns] (row stride `columns`) @ value rows `rows[c]` (16 floats
// from each): R rows x 16 lanes of accumulators stay in registers while the value rows stream past.
template <int64_t R>
void accumulate_tile(const float* weights, int64_t columns, const float* const* rows, float* acc, int64_t dim) {
  float a[R][16] = {};
  for (int64_t c = 0; c < columns; ++c) {
    const float* v = rows[c];
    for (int64_t r = 0; r < R; ++r) {
      const float w = weights[r * columns + c];
#pragma omp simd
      for (int64_t e = 0; e < 16; ++e) a[r][e] += w * v[e];
    }
  }
  for (int64_t r = 0; r < R; ++r) std::copy(a[r], a[r] + 16, acc + r * dim);
}

// acc [R, D] (row stride D) = weights [R, columns] @ value rows `rows[c]` (D floats each), whole rows at a time: for a
// decode's few query rows, R x D accumulators fit in registers and each value row is read once, front to back.
template <int64_t R, int64_t D>
void accumulate_rows(const float* weights, int64_t columns, const float* const* rows, float* acc) {
  float a[R][D] = {};
  for (int64_t c = 0; c < columns; ++c) {
    const float* v = rows[c];
    if (c + kPrefetchRows < columns) prefetch_row(rows[c + kPrefetchRows], D);
    for (int64_t r = 0; r < R; ++r) {
      const float w = weights[r * columns + c];
#pragma omp simd
      for (int64_t e = 0; e < D; ++e) a[r][e] += w * v[e];
    }
  }
  for (int64_t r = 0; r < R; ++r) std::copy(a[r], a[r] + D, acc + r * D);
}

// Whole-row accumulation (`accumulate_rows`) for head sizes 64 and 128; false where it does not apply.
inline bool accumulate_decode(const float* weights, int64_t num_q, int64_t columns, const float* const* rows,
                              int64_t dim, float* acc) {
  if (dim != 64 && dim != 128) return false;
  int64_t j = 0;
  for (; j + 2 <= num_q; j += 2) {
    if (dim == 64) accumulate_rows<2, 64>(weights + j * columns, columns, rows, acc + j * dim);
    else accumulate_rows<2, 128>(weights + j * columns, columns, rows, acc + j * dim);
  }
  for (; j < num_q; ++j) {
    if (dim == 64) accumulate_rows<1, 64>(weights + j * columns, columns, rows, acc + j * dim);
    else accumulate_rows<1, 128>(weights + j * columns, columns, rows, acc + j * dim);
  }
  return true;
}

}  // namespace
