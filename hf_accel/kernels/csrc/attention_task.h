// One task of paged attention: the queries of one sequence's K/V head (a decode's one per query head, a prefill
// chunk's up to kQueryChunk positions), scored against that sequence's blocks where they lie in the pool, softmaxed
// under the causal, window and tree rules, and their values accumulated (shapes: paged_attention.cpp). Included by
// paged_attention.cpp alone.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>

#include "attention_softmax.h"
#include "attention_tiles.h"

namespace {

constexpr int64_t kQueryChunk = 32;     // a long prefill chunk is split into tasks of this many positions
constexpr int64_t kTransposeFrom = 16;  // query rows (heads x positions) from which K blocks are transposed

// A pool row as floats: the row itself for fp32, else converted into `buffer` [dim].
template <typename scalar_t>
inline const float* row_as_float(const scalar_t* row, int64_t dim, float* buffer) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return row;
  } else {
    for (int64_t d = 0; d < dim; ++d) buffer[d] = static_cast<float>(row[d]);
    return buffer;
  }
}

// Shapes and strides every task shares.
struct Layout {
  int64_t heads, kv_heads, groups, dim, block_size, max_blocks;
  int64_t q_head_stride, q_token_stride;  // query strides
  int64_t pool_head_stride;               // num_blocks * block_size * dim
  float scale, softcap;
  int64_t window;
  const uint8_t* tree = nullptr;  // paged_tree_attention's mask [seqs, n, m], else null
  int64_t tree_queries = 0;       // n
  int64_t tree_columns = 0;       // m
};

// One task: kv head `kvh` of sequence `seq`, its queries `first_query` .. `last_query` (exclusive) of `num_queries`.
struct Task {
  int64_t seq, kvh, first_query, last_query;
};

// `size` uninitialized elements: every user writes before it reads (zeroing a step's scratch cost as much as a
// decode's scores).
template <typename T>
struct Buffer {
  std::unique_ptr<T[]> memory;
  explicit Buffer(int64_t size) : memory(new T[size]) {}
  T* data() { return memory.get(); }
};

// Per-thread working memory, sized once per parallel chunk.
struct Scratch {
  Buffer<float> q, scores, acc, block, row, values;
  Buffer<const float*> rows;  // a task's value rows, as floats
  Scratch(const Layout& l, int64_t max_length, bool converts)
      : q(l.groups * kQueryChunk * l.dim), scores(l.groups * kQueryChunk * max_length),
        acc(l.groups * kQueryChunk * l.dim), block(l.dim * l.block_size), row(16 * l.dim),
        values(converts ? max_length * l.dim : 0), rows(max_length) {}
};

// Scores of `num_q` scaled queries `q` [num_q, dim] against columns [0, columns) of one sequence's K, written to
// `scores` [num_q, columns]. Few queries (decodes): one dot product per (key, query), each key read once. Many
// (prefill chunks) with 16-token blocks: each block is transposed to [dim, 16] once and shared by all the queries,
// whose inner loop then runs over the block's keys without horizontal sums.
template <typename scalar_t>
void score_columns(const Layout& l, const float* q, int64_t num_q, const scalar_t* keys, const int64_t* blocks,
                   int64_t columns, Scratch& s, float* scores) {
  const int64_t size = l.block_size, dim = l.dim;
  if (num_q >= kTransposeFrom && size == 16) {
    float* kt = s.block.data();
    for (int64_t b = 0; b * size < columns; ++b) {
      const int64_t width = std::min(size, columns - b * size);
      if ((b + 1) * size < columns)  // blocks lie anywhere in the pool: ask for the next one's rows now
        for (int64_t c = 0; c < size; ++c) prefetch_row(keys + (blocks[b + 1] * size + c) * dim, dim);
      transpose_keys(keys + blocks[b] * size * dim, width, dim, s.row.data(), kt);
      score_block<16>(q, num_q, dim, kt, width, scores + b * size, columns);
    }
  } else {
    for (int64_t b = 0, first = 0; first < columns; ++b, first += size) {  // block by block: no division per key
      const scalar_t* block = keys + blocks[b] * size * dim;
      const int64_t width = std::min(size, columns - first);
      // blocks lie anywhere in the pool: fetch the next one's rows while this one's are scored
      const scalar_t* next = first + size < columns ? keys + blocks[b + 1] * size * dim : nullptr;
      for (int64_t c = 0; c < width; ++c) {
        if (next != nullptr) prefetch_row(next + c * dim, dim);
        const float* k = row_as_float(block + c * dim, dim, s.row.data());
        for (int64_t j = 0; j < num_q; ++j) scores[j * columns + first + c] = dot(q + j * dim, k, dim);
      }
    }
  }
  if (l.softcap > 0.f)
    for (int64_t i = 0; i < num_q * columns; ++i) scores[i] = std::tanh(scores[i] / l.softcap) * l.softcap;
}

