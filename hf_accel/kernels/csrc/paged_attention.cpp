// One engine step's attention for one layer, over the block pool in place: the step's new K/V are written into
// their slots, then every sequence's queries (a decode's one, a speculating decode's few, a prefill chunk's many)
// attend over that sequence's blocks where they lie. No context is copied.
//
// query       [heads, tokens, dim]      the step's packed queries (any strides; dim contiguous)
// key, value  [kv_heads, tokens, dim]   the step's new K/V (any strides; dim contiguous)
// key_pool    [kv_heads, num_blocks, block_size, dim] contiguous (value_pool the same); written in place
// slots       [tokens] int64            pool slot (block * block_size + offset) of each packed token
// block_table [seqs, max_blocks] int64  the pool block of each of sequence s's logical blocks
// query_start [seqs + 1] int64          sequence s owns packed tokens query_start[s] .. query_start[s + 1]
// kv_lengths  [seqs] int64              tokens sequence s attends over; its queries are the last ones, so query i
//                                       of s sits at position kv_lengths[s] - num_queries(s) + i
// returns     [tokens, heads, dim]
// Query head h reads K/V head h / (heads / kv_heads). A query at position p attends to columns c <= p and, with a
// window w > 0, c > p - w (transformers' sliding rule). With softcap > 0 the scores are tanh-capped as Gemma 2 does.
// Accumulation is in fp32 whatever the storage dtype.
//
// paged_tree_attention: the same, for a speculative tree. Every sequence computes n packed tokens, nodes of a tree
// written to its last n columns; the tree is its last m >= n columns (m > n: nodes written by earlier steps, as when
// a draft head grows a tree level by level), ancestors before descendants. One more argument:
// tree_mask   [seqs, n, m] bool         node i (column length - n + i) sees tree column j; each row holds the node's
//                                       ancestors and itself
// Node i attends to the columns before the tree and to the tree columns its row allows. Its position is the tree's
// first column plus its depth (its row's count minus one), which is what a window is measured from.
//
// Here: the arguments checked, the step's K/V written, the work split into tasks run in parallel. A task's work is
// attention_task.h, its register-tiled loops attention_tiles.h, its softmax attention_softmax.h.
#include <ATen/ATen.h>  // not torch/extension.h: its Python and nn headers triple the compile time
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention_task.h"

namespace {

template <typename scalar_t>
void write_new_tokens(const at::Tensor& fresh, const at::Tensor& pool, const int64_t* slots, int64_t tokens) {
  // fresh [kv_heads, tokens, dim] -> pool rows `slots` of each kv head
  const int64_t kv_heads = fresh.size(0), dim = fresh.size(2);
  const int64_t head_stride = fresh.stride(0), token_stride = fresh.stride(1);
  const int64_t pool_head_stride = pool.size(1) * pool.size(2) * dim;
  const scalar_t* src = fresh.data_ptr<scalar_t>();
  scalar_t* dst = pool.data_ptr<scalar_t>();
  for (int64_t h = 0; h < kv_heads; ++h)
    for (int64_t t = 0; t < tokens; ++t)
      std::memcpy(dst + h * pool_head_stride + slots[t] * dim, src + h * head_stride + t * token_stride,
                  dim * sizeof(scalar_t));
}

// The step's tensors against the shapes above; TORCH_CHECK's error names the first that disagrees.
void check_tensors(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_pool,
                   const at::Tensor& value_pool) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3 && key_pool.dim() == 4,
              "query [heads, tokens, dim], key/value [kv_heads, tokens, dim], pools [kv_heads, blocks, size, dim]");
  TORCH_CHECK(key_pool.sizes() == value_pool.sizes(), "key and value pools differ in shape");
  const auto dtype = key_pool.scalar_type();
  TORCH_CHECK(query.scalar_type() == dtype && key.scalar_type() == dtype && value.scalar_type() == dtype &&
                  value_pool.scalar_type() == dtype,
              "query, key, value and pools must share a dtype");
  TORCH_CHECK(key_pool.is_contiguous() && value_pool.is_contiguous(), "pools must be contiguous");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1 && value.stride(2) == 1, "head_dim must be contiguous");
  const int64_t heads = query.size(0), tokens = query.size(1), dim = query.size(2), kv_heads = key_pool.size(0);
  TORCH_CHECK(heads % kv_heads == 0 && key_pool.size(3) == dim, "heads must be a multiple of kv_heads, same dim");
  TORCH_CHECK(key.size(0) == kv_heads && key.size(1) == tokens && key.size(2) == dim && key.sizes() == value.sizes(),
              "key and value must be [kv_heads, tokens, dim]");
}

