// The LoRA update of a step whose tokens use different adapters, added in place to a projection's output
// (hf_accel/lora/layers.py): for each token t with slot s = slots[t] >= 0,
//     h[r]   = a[s, r, :] . x[t, :]           r < ranks[s]    ("shrink")
//     y[t,:] += sum_r h[r] * b[s, r, :]                         ("expand")
// and nothing for a token of the base model (s = -1). fp32.
//
// y      [..., out]          the projection's output, T rows of `out`, contiguous
// x      [..., in]           the projection's input, T rows of `in` (made contiguous if it is not)
// a      flat fp32           every projection's stacked A; this one's [S, R, in] from `a_offset`
// b      flat fp32           every projection's stacked B transposed (scaling folded in); this one's [S, R, out]
//                            from `b_offset`; rank rows past a slot's rank are zeros
// slots  [capacity] int64    each packed token's slot, or -1 (entries past T unread); T > capacity: not an
//                            engine step (a `generate` on the same model), nothing is added
// ranks  [P, S] int64        each projection's slots' ranks; row `projection` is this one's (<= R = `max_rank`;
//                            0: the slot's adapter leaves it alone): rows past it are skipped
// The flat buffers and plain offsets keep a compiled step's call of this op free of view arithmetic (one call per
// adapted projection, each step).
//
// Why: the torch path multiplies every token by every adapter the step uses and keeps its own columns (U x R work
// per token); here each token does its own adapter's rank x (in + out) multiply-adds. Tokens are grouped by slot
// (a counting sort) and taken up to 4 at a time, in 16-float vectors: the shrink loads each block of a token's x
// once for 4 rows of A, the expand keeps 16 columns of the group's y in registers while B's rank rows stream (one
// load of B per 4 multiply-adds). Groups are split across threads; a token's row of y is written by one group only.
#include <ATen/ATen.h>  // not torch/extension.h: its Python and nn headers triple the compile time
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kGroup = 4;  // tokens of one adapter computed together
constexpr int kRows = 4;   // rank rows of A reduced together (each x load serves kRows rows)
constexpr int kWidth = 16;  // floats per vector: GCC lowers it to the target's registers (1 zmm, 2 ymm, ...)
typedef float vec __attribute__((vector_size(kWidth * sizeof(float))));

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(vec));  // unaligned: rows start anywhere
  return v;
}

inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof(vec)); }

inline float sum(vec v) {
  float total = 0.f;
  for (int j = 0; j < kWidth; ++j) total += v[j];
  return total;
}

// h[r][k] = A[r, :] . x_k for the group's N tokens, r < rank: kRows rows of A at a time, so each 16-float block of
// x_k is loaded once for kRows rows (kRows x N vector accumulators).
template <int N>
void shrink(const float* a, int64_t in, int64_t rank, const float* const* x, float (*h)[kGroup]) {
  const int64_t whole = in - in % kWidth;
  for (int64_t r0 = 0; r0 < rank; r0 += kRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kRows, rank - r0));
    vec acc[kRows][N] = {};
    const float* ar[kRows];
    for (int q = 0; q < kRows; ++q) ar[q] = a + (r0 + std::min(q, rows - 1)) * in;  // rows past rank: repeats
    for (int64_t i = 0; i < whole; i += kWidth) {
      vec xv[N];
      for (int k = 0; k < N; ++k) xv[k] = load(x[k] + i);
      for (int q = 0; q < kRows; ++q) {
        const vec av = load(ar[q] + i);
        for (int k = 0; k < N; ++k) acc[q][k] += av * xv[k];
      }
    }
    for (int q = 0; q < rows; ++q) {
      for (int k = 0; k < N; ++k) {
        float total = sum(acc[q][k]);
        for (int64_t i = whole; i < in; ++i) total += ar[q][i] * x[k][i];
        h[r0 + q][k] = total;
      }
    }
  }
}

// y_k[o] += sum_r h[r][k] * B[r, o] for the group's N tokens: 16 columns of each y_k stay in registers while the
// rank rows of B stream (one B load per N multiply-adds).
template <int N>
void expand(const float* b, int64_t out, int64_t rank, const float (*h)[kGroup], float* const* y) {
  const int64_t whole = out - out % kWidth;
  for (int64_t o = 0; o < whole; o += kWidth) {
    vec acc[N];
    for (int k = 0; k < N; ++k) acc[k] = load(y[k] + o);
    for (int64_t r = 0; r < rank; ++r) {
      const vec bv = load(b + r * out + o);
      for (int k = 0; k < N; ++k) acc[k] += h[r][k] * bv;
    }
    for (int k = 0; k < N; ++k) store(y[k] + o, acc[k]);
  }
  for (int64_t r = 0; r < rank && whole < out; ++r) {  // the last out % 16 columns
    const float* br = b + r * out;
    for (int k = 0; k < N; ++k) {
      const float hk = h[r][k];
      for (int64_t o = whole; o < out; ++o) y[k][o] += hk * br[o];
    }
  }
}

template <int N>
void group_update(const float* a, const float* b, int64_t in, int64_t out, int64_t rank, const float* const* x,
                  float* const* y, float (*h)[kGroup]) {
  shrink<N>(a, in, rank, x, h);
  expand<N>(b, out, rank, h, y);
}

