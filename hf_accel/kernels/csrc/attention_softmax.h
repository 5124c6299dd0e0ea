// Softmax over one row of attention scores, vectorized: exp(x) for x <= 0 (scores minus their maximum) in the
// compiler's `omp simd` loops and in AVX-512 lanes, and `normalize`, the row's softmax. Included by
// paged_attention.cpp's tasks (attention_task.h) alone.
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

// The float whose bits are `bits` (std::bit_cast is C++20; torch before 2.13 builds extensions as C++17).
inline float float_from_bits(int32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// exp(x) for x <= 0 (scores minus their maximum), written so `omp simd` loops vectorize it: exp(x) = 2^n exp(r) with
// n = round(x / ln 2), r in [-ln2 / 2, ln2 / 2] and Cephes' expf polynomial for exp(r) (relative error ~1e-7).
// Below -87 it returns exp(-87) ~ 1.6e-38 instead of a smaller number: nothing a softmax sum can see.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  return p * float_from_bits((static_cast<int32_t>(n) + 127) << 23);
}

#if defined(__AVX512F__)
// exp_nonpositive on 16 lanes.
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  const __m512i exponent = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(exponent));
}

inline __mmask16 lanes_from(int64_t c, int64_t count) {  // the lanes of columns c .. c + 15 below `count`
  return count - c >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (count - c)) - 1);
}
#endif

// w[0, count) = softmax(w[0, count)), -inf entries to zero. With AVX-512 in masked vectors (the compiler's loops left
// each row's last partial vector to scalar code, the larger part of a decode's softmax).
inline void normalize(float* w, int64_t count) {
  constexpr float kMinus = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  __m512 top = _mm512_set1_ps(kMinus);
  for (int64_t c = 0; c < count; c += 16)
    top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(kMinus), lanes_from(c, count), w + c));
  const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t c = 0; c < count; c += 16) {
    const __mmask16 lanes = lanes_from(c, count);
    const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(kMinus), lanes, w + c);
    const __mmask16 finite = _mm512_mask_cmp_ps_mask(lanes, x, _mm512_set1_ps(kMinus), _CMP_NEQ_OQ);
    const __m512 e = _mm512_maskz_mov_ps(finite, exp_nonpositive16(_mm512_sub_ps(x, shift)));
    sum = _mm512_add_ps(sum, e);
    _mm512_mask_storeu_ps(w + c, lanes, e);
  }
  const __m512 inverse = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
  for (int64_t c = 0; c < count; c += 16) {
    const __mmask16 lanes = lanes_from(c, count);
    _mm512_mask_storeu_ps(w + c, lanes, _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, w + c), inverse));
  }
#else
  float top = kMinus;
#pragma omp simd reduction(max : top)
  for (int64_t c = 0; c < count; ++c) top = w[c] > top ? w[c] : top;
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t c = 0; c < count; ++c) {
    w[c] = w[c] == kMinus ? 0.f : exp_nonpositive(w[c] - top);
    total += w[c];
  }
  const float inverse = 1.f / total;
#pragma omp simd
  for (int64_t c = 0; c < count; ++c) w[c] *= inverse;
#endif
}

}  // namespace
