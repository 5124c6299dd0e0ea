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
// (a counting sort) into chunks of up to 16 tokens of one adapter, the unit split across threads (a token's row of y
// is written by one chunk only). A chunk reads its adapter's A and B from memory once: the shrink takes 4 rows of A
// at a time over every 4 tokens (each block of a token's x loaded once for the 4 rows; the rows stay in L1 across
// the groups), the expand 64 columns of B likewise (the group's 4 x 64 columns of y in registers while B's rank
// rows stream: each load of B serves 4 multiply-adds, each broadcast of h 4). In 16-float vectors. Measured with
// 8 rank-16 adapters on the reference target's 56 projections, one thread: 64 tokens 1.86 ms a step (the kernel
// before chunks, a group of 4 tokens reading A and B itself: 2.05 ms). With the shrink's lane sums by register halves
// (`reduce`), one call of 64 tokens over 8 adapters, A and B in cache: 256 -> 256 20.0 -> 14.2 us, 256 -> 768 31.7 ->
// 22.5 us, 768 -> 256 26.8 -> 21.0 us (~3 us of each is the call itself). In an engine step A and B come from memory
// (8 adapters: ~20 MB a step on the reference target, against its ~33 MB of weights), so each chunk prefetches the
// next chunk's A and B (`Prefetch`). On an AVX-512 EPYC (32 MB L3), the 56 projections' calls of a 64-token step
// over 8 adapters, a 33 MB read between layers as the base weights' would: 2.1 -> 1.5 ms; the engine's 64-request
// mix over 8 adapters 0.85x -> 0.90x the base engine's tok/s.
#include <ATen/ATen.h>  // not torch/extension.h: its Python and nn headers triple the compile time
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
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

// The next chunk's A and B rows, requested a few cache lines at each inner step of this chunk's loops, so they are
// on their way from memory while this chunk computes (the hardware prefetcher starts each short stream late: every
// chunk reads a new [rank, in] and [rank, out]). `per`: lines a step, enough to cover both by the chunk's end.
struct Prefetch {
  const char* next[2] = {nullptr, nullptr};
  const char* end[2] = {nullptr, nullptr};
  int64_t per = 0;

  void set(const float* a, int64_t a_floats, const float* b, int64_t b_floats, int64_t steps) {
    next[0] = reinterpret_cast<const char*>(a);
    end[0] = next[0] + a_floats * sizeof(float);
    next[1] = reinterpret_cast<const char*>(b);
    end[1] = next[1] + b_floats * sizeof(float);
    const int64_t lines = ((a_floats + b_floats) * static_cast<int64_t>(sizeof(float)) + 63) / 64;
    per = std::min<int64_t>(8, (lines + steps - 1) / std::max<int64_t>(steps, 1));
  }

  inline void step() {
    for (int64_t j = 0; j < per; ++j) {
      const int which = next[0] < end[0] ? 0 : 1;
      if (next[which] >= end[which]) return;
      __builtin_prefetch(next[which]);
      next[which] += 64;
    }
  }
};

// the lanes' total by halves: the upper half added onto the lower, down to one lane (log2(16) adds). The halves are
// taken by memcpy, which GCC lowers to register extracts; a loop over lanes (v[j] += v[j + half]) is not unrolled and
// goes through the stack, which made these sums cost more than the shrink's multiply-adds at 256 inputs.
template <int W>
struct Lanes {
  typedef float type __attribute__((vector_size(W * sizeof(float))));
};

template <int W>
inline float reduce(typename Lanes<W>::type v) {
  if constexpr (W == 1) {
    return v[0];
  } else {
    typename Lanes<W / 2>::type low, high;
    std::memcpy(&low, &v, sizeof(low));
    std::memcpy(&high, reinterpret_cast<const char*>(&v) + sizeof(low), sizeof(high));
    return reduce<W / 2>(low + high);
  }
}

inline float sum(vec v) { return reduce<kWidth>(v); }

