// The small operators between a layer's matrix products, each a single loop over the pass's rows.
//
// Every matrix product of a pass streams megabytes of weights through the caches, so the PyTorch
// operator that runs next finds its code and metadata evicted: on the development CPU a one-row
// RMSNorm took 50 us after a product against 9 us alone, a view 4.6 us against 0.7. At a few rows a
// pass is mostly that: norms, the gated activation, rotary embedding and cache writes cost more than
// the attention. Each op below replaces a chain of PyTorch operators by one call that touches little
// code. Rows are processed one at a time by the same code whatever their number, so a token's result
// does not depend on what else is in the pass (the lossless checks compare passes of any width).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int kLanes = 16;
typedef float Vec16 __attribute__((vector_size(64)));
typedef int32_t Int16 __attribute__((vector_size(64)));

inline Vec16 load(const float* p) {
  Vec16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, Vec16 v) { std::memcpy(p, &v, sizeof(v)); }

inline Vec16 splat(float value) { return Vec16{} + value; }

// exp(x) lane by lane (Cephes' single-precision polynomial, about 1 ulp): range-reduced by powers of
// two, which are put back through the exponent bits.
inline Vec16 exp16(Vec16 x) {
  x = x < splat(88.3762626647949f) ? x : splat(88.3762626647949f);
  x = x > splat(-88.3762626647949f) ? x : splat(-88.3762626647949f);
  const Vec16 scaled = x * 1.44269504088896341f + 0.5f;
  Int16 n = __builtin_convertvector(scaled, Int16);
  n += (Int16)(__builtin_convertvector(n, Vec16) > scaled);  // truncation to floor: -1 where above
  const Vec16 whole = __builtin_convertvector(n, Vec16);
  x = x - whole * 0.693359375f - whole * -2.12194440e-4f;
  Vec16 y = splat(1.9875691500e-4f);
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * (x * x) + x + 1.0f;
  const Int16 bits = (n + 127) << 23;
  Vec16 power;
  std::memcpy(&power, &bits, sizeof(power));
  return y * power;
}

void check_float_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
}

// hidden += delta (when given, in place), then Llama's RMSNorm of the result: weight * (h / rms(h)).
at::Tensor add_rms_norm(at::Tensor hidden, const c10::optional<at::Tensor>& delta, const at::Tensor& weight,
                        double epsilon) {
  check_float_cpu(hidden, "hidden");
  check_float_cpu(weight, "weight");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "hidden must be a contiguous [tokens, features]");
  const int64_t rows = hidden.size(0), features = hidden.size(1);
  TORCH_CHECK(weight.numel() == features, "weight has ", weight.numel(), " features, hidden ", features);
  at::Tensor added;
  if (delta.has_value() && delta->defined()) {
    check_float_cpu(*delta, "delta");
    TORCH_CHECK(delta->sizes() == hidden.sizes(), "delta and hidden differ in shape");
    added = delta->contiguous();
  }
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty_like(hidden);
  float* h = hidden.data_ptr<float>();
  const float* d = added.defined() ? added.data_ptr<float>() : nullptr;
  const float* wp = w.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t vectors = features / kLanes * kLanes;
  for (int64_t r = 0; r < rows; ++r) {
    float* row = h + r * features;
    if (d != nullptr) {
      const float* add = d + r * features;
      for (int64_t i = 0; i < features; ++i) row[i] += add[i];
    }
    Vec16 squares{};
    for (int64_t i = 0; i < vectors; i += kLanes) {
      const Vec16 v = load(row + i);
      squares += v * v;
    }
    float sum = 0;
    for (int lane = 0; lane < kLanes; ++lane) sum += squares[lane];
    for (int64_t i = vectors; i < features; ++i) sum += row[i] * row[i];
    const float inverse = 1.0f / std::sqrt(sum / static_cast<float>(features) + static_cast<float>(epsilon));
    float* normed = o + r * features;
    for (int64_t i = 0; i < features; ++i) normed[i] = wp[i] * (row[i] * inverse);
  }
  return out;
}

// silu(gate) * up: the two parts of the fused gate/up projection's output (views of its rows).
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  check_float_cpu(gate, "gate");
  check_float_cpu(up, "up");
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.stride(1) == 1 && up.stride(1) == 1,
              "gate and up must be [tokens, features] with contiguous rows");
  const int64_t rows = gate.size(0), features = gate.size(1);
  at::Tensor out = at::empty({rows, features}, gate.options());
  const float* g = gate.data_ptr<float>();
  const float* u = up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t vectors = features / kLanes * kLanes;
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate_row = g + r * gate.stride(0);
    const float* up_row = u + r * up.stride(0);
    float* row = o + r * features;
    for (int64_t i = 0; i < vectors; i += kLanes) {
      const Vec16 x = load(gate_row + i);
      store(row + i, x / (1.0f + exp16(-x)) * load(up_row + i));
    }
    for (int64_t i = vectors; i < features; ++i) row[i] = gate_row[i] / (1.0f + std::exp(-gate_row[i])) * up_row[i];
  }
  return out;
}

