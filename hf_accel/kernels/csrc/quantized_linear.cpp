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
//
// Here: the ops' checks and their passes over panels and threads; format 0's kernels are fma_panels.h, format 1's
// vnni_panels.h, what both share quantized_panels.h (build, panel width, rows a pass) and panel_lanes.h (16 lanes).
#include <ATen/ATen.h>  // not torch/extension.h: its Python and nn headers triple the compile time
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "fma_panels.h"
#include "quantized_panels.h"
#include "vnni_panels.h"

namespace {

constexpr int64_t kKernelRows = 64;   // format 0: the most rows the register kernel computes (where MKL's matmul on
                                      // the dequantized weight catches up); more dequantize into blocks
constexpr int64_t kBlockPanels = 32;  // panels (512 columns) dequantized per ATen matmul past kKernelRows

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
#endif

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
  TORCH_CHECK(groups > 0 && k % groups == 0 && (k / groups) % kXBlock == 0, "K / G must be a multiple of 32");
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
