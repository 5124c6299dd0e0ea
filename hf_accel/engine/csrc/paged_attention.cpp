// Decode attention that reads the engine's block pool in place (no per-step copy of the context).
//
// query       [rows, heads, num_queries, dim]   row r's queries sit at positions lengths[r] - num_queries + i
// key_pool    [kv_heads, num_blocks, block_size, dim]   (value_pool the same)
// block_table [rows, max_blocks] int64: the pool block of each of row r's logical blocks
// lengths     [rows] int64: tokens row r attends over (its queries included)
// Query head h reads K/V head h / (heads / kv_heads). Query i of row r attends to columns c with
// c <= position(i) and, with a window w > 0, c > position(i) - w (transformers' sliding rule). With softcap > 0 the
// scores are tanh-capped as Gemma 2 does. Accumulation is in fp32 whatever the storage dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// exp(x) for x <= 0 (scores minus their maximum), written so `omp simd` loops vectorize it: exp(x) = 2^n exp(r) with
// n = round(x / ln 2), r in [-ln2 / 2, ln2 / 2] and Cephes' expf polynomial for exp(r) (relative error ~1e-7).
// Below -87 it returns exp(-87) ~ 1.6e-38 instead of a smaller number: nothing a softmax sum can see.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  return p * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

inline float dot(const float* a, const float* b, int64_t dim) {
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t d = 0; d < dim; ++d) total += a[d] * b[d];
  return total;
}

// Row `c` of a pool as floats: the pool itself for fp32, else converted into `buffer`.
template <typename scalar_t>
inline const float* as_float(const scalar_t* row, int64_t dim, float* buffer) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return row;
  } else {
    for (int64_t d = 0; d < dim; ++d) buffer[d] = static_cast<float>(row[d]);
    return buffer;
  }
}

// Per-thread working memory, sized once per parallel chunk: queries, scores/weights and accumulators of one task.
struct Scratch {
  std::vector<float> q, scores, acc, row;
  Scratch(int64_t num_q, int64_t max_length, int64_t dim)
      : q(num_q * dim), scores(num_q * max_length), acc(num_q * dim), row(dim) {}
};