// Rotary embedding of every query and key head (x * cos + rotate_half(x) * sin), the rotated keys and
// the values written into the cache at (row, head, position) of each token; returns the rotated
// queries, [tokens, query_heads, head_dim].
at::Tensor rotary_store(const at::Tensor& query_key, const at::Tensor& value, const at::Tensor& cos,
                        const at::Tensor& sin, at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& rows,
                        const at::Tensor& positions, int64_t query_heads) {
  for (const at::Tensor& t : {query_key, value, cos, sin, key_cache, value_cache}) check_float_cpu(t, "operand");
  TORCH_CHECK(query_key.dim() == 3 && query_key.stride(2) == 1 && query_key.stride(1) == query_key.size(2),
              "query_key must be [tokens, heads, head_dim] with heads side by side");
  TORCH_CHECK(value.dim() == 3 && value.stride(2) == 1 && value.stride(1) == value.size(2),
              "value must be [tokens, kv_heads, head_dim] with heads side by side");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "caches must be contiguous [rows, kv_heads, capacity, head_dim]");
  const int64_t tokens = query_key.size(0), dim = query_key.size(2), half = dim / 2;
  const int64_t kv_heads = query_key.size(1) - query_heads;
  TORCH_CHECK(dim % 2 == 0 && kv_heads == value.size(1) && kv_heads == key_cache.size(1) &&
                  dim == key_cache.size(3) && value_cache.sizes() == key_cache.sizes(),
              "query_key, value and the caches disagree on heads or head_dim");
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  TORCH_CHECK(c.numel() == tokens * dim && s.numel() == tokens * dim, "cos and sin must be [tokens, head_dim]");
  const at::Tensor row_of = rows.to(at::kLong).contiguous(), position_of = positions.to(at::kLong).contiguous();
  TORCH_CHECK(row_of.numel() == tokens && position_of.numel() == tokens, "one row and position per token");
  const int64_t capacity = key_cache.size(2), cache_rows = key_cache.size(0);
  at::Tensor queries = at::empty({tokens, query_heads, dim}, query_key.options());
  const float* qk = query_key.data_ptr<float>();
  const float* v = value.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  const int64_t* rp = row_of.data_ptr<int64_t>();
  const int64_t* pp = position_of.data_ptr<int64_t>();
  float* q_out = queries.data_ptr<float>();
  float* keys = key_cache.data_ptr<float>();
  float* values = value_cache.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(rp[t] >= 0 && rp[t] < cache_rows && pp[t] >= 0 && pp[t] < capacity, "token outside the cache");
    const float* cos_t = cp + t * dim;
    const float* sin_t = sp + t * dim;
    for (int64_t head = 0; head < query_heads + kv_heads; ++head) {
      const float* x = qk + t * query_key.stride(0) + head * dim;
      const bool is_key = head >= query_heads;
      const int64_t kv_head = head - query_heads;
      float* out = is_key ? keys + ((rp[t] * kv_heads + kv_head) * capacity + pp[t]) * dim
                          : q_out + (t * query_heads + head) * dim;
      for (int64_t i = 0; i < half; ++i) {
        out[i] = x[i] * cos_t[i] - x[i + half] * sin_t[i];
        out[i + half] = x[i + half] * cos_t[i + half] + x[i] * sin_t[i + half];
      }
    }
    for (int64_t kv_head = 0; kv_head < kv_heads; ++kv_head) {
      std::memcpy(values + ((rp[t] * kv_heads + kv_head) * capacity + pp[t]) * dim,
                  v + t * value.stride(0) + kv_head * dim, dim * sizeof(float));
    }
  }
  return queries;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(reader_spec, m) {
  m.def("add_rms_norm(Tensor(a!) hidden, Tensor? delta, Tensor weight, float epsilon) -> Tensor");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def(
      "rotary_store(Tensor query_key, Tensor value, Tensor cos, Tensor sin, Tensor(a!) key_cache, "
      "Tensor(b!) value_cache, Tensor rows, Tensor positions, int query_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(reader_spec, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rotary_store", &rotary_store);
}
