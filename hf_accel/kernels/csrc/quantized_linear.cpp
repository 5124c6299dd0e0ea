// Linears over weight-only quantized weights (hf_accel's int8 per output channel and int4 per group), re-laid once
// into 16-column panels (hf_accel/quant/panels.py packs them) and dequantized in registers: the few rows of a decode
// or a speculative verify read each weight byte once, at the memory's speed.
//
// int8_linear(x, panels, scale, bias)
//   x        [M, K]            fp32, bf16 or fp16 rows (any strides)
//   panels   [P, K, 16] int8   columns 16p .. 16p + 15 of the codes, row k of a panel holding their k-th inputs
//   scale    [N = 16 P]        per output column: w[n, k] = code * scale[n]
// int4_linear(x, panels, qpanels, bias)
//   panels   [P, K / 2, 16] uint8   byte j of a column holds the codes (0..15) of inputs 2j (low nibble), 2j + 1
//   qpanels  [P, G, 2, 16] fp16     per group of K / G inputs and column: (scale, minimum),
//                                   w[n, k] = code * scale + minimum
// both: bias [N] or None; returns [M, N] in x's dtype.
//
// Rule: out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]), accumulated in fp32. int4 sums each group as
// scale * sum_k x_k code_k + minimum * sum_k x_k (the second factor computed once per row and group), so the inner
// loop is one FMA per code and row. Up to kPassRows rows share one pass over a panel (their accumulators stay in
// registers); more rows take further passes over the panel, now in cache. Past kKernelRows rows (a prefill) the
// weight is dequantized into fp32 blocks of columns and multiplied by ATen's matmul. Panels are split over torch's
// intra-op threads. AVX-512 (one register per 16 columns) or AVX2 + F16C (two), chosen at build (-march=native);
// without either the ops dequantize and run ATen's matmul.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HF_ACCEL_QLINEAR_SIMD 1
#endif

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kPanel = 16;        // columns per panel
constexpr int64_t kKernelRows = 16;   // the most rows the register kernel computes; more dequantize into blocks
constexpr int64_t kBlockPanels = 32;  // panels (512 columns) dequantized per ATen matmul past kKernelRows
// bytes ahead of the current 64-byte line that a pass asks the memory for: one stream per thread is otherwise held
// to about half the core's read bandwidth (7 of 13.5 GB/s here; 10-12 GB/s with 4 KB ahead, 1024 and 2048 less)
constexpr int64_t kPrefetch = 4096;

#ifdef HF_ACCEL_QLINEAR_SIMD

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

#if defined(__AVX512F__)
constexpr int kPassRows = 8;  // rows per pass over a panel: 32 registers hold their accumulators
#else
constexpr int kPassRows = 4;  // 16 registers, two per 16 lanes
#endif

// out[r, :16] = scale * sum_k x[r, k] codes[k, :] for R rows (x: fp32 [R, K] contiguous), S streams over k.
template <int R, int S>
void int8_panel(const float* x, int64_t k, const int8_t* panel, const float* scale, float* out, int64_t n) {
  Lanes acc[R][S];
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s) acc[r][s] = zero();
  int64_t i = 0;
  for (; i + S <= k; i += S) {
    if (i % 4 == 0) _mm_prefetch(reinterpret_cast<const char*>(panel + i * kPanel) + kPrefetch, _MM_HINT_T0);
#pragma GCC unroll 8
    for (int s = 0; s < S; ++s) {
      const Lanes w = codes8(panel + (i + s) * kPanel);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][s] = fma(w, x[r * k + i + s], acc[r][s]);
    }
  }
  for (; i < k; ++i) {
    const Lanes w = codes8(panel + i * kPanel);
    for (int r = 0; r < R; ++r) acc[r][0] = fma(w, x[r * k + i], acc[r][0]);
  }
  const Lanes columns = load(scale);
  for (int r = 0; r < R; ++r) {
    Lanes sum = acc[r][0];
    for (int s = 1; s < S; ++s) sum = add(sum, acc[r][s]);
    store(out + r * n, mul(sum, columns));
  }
}

