// 16 fp32 lanes, the 16 columns of a panel, in one AVX-512 register or two AVX2 ones: loads (fp32, fp16), stores,
// multiply-adds, a panel row's int8 or int4 codes as floats, and a group's (scale, minimum). Used by both formats'
// kernels (fma_panels.h, vnni_panels.h).
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

#include "quantized_panels.h"

#ifdef HF_ACCEL_QLINEAR_SIMD
namespace {

// 16 fp32 lanes: the 16 columns of a panel.
#if defined(__AVX512F__)
struct Lanes {
  __m512 v;
};
inline Lanes zero() { return {_mm512_setzero_ps()}; }
inline Lanes fma(Lanes a, float b, Lanes c) { return {_mm512_fmadd_ps(a.v, _mm512_set1_ps(b), c.v)}; }
inline Lanes fma(Lanes a, Lanes b, Lanes c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Lanes mul(Lanes a, Lanes b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Lanes add(Lanes a, Lanes b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Lanes load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Lanes load_half(const at::Half* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline Lanes load(const at::Half* p) { return load_half(p); }
inline void store(float* p, Lanes a) { _mm512_storeu_ps(p, a.v); }
// 16 int8 codes -> fp32
inline Lanes codes8(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
// 16 bytes of nibbles -> the low codes and the high codes, fp32
inline void codes4(const uint8_t* p, Lanes& low, Lanes& high) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  low.v = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)));
  high.v = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
}
#else
struct Lanes {
  __m256 lo, hi;
};
inline Lanes zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Lanes fma(Lanes a, float b, Lanes c) {
  const __m256 s = _mm256_set1_ps(b);
  return {_mm256_fmadd_ps(a.lo, s, c.lo), _mm256_fmadd_ps(a.hi, s, c.hi)};
}
inline Lanes fma(Lanes a, Lanes b, Lanes c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Lanes mul(Lanes a, Lanes b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Lanes add(Lanes a, Lanes b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Lanes load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline Lanes load_half(const at::Half* p) {
  const __m128i* q = reinterpret_cast<const __m128i*>(p);
  return {_mm256_cvtph_ps(_mm_loadu_si128(q)), _mm256_cvtph_ps(_mm_loadu_si128(q + 1))};
}
inline Lanes load(const at::Half* p) { return load_half(p); }
inline void store(float* p, Lanes a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline Lanes codes8(const int8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(bytes, bytes)))};
}
inline void codes4(const uint8_t* p, Lanes& low, Lanes& high) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i first = _mm256_cvtepu8_epi32(bytes), second = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(bytes, bytes));
  const __m256i nibble = _mm256_set1_epi32(15);
  low = {_mm256_cvtepi32_ps(_mm256_and_si256(first, nibble)), _mm256_cvtepi32_ps(_mm256_and_si256(second, nibble))};
  high = {_mm256_cvtepi32_ps(_mm256_srli_epi32(first, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(second, 4))};
}
#endif

// A group's (scale, minimum) from its `fields` (2: both stored; 1: the scale, minimum -8 * scale, exact in fp32).
inline void group_params(const at::Half* q, int64_t fields, Lanes& scale, Lanes& minimum) {
  scale = load_half(q);
  minimum = fields == 2 ? load_half(q + kPanel) : fma(scale, -8.0f, zero());
}

}  // namespace
#endif  // HF_ACCEL_QLINEAR_SIMD
