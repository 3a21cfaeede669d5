// Attention of a few query tokens per sequence on that sequence's cache row.
//
// A decoding or verification pass asks 1 to ~64 queries per sequence; PyTorch's fused kernel and
// batched matmuls spend microseconds of setup on each (sequence, head) pair, which at batch 32
// outweighs the arithmetic. Here one task per (sequence, key/value head) reads each key and value
// row once for all the query heads that share it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

typedef float Vec16 __attribute__((vector_size(64)));

inline float dot(const float* a, const float* b, int64_t n) {
  Vec16 sum = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    Vec16 x, y;
    std::memcpy(&x, a + i, sizeof(x));
    std::memcpy(&y, b + i, sizeof(y));
    sum += x * y;
  }
  float total = 0.0f;
  for (int k = 0; k < 16; ++k) total += sum[k];
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

inline void add_scaled(float* out, const float* row, float scale, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] += scale * row[i];
}

// query [rows, heads, width, dim]; key, value [rows, kv_heads, kv_length, dim] (dim contiguous);
// mask [rows, 1, width, kv_length] additive. Returns [rows, width, heads, dim].
at::Tensor short_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           const at::Tensor& mask, double scaling) {
  TORCH_CHECK(query.device().is_cpu() && query.scalar_type() == at::kFloat, "short_attention: CPU float32");
  TORCH_CHECK(key.stride(3) == 1 && value.stride(3) == 1, "keys and values must be contiguous per head");
  const int64_t rows = query.size(0), heads = query.size(1), width = query.size(2), dim = query.size(3);
  const int64_t kv_heads = key.size(1), kv_length = key.size(2);
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of key/value heads");
  TORCH_CHECK(mask.size(0) == rows && mask.size(2) == width && mask.size(3) == kv_length, "mask shape");
  const int64_t group = heads / kv_heads;
  const at::Tensor q = query.contiguous();
  at::Tensor out = at::empty({rows, width, heads, dim}, query.options());
  const float* q_data = q.data_ptr<float>();
  const float* k_data = key.data_ptr<float>();
  const float* v_data = value.data_ptr<float>();
  const float* m_data = mask.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const float scale = static_cast<float>(scaling);
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    const int64_t queries = group * width;
    std::vector<float> scores(queries * kv_length);
    std::vector<float> sums(queries * dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / kv_heads, kv_head = task % kv_heads;
      const float* keys = k_data + row * key.stride(0) + kv_head * key.stride(1);
      const float* values = v_data + row * value.stride(0) + kv_head * value.stride(1);
      auto query_of = [&](int64_t n) {  // n = g * width + w: head kv_head * group + g, token w
        const int64_t head = kv_head * group + n / width, token = n % width;
        return q_data + ((row * heads + head) * width + token) * dim;
      };
      for (int64_t j = 0; j < kv_length; ++j) {
        const float* key_row = keys + j * key.stride(2);
        for (int64_t n = 0; n < queries; ++n) {
          const float bias = m_data[row * mask.stride(0) + (n % width) * mask.stride(2) + j * mask.stride(3)];
          scores[n * kv_length + j] = dot(query_of(n), key_row, dim) * scale + bias;
        }
      }
      std::fill(sums.begin(), sums.end(), 0.0f);
      for (int64_t n = 0; n < queries; ++n) {
        float* score = scores.data() + n * kv_length;
        const float top = *std::max_element(score, score + kv_length);
        float total = 0.0f;
        for (int64_t j = 0; j < kv_length; ++j) {
          score[j] = std::exp(score[j] - top);
          total += score[j];
        }
        const float inverse = 1.0f / total;
        for (int64_t j = 0; j < kv_length; ++j) score[j] *= inverse;
      }
      for (int64_t j = 0; j < kv_length; ++j) {
        const float* value_row = values + j * value.stride(2);
        for (int64_t n = 0; n < queries; ++n) add_scaled(sums.data() + n * dim, value_row, scores[n * kv_length + j], dim);
      }
      for (int64_t n = 0; n < queries; ++n) {
        const int64_t head = kv_head * group + n / width, token = n % width;
        std::memcpy(out_data + ((row * width + token) * heads + head) * dim, sums.data() + n * dim, dim * sizeof(float));
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(reader_spec, m) {
  m.def("short_attention(Tensor query, Tensor key, Tensor value, Tensor mask, float scaling) -> Tensor");
}

TORCH_LIBRARY_IMPL(reader_spec, CPU, m) { m.impl("short_attention", &short_attention); }
