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
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <ATen/ATen.h>  // not torch/extension.h: its Python and nn headers triple the compile time
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kQueryChunk = 32;     // a long prefill chunk is split into tasks of this many positions
constexpr int64_t kTransposeFrom = 16;  // query rows (heads x positions) from which K blocks are transposed

// The float whose bits are `bits` (std::bit_cast is C++20; torch before 2.13 builds extensions as C++17).
inline float float_from_bits(int32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

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
  return p * float_from_bits((static_cast<int32_t>(n) + 127) << 23);
}

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

constexpr int64_t kPrefetchRows = 16;  // value rows fetched ahead of the one being accumulated

// Ask for the cache lines of one pool row (`dim` elements) ahead of their use.
template <typename scalar_t>
inline void prefetch_row(const scalar_t* row, int64_t dim) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < dim * static_cast<int64_t>(sizeof(scalar_t)); offset += 64)
    __builtin_prefetch(bytes + offset);
}

// One dot product per (key, query) for decodes. With AVX-512 (the kernel is built with -march=native) the lanes are
// summed by one reduction instruction, with AVX2 by three shuffles and adds in registers: a plain `omp simd reduction`
// left that last step to sixteen dependent scalar adds through the stack, the largest cost of a decode step's
// attention (AVX2, reference target's heads: a decode's attention 1.4-1.75x faster, a 64-sequence engine step 16%).
inline float dot(const float* a, const float* b, int64_t dim) {
#if defined(__AVX512F__)
  if (dim % 16 == 0) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 16) sum = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), sum);
    return _mm512_reduce_add_ps(sum);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (dim % 16 == 0) {  // two independent accumulators, then 8 lanes -> 4 -> 2 -> 1 in registers
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 16) {
      even = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), even);
      odd = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), odd);
    }
    const __m256 sum = _mm256_add_ps(even, odd);
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    half = _mm_add_ss(half, _mm_movehdup_ps(half));
    return _mm_cvtss_f32(half);
  }
#endif
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t d = 0; d < dim; ++d) total += a[d] * b[d];
  return total;
}

// Scores of R query rows `q` [R, dim] against one block transposed to `kt` [dim, BS] (its first `width` keys valid),
// into `scores` (row stride `columns`): each row's BS scores stay in registers while the block's dim rows stream past.
template <int64_t R, int64_t BS>
void score_rows(const float* q, int64_t dim, const float* kt, int64_t width, float* scores, int64_t columns) {
  float a[R][BS] = {};
  for (int64_t d = 0; d < dim; ++d) {
    const float* kd = kt + d * BS;
    for (int64_t r = 0; r < R; ++r) {
      const float qd = q[r * dim + d];
#pragma omp simd
      for (int64_t c = 0; c < BS; ++c) a[r][c] += qd * kd[c];
    }
  }
  for (int64_t r = 0; r < R; ++r) std::copy(a[r], a[r] + width, scores + r * columns);
}

// score_rows over all `num_q` rows: eight at a time (independent chains of FMAs: four waited on their latency), then
// four, then one.
template <int64_t BS>
void score_block(const float* q, int64_t num_q, int64_t dim, const float* kt, int64_t width, float* scores,
                 int64_t columns) {
  int64_t j = 0;
  for (; j + 8 <= num_q; j += 8) score_rows<8, BS>(q + j * dim, dim, kt, width, scores + j * columns, columns);
  for (; j + 4 <= num_q; j += 4) score_rows<4, BS>(q + j * dim, dim, kt, width, scores + j * columns, columns);
  for (; j < num_q; ++j) score_rows<1, BS>(q + j * dim, dim, kt, width, scores + j * columns, columns);
}