// acc [num_q, dim] = weights [num_q, columns] @ V[columns, dim] of one sequence (rows found through its blocks).
template <typename scalar_t>
void accumulate_values(const Layout& l, const float* weights, int64_t num_q, int64_t columns, const scalar_t* values,
                       const int64_t* blocks, Scratch& s, float* acc) {
  const int64_t dim = l.dim, size = l.block_size;
  std::fill(acc, acc + num_q * dim, 0.f);
  if (dim % 16 == 0) {
    // tiles of up to kTileRows query rows x 16 lanes kept in registers; row pointers (fp32: into the pool; else
    // converted copies)
    const float** rows = s.rows.data();
    for (int64_t c = 0; c < columns; ++c) {
      const scalar_t* row = values + (blocks[c / size] * size + c % size) * dim;  // once per key for all queries
      if constexpr (std::is_same_v<scalar_t, float>) {
        if (num_q >= kTransposeFrom) prefetch_row(row, dim);  // all rows in flight at once, before the tiles read them
        rows[c] = row;
      } else {
        float* converted = s.values.data() + c * dim;
        for (int64_t d = 0; d < dim; ++d) converted[d] = static_cast<float>(row[d]);
        rows[c] = converted;
      }
    }
    if (num_q < kTransposeFrom && accumulate_decode(weights, num_q, columns, rows, dim, acc)) return;
    for (int64_t lane = 0; lane < dim; lane += 16) {
      if (lane > 0)
        for (int64_t c = 0; c < columns; ++c) rows[c] += 16;
      int64_t j = 0;
      for (; j + kTileRows <= num_q; j += kTileRows)
        accumulate_tile<kTileRows>(weights + j * columns, columns, rows, acc + j * dim + lane, dim);
      for (; kTileRows > 4 && j + 4 <= num_q; j += 4)
        accumulate_tile<4>(weights + j * columns, columns, rows, acc + j * dim + lane, dim);
      for (; j + 2 <= num_q; j += 2)  // a decode's query heads of one K/V head (grouped-query attention)
        accumulate_tile<2>(weights + j * columns, columns, rows, acc + j * dim + lane, dim);
      for (; j < num_q; ++j) accumulate_tile<1>(weights + j * columns, columns, rows, acc + j * dim + lane, dim);
    }
    return;
  }
  for (int64_t b = 0, first = 0; first < columns; ++b, first += size) {  // block by block: no division per key
    const scalar_t* block = values + blocks[b] * size * dim;
    const int64_t width = std::min(size, columns - first);
    for (int64_t c = 0; c < width; ++c) {
      const float* v = row_as_float(block + c * dim, dim, s.row.data());
      for (int64_t j = 0; j < num_q; ++j) {
        const float wj = weights[j * columns + first + c];
        if (wj == 0.f) continue;
        float* a = acc + j * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) a[d] += wj * v[d];
      }
    }
  }
}

// Softmax of each row of `scores` over its allowed columns (zero elsewhere); row j is query position `position(j)`.
// With a tree (`sees`: sequence's mask [n, m]; node i at column query_base + i, tree column j at tree_base + j) the
// tree columns a node may see are its row's, and its window starts from its depth.
void softmax_rows(const Layout& l, float* scores, int64_t num_q, int64_t columns, int64_t num_positions,
                  int64_t first_position, const uint8_t* sees, int64_t tree_base, int64_t query_base) {
  for (int64_t j = 0; j < num_q; ++j) {
    const int64_t position = first_position + j % num_positions;
    const uint8_t* row = sees == nullptr ? nullptr : sees + (position - query_base) * l.tree_columns;
    int64_t depth = position;  // a node's depth-based position
    if (row != nullptr) {
      depth = tree_base - 1;
      for (int64_t c = 0; c < l.tree_columns; ++c) depth += row[c] != 0;
    }
    const int64_t first = l.window > 0 ? std::max<int64_t>(depth - l.window + 1, 0) : 0;
    float* w = scores + j * columns;
    if (row != nullptr)
      for (int64_t c = tree_base; c <= position; ++c)
        if (row[c - tree_base] == 0) w[c] = -std::numeric_limits<float>::infinity();
    normalize(w + first, position + 1 - first);
    std::fill(w, w + first, 0.f);
    std::fill(w + position + 1, w + columns, 0.f);
  }
}

template <typename scalar_t>
void attend_task(const Layout& l, const Task& task, const scalar_t* query, const scalar_t* key_pool,
                 const scalar_t* value_pool, const int64_t* block_table, const int64_t* query_start,
                 const int64_t* kv_lengths, Scratch& s, scalar_t* out) {
  const int64_t dim = l.dim, num_queries = query_start[task.seq + 1] - query_start[task.seq];
  const int64_t length = kv_lengths[task.seq];
  const int64_t num_positions = task.last_query - task.first_query, num_q = l.groups * num_positions;
  const int64_t first_position = length - num_queries + task.first_query;
  const int64_t columns = first_position + num_positions;  // through the task's last query (causal)
  const int64_t* blocks = block_table + task.seq * l.max_blocks;
  const int64_t pool_offset = task.kvh * l.pool_head_stride;
  // q rows are (group, position): query head kvh * groups + g at packed token query_start[seq] + first_query + i
  float* q = s.q.data();
  for (int64_t g = 0; g < l.groups; ++g)
    for (int64_t i = 0; i < num_positions; ++i) {
      const scalar_t* src = query + (task.kvh * l.groups + g) * l.q_head_stride +
                            (query_start[task.seq] + task.first_query + i) * l.q_token_stride;
      for (int64_t d = 0; d < dim; ++d) q[(g * num_positions + i) * dim + d] = static_cast<float>(src[d]) * l.scale;
    }
  float* scores = s.scores.data();
  score_columns<scalar_t>(l, q, num_q, key_pool + pool_offset, blocks, columns, s, scores);
  const uint8_t* sees = l.tree == nullptr ? nullptr : l.tree + task.seq * l.tree_queries * l.tree_columns;
  softmax_rows(l, scores, num_q, columns, num_positions, first_position, sees, length - l.tree_columns,
               length - num_queries);
  float* acc = s.acc.data();
  accumulate_values<scalar_t>(l, scores, num_q, columns, value_pool + pool_offset, blocks, s, acc);
  for (int64_t g = 0; g < l.groups; ++g)
    for (int64_t i = 0; i < num_positions; ++i) {
      scalar_t* dst = out + ((query_start[task.seq] + task.first_query + i) * l.heads + task.kvh * l.groups + g) * dim;
      for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<scalar_t>(acc[(g * num_positions + i) * dim + d]);
    }
}

}  // namespace