// The same for int4: `group` inputs (group / 2 bytes) per (scale, minimum); xsum [R, G] the rows' group sums.
template <int R, int S>
void int4_panel(const float* x, int64_t k, const uint8_t* panel, const at::Half* qpanel, int64_t group,
                const float* xsum, float* out, int64_t n) {
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
    const Lanes scale = load_half(qpanel + g * 2 * kPanel), minimum = load_half(qpanel + g * 2 * kPanel + kPanel);
    for (int r = 0; r < R; ++r) {
      Lanes sum = acc[r][0];
      for (int s = 1; s < S; ++s) sum = add(sum, acc[r][s]);
      total[r] = fma(minimum, xsum[r * groups + g], fma(sum, scale, total[r]));
    }
  }
  for (int r = 0; r < R; ++r) store(out + r * n, total[r]);
}

#endif  // HF_ACCEL_QLINEAR_SIMD

void check_common(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.is_floating_point(), "x must be a float [M, K] tensor");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous(),
              "panels must be contiguous [P, ., 16]");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n), "bias must be [N]");
}

at::Tensor finish(at::Tensor out, const at::Tensor& x, const c10::optional<at::Tensor>& bias) {
  if (bias.has_value()) out.add_(bias->to(at::kFloat));
  return out.to(x.scalar_type());
}

// fp32 [K, 16 * panels] of panels first .. first + count (the dequantized weight, transposed).
at::Tensor int8_block(const at::Tensor& panels, const at::Tensor& scale, int64_t first, int64_t count) {
  auto codes = panels.narrow(0, first, count).to(at::kFloat);                   // [count, K, 16]
  auto columns = scale.narrow(0, first * kPanel, count * kPanel).view({count, 1, kPanel});
  return (codes * columns).permute({1, 0, 2}).reshape({panels.size(1), count * kPanel});
}

at::Tensor int4_block(const at::Tensor& panels, const at::Tensor& qpanels, int64_t first, int64_t count) {
  auto bytes = panels.narrow(0, first, count).to(at::kInt);                     // [count, K / 2, 16]
  auto codes = at::stack({bytes.bitwise_and(15), bytes.bitwise_right_shift(4)}, 2)  // [count, K / 2, 2, 16]
                   .view({count, -1, kPanel}).to(at::kFloat);                   // [count, K, 16]
  const int64_t groups = qpanels.size(1), k = codes.size(1);
  auto q = qpanels.narrow(0, first, count).to(at::kFloat);                      // [count, G, 2, 16]
  auto grouped = codes.view({count, groups, k / groups, kPanel});
  auto weight = grouped * q.select(2, 0).unsqueeze(2) + q.select(2, 1).unsqueeze(2);
  return weight.view({count, k, kPanel}).permute({1, 0, 2}).reshape({k, count * kPanel});
}

// Past kKernelRows rows: out[:, block] = x @ block's fp32 weight, one block of kBlockPanels panels at a time.
template <typename Block>
at::Tensor blocked_matmul(const at::Tensor& x, int64_t panel_count, Block block) {
  auto rows = x.to(at::kFloat);
  auto out = at::empty({x.size(0), panel_count * kPanel}, rows.options());
  for (int64_t first = 0; first < panel_count; first += kBlockPanels) {
    const int64_t count = std::min(kBlockPanels, panel_count - first);
    out.narrow(1, first * kPanel, count * kPanel).copy_(at::mm(rows, block(first, count)));
  }
  return out;
}

#ifdef HF_ACCEL_QLINEAR_SIMD
// Each panel of [0, panel_count) for all rows, kPassRows rows a pass, split over threads by panel.
template <typename PanelFn>
at::Tensor over_panels(const at::Tensor& rows, int64_t panel_count, PanelFn run) {
  const int64_t m = rows.size(0), n = panel_count * kPanel;
  auto out = at::empty({m, n}, rows.options());
  float* out_data = out.data_ptr<float>();
  at::parallel_for(0, panel_count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t first = 0; first < m; first += kPassRows)
        run(p, first, std::min<int64_t>(kPassRows, m - first), out_data + first * n + p * kPanel);
  });
  return out;
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
  static void run(const float* x, int64_t k, const int8_t* panel, const float* scale, float* out, int64_t n) {
    int8_panel<R, S>(x, k, panel, scale, out, n);
  }
};

