// One decode step's attention for one layer of compiled generate's quantized KV cache (hf_accel/compiled/
// quantized_rows.py): each row's one query per head attends its valid full-precision slots, its quantized history
// read as packed codes (each token's codes unpacked into a [dim] scratch row, never into a dequantized buffer) and
// its new token. fp32 storage; any strides with the last dimension contiguous.
//
// query        [rows, heads, dim]
// fp_keys      [kv_heads, rows, S, dim]               the sinks and the residual (fp_values alike)
// key_codes    [rows, kv_heads, groups, G, packed]    uint8, `ops.pack`'s bit planes: byte j holds the codes of
//                                                     channels j, j + packed, ... (the first in the lowest bits)
// key_scale    [rows, kv_heads, groups, 1, dim]       per channel over G tokens (key_minimum alike)
// value_codes  [rows, kv_heads, tokens, packed]       uint8, tokens = groups * G
// value_scale  [rows, kv_heads, tokens, dim / G, 1]   per token over G channels (value_minimum alike)
// valid        [rows, S + tokens] bool                which fp slots, then which history tokens, hold a real token
// new_key      [rows, kv_heads, dim]                  the step's own token: always attended (new_value alike)
// returns      [rows, heads, dim]
// Query head h reads K/V head h / (heads / kv_heads). A value is code * scale + minimum. Scores and sums in fp32.
#include <ATen/ATen.h>  // not torch/extension.h: its Python and nn headers triple the compile time
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

// codes [dim] as floats from one token's packed bytes [packed]
inline void unpack_row(const uint8_t* bytes, int64_t packed, int64_t dim, float* codes) {
  const int64_t planes = dim / packed;
  const int nbits = static_cast<int>(8 / planes);
  const int mask = (1 << nbits) - 1;
  for (int64_t plane = 0; plane < planes; ++plane) {
    const int shift = static_cast<int>(plane) * nbits;
    float* out = codes + plane * packed;
#pragma omp simd
    for (int64_t j = 0; j < packed; ++j) out[j] = static_cast<float>((bytes[j] >> shift) & mask);
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void add_scaled(float* acc, const float* row, float weight, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) acc[i] += weight * row[i];
}

struct Strided {  // a tensor's data and strides, indexed by up to 5 coordinates
  const char* data;
  int64_t element;
  int64_t stride[5];
  template <typename T>
  const T* at(int64_t a, int64_t b = 0, int64_t c = 0, int64_t d = 0) const {
    return reinterpret_cast<const T*>(data) + a * stride[0] + b * stride[1] + c * stride[2] + d * stride[3];
  }
};

Strided strided(const at::Tensor& t) {
  Strided s{static_cast<const char*>(t.data_ptr()), t.element_size(), {0, 0, 0, 0, 0}};
  for (int64_t i = 0; i < t.dim() && i < 5; ++i) s.stride[i] = t.stride(i);
  return s;
}

}  // namespace