// The step's layout as int64 (slots [tokens], table [seqs, max_blocks], starts [seqs + 1], lengths [seqs]), checked
// against the pool: every slot and block in it, every sequence's queries within its length and its length within
// its block table's row; max_length the longest length.
struct StepLayout {
  at::Tensor slots, table, starts, lengths;
  int64_t max_length = 0;
  StepLayout(const at::Tensor& slot, const at::Tensor& block_table, const at::Tensor& query_start,
             const at::Tensor& kv_lengths, const at::Tensor& key_pool, int64_t tokens)
      : slots(slot.to(at::kLong).contiguous()), table(block_table.to(at::kLong).contiguous()),
        starts(query_start.to(at::kLong).contiguous()), lengths(kv_lengths.to(at::kLong).contiguous()) {
    const int64_t seqs = lengths.size(0), num_blocks = key_pool.size(1), block_size = key_pool.size(2);
    TORCH_CHECK(slots.numel() == tokens, "one slot per packed token");
    TORCH_CHECK(table.size(0) == seqs && starts.numel() == seqs + 1, "one block-table row, one start per sequence");
    const int64_t *slot_data = slots.data_ptr<int64_t>(), *start_data = starts.data_ptr<int64_t>();
    const int64_t *len_data = lengths.data_ptr<int64_t>(), *table_data = table.data_ptr<int64_t>();
    for (int64_t t = 0; t < tokens; ++t)
      TORCH_CHECK(slot_data[t] >= 0 && slot_data[t] < num_blocks * block_size, "slot out of pool");
    TORCH_CHECK(start_data[0] == 0 && start_data[seqs] == tokens, "query_start must run from 0 to the token count");
    for (int64_t s = 0; s < seqs; ++s) {
      const int64_t num_queries = start_data[s + 1] - start_data[s];
      TORCH_CHECK(num_queries >= 0 && len_data[s] >= num_queries && len_data[s] <= table.size(1) * block_size,
                  "length out of the block table");
      max_length = std::max(max_length, len_data[s]);
    }
    for (int64_t i = 0; i < table.numel(); ++i)
      TORCH_CHECK(table_data[i] >= 0 && table_data[i] < num_blocks, "block id out of pool");
  }
};

// One task per (sequence, K/V head, kQueryChunk of the sequence's queries).
std::vector<Task> plan_tasks(const StepLayout& step, int64_t kv_heads) {
  const int64_t* start_data = step.starts.data_ptr<int64_t>();
  std::vector<Task> tasks;
  for (int64_t s = 0; s < step.lengths.size(0); ++s) {
    const int64_t num_queries = start_data[s + 1] - start_data[s];
    for (int64_t first = 0; first < num_queries; first += kQueryChunk)
      for (int64_t h = 0; h < kv_heads; ++h) tasks.push_back({s, h, first, std::min(first + kQueryChunk, num_queries)});
  }
  return tasks;
}

// paged_tree_attention's mask, checked against the step, as bytes in `layout`; returns the tensor that holds them.
at::Tensor set_tree(const at::Tensor& tree_mask, const StepLayout& step, int64_t window, Layout& layout) {
  const int64_t seqs = step.lengths.size(0);
  const int64_t *start_data = step.starts.data_ptr<int64_t>(), *len_data = step.lengths.data_ptr<int64_t>();
  TORCH_CHECK(tree_mask.dim() == 3 && tree_mask.size(0) == seqs, "tree_mask must be [seqs, n, m]");
  const int64_t n = tree_mask.size(1), m = tree_mask.size(2);
  TORCH_CHECK(m >= n, "tree_mask [seqs, n, m] needs m >= n: the n nodes are the tree's last columns");
  for (int64_t s = 0; s < seqs; ++s)
    TORCH_CHECK(start_data[s + 1] - start_data[s] == n && len_data[s] >= m,
                "every sequence computes n tree nodes and holds the tree's m columns");
  TORCH_CHECK(window == 0 || window > m, "a window must be longer than the tree");
  auto tree = tree_mask.to(at::kByte).contiguous();
  layout.tree = tree.data_ptr<uint8_t>();
  layout.tree_queries = n;
  layout.tree_columns = m;
  return tree;
}