void lora_add(at::Tensor y, const at::Tensor& x_in, const at::Tensor& a_all, const at::Tensor& b_all,
              const at::Tensor& slots, const at::Tensor& ranks, int64_t projection, int64_t a_offset,
              int64_t b_offset, int64_t max_rank) {
  TORCH_CHECK(y.scalar_type() == at::kFloat && x_in.scalar_type() == at::kFloat && a_all.scalar_type() == at::kFloat &&
                  b_all.scalar_type() == at::kFloat,
              "lora_add takes fp32 tensors");
  TORCH_CHECK(y.dim() >= 1 && x_in.dim() >= 1 && y.is_contiguous(), "y must be contiguous [..., out], x [..., in]");
  const int64_t in = x_in.size(-1), out = y.size(-1);
  const int64_t tokens = in ? x_in.numel() / in : 0;
  TORCH_CHECK(out && y.numel() / out == tokens, "y and x must hold the same number of rows");
  TORCH_CHECK(a_all.dim() == 1 && b_all.dim() == 1 && a_all.is_contiguous() && b_all.is_contiguous(),
              "a and b must be the flat stacks");
  TORCH_CHECK(ranks.dim() == 2 && ranks.scalar_type() == at::kLong && projection >= 0 && projection < ranks.size(0),
              "ranks must be [P, S] int64 and projection one of its rows");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong, "slots must be a [capacity] int64 tensor");
  const int64_t count = ranks.size(1), stacked = max_rank;
  TORCH_CHECK(stacked >= 0 && a_offset >= 0 && b_offset >= 0 && a_offset + count * stacked * in <= a_all.numel() &&
                  b_offset + count * stacked * out <= b_all.numel(),
              "this projection's [S, R, in] and [S, R, out] must lie within a and b");
  if (tokens == 0 || tokens > slots.size(0)) return;  // not an engine step: its tokens have no slots
  const at::Tensor x = x_in.contiguous();
  // read once: a background compile's warm-up runs this while the stepping thread rewrites the slots and ranks (its
  // result is thrown away, but the grouping below must see one consistent set of values)
  const at::Tensor token_slots = slots.contiguous(), slot_ranks = ranks.select(0, projection).contiguous();
  const std::vector<int64_t> slot_of(token_slots.data_ptr<int64_t>(), token_slots.data_ptr<int64_t>() + tokens);
  const std::vector<int64_t> rank_of(slot_ranks.data_ptr<int64_t>(), slot_ranks.data_ptr<int64_t>() + count);
  for (int64_t s = 0; s < count; ++s) {
    TORCH_CHECK(rank_of[s] >= 0 && rank_of[s] <= stacked, "ranks must be within the stacked rank");
  }
  // tokens by slot (counting sort), those of a slot with rank 0 (or of the base) left out
  std::vector<int64_t> first(count + 1, 0);
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t s = slot_of[t];
    TORCH_CHECK(s >= -1 && s < count, "slots must be -1 or a slot of a and b");
    if (s >= 0 && rank_of[s] > 0) ++first[s + 1];
  }
  for (int64_t s = 0; s < count; ++s) first[s + 1] += first[s];
  if (first[count] == 0) return;
  std::vector<int64_t> order(first[count]);
  std::vector<int64_t> fill(first.begin(), first.end() - 1);
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t s = slot_of[t];
    if (s >= 0 && rank_of[s] > 0) order[fill[s]++] = t;
  }
  std::vector<int64_t> groups;  // start of each group in `order`: at most kGroup tokens, all of one slot
  for (int64_t s = 0; s < count; ++s)
    for (int64_t g = first[s]; g < first[s + 1]; g += kGroup) groups.push_back(g);
  const int64_t num_groups = static_cast<int64_t>(groups.size());

  const float* xs = x.data_ptr<float>();
  const float* as = a_all.data_ptr<float>() + a_offset;
  const float* bs = b_all.data_ptr<float>() + b_offset;
  float* ys = y.data_ptr<float>();
  const int64_t x_stride = in, y_stride = out;
  at::parallel_for(0, num_groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> h_store(static_cast<size_t>(stacked) * kGroup);
    float (*h)[kGroup] = reinterpret_cast<float (*)[kGroup]>(h_store.data());
    for (int64_t g = begin; g < end; ++g) {
      const int64_t start = groups[g], s = slot_of[order[start]];
      const int64_t n = std::min<int64_t>(kGroup, first[s + 1] - start), rank = rank_of[s];
      const float* xr[kGroup];
      float* yr[kGroup];
      for (int64_t k = 0; k < n; ++k) {
        xr[k] = xs + order[start + k] * x_stride;
        yr[k] = ys + order[start + k] * y_stride;
      }
      const float* ap = as + s * stacked * in;
      const float* bp = bs + s * stacked * out;
      switch (n) {
        case 1: group_update<1>(ap, bp, in, out, rank, xr, yr, h); break;
        case 2: group_update<2>(ap, bp, in, out, rank, xr, yr, h); break;
        case 3: group_update<3>(ap, bp, in, out, rank, xr, yr, h); break;
        default: group_update<4>(ap, bp, in, out, rank, xr, yr, h); break;
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_accel, m) {
  m.def(
      "lora_add(Tensor(a!) y, Tensor x, Tensor a, Tensor b, Tensor slots, Tensor ranks, int projection, int a_offset, "
      "int b_offset, int max_rank) -> ()");
}

TORCH_LIBRARY_IMPL(hf_accel, CPU, m) { m.impl("lora_add", &lora_add); }