#if defined(__AVX512F__)
// dst [16, 16] (row stride `dst_stride`) = src [16, 16] (row stride `src_stride`) transposed, in registers: pairs of
// rows interleaved at 1, 2, 4 and 8 floats.
inline void transpose16(const float* src, int64_t src_stride, float* dst, int64_t dst_stride) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * src_stride);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4)
    for (int j = 0; j < 2; ++j) {
      r[i + 2 * j] = _mm512_shuffle_ps(t[i + j], t[i + j + 2], 0x44);
      r[i + 2 * j + 1] = _mm512_shuffle_ps(t[i + j], t[i + j + 2], 0xee);
    }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
  }
  for (int j = 0; j < 16; ++j) _mm512_storeu_ps(dst + j * dst_stride, r[j]);  // r[j]: column j of src
}
#endif

// kt [dim, 16] = the first `width` keys [width, dim] of a 16-key block transposed, zero past them; `rows` a
// [16 * dim] buffer for the keys as floats when the pool holds another dtype.
template <typename scalar_t>
void transpose_keys(const scalar_t* k, int64_t width, int64_t dim, float* rows, float* kt) {
#if defined(__AVX512F__)
  if (dim % 16 == 0) {
    const float* src = rows;
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (width == 16) src = k;
    }
    if (src == rows) {  // as floats, zero rows past `width`
      for (int64_t c = 0; c < width; ++c)
        for (int64_t d = 0; d < dim; ++d) rows[c * dim + d] = static_cast<float>(k[c * dim + d]);
      std::fill(rows + width * dim, rows + 16 * dim, 0.f);
    }
    for (int64_t d = 0; d < dim; d += 16) transpose16(src + d, dim, kt + d * 16, 16);
    return;
  }
#endif
  std::fill(kt, kt + dim * 16, 0.f);
  for (int64_t c = 0; c < width; ++c)
    for (int64_t d = 0; d < dim; ++d) kt[d * 16 + c] = static_cast<float>(k[c * dim + d]);
}

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

// Query rows of a value tile: 8 x 16 accumulators are 8 of AVX-512's 32 registers but all 16 of AVX2's (the loads
// would spill them), so there a tile has 4 rows.
#if defined(__AVX512F__)
constexpr int64_t kTileRows = 8;
#else
constexpr int64_t kTileRows = 4;
#endif

// acc [R, 16] (row stride `dim`) += weights [R, columns] (row stride `columns`) @ value rows `rows[c]` (16 floats
// from each): R rows x 16 lanes of accumulators stay in registers while the value rows stream past.
template <int64_t R>
void accumulate_tile(const float* weights, int64_t columns, const float* const* rows, float* acc, int64_t dim) {
  float a[R][16] = {};
  for (int64_t c = 0; c < columns; ++c) {
    const float* v = rows[c];
    for (int64_t r = 0; r < R; ++r) {
      const float w = weights[r * columns + c];
#pragma omp simd
      for (int64_t e = 0; e < 16; ++e) a[r][e] += w * v[e];
    }
  }
  for (int64_t r = 0; r < R; ++r) std::copy(a[r], a[r] + 16, acc + r * dim);
}

// acc [R, D] (row stride D) = weights [R, columns] @ value rows `rows[c]` (D floats each), whole rows at a time: for a
// decode's few query rows, R x D accumulators fit in registers and each value row is read once, front to back.
template <int64_t R, int64_t D>
void accumulate_rows(const float* weights, int64_t columns, const float* const* rows, float* acc) {
  float a[R][D] = {};
  for (int64_t c = 0; c < columns; ++c) {
    const float* v = rows[c];
    if (c + kPrefetchRows < columns) prefetch_row(rows[c + kPrefetchRows], D);
    for (int64_t r = 0; r < R; ++r) {
      const float w = weights[r * columns + c];
#pragma omp simd
      for (int64_t e = 0; e < D; ++e) a[r][e] += w * v[e];
    }
  }
  for (int64_t r = 0; r < R; ++r) std::copy(a[r], a[r] + D, acc + r * D);
}

