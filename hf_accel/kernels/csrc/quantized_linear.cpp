// Linears over weight-only quantized weights (hf_accel's int8 per output channel and int4 per group), re-laid once
// into 16-column panels (hf_accel/quant/panels.py packs them): the few rows of a decode or a speculative verify read
// each weight byte once, at the memory's speed, and a prefill's many rows reuse each panel from cache.
//
// int8_linear(x, panels, scale, bias)
//   x        [M, K]            fp32, bf16 or fp16 rows (any strides)
//   panels   [P, K, 16]        the codes of columns 16p .. 16p + 15 (byte order: below)
//   scale    [N = 16 P]        per output column: w[n, k] = code * scale[n]; or
//            [P, G, 16]        per group of K / G inputs (a multiple of 32) and column (GGUF's Q8_0: G = K / 32),
//                              fp16 (half the bytes of fp32: 1 / 16 of the codes' at groups of 32) or fp32.
//                              [N] is the G = 1 case of the same memory.
// int4_linear(x, panels, qpanels, bias)
//   panels   [P, K / 2, 16] uint8   the codes (0..15) of columns 16p .. 16p + 15, two a byte (byte order: below)
//   qpanels  [P, G, F, 16] fp16     per group of K / G inputs and column: F = 2, (scale, minimum),
//                                   w[n, k] = code * scale + minimum; or F = 1, the scale alone, minimum =
//                                   -8 * scale (symmetric: GGUF's Q4_0), half the bytes at the same arithmetic
// both: bias [N] or None; returns [M, N] in x's dtype. quantized_linear_format() says which byte order the build
// expects (panels.py packs either):
//
// Format 1, integer dot products (AVX-512 VNNI): each row of x is quantized to int8 in blocks of 32 inputs
// (symmetric, scale absmax / 127: llama.cpp's Q8_0 rule), and `vpdpbusd` sums 4 products of unsigned weight bytes
// and signed activation bytes per lane. int8 panels hold code + 128 as uint8, 4 consecutive inputs per column
// ([P, K / 4, 16, 4]); the +128 is taken back once per row (128 * the row's block sums). int4 panels hold 8
// consecutive inputs per column in 4 bytes ([P, K / 8, 16, 4]: byte t has input t in the low nibble, t + 4 in the
// high). out = sum over blocks of dx_b * (integer dot), so a row's result is the same bits whatever the other rows.
// Format 0, fp32 FMA after an in-register dequantization (AVX2 + F16C, or AVX-512 without VNNI): int8 panels [P, K,
// 16] hold the signed codes, int4 panels [P, K / 2, 16] inputs 2j (low nibble) and 2j + 1 (high) in byte j; x stays
// fp32; past kKernelRows rows the weight is dequantized into fp32 blocks of columns for ATen's matmul.
//
// int4 sums each group as scale * sum_k x_k code_k + minimum * sum_k x_k (the second factor once per row and group).
// Up to kPassRows rows share one pass over a panel (their accumulators stay in registers); more rows take further
// passes over the panel, now in cache. Panels are split over torch's intra-op threads. Without AVX2 the ops
// dequantize and run ATen's matmul.
#include <ATen/ATen.h>  // not torch/extension.h: its Python and nn headers triple the compile time
#include <torch/library.h>
#include <ATen/Parallel.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HF_ACCEL_QLINEAR_SIMD 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(HF_ACCEL_QLINEAR_FORMAT0)
#define HF_ACCEL_QLINEAR_VNNI 1  // (HF_ACCEL_QLINEAR_FORMAT0: the tests' build of format 0 on such a CPU)
#endif
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kPanel = 16;        // columns per panel
constexpr int64_t kKernelRows = 64;   // format 0: the most rows the register kernel computes (where MKL's matmul on
                                      // the dequantized weight catches up); more dequantize into blocks
constexpr int64_t kBlockPanels = 32;  // panels (512 columns) dequantized per ATen matmul past kKernelRows
constexpr int64_t kXBlock = 32;       // format 1: inputs per activation scale
// bytes ahead of the current 64-byte line that a pass asks the memory for: one stream per thread is otherwise held
// to about half the core's read bandwidth by the hardware prefetcher (benchmarks/bench_size.py measures the result)
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

#if defined(__AVX512F__)
constexpr int kPassRows = 8;  // rows per pass over a panel: 32 registers hold their accumulators
#else
constexpr int kPassRows = 4;  // 16 registers, two per 16 lanes
#endif

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