template <int R, int S>
struct Int4Kernel {
  static void run(const float* x, int64_t k, const uint8_t* panel, const at::Half* qpanel, int64_t group,
                  const float* xsum, float* out, int64_t n) {
    int4_panel<R, S>(x, k, panel, qpanel, group, xsum, out, n);
  }
};
#endif

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias) {
  const int64_t p = panels.size(0), k = panels.size(1), n = p * kPanel;
  check_common(x, panels, bias, n);
  TORCH_CHECK(panels.scalar_type() == at::kChar, "int8 panels must be int8");
  TORCH_CHECK(x.size(1) == k, "x and panels disagree on K");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == n, "scale must be [16 P]");
  auto columns = scale.to(at::kFloat).contiguous();
#ifdef HF_ACCEL_QLINEAR_SIMD
  if (x.size(0) <= kKernelRows) {
    auto rows = x.to(at::kFloat).contiguous();
    const float* x_data = rows.data_ptr<float>();
    const int8_t* codes = panels.data_ptr<int8_t>();
    const float* scale_data = columns.data_ptr<float>();
    auto out = over_panels(rows, p, [&](int64_t panel, int64_t first, int64_t count, float* dst) {
      rows_dispatch<Int8Kernel>(count, x_data + first * k, k, codes + panel * k * kPanel,
                                scale_data + panel * kPanel, dst, n);
    });
    return finish(out, x, bias);
  }
#endif
  auto out = blocked_matmul(x, p, [&](int64_t first, int64_t count) { return int8_block(panels, columns, first, count); });
  return finish(out, x, bias);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& qpanels,
                       const c10::optional<at::Tensor>& bias) {
  const int64_t p = panels.size(0), k = panels.size(1) * 2, n = p * kPanel;
  check_common(x, panels, bias, n);
  TORCH_CHECK(panels.scalar_type() == at::kByte, "int4 panels must be uint8");
  TORCH_CHECK(x.size(1) == k, "x and panels disagree on K");
  TORCH_CHECK(qpanels.dim() == 4 && qpanels.size(0) == p && qpanels.size(2) == 2 && qpanels.size(3) == kPanel &&
                  qpanels.scalar_type() == at::kHalf && qpanels.is_contiguous(),
              "qpanels must be contiguous fp16 [P, G, 2, 16]");
  const int64_t groups = qpanels.size(1);
  TORCH_CHECK(groups > 0 && k % groups == 0 && (k / groups) % 8 == 0, "K / G must be a multiple of 8");
#ifdef HF_ACCEL_QLINEAR_SIMD
  if (x.size(0) <= kKernelRows) {
    auto rows = x.to(at::kFloat).contiguous();
    auto xsum = rows.view({rows.size(0), groups, k / groups}).sum(-1).contiguous();  // [M, G]
    const float* x_data = rows.data_ptr<float>();
    const float* xsum_data = xsum.data_ptr<float>();
    const uint8_t* codes = panels.data_ptr<uint8_t>();
    const at::Half* q = qpanels.data_ptr<at::Half>();
    const int64_t group = k / groups;
    auto out = over_panels(rows, p, [&](int64_t panel, int64_t first, int64_t count, float* dst) {
      rows_dispatch<Int4Kernel>(count, x_data + first * k, k, codes + panel * (k / 2) * kPanel,
                                q + panel * groups * 2 * kPanel, group, xsum_data + first * groups, dst, n);
    });
    return finish(out, x, bias);
  }
#endif
  auto out = blocked_matmul(x, p, [&](int64_t first, int64_t count) { return int4_block(panels, qpanels, first, count); });
  return finish(out, x, bias);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_accel, m) {
  m.def("int8_linear(Tensor x, Tensor panels, Tensor scale, Tensor? bias) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor panels, Tensor qpanels, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(hf_accel, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
}
