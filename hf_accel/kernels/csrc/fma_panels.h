// Format 0 of the quantized Linear kernels (quantized_linear.cpp): fp32 multiply-adds after an in-register
// dequantization of a panel's int8 or int4 codes (AVX2 + F16C, or AVX-512 without VNNI), 1 to kPassRows rows a pass.
// Included by quantized_linear.cpp alone.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

#include "panel_lanes.h"
#include "quantized_panels.h"

#ifdef HF_ACCEL_QLINEAR_SIMD
namespace {

// bytes ahead of the current 64-byte line that a pass asks the memory for: one stream per thread is otherwise held
// to about half the core's read bandwidth by the hardware prefetcher (benchmarks/bench_size.py measures the result)
constexpr int64_t kPrefetch = 4096;

// out[r, :16] = sum_g scale_g * sum_{k in g} x[r, k] codes[k, :] for R rows (x: fp32 [R, K] contiguous), `group`
// inputs per scale (K for one per column), S streams over k.
template <int R, int S, typename Scale>
void int8_panel(const float* x, int64_t k, const int8_t* panel, const Scale* scale, int64_t group, float* out,
                int64_t n) {
  Lanes total[R];
  for (int r = 0; r < R; ++r) total[r] = zero();
  for (int64_t start = 0, g = 0; start < k; start += group, ++g) {
    Lanes acc[R][S];
    for (int r = 0; r < R; ++r)
      for (int s = 0; s < S; ++s) acc[r][s] = zero();
    const int64_t end = start + group;
    int64_t i = start;
    for (; i + S <= end; i += S) {
      if (i % 4 == 0) _mm_prefetch(reinterpret_cast<const char*>(panel + i * kPanel) + kPrefetch, _MM_HINT_T0);
#pragma GCC unroll 8
      for (int s = 0; s < S; ++s) {
        const Lanes w = codes8(panel + (i + s) * kPanel);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r][s] = fma(w, x[r * k + i + s], acc[r][s]);
      }
    }
    for (; i < end; ++i) {
      const Lanes w = codes8(panel + i * kPanel);
      for (int r = 0; r < R; ++r) acc[r][0] = fma(w, x[r * k + i], acc[r][0]);
    }
    const Lanes columns = load(scale + g * kPanel);
    for (int r = 0; r < R; ++r) {
      Lanes sum = acc[r][0];
      for (int s = 1; s < S; ++s) sum = add(sum, acc[r][s]);
      total[r] = fma(sum, columns, total[r]);
    }
  }
  for (int r = 0; r < R; ++r) store(out + r * n, total[r]);
}

// The same for int4: `group` inputs (group / 2 bytes) per (scale, minimum) of `fields` fp16 panels; xsum [R, G] the
// rows' group sums.
template <int R, int S>
void int4_panel(const float* x, int64_t k, const uint8_t* panel, const at::Half* qpanel, int64_t fields,
                int64_t group, const float* xsum, float* out, int64_t n) {
  const int64_t groups = k / group, pairs = group / 2;
  Lanes total[R];
  for (int r = 0; r < R; ++r) total[r] = zero();
  for (int64_t g = 0; g < groups; ++g) {
    Lanes acc[R][S];
    for (int r = 0; r < R; ++r)
      for (int s = 0; s < S; ++s) acc[r][s] = zero();
    const uint8_t* bytes = panel + g * pairs * kPanel;
    const float* xg = x + g * group;
    for (int64_t j = 0; j < pairs; j += S) {  // pairs (16 or more) is a multiple of S (at most 4)
      if (j % 4 == 0) _mm_prefetch(reinterpret_cast<const char*>(bytes + j * kPanel) + kPrefetch, _MM_HINT_T0);
#pragma GCC unroll 8
      for (int s = 0; s < S; ++s) {
        Lanes low, high;
        codes4(bytes + (j + s) * kPanel, low, high);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          acc[r][s] = fma(low, xg[r * k + 2 * (j + s)], acc[r][s]);
          acc[r][s] = fma(high, xg[r * k + 2 * (j + s) + 1], acc[r][s]);
        }
      }
    }
    Lanes scale, minimum;
    group_params(qpanel + g * fields * kPanel, fields, scale, minimum);
    for (int r = 0; r < R; ++r) {
      Lanes sum = acc[r][0];
      for (int s = 1; s < S; ++s) sum = add(sum, acc[r][s]);
      total[r] = fma(minimum, xsum[r * groups + g], fma(sum, scale, total[r]));
    }
  }
  for (int r = 0; r < R; ++r) store(out + r * n, total[r]);
}

// R rows with S streams over k: enough independent FMA chains to hide their latency at one or two rows.
template <template <int, int> class Kernel, typename... Args>
void rows_dispatch(int64_t rows, Args... args) {
  switch (rows) {
    case 1: Kernel<1, 4>::run(args...); break;
    case 2: Kernel<2, 2>::run(args...); break;
    case 3: Kernel<3, 2>::run(args...); break;
    case 4: Kernel<4, 1>::run(args...); break;
#if defined(__AVX512F__)
    case 5: Kernel<5, 1>::run(args...); break;
    case 6: Kernel<6, 1>::run(args...); break;
    case 7: Kernel<7, 1>::run(args...); break;
    default: Kernel<8, 1>::run(args...); break;
#else
    default: Kernel<4, 1>::run(args...); break;
#endif
  }
}

template <int R, int S>
struct Int8Kernel {
  template <typename Scale>
  static void run(const float* x, int64_t k, const int8_t* panel, const Scale* scale, int64_t group, float* out,
                  int64_t n) {
    int8_panel<R, S, Scale>(x, k, panel, scale, group, out, n);
  }
};

template <int R, int S>
struct Int4Kernel {
  static void run(const float* x, int64_t k, const uint8_t* panel, const at::Half* qpanel, int64_t fields,
                  int64_t group, const float* xsum, float* out, int64_t n) {
    int4_panel<R, S>(x, k, panel, qpanel, fields, group, xsum, out, n);
  }
};

}  // namespace
#endif  // HF_ACCEL_QLINEAR_SIMD
