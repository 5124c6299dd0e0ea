// A Linear of the few rows a decode or speculative verify step has, over a weight packed once into column panels
// (hf_accel/kernels/packed_linear.py packs it and rewrites the frozen matmuls of hf_accel's compiled CPU steps into
// this op). fp32.
//
// x        [M, K]                 the step's rows (any strides)
// packed   [panels, K, 16]        columns 16p .. 16p + 15 of the weight, row k of the panel holding their k-th
//                                 inputs (the last panel zero-padded past N)
// weight   [K, N]                 the same weight as the matmul's right operand lies (any strides): many rows take
//                                 a GEMM over it instead (`many_rows`)
// bias     [N] or None
// returns  [M, N] = x @ weight (+ bias)
//
// Why: at a few rows oneDNN and MKL read the weight once per handful of rows and run at a third of the core's peak
// (a 9-token verify of the reference target took 1.7x a one-token decode on an AVX2 EPYC, nearly all of it in the
// Linears). Here each panel (16 columns x K: 16 KB at K = 256) is streamed once for up to 6 rows (AVX2: 12
// accumulators) or 12 rows (AVX-512: up to 24), which keep their accumulators in registers while the panel's rows go
// past; more rows start another pass over the panel, now in L1 or L2. At a few rows, interleaved streams over k keep
// the FMA units busy instead of waiting on one chain. With AVX-512 (a Xeon's 16-lane FMAs), MKL's sgemm ran 2x this
// kernel's AVX2 form from 8 rows on; the AVX-512 form doubles it (benchmarks/bench_linear.py).
// Rows beyond kPackedRows take oneDNN's (or MKL's) GEMM, which runs near peak there (`many_rows`).
#include <ATen/ATen.h>  // not torch/extension.h: its Python and nn headers triple the compile time
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#if (defined(__AVX2__) || defined(__AVX512F__)) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kPanel = 16;        // columns per panel: two AVX2 vectors, one AVX-512 vector
// the most rows this kernel computes; more take a GEMM (`many_rows`: MKL's sgemm passed the panels at 48-64 rows on
// an AVX-512 Xeon, at about 128 on an AVX2 EPYC: bench_linear)
#if defined(__AVX512F__) && defined(__FMA__)
constexpr int64_t kPackedRows = 48;
#else
constexpr int64_t kPackedRows = 128;
#endif
// bytes ahead that a pass asks the memory for: one stream per thread is otherwise held well below the core's read
// bandwidth once the weights are past the caches (as csrc/quantized_linear.cpp measured)
constexpr int64_t kPrefetch = 4096;

#if defined(__AVX512F__) && defined(__FMA__)

// out[r, 0 .. width) = x[r, :] @ panel for R rows, with S interleaved streams over k: R * S accumulators (a panel
// row is one 16-lane vector), at most 24 of the 32 registers; each x element is broadcast straight from memory into
// its FMA. Enough accumulators keep both FMA units busy past their latency; the streams are summed at the end.
template <int R, int S>
inline void panel_rows(const float* x, int64_t x_row, int64_t x_col, const float* panel, int64_t k, float* out,
                       int64_t out_row, int64_t width) {
  __m512 acc[R][S];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int s = 0; s < S; ++s) acc[r][s] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + S <= k; i += S) {
#pragma GCC unroll 8
    for (int s = 0; s < S; ++s) {
      const float* row = panel + (i + s) * kPanel;  // one cache line
      _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetch, _MM_HINT_T0);
      const __m512 w = _mm512_loadu_ps(row);
#pragma GCC unroll 32
      for (int r = 0; r < R; ++r)
        acc[r][s] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * x_row + (i + s) * x_col]), w, acc[r][s]);
    }
  }
  for (; i < k; ++i) {
    const __m512 w = _mm512_loadu_ps(panel + i * kPanel);
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) acc[r][0] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * x_row + i * x_col]), w, acc[r][0]);
  }
  const __mmask16 lanes = width == kPanel ? __mmask16(0xFFFF) : __mmask16((1u << width) - 1);  // the last panel's
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r) {
    __m512 sum = acc[r][0];
#pragma GCC unroll 8
    for (int s = 1; s < S; ++s) sum = _mm512_add_ps(sum, acc[r][s]);
    _mm512_mask_storeu_ps(out + r * out_row, lanes, sum);
  }
}

constexpr int64_t kPassRows = 12;  // rows one pass over a panel computes

