// What the quantized Linear kernels' two formats share (quantized_linear.cpp describes both): the build's choice
// of format, the panel width and the rows one pass over a panel carries. Included by quantized_linear.cpp and its
// kernels (fma_panels.h, vnni_panels.h) alone.
#pragma once
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HF_ACCEL_QLINEAR_SIMD 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(HF_ACCEL_QLINEAR_FORMAT0)
#define HF_ACCEL_QLINEAR_VNNI 1  // (HF_ACCEL_QLINEAR_FORMAT0: the tests' build of format 0 on such a CPU)
#endif
#endif

namespace {

constexpr int64_t kPanel = 16;   // columns per panel
constexpr int64_t kXBlock = 32;  // format 1: inputs per activation scale; both: group sizes are multiples of it
#if defined(__AVX512F__)
constexpr int kPassRows = 8;  // rows per pass over a panel: 32 registers hold their accumulators
#else
constexpr int kPassRows = 4;  // 16 registers, two per 16 lanes
#endif

}  // namespace