// Whole-row accumulation (`accumulate_rows`) for head sizes 64 and 128; false where it does not apply.
inline bool accumulate_decode(const float* weights, int64_t num_q, int64_t columns, const float* const* rows,
                              int64_t dim, float* acc) {
  if (dim != 64 && dim != 128) return false;
  int64_t j = 0;
  for (; j + 2 <= num_q; j += 2) {
    if (dim == 64) accumulate_rows<2, 64>(weights + j * columns, columns, rows, acc + j * dim);
    else accumulate_rows<2, 128>(weights + j * columns, columns, rows, acc + j * dim);
  }
  for (; j < num_q; ++j) {
    if (dim == 64) accumulate_rows<1, 64>(weights + j * columns, columns, rows, acc + j * dim);
    else accumulate_rows<1, 128>(weights + j * columns, columns, rows, acc + j * dim);
  }
  return true;
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

#if defined(__AVX512F__)
// exp_nonpositive on 16 lanes.
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  const __m512i exponent = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(exponent));
}

inline __mmask16 lanes_from(int64_t c, int64_t count) {  // the lanes of columns c .. c + 15 below `count`
  return count - c >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (count - c)) - 1);
}
#endif

// w[0, count) = softmax(w[0, count)), -inf entries to zero. With AVX-512 in masked vectors (the compiler's loops left
// each row's last partial vector to scalar code, the larger part of a decode's softmax).
inline void normalize(float* w, int64_t count) {
  constexpr float kMinus = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  __m512 top = _mm512_set1_ps(kMinus);
  for (int64_t c = 0; c < count; c += 16)
    top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(kMinus), lanes_from(c, count), w + c));
  const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t c = 0; c < count; c += 16) {
    const __mmask16 lanes = lanes_from(c, count);
    const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(kMinus), lanes, w + c);
    const __mmask16 finite = _mm512_mask_cmp_ps_mask(lanes, x, _mm512_set1_ps(kMinus), _CMP_NEQ_OQ);
    const __m512 e = _mm512_maskz_mov_ps(finite, exp_nonpositive16(_mm512_sub_ps(x, shift)));
    sum = _mm512_add_ps(sum, e);
    _mm512_mask_storeu_ps(w + c, lanes, e);
  }
  const __m512 inverse = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
  for (int64_t c = 0; c < count; c += 16) {
    const __mmask16 lanes = lanes_from(c, count);
    _mm512_mask_storeu_ps(w + c, lanes, _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, w + c), inverse));
  }
#else
  float top = kMinus;
#pragma omp simd reduction(max : top)
  for (int64_t c = 0; c < count; ++c) top = w[c] > top ? w[c] : top;
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t c = 0; c < count; ++c) {
    w[c] = w[c] == kMinus ? 0.f : exp_nonpositive(w[c] - top);
    total += w[c];
  }
  const float inverse = 1.f / total;
#pragma omp simd
  for (int64_t c = 0; c < count; ++c) w[c] *= inverse;
#endif
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

