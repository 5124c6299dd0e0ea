// The LoRA update of a step whose tokens use different adapters, added in place to a projection's output
// (hf_accel/lora/layers.py): for each token t with slot s = slots[t] >= 0,
//     h[r]   = a[s, r, :] . x[t, :]           r < rank        ("shrink")
//     y[t,:] += sum_r h[r] * b[s, r, :]                         ("expand")
// and nothing for a token of the base model (s = -1). fp32.
//
// y      [T, out]            the projection's output, rows contiguous
// x      [T, in]             the projection's input, rows contiguous
// a      [S, R, in]          the resident adapters' A, stacked by slot (ranks below R zero-padded)
// b      [S, R, out]         their B transposed, scaling folded in
// slots  [T] int64           each token's slot, or -1
// rank   the largest rank among the slots the step uses (<= R): rows past it are zeros and are skipped
//
// Why: the torch path multiplies every token by every adapter the step uses and keeps its own columns (U x R work
// per token); here each token does its own adapter's R x (in + out) multiply-adds, reading that adapter's A and B
// (R x (in + out) floats: L1 / L2 resident across the tokens that share it). Tokens are split across threads.
#include <ATen/ATen.h>  // not torch/extension.h: its Python and nn headers triple the compile time
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace {

void lora_add(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const at::Tensor& slots,
              int64_t rank) {
  TORCH_CHECK(y.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat && a.scalar_type() == at::kFloat &&
                  b.scalar_type() == at::kFloat,
              "lora_add takes fp32 tensors");
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.size(0) == x.size(0), "y and x must be [T, out] and [T, in]");
  TORCH_CHECK(y.stride(1) == 1 && x.stride(1) == 1, "y and x rows must be contiguous");
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.is_contiguous() && b.is_contiguous() && a.size(0) == b.size(0) &&
                  a.size(1) == b.size(1) && a.size(2) == x.size(1) && b.size(2) == y.size(1),
              "a and b must be contiguous [S, R, in] and [S, R, out]");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.size(0) == x.size(0),
              "slots must be a [T] int64 tensor");
  TORCH_CHECK(rank >= 0 && rank <= a.size(1), "rank must be within the stacked rank");
  const at::Tensor token_slots = slots.contiguous();
  const int64_t* slot_of = token_slots.data_ptr<int64_t>();
  const int64_t tokens = x.size(0), in = x.size(1), out = y.size(1), stacked = a.size(1), count = a.size(0);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot_of[t] >= -1 && slot_of[t] < count, "slots must be -1 or a slot of a and b");
  }
  const float* xs = x.data_ptr<float>();
  const float* as = a.data_ptr<float>();
  const float* bs = b.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  const int64_t x_stride = x.stride(0), y_stride = y.stride(0);
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> h(static_cast<size_t>(rank));
    for (int64_t t = begin; t < end; ++t) {
      const int64_t s = slot_of[t];
      if (s < 0) continue;
      const float* xt = xs + t * x_stride;
      for (int64_t r = 0; r < rank; ++r) {
        const float* ar = as + (s * stacked + r) * in;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < in; ++i) acc += ar[i] * xt[i];
        h[r] = acc;
      }
      float* yt = ys + t * y_stride;
      for (int64_t r = 0; r < rank; ++r) {
        const float* br = bs + (s * stacked + r) * out;
        const float hr = h[r];
#pragma omp simd
        for (int64_t o = 0; o < out; ++o) yt[o] += hr * br[o];
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_accel, m) {
  m.def("lora_add(Tensor(a!) y, Tensor x, Tensor a, Tensor b, Tensor slots, int rank) -> ()");
}

TORCH_LIBRARY_IMPL(hf_accel, CPU, m) { m.impl("lora_add", &lora_add); }
