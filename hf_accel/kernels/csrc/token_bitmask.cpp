// Structured outputs' mask: the logits of the tokens a grammar forbids set to -inf, in place, from xgrammar's
// bitmask (hf_accel/structured/matcher.py fills it).
//
// logits   [rows, V] fp32 / bf16 / fp16, last dimension contiguous (rows may be strided)
// bitmask  [bitmask_rows, ceil(V' / 32)] int32, contiguous: bit j % 32 of word j / 32 set = token j allowed
// indices  [n] int64: the rows to mask; row r of logits takes row r of the bitmask (the others are left as they are)
// Tokens past the bitmask's 32 * words columns are left as they are (a bitmask covers the model's whole vocabulary).
//
// Why: xgrammar's CPU kernel tests and writes one token at a time, so a mask that allows a few tokens (the usual
// case in JSON: punctuation, keys, digits) costs ~5 ns per forbidden token: 0.6 ms per row at a 128k vocabulary,
// 5 ms a step at batch 8. Here a word with no allowed token is 32 stores of -inf that the compiler vectorizes, and a
// word with every token allowed is skipped: ~30x less at that size.
#include <ATen/ATen.h>  // not torch/extension.h: its Python and nn headers triple the compile time
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace {

template <typename T>
void mask_row(T* logits, const int32_t* words, int64_t vocab) {
  const T forbidden = static_cast<T>(-std::numeric_limits<float>::infinity());
  const int64_t whole = vocab / 32;  // words whose 32 tokens are all in the vocabulary
  for (int64_t w = 0; w < whole; ++w) {
    const uint32_t word = static_cast<uint32_t>(words[w]);
    T* out = logits + 32 * w;
    if (word == 0xFFFFFFFFu) continue;
    if (word == 0) {
#pragma omp simd
      for (int b = 0; b < 32; ++b) out[b] = forbidden;
      continue;
    }
    for (int b = 0; b < 32; ++b) {
      if (!((word >> b) & 1u)) out[b] = forbidden;
    }
  }
  const int64_t tail = vocab - 32 * whole;
  if (tail > 0) {
    const uint32_t word = static_cast<uint32_t>(words[whole]);
    for (int64_t b = 0; b < tail; ++b) {
      if (!((word >> b) & 1u)) logits[32 * whole + b] = forbidden;
    }
  }
}

void apply_token_bitmask(at::Tensor logits, const at::Tensor& bitmask, const at::Tensor& indices) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits must be [rows, vocab], last dim contiguous");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "bitmask must be a contiguous [rows, words] int32 tensor");
  TORCH_CHECK(indices.dim() == 1 && indices.scalar_type() == at::kLong, "indices must be a [n] int64 tensor");
  const at::Tensor rows = indices.contiguous();
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  const int64_t n = rows.numel();
  const int64_t vocab = std::min<int64_t>(logits.size(1), 32 * bitmask.size(1));
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < logits.size(0) && row_ids[i] < bitmask.size(0),
                "indices must name rows of both logits and bitmask");
  }
  const int32_t* words = bitmask.data_ptr<int32_t>();
  const int64_t words_stride = bitmask.stride(0), logits_stride = logits.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "apply_token_bitmask", [&] {
    scalar_t* base = logits.data_ptr<scalar_t>();
    // a row is ~V / 8 bytes of stores at most: threads only pay off for many rows
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r = row_ids[i];
        mask_row(base + r * logits_stride, words + r * words_stride, vocab);
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_accel, m) {
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor indices) -> ()");
}

TORCH_LIBRARY_IMPL(hf_accel, CPU, m) { m.impl("apply_token_bitmask", &apply_token_bitmask); }