// `count` (1 .. 12) rows against one panel; from 6 rows on, two streams give 12-24 accumulators.
inline void panel_pass(const float* x, int64_t x_row, int64_t x_col, int64_t count, const float* panel, int64_t k,
                       float* out, int64_t n, int64_t width) {
  switch (count) {
    case 1: panel_rows<1, 8>(x, x_row, x_col, panel, k, out, n, width); break;
    case 2: panel_rows<2, 4>(x, x_row, x_col, panel, k, out, n, width); break;
    case 3: panel_rows<3, 4>(x, x_row, x_col, panel, k, out, n, width); break;
    case 4: panel_rows<4, 4>(x, x_row, x_col, panel, k, out, n, width); break;
    case 5: panel_rows<5, 3>(x, x_row, x_col, panel, k, out, n, width); break;
    case 6: panel_rows<6, 2>(x, x_row, x_col, panel, k, out, n, width); break;
    case 7: panel_rows<7, 2>(x, x_row, x_col, panel, k, out, n, width); break;
    case 8: panel_rows<8, 2>(x, x_row, x_col, panel, k, out, n, width); break;
    case 9: panel_rows<9, 2>(x, x_row, x_col, panel, k, out, n, width); break;
    case 10: panel_rows<10, 2>(x, x_row, x_col, panel, k, out, n, width); break;
    case 11: panel_rows<11, 2>(x, x_row, x_col, panel, k, out, n, width); break;
    default: panel_rows<12, 2>(x, x_row, x_col, panel, k, out, n, width); break;
  }
}

#elif defined(__AVX2__) && defined(__FMA__)
// out[r, 0 .. width) = x[r, :] @ panel for R rows, with S interleaved streams over k (R * S * 2 accumulators, at
// most 12 of the 16 registers; the streams are summed at the end).
template <int R, int S>
inline void panel_rows(const float* x, int64_t x_row, int64_t x_col, const float* panel, int64_t k, float* out,
                       int64_t out_row, int64_t width) {
  __m256 acc[R][S][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int s = 0; s < S; ++s) acc[r][s][0] = acc[r][s][1] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + S <= k; i += S) {
#pragma GCC unroll 16
    for (int s = 0; s < S; ++s) {
      const float* row = panel + (i + s) * kPanel;  // one cache line
      _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetch, _MM_HINT_T0);
      const __m256 w0 = _mm256_loadu_ps(row), w1 = _mm256_loadu_ps(row + 8);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * x_row + (i + s) * x_col);
        acc[r][s][0] = _mm256_fmadd_ps(xb, w0, acc[r][s][0]);
        acc[r][s][1] = _mm256_fmadd_ps(xb, w1, acc[r][s][1]);
      }
    }
  }
  for (; i < k; ++i) {
    const float* row = panel + i * kPanel;
    const __m256 w0 = _mm256_loadu_ps(row), w1 = _mm256_loadu_ps(row + 8);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * x_row + i * x_col);
      acc[r][0][0] = _mm256_fmadd_ps(xb, w0, acc[r][0][0]);
      acc[r][0][1] = _mm256_fmadd_ps(xb, w1, acc[r][0][1]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    __m256 low = acc[r][0][0], high = acc[r][0][1];
#pragma GCC unroll 16
    for (int s = 1; s < S; ++s) {
      low = _mm256_add_ps(low, acc[r][s][0]);
      high = _mm256_add_ps(high, acc[r][s][1]);
    }
    float* dst = out + r * out_row;
    if (width == kPanel) {
      _mm256_storeu_ps(dst, low);
      _mm256_storeu_ps(dst + 8, high);
    } else {  // the last panel: only the real columns
      alignas(32) float lanes[kPanel];
      _mm256_store_ps(lanes, low);
      _mm256_store_ps(lanes + 8, high);
      std::copy(lanes, lanes + width, dst);
    }
  }
}

constexpr int64_t kPassRows = 6;  // rows one pass over a panel computes

// `count` (1 .. 6) rows against one panel.
inline void panel_pass(const float* x, int64_t x_row, int64_t x_col, int64_t count, const float* panel, int64_t k,
                       float* out, int64_t n, int64_t width) {
  switch (count) {
    case 1: panel_rows<1, 4>(x, x_row, x_col, panel, k, out, n, width); break;
    case 2: panel_rows<2, 2>(x, x_row, x_col, panel, k, out, n, width); break;
    case 3: panel_rows<3, 2>(x, x_row, x_col, panel, k, out, n, width); break;
    case 4: panel_rows<4, 1>(x, x_row, x_col, panel, k, out, n, width); break;
    case 5: panel_rows<5, 1>(x, x_row, x_col, panel, k, out, n, width); break;
    default: panel_rows<6, 1>(x, x_row, x_col, panel, k, out, n, width); break;
  }
}

#endif

#if defined(__AVX2__) && defined(__FMA__)

// All `m` rows against one panel, `kPassRows` rows a pass (the panel stays in L1 or L2 after the first).
void panel_all_rows(const float* x, int64_t x_row, int64_t x_col, int64_t m, const float* panel, int64_t k,
                    float* out, int64_t n, int64_t width) {
  for (int64_t first = 0; first < m; first += kPassRows)
    panel_pass(x + first * x_row, x_row, x_col, std::min(kPassRows, m - first), panel, k, out + first * n, n, width);
}