// fp32 [K, 16 * panels] of panels first .. first + count (the dequantized weight, transposed); scale [P, G, 16].
at::Tensor int8_block(const at::Tensor& panels, const at::Tensor& scale, int64_t first, int64_t count) {
  const int64_t k = panels.size(1), groups = scale.size(1);
  auto codes = panels.narrow(0, first, count).to(at::kFloat).view({count, groups, k / groups, kPanel});
  auto weight = codes * scale.narrow(0, first, count).unsqueeze(2);            // [count, G, K / G, 16]
  return weight.view({count, k, kPanel}).permute({1, 0, 2}).reshape({k, count * kPanel});
}

at::Tensor int4_block(const at::Tensor& panels, const at::Tensor& qpanels, int64_t first, int64_t count) {
  auto bytes = panels.narrow(0, first, count).to(at::kInt);                     // [count, K / 2, 16]
  auto codes = at::stack({bytes.bitwise_and(15), bytes.bitwise_right_shift(4)}, 2)  // [count, K / 2, 2, 16]
                   .view({count, -1, kPanel}).to(at::kFloat);                   // [count, K, 16]
  const int64_t groups = qpanels.size(1), k = codes.size(1);
  auto q = qpanels.narrow(0, first, count).to(at::kFloat);                      // [count, G, F, 16]
  auto scale = q.select(2, 0).unsqueeze(2), minimum = q.size(2) == 2 ? q.select(2, 1).unsqueeze(2) : scale * -8.0;
  auto weight = codes.view({count, groups, k / groups, kPanel}) * scale + minimum;
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
at::Tensor over_panels(int64_t m, int64_t panel_count, PanelFn run) {
  const int64_t n = panel_count * kPanel;
  auto out = at::empty({m, n}, at::TensorOptions().dtype(at::kFloat));
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
#endif

#ifdef HF_ACCEL_QLINEAR_VNNI
// Each 32-input block asks for all of its lines kVnniPrefetch bytes ahead (the format-0 kernels ask for every line,
// kPrefetch ahead): with one line a block, a pass of several rows waited on the memory, its loads no longer
// overlapping its dot products (docs/weight-quantization.md has the measured distances).
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
      prefetch_block(bytes, 8);
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

#endif  // HF_ACCEL_QLINEAR_VNNI

int64_t quantized_linear_format() {
#ifdef HF_ACCEL_QLINEAR_VNNI
  return 1;
#else
  return 0;
#endif
}

// scale [N] or [P, G, 16] -> contiguous [P, G, 16]: fp16 grouped scales as they are, anything else in fp32 ([N]
// is the same memory, G = 1).
at::Tensor int8_scale_panels(const at::Tensor& scale, int64_t p, int64_t k) {
  if (scale.dim() == 1) {
    TORCH_CHECK(scale.size(0) == p * kPanel, "scale must be [16 P] or [P, G, 16]");
    return scale.to(at::kFloat).contiguous().view({p, 1, kPanel});
  }
  TORCH_CHECK(scale.dim() == 3 && scale.size(0) == p && scale.size(2) == kPanel,
              "scale must be [16 P] or [P, G, 16]");
  const int64_t groups = scale.size(1);
  TORCH_CHECK(groups > 0 && k % groups == 0 && (k / groups) % kXBlock == 0,
              "grouped scale: K / G must be a multiple of 32");
  return (scale.scalar_type() == at::kHalf ? scale : scale.to(at::kFloat)).contiguous();
}

// int8_linear with scales [P, G, 16] of type Scale (float or at::Half).
template <typename Scale>
at::Tensor int8_linear_with(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scales,
                            const c10::optional<at::Tensor>& bias) {
  const int64_t p = panels.size(0), k = panels.size(1), n = p * kPanel;
  const int64_t groups = scales.size(1), group = k / groups;
  const Scale* scale_data = scales.data_ptr<Scale>();
#ifdef HF_ACCEL_QLINEAR_VNNI
  TORCH_CHECK(panels.scalar_type() == at::kByte && k % kXBlock == 0, "format 1: uint8 panels, K a multiple of 32");
  const auto rows = quantize_rows(x, groups, 128.0f);  // sums: [M, G], what the codes' +128 adds per group
  const int8_t* q = rows.q.data_ptr<int8_t>();
  const float *dx = rows.scale.data_ptr<float>(), *offset = rows.sum.data_ptr<float>();
  const uint8_t* codes = panels.data_ptr<uint8_t>();
  const int64_t blocks = k / kXBlock;
  auto out = over_panels(x.size(0), p, [&](int64_t panel, int64_t first, int64_t count, float* dst) {
    vnni_rows_dispatch<Int8Vnni>(count, q + first * k, dx + first * blocks, offset + first * groups, k,
                                 codes + panel * k * kPanel, scale_data + panel * groups * kPanel, group, dst, n);
  });
  return finish(out, x, bias);
#else
  TORCH_CHECK(panels.scalar_type() == at::kChar, "format 0: int8 panels");
#ifdef HF_ACCEL_QLINEAR_SIMD
  if (x.size(0) <= kKernelRows) {
    auto rows = x.to(at::kFloat).contiguous();
    const float* x_data = rows.data_ptr<float>();
    const int8_t* codes = panels.data_ptr<int8_t>();
    auto out = over_panels(x.size(0), p, [&](int64_t panel, int64_t first, int64_t count, float* dst) {
      rows_dispatch<Int8Kernel>(count, x_data + first * k, k, codes + panel * k * kPanel,
                                scale_data + panel * groups * kPanel, group, dst, n);
    });
    return finish(out, x, bias);
  }
#endif
  auto columns = scales.to(at::kFloat);
  auto out = blocked_matmul(x, p, [&](int64_t first, int64_t count) {
    return int8_block(panels, columns, first, count);
  });
  return finish(out, x, bias);
#endif
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias) {
  const int64_t p = panels.size(0), k = panels.size(1);
  check_common(x, panels, bias, p * kPanel);
  TORCH_CHECK(x.size(1) == k, "x and panels disagree on K");
  const auto scales = int8_scale_panels(scale, p, k);  // [P, G, 16]
  if (scales.scalar_type() == at::kHalf) return int8_linear_with<at::Half>(x, panels, scales, bias);
  return int8_linear_with<float>(x, panels, scales, bias);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& qpanels,
                       const c10::optional<at::Tensor>& bias) {
  const int64_t p = panels.size(0), k = panels.size(1) * 2, n = p * kPanel;
  check_common(x, panels, bias, n);
  TORCH_CHECK(panels.scalar_type() == at::kByte, "int4 panels must be uint8");
  TORCH_CHECK(x.size(1) == k, "x and panels disagree on K");
  TORCH_CHECK(qpanels.dim() == 4 && qpanels.size(0) == p && (qpanels.size(2) == 1 || qpanels.size(2) == 2) &&
                  qpanels.size(3) == kPanel && qpanels.scalar_type() == at::kHalf && qpanels.is_contiguous(),
              "qpanels must be contiguous fp16 [P, G, 2, 16] (scale, minimum) or [P, G, 1, 16] (scale)");
  const int64_t groups = qpanels.size(1), fields = qpanels.size(2);
  TORCH_CHECK(groups > 0 && k % groups == 0 && (k / groups) % 32 == 0, "K / G must be a multiple of 32");
  const int64_t group = k / groups;
  const uint8_t* codes = panels.data_ptr<uint8_t>();
  const at::Half* params = qpanels.data_ptr<at::Half>();
#ifdef HF_ACCEL_QLINEAR_VNNI
  const auto rows = quantize_rows(x, groups, 1.0f);
  const int8_t* q = rows.q.data_ptr<int8_t>();
  const float *dx = rows.scale.data_ptr<float>(), *gsum = rows.sum.data_ptr<float>();
  const int64_t blocks = k / kXBlock;
  auto out = over_panels(x.size(0), p, [&](int64_t panel, int64_t first, int64_t count, float* dst) {
    vnni_rows_dispatch<Int4Vnni>(count, q + first * k, dx + first * blocks, gsum + first * groups, k,
                                 codes + panel * (k / 2) * kPanel, params + panel * groups * fields * kPanel, fields,
                                 group, dst, n);
  });
  return finish(out, x, bias);
#else
#ifdef HF_ACCEL_QLINEAR_SIMD
  if (x.size(0) <= kKernelRows) {
    auto rows = x.to(at::kFloat).contiguous();
    auto xsum = rows.view({rows.size(0), groups, group}).sum(-1).contiguous();  // [M, G]
    const float* x_data = rows.data_ptr<float>();
    const float* xsum_data = xsum.data_ptr<float>();
    auto out = over_panels(x.size(0), p, [&](int64_t panel, int64_t first, int64_t count, float* dst) {
      rows_dispatch<Int4Kernel>(count, x_data + first * k, k, codes + panel * (k / 2) * kPanel,
                                params + panel * groups * fields * kPanel, fields, group, xsum_data + first * groups,
                                dst, n);
    });
    return finish(out, x, bias);
  }
#endif
  auto out = blocked_matmul(x, p, [&](int64_t first, int64_t count) {
    return int4_block(panels, qpanels, first, count);
  });
  return finish(out, x, bias);
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_accel, m) {
  m.def("int8_linear(Tensor x, Tensor panels, Tensor scale, Tensor? bias) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor panels, Tensor qpanels, Tensor? bias) -> Tensor");
  m.def("quantized_linear_format() -> int", &quantized_linear_format);
}

TORCH_LIBRARY_IMPL(hf_accel, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
}