at::Tensor attend_pool(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, at::Tensor& key_pool,
                       at::Tensor& value_pool, const at::Tensor& slots, const at::Tensor& block_table,
                       const at::Tensor& query_start, const at::Tensor& kv_lengths, double scale, int64_t window,
                       double softcap, const at::Tensor* tree_mask) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3 && key_pool.dim() == 4,
              "query [heads, tokens, dim], key/value [kv_heads, tokens, dim], pools [kv_heads, blocks, size, dim]");
  TORCH_CHECK(key_pool.sizes() == value_pool.sizes(), "key and value pools differ in shape");
  const auto dtype = key_pool.scalar_type();
  TORCH_CHECK(query.scalar_type() == dtype && key.scalar_type() == dtype && value.scalar_type() == dtype &&
                  value_pool.scalar_type() == dtype,
              "query, key, value and pools must share a dtype");
  TORCH_CHECK(key_pool.is_contiguous() && value_pool.is_contiguous(), "pools must be contiguous");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1 && value.stride(2) == 1, "head_dim must be contiguous");
  const int64_t heads = query.size(0), tokens = query.size(1), dim = query.size(2);
  const int64_t kv_heads = key_pool.size(0), block_size = key_pool.size(2);
  TORCH_CHECK(heads % kv_heads == 0 && key_pool.size(3) == dim, "heads must be a multiple of kv_heads, same dim");
  TORCH_CHECK(key.size(0) == kv_heads && key.size(1) == tokens && key.size(2) == dim && key.sizes() == value.sizes(),
              "key and value must be [kv_heads, tokens, dim]");
  const auto slot = slots.to(at::kLong).contiguous();
  const auto table = block_table.to(at::kLong).contiguous();
  const auto starts = query_start.to(at::kLong).contiguous();
  const auto lens = kv_lengths.to(at::kLong).contiguous();
  const int64_t seqs = lens.size(0), max_blocks = table.size(1);
  TORCH_CHECK(slot.numel() == tokens, "one slot per packed token");
  TORCH_CHECK(table.size(0) == seqs && starts.numel() == seqs + 1, "one block-table row, one start per sequence");
  const int64_t* slot_data = slot.data_ptr<int64_t>();
  const int64_t* start_data = starts.data_ptr<int64_t>();
  const int64_t* len_data = lens.data_ptr<int64_t>();
  const int64_t num_slots = key_pool.size(1) * block_size;
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(slot_data[t] >= 0 && slot_data[t] < num_slots, "slot out of pool");
  TORCH_CHECK(start_data[0] == 0 && start_data[seqs] == tokens, "query_start must run from 0 to the token count");
  std::vector<Task> tasks;
  int64_t max_length = 0;
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t num_queries = start_data[s + 1] - start_data[s];
    TORCH_CHECK(num_queries >= 0 && len_data[s] >= num_queries && len_data[s] <= max_blocks * block_size,
                "length out of the block table");
    max_length = std::max(max_length, len_data[s]);
    for (int64_t first = 0; first < num_queries; first += kQueryChunk)
      for (int64_t h = 0; h < kv_heads; ++h) tasks.push_back({s, h, first, std::min(first + kQueryChunk, num_queries)});
  }
  const int64_t* table_data = table.data_ptr<int64_t>();
  const int64_t num_blocks = key_pool.size(1);
  for (int64_t i = 0; i < table.numel(); ++i)
    TORCH_CHECK(table_data[i] >= 0 && table_data[i] < num_blocks, "block id out of pool");
  auto out = at::empty({tokens, heads, dim}, query.options());
  Layout layout{heads, kv_heads, heads / kv_heads, dim, block_size, max_blocks, query.stride(0), query.stride(1),
                num_blocks * block_size * dim, static_cast<float>(scale), static_cast<float>(softcap), window};
  at::Tensor tree;
  if (tree_mask != nullptr) {
    TORCH_CHECK(tree_mask->dim() == 3 && tree_mask->size(0) == seqs, "tree_mask must be [seqs, n, m]");
    const int64_t n = tree_mask->size(1), m = tree_mask->size(2);
    TORCH_CHECK(m >= n, "tree_mask [seqs, n, m] needs m >= n: the n nodes are the tree's last columns");
    for (int64_t s = 0; s < seqs; ++s)
      TORCH_CHECK(start_data[s + 1] - start_data[s] == n && len_data[s] >= m,
                  "every sequence computes n tree nodes and holds the tree's m columns");
    TORCH_CHECK(window == 0 || window > m, "a window must be longer than the tree");
    tree = tree_mask->to(at::kByte).contiguous();
    layout.tree = tree.data_ptr<uint8_t>();
    layout.tree_queries = n;
    layout.tree_columns = m;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "paged_attention", [&] {
    write_new_tokens<scalar_t>(key, key_pool, slot_data, tokens);
    write_new_tokens<scalar_t>(value, value_pool, slot_data, tokens);
    const scalar_t* q_data = query.data_ptr<scalar_t>();
    const scalar_t* k_data = key_pool.data_ptr<scalar_t>();
    const scalar_t* v_data = value_pool.data_ptr<scalar_t>();
    scalar_t* out_data = out.data_ptr<scalar_t>();
    at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
      Scratch scratch(layout, max_length, !std::is_same_v<scalar_t, float>);
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
