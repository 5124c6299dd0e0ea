// Structured outputs' mask: the logits of the tokens a grammar forbids set to -inf, in place, from xgrammar's
// bitmask (hf_accel/structured/matcher.py fills it); and the greedy choice under that mask without writing it
// (masked_argmax: what applying the mask, then an argmax, would choose).
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
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

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

// Running argmax over logits[begin, end), all allowed: `best` / `chosen` move to a larger value's first index.
// True when a NaN is found (then `chosen` is the first NaN's index, which an argmax returns). Two passes that
// vectorize: the span's maximum (and whether it holds a NaN), then where it first occurs.
template <typename T>
bool argmax_span(const T* logits, int64_t begin, int64_t end, float& best, int64_t& chosen) {
  float top = -std::numeric_limits<float>::infinity();
  bool any_nan = false;
#pragma omp simd reduction(max : top) reduction(|| : any_nan)
  for (int64_t t = begin; t < end; ++t) {
    const float value = static_cast<float>(logits[t]);
    top = std::max(top, value);
    any_nan = any_nan || value != value;
  }
  if (any_nan) {
    for (int64_t t = begin; t < end; ++t) {
      if (std::isnan(static_cast<float>(logits[t]))) {
        chosen = t;
        return true;
      }
    }
  }
  if (top > best) {
    best = top;
    for (int64_t t = begin; t < end; ++t) {
      if (static_cast<float>(logits[t]) == top) {
        chosen = t;
        break;
      }
    }
  }
  return false;
}

// The first maximum of row logits[0, vocab) with the tokens `words` forbids read as -inf, NaN counting as the
// maximum (numpy's and torch's argmax rule): the token an argmax of the masked row picks (nullptr `words`: no mask).
// Tokens past the bitmask's 32 * num_words columns are allowed. A word with no allowed token holds only -inf: it
// can neither raise the maximum nor hold a NaN, so it is skipped (most words, where a grammar allows a few tokens).
template <typename T>
int64_t masked_argmax_row(const T* logits, const int32_t* words, int64_t num_words, int64_t vocab) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t chosen = 0;  // every token -inf (or forbidden): the first, as an argmax of the masked row
  if (words == nullptr) {
    argmax_span(logits, 0, vocab, best, chosen);
    return chosen;
  }
  for (int64_t w = 0; 32 * w < vocab; ++w) {
    const uint32_t word = w < num_words ? static_cast<uint32_t>(words[w]) : 0xFFFFFFFFu;
    const int64_t begin = 32 * w, end = std::min<int64_t>(begin + 32, vocab);
    if (word == 0xFFFFFFFFu) {
      if (argmax_span(logits, begin, end, best, chosen)) return chosen;
      continue;
    }
    for (uint32_t bits = word; bits != 0; bits &= bits - 1) {  // the allowed tokens, lowest first
      const int64_t t = begin + __builtin_ctz(bits);
      if (t >= end) break;
      const float value = static_cast<float>(logits[t]);
      if (std::isnan(value)) return t;
      if (value > best) {
        best = value;
        chosen = t;
      }
    }
  }
  return chosen;
}

// logits [rows, V]; bitmask [bitmask_rows, W] int32; indices [n] int64: the rows masked (as apply_token_bitmask).
// Returns [rows] int64: each row's argmax, under its bitmask row where indexed; nothing is written to `logits`.
at::Tensor masked_argmax(const at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& indices) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits must be [rows, vocab], last dim contiguous");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "bitmask must be a contiguous [rows, words] int32 tensor");
  TORCH_CHECK(indices.dim() == 1 && indices.scalar_type() == at::kLong, "indices must be a [n] int64 tensor");
  const int64_t num_rows = logits.size(0), vocab = logits.size(1);
  std::vector<char> masked(num_rows, 0);
  const at::Tensor rows = indices.contiguous();
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.numel(); ++i) {
    const int64_t r = row_ids[i];
    TORCH_CHECK(r >= 0 && r < num_rows && r < bitmask.size(0), "indices must name rows of both logits and bitmask");
    masked[r] = 1;
  }
  at::Tensor chosen = at::empty({num_rows}, logits.options().dtype(at::kLong));
  int64_t* out = chosen.data_ptr<int64_t>();
  const int32_t* words = bitmask.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "masked_argmax", [&] {
    const scalar_t* base = logits.data_ptr<scalar_t>();
    for (int64_t r = 0; r < num_rows; ++r) {
      const int32_t* row_words = masked[r] ? words + r * bitmask.stride(0) : nullptr;
      out[r] = masked_argmax_row(base + r * logits.stride(0), row_words, bitmask.size(1), vocab);
    }
  });
  return chosen;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_accel, m) {
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor indices) -> ()");
  m.def("masked_argmax(Tensor logits, Tensor bitmask, Tensor indices) -> Tensor");
}

TORCH_LIBRARY_IMPL(hf_accel, CPU, m) {
  m.impl("apply_token_bitmask", &apply_token_bitmask);
  m.impl("masked_argmax", &masked_argmax);
}