at::Tensor attend_pool(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, at::Tensor& key_pool,
                       at::Tensor& value_pool, const at::Tensor& slots, const at::Tensor& block_table,
                       const at::Tensor& query_start, const at::Tensor& kv_lengths, double scale, int64_t window,
                       double softcap, const at::Tensor* tree_mask) {
  check_tensors(query, key, value, key_pool, value_pool);
  const int64_t heads = query.size(0), tokens = query.size(1), dim = query.size(2);
  const int64_t kv_heads = key_pool.size(0), num_blocks = key_pool.size(1), block_size = key_pool.size(2);
  const StepLayout step(slots, block_table, query_start, kv_lengths, key_pool, tokens);
  const std::vector<Task> tasks = plan_tasks(step, kv_heads);
  auto out = at::empty({tokens, heads, dim}, query.options());
  Layout layout{heads, kv_heads, heads / kv_heads, dim, block_size, step.table.size(1), query.stride(0),
                query.stride(1), num_blocks * block_size * dim, static_cast<float>(scale), static_cast<float>(softcap),
                window};
  const at::Tensor tree = tree_mask == nullptr ? at::Tensor() : set_tree(*tree_mask, step, window, layout);
  const int64_t *slot_data = step.slots.data_ptr<int64_t>(), *table_data = step.table.data_ptr<int64_t>();
  const int64_t *start_data = step.starts.data_ptr<int64_t>(), *len_data = step.lengths.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key_pool.scalar_type(), "paged_attention", [&] {
    write_new_tokens<scalar_t>(key, key_pool, slot_data, tokens);
    write_new_tokens<scalar_t>(value, value_pool, slot_data, tokens);
    const scalar_t* q_data = query.data_ptr<scalar_t>();
    const scalar_t* k_data = key_pool.data_ptr<scalar_t>();
    const scalar_t* v_data = value_pool.data_ptr<scalar_t>();
    scalar_t* out_data = out.data_ptr<scalar_t>();
    at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
      Scratch scratch(layout, step.max_length, !std::is_same_v<scalar_t, float>);
      for (int64_t i = begin; i < end; ++i)
        attend_task<scalar_t>(layout, tasks[i], q_data, k_data, v_data, table_data, start_data, len_data, scratch,
                              out_data);
    });
  });
  return out;
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           at::Tensor& key_pool, at::Tensor& value_pool, const at::Tensor& slots,
                           const at::Tensor& block_table, const at::Tensor& query_start, const at::Tensor& kv_lengths,
                           double scale, int64_t window, double softcap) {
  return attend_pool(query, key, value, key_pool, value_pool, slots, block_table, query_start, kv_lengths, scale,
                     window, softcap, nullptr);
}

at::Tensor paged_tree_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                at::Tensor& key_pool, at::Tensor& value_pool, const at::Tensor& slots,
                                const at::Tensor& block_table, const at::Tensor& query_start,
                                const at::Tensor& kv_lengths, double scale, int64_t window, double softcap,
                                const at::Tensor& tree_mask) {
  return attend_pool(query, key, value, key_pool, value_pool, slots, block_table, query_start, kv_lengths, scale,
                     window, softcap, &tree_mask);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_accel, m) {
  m.def("paged_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) key_pool, Tensor(b!) value_pool, "
        "Tensor slots, Tensor block_table, Tensor query_start, Tensor kv_lengths, float scale, int window, "
        "float softcap) -> Tensor");
  m.def("paged_tree_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) key_pool, Tensor(b!) value_pool, "
        "Tensor slots, Tensor block_table, Tensor query_start, Tensor kv_lengths, float scale, int window, "
        "float softcap, Tensor tree_mask) -> Tensor");
}

TORCH_LIBRARY_IMPL(hf_accel, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_tree_attention", &paged_tree_attention);
}