// x [M, K] (fp32, M <= kPackedRows) over the panels of a [K, N] weight starting at `panels` -> [M, N] (+ bias).
at::Tensor over_panels(const at::Tensor& x, const float* panels, int64_t n, const c10::optional<at::Tensor>& bias) {
  const int64_t m = x.size(0), k = x.size(1);
  auto out = at::empty({m, n}, x.options());
  const float* x_data = x.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const int64_t x_row = x.stride(0), x_col = x.stride(1);
  at::parallel_for(0, (n + kPanel - 1) / kPanel, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      panel_all_rows(x_data, x_row, x_col, m, panels + p * k * kPanel, k, out_data + p * kPanel, n,
                     std::min(kPanel, n - p * kPanel));
  });
  if (bias.has_value()) out.add_(*bias);
  return out;
}

#endif

// x [M, K] @ weight [N, K]^T (+ bias) for more rows than the panels take: MKL's sgemm, except on an AMD CPU, where
// MKL runs its AVX2 code: there oneDNN's fp32 linear (`mkldnn::_linear_pointwise`, the op torch's own compiler emits
// for CPU Linears; it reads a contiguous weight as it lies), from kOneDnnMacs multiply-adds on (below, its per-call
// cost is more than it saves). One Zen 5 thread: 115 GFLOPS from MKL on a [880, 768] x [768, 3072] prefill Linear,
// 240 from oneDNN; 61 vs 40 us at [49, 256] x [256, 256]; 9 vs 14 us at [49, 64] x [64, 128].
constexpr int64_t kOneDnnMacs = int64_t{1} << 20;

bool mkl_takes_avx2() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool amd = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") > 0;
  }();
  return amd;
#else
  return false;  // (MKL is an x86 library)
#endif
}

at::Tensor many_rows(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  static const c10::optional<c10::OperatorHandle> onednn =
      c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
  if (onednn.has_value() && mkl_takes_avx2() && x.size(0) * x.size(1) * weight.size(0) >= kOneDnnMacs &&
      x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.device().is_cpu() &&
      weight.is_contiguous() && (!bias.has_value() || bias->scalar_type() == at::kFloat)) {
    torch::jit::Stack stack{x, weight, bias, std::string("none"), c10::List<c10::optional<c10::Scalar>>(),
                            c10::optional<std::string>()};
    onednn->callBoxed(&stack);
    return stack[0].toTensor();
  }
  const at::Tensor right = weight.t();  // straight to MKL's sgemm (at::linear would pass through matmul's dispatch)
  return bias.has_value() ? at::addmm(*bias, x, right) : at::mm(x, right);
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& weight,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && packed.dim() == 3, "x [M, K], weight [K, N], packed [P, K, 16]");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(1);
  TORCH_CHECK(weight.size(0) == k, "x and weight disagree on K");
  TORCH_CHECK(packed.size(0) == (n + kPanel - 1) / kPanel && packed.size(1) == k && packed.size(2) == kPanel,
              "packed must be [ceil(N / 16), K, 16]");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n), "bias must be [N]");
#if defined(__AVX2__) && defined(__FMA__)
  if (x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat && packed.is_contiguous() &&
      m <= kPackedRows)
    return over_panels(x, packed.data_ptr<float>(), n, bias);
#endif
  return many_rows(x, weight.t(), bias);
}

// The same Linear with a Linear's own weight [N, K], its panels at `panels[start ..]` of a buffer holding many
// Linears' panels one after the other: a compiled step over such a buffer takes one input for all of them, and no
// view of it is made per Linear and call (three views cost more than the few-row matmul of a small Linear).
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t start, const at::Tensor& weight,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && panels.dim() == 1, "x [M, K], weight [N, K], panels [total]");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(weight.size(1) == k, "x and weight disagree on K");
  TORCH_CHECK(start >= 0 && start + (n + kPanel - 1) / kPanel * k * kPanel <= panels.size(0),
              "the panels run past the buffer");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n), "bias must be [N]");
#if defined(__AVX2__) && defined(__FMA__)
  if (x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat && panels.is_contiguous() &&
      m <= kPackedRows)
    return over_panels(x, panels.data_ptr<float>() + start, n, bias);
#endif
  return many_rows(x, weight, bias);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_accel, m) {
  m.def("packed_linear(Tensor x, Tensor packed, Tensor weight, Tensor? bias) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor panels, int start, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(hf_accel, CPU, m) {
  m.impl("packed_linear", &packed_linear);
  m.impl("panel_linear", &panel_linear);
}