// h_k[r] = A[r, :] . x_k for N tokens and the kRows rows r0.. of A (those past `rank` are not written): each
// 16-float block of x_k is loaded once for kRows rows (kRows x N vector accumulators).
template <int N>
void shrink_rows(const float* a, int64_t in, int64_t rank, int64_t r0, const float* const* x, float* const* h,
                 Prefetch& prefetch) {
  const int64_t whole = in - in % kWidth;
  const int rows = static_cast<int>(std::min<int64_t>(kRows, rank - r0));
  vec acc[kRows][N] = {};
  const float* ar[kRows];
  for (int q = 0; q < kRows; ++q) ar[q] = a + (r0 + std::min(q, rows - 1)) * in;  // rows past rank: repeats
  for (int64_t i = 0; i < whole; i += kWidth) {
    vec xv[N];
    for (int k = 0; k < N; ++k) xv[k] = load(x[k] + i);
    prefetch.step();
    for (int q = 0; q < kRows; ++q) {
      const vec av = load(ar[q] + i);
      for (int k = 0; k < N; ++k) acc[q][k] += av * xv[k];
    }
  }
  for (int q = 0; q < rows; ++q) {
    for (int k = 0; k < N; ++k) {
      float total = sum(acc[q][k]);
      for (int64_t i = whole; i < in; ++i) total += ar[q][i] * x[k][i];
      h[k][r0 + q] = total;
    }
  }
}

// y_k[o + j] += sum_r h_k[r] * B[r, o + j], j < C * 16, for N tokens: their C x 16 columns stay in registers while
// B's rank rows stream (each broadcast of h_k[r] serves C multiply-adds, each load of B N).
template <int N, int C>
void expand_columns(const float* b, int64_t out, int64_t rank, int64_t o, const float* const* h, float* const* y,
                    Prefetch& prefetch) {
  vec acc[N][C];
  for (int k = 0; k < N; ++k)
    for (int c = 0; c < C; ++c) acc[k][c] = load(y[k] + o + c * kWidth);
  for (int64_t r = 0; r < rank; ++r) {
    vec bv[C];
    for (int c = 0; c < C; ++c) bv[c] = load(b + r * out + o + c * kWidth);
    prefetch.step();
    for (int k = 0; k < N; ++k) {
      const float hk = h[k][r];
      for (int c = 0; c < C; ++c) acc[k][c] += hk * bv[c];
    }
  }
  for (int k = 0; k < N; ++k)
    for (int c = 0; c < C; ++c) store(y[k] + o + c * kWidth, acc[k][c]);
}

template <int N>
void expand_tail(const float* b, int64_t out, int64_t rank, int64_t whole, const float* const* h, float* const* y) {
  for (int64_t r = 0; r < rank; ++r) {
    const float* br = b + r * out;
    for (int k = 0; k < N; ++k)
      for (int64_t o = whole; o < out; ++o) y[k][o] += h[k][r] * br[o];
  }
}

// Calls f(k, size) for each run of at most kGroup of the n tokens: k its first, `size` a
// std::integral_constant<int, N>, N the run's length (`size()` a template argument of the group kernels).
template <typename F>
inline void by_groups(int64_t n, F&& f) {
  int64_t k = 0;
  for (; k + kGroup <= n; k += kGroup) f(k, std::integral_constant<int, kGroup>{});
  switch (n - k) {
    case 1: f(k, std::integral_constant<int, 1>{}); break;
    case 2: f(k, std::integral_constant<int, 2>{}); break;
    case 3: f(k, std::integral_constant<int, 3>{}); break;
    default: break;
  }
}

constexpr int kBlocks = 4;  // 16-float column blocks of the expand's widest pass