at::Tensor quantized_decode_attention(const at::Tensor& query, const at::Tensor& fp_keys,
                                         const at::Tensor& fp_values,
                                         const at::Tensor& key_codes, const at::Tensor& key_scale,
                                         const at::Tensor& key_minimum, const at::Tensor& value_codes,
                                         const at::Tensor& value_scale, const at::Tensor& value_minimum,
                                         const at::Tensor& valid, const at::Tensor& new_key,
                                         const at::Tensor& new_value, double scale) {
  for (const auto* t : {&query, &fp_keys, &fp_values, &key_scale, &key_minimum, &value_scale, &value_minimum,
                        &new_key, &new_value}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat, "quantized_decode_attention: fp32 tensors expected");
    TORCH_CHECK(t->stride(-1) == 1, "quantized_decode_attention: the last dimension must be contiguous");
  }
  TORCH_CHECK(key_codes.scalar_type() == at::kByte && value_codes.scalar_type() == at::kByte,
              "quantized_decode_attention: uint8 codes expected");
  TORCH_CHECK(valid.scalar_type() == at::kBool, "quantized_decode_attention: a bool `valid` expected");
  const int64_t rows = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = fp_keys.size(0), slots = fp_keys.size(2);
  const int64_t groups = key_codes.size(2), group = key_codes.size(3), packed = key_codes.size(4);
  const int64_t tokens = value_codes.size(2), channel_groups = value_scale.size(3);
  const int64_t per_head = heads / kv_heads, total = slots + tokens + 1;
  TORCH_CHECK(groups * group == tokens && dim % packed == 0 && dim % channel_groups == 0,
              "quantized_decode_attention: inconsistent history shapes");
  const auto q = strided(query), fk = strided(fp_keys), fv = strided(fp_values), kc = strided(key_codes),
             ks = strided(key_scale), km = strided(key_minimum), vc = strided(value_codes),
             vs = strided(value_scale), vm = strided(value_minimum), ok = strided(valid), nk = strided(new_key),
             nv = strided(new_value);
  auto out = at::empty({rows, heads, dim}, query.options());
  float* out_data = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const int64_t channels_per_group = dim / channel_groups;

  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(per_head * total), codes(dim), weighted(per_head * dim), qs(dim);
    std::vector<float> constant(per_head), scaled(per_head * dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads, h = task % kv_heads;
      const bool* row_valid = ok.at<bool>(r);
      const float neg_inf = -std::numeric_limits<float>::infinity();
      // scores: the fp slots, the history, the new token
      for (int64_t i = 0; i < per_head; ++i) {
        const float* qi = q.at<float>(r, h * per_head + i);
        float* si = scores.data() + i * total;
        for (int64_t s = 0; s < slots; ++s) {
          si[s] = row_valid[s] ? dot(qi, fk.at<float>(h, r, s), dim) * fscale : neg_inf;
        }
        si[total - 1] = dot(qi, nk.at<float>(r, h), dim) * fscale;
      }
      for (int64_t g = 0; g < groups; ++g) {
        const float* gscale = ks.at<float>(r, h, g);
        const float* gmin = km.at<float>(r, h, g);
        // q . (code * scale + min) = (q * scale) . code + q . min, per query head and group
        for (int64_t i = 0; i < per_head; ++i) {
          const float* qi = q.at<float>(r, h * per_head + i);
          for (int64_t d = 0; d < dim; ++d) scaled[i * dim + d] = qi[d] * gscale[d];
          constant[i] = dot(qi, gmin, dim);
        }
        for (int64_t j = 0; j < group; ++j) {
          const int64_t t = g * group + j;
          if (!row_valid[slots + t]) {
            for (int64_t i = 0; i < per_head; ++i) scores[i * total + slots + t] = neg_inf;
            continue;
          }
          unpack_row(kc.at<uint8_t>(r, h, g, j), packed, dim, codes.data());
          for (int64_t i = 0; i < per_head; ++i) {
            scores[i * total + slots + t] = (dot(scaled.data() + i * dim, codes.data(), dim) + constant[i]) * fscale;
          }
        }
      }
      // softmax per query head (the new token is always valid: the maximum is finite)
      for (int64_t i = 0; i < per_head; ++i) {
        float* si = scores.data() + i * total;
        const float top = *std::max_element(si, si + total);
        float sum = 0.f;
        for (int64_t k = 0; k < total; ++k) {
          si[k] = std::exp(si[k] - top);
          sum += si[k];
        }
        const float inverse = 1.f / sum;
        for (int64_t k = 0; k < total; ++k) si[k] *= inverse;
      }
      // values
      std::fill(weighted.begin(), weighted.end(), 0.f);
      for (int64_t s = 0; s < slots; ++s) {
        if (!row_valid[s]) continue;
        const float* row = fv.at<float>(h, r, s);
        for (int64_t i = 0; i < per_head; ++i) add_scaled(weighted.data() + i * dim, row, scores[i * total + s], dim);
      }
      for (int64_t t = 0; t < tokens; ++t) {
        if (!row_valid[slots + t]) continue;
        unpack_row(vc.at<uint8_t>(r, h, t), packed, dim, codes.data());
        const float* tscale = vs.at<float>(r, h, t);
        const float* tmin = vm.at<float>(r, h, t);
        for (int64_t c = 0; c < channel_groups; ++c) {
          float* span = codes.data() + c * channels_per_group;
          const float a = tscale[c * vs.stride[3]], b = tmin[c * vm.stride[3]];
#pragma omp simd
          for (int64_t d = 0; d < channels_per_group; ++d) span[d] = span[d] * a + b;
        }
        for (int64_t i = 0; i < per_head; ++i) {
          add_scaled(weighted.data() + i * dim, codes.data(), scores[i * total + slots + t], dim);
        }
      }
      const float* own = nv.at<float>(r, h);
      for (int64_t i = 0; i < per_head; ++i) {
        float* acc = weighted.data() + i * dim;
        add_scaled(acc, own, scores[i * total + total - 1], dim);
        std::copy(acc, acc + dim, out_data + (r * heads + h * per_head + i) * dim);
      }
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(hf_accel, m) {
  m.def("quantized_decode_attention(Tensor query, Tensor fp_keys, Tensor fp_values, "
        "Tensor key_codes, Tensor key_scale, Tensor key_minimum, Tensor value_codes, Tensor value_scale, "
        "Tensor value_minimum, Tensor valid, Tensor new_key, Tensor new_value, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(hf_accel, CPU, m) { m.impl("quantized_decode_attention", &quantized_decode_attention); }