template <typename scalar_t>
void attend_row_head(const scalar_t* query, const scalar_t* keys, const scalar_t* values, const int64_t* blocks,
                     int64_t length, int64_t groups, int64_t num_queries, int64_t dim, int64_t block_size,
                     int64_t block_stride, int64_t query_head_stride, float scale, int64_t window, float softcap,
                     Scratch& scratch, scalar_t* out) {
  // one (row, kv head): its `groups` query heads x `num_queries` queries share every K/V row they read
  const int64_t num_q = groups * num_queries;
  float* q = scratch.q.data();
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t i = 0; i < num_queries; ++i)
      for (int64_t d = 0; d < dim; ++d)
        q[(g * num_queries + i) * dim + d] = static_cast<float>(query[g * query_head_stride + i * dim + d]) * scale;
  float* scores = scratch.scores.data();  // [num_q, length]: scores, then softmax weights
  for (int64_t c = 0; c < length; ++c) {
    const float* k = as_float(keys + blocks[c / block_size] * block_stride + (c % block_size) * dim, dim,
                              scratch.row.data());
    for (int64_t j = 0; j < num_q; ++j) {
      const float s = dot(q + j * dim, k, dim);
      scores[j * length + c] = softcap > 0.f ? std::tanh(s / softcap) * softcap : s;
    }
  }
  for (int64_t j = 0; j < num_q; ++j) {
    const int64_t position = length - num_queries + j % num_queries;
    const int64_t first = window > 0 ? std::max<int64_t>(position - window + 1, 0) : 0;
    float* w = scores + j * length;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t c = first; c <= position; ++c) top = std::max(top, w[c]);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t c = first; c <= position; ++c) {
      w[c] = exp_nonpositive(w[c] - top);
      total += w[c];
    }
    const float inverse = 1.f / total;
    for (int64_t c = 0; c < length; ++c) w[c] = (c >= first && c <= position) ? w[c] * inverse : 0.f;
  }
  float* acc = scratch.acc.data();
  std::fill(acc, acc + num_q * dim, 0.f);
  for (int64_t c = 0; c < length; ++c) {
    const float* v = as_float(values + blocks[c / block_size] * block_stride + (c % block_size) * dim, dim,
                              scratch.row.data());
    for (int64_t j = 0; j < num_q; ++j) {
      const float wj = scores[j * length + c];
      if (wj == 0.f) continue;
      float* a = acc + j * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) a[d] += wj * v[d];
    }
  }
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t i = 0; i < num_queries; ++i)
      for (int64_t d = 0; d < dim; ++d)
        out[g * query_head_stride + i * dim + d] = static_cast<scalar_t>(acc[(g * num_queries + i) * dim + d]);
}

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_pool, const at::Tensor& value_pool,
                                  const at::Tensor& block_table, const at::Tensor& lengths, double scale,
                                  int64_t window, double softcap) {
  TORCH_CHECK(query.dim() == 4 && key_pool.dim() == 4,
              "query [rows, heads, q, dim], pools [kv_heads, blocks, size, dim]");
  TORCH_CHECK(key_pool.sizes() == value_pool.sizes(), "key and value pools differ in shape");
  TORCH_CHECK(query.scalar_type() == key_pool.scalar_type() && key_pool.scalar_type() == value_pool.scalar_type(),
              "query and pools must share a dtype");
  TORCH_CHECK(key_pool.is_contiguous() && value_pool.is_contiguous(), "pools must be contiguous");
  const auto q = query.contiguous();
  const auto table = block_table.to(at::kLong).contiguous();
  const auto lens = lengths.to(at::kLong).contiguous();
  const int64_t rows = q.size(0), heads = q.size(1), num_queries = q.size(2), dim = q.size(3);
  const int64_t kv_heads = key_pool.size(0), num_blocks = key_pool.size(1), block_size = key_pool.size(2);
  TORCH_CHECK(heads % kv_heads == 0 && key_pool.size(3) == dim, "heads must be a multiple of kv_heads, same dim");
  TORCH_CHECK(table.size(0) == rows && lens.size(0) == rows, "one block-table row and one length per query row");
  const int64_t groups = heads / kv_heads;
  auto out = at::empty_like(q);
  const int64_t* table_data = table.data_ptr<int64_t>();
  const int64_t* lens_data = lens.data_ptr<int64_t>();
  const int64_t max_blocks = table.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    const scalar_t* q_data = q.data_ptr<scalar_t>();
    const scalar_t* k_data = key_pool.data_ptr<scalar_t>();
    const scalar_t* v_data = value_pool.data_ptr<scalar_t>();
    scalar_t* out_data = out.data_ptr<scalar_t>();
    const int64_t block_stride = block_size * dim;  // consecutive blocks of one kv head
    const int64_t head_pool_stride = num_blocks * block_stride;
    const int64_t query_head_stride = num_queries * dim;
    const int64_t max_length = lens.numel() ? lens.max().item<int64_t>() : 0;
    at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
      Scratch scratch(groups * num_queries, max_length, dim);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t r = task / kv_heads, kvh = task % kv_heads;
        const int64_t length = lens_data[r];
        TORCH_CHECK(length >= num_queries && length <= max_blocks * block_size, "length out of the block table");
        const int64_t offset = (r * heads + kvh * groups) * query_head_stride;
        attend_row_head<scalar_t>(q_data + offset, k_data + kvh * head_pool_stride, v_data + kvh * head_pool_stride,
                                  table_data + r * max_blocks, length, groups, num_queries, dim, block_size,
                                  block_stride, query_head_stride, static_cast<float>(scale), window,
                                  static_cast<float>(softcap), scratch, out_data + offset);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_accel, m) {
  m.def("paged_decode_attention(Tensor query, Tensor key_pool, Tensor value_pool, Tensor block_table, "
        "Tensor lengths, float scale, int window, float softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(hf_accel, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