// The update of n tokens of one adapter: the shrink by kRows rows of A at a time over every group of tokens (those
// rows stay in L1 across the groups), then the expand by 64 columns of B at a time likewise; `prefetch` steps along.
void adapter_update(const float* a, const float* b, int64_t in, int64_t out, int64_t rank, int64_t n,
                    const float* const* x, float* const* y, float* const* h, Prefetch& prefetch) {
  for (int64_t r0 = 0; r0 < rank; r0 += kRows)
    by_groups(n, [&](int64_t k, auto size) { shrink_rows<size()>(a, in, rank, r0, x + k, h + k, prefetch); });
  const int64_t whole = out - out % kWidth, wide = out - out % (kBlocks * kWidth);
  for (int64_t o = 0; o < wide; o += kBlocks * kWidth)
    by_groups(n, [&](int64_t k, auto size) {
      expand_columns<size(), kBlocks>(b, out, rank, o, h + k, y + k, prefetch);
    });
  for (int64_t o = wide; o < whole; o += kWidth)
    by_groups(n, [&](int64_t k, auto size) { expand_columns<size(), 1>(b, out, rank, o, h + k, y + k, prefetch); });
  if (whole < out) by_groups(n, [&](int64_t k, auto size) { expand_tail<size()>(b, out, rank, whole, h + k, y + k); });
}

// How many times `adapter_update` of n tokens steps its prefetch (the inner steps of its shrink and expand).
int64_t prefetch_steps(int64_t in, int64_t out, int64_t rank, int64_t n) {
  const int64_t groups = (n + kGroup - 1) / kGroup;
  const int64_t shrink = (rank + kRows - 1) / kRows * (in / kWidth);
  const int64_t expand = (out / (kBlocks * kWidth) + out % (kBlocks * kWidth) / kWidth) * rank;
  return groups * (shrink + expand);
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
  // (the row of `ranks` by pointer: a `select` view costs a tensor per call, 56 calls a step)
  const at::Tensor token_slots = slots.contiguous(), all_ranks = ranks.contiguous();
  const int64_t* slot_ranks = all_ranks.data_ptr<int64_t>() + projection * count;
  const std::vector<int64_t> slot_of(token_slots.data_ptr<int64_t>(), token_slots.data_ptr<int64_t>() + tokens);
  const std::vector<int64_t> rank_of(slot_ranks, slot_ranks + count);
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
  constexpr int64_t kChunk = 16;  // tokens of one adapter per unit of work: A and B are read once per chunk
  std::vector<int64_t> chunks;  // start of each chunk in `order`: at most kChunk tokens, all of one slot
  for (int64_t s = 0; s < count; ++s)
    for (int64_t c = first[s]; c < first[s + 1]; c += kChunk) chunks.push_back(c);
  const int64_t num_chunks = static_cast<int64_t>(chunks.size());

  const float* xs = x.data_ptr<float>();
  const float* as = a_all.data_ptr<float>() + a_offset;
  const float* bs = b_all.data_ptr<float>() + b_offset;
  float* ys = y.data_ptr<float>();
  at::parallel_for(0, num_chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> h_store(static_cast<size_t>(stacked) * kChunk);
    for (int64_t c = begin; c < end; ++c) {
      const int64_t start = chunks[c], s = slot_of[order[start]];
      const int64_t n = std::min<int64_t>(kChunk, first[s + 1] - start);
      const float* xr[kChunk];
      float* yr[kChunk];
      float* hr[kChunk];
      for (int64_t k = 0; k < n; ++k) {
        xr[k] = xs + order[start + k] * in;
        yr[k] = ys + order[start + k] * out;
        hr[k] = h_store.data() + k * stacked;
      }
      Prefetch prefetch;  // the next chunk's adapter, when it is another (and this thread's)
      const int64_t s_next = c + 1 < end ? slot_of[order[chunks[c + 1]]] : s;
      if (s_next != s)
        prefetch.set(as + s_next * stacked * in, rank_of[s_next] * in, bs + s_next * stacked * out,
                     rank_of[s_next] * out, prefetch_steps(in, out, rank_of[s], n));
      adapter_update(as + s * stacked * in, bs + s * stacked * out, in, out, rank_of[s], n, xr, yr, hr, prefetch);
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
