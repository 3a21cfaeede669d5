// What the compiled files share: each routine is defined once (blocked_linear.cpp, layer_ops.cpp), so
// the ops and the decoder layer that call it run the same machine code, and a token's arithmetic is
// the same whichever of them computes it.
#pragma once

#include <cstdint>
#include <cstring>

namespace reader_spec {

// Sixteen lanes of 32 bits (one AVX-512 register; two AVX2 ones), in GCC's portable vector types.
constexpr int kLanes = 16;
typedef float Vec16 __attribute__((vector_size(64)));
typedef int32_t Int16 __attribute__((vector_size(64)));

inline Vec16 load(const float* p) {
  Vec16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, Vec16 v) { std::memcpy(p, &v, sizeof(v)); }

// y = x @ W.T (+ bias) for `rows` rows of x side by side (`k_size` floats each), W in column blocks
// ([blocks, k_size, 32]); int8 weights are multiplied by one scale per column.
void blocked_product(const float* x, int64_t rows, const float* weight, int64_t k_size, const float* bias, float* y,
                     int64_t out_features);
void blocked_product(const float* x, int64_t rows, const int8_t* weight, int64_t k_size, const float* scales,
                     const float* bias, float* y, int64_t out_features);

// Row by row: hidden += delta (where delta is not null), normed = weight * hidden / rms(hidden).
void add_rms_norm_rows(float* hidden, const float* delta, const float* weight, float epsilon, int64_t rows,
                       int64_t features, float* normed);

// Row by row: out = silu(gate) * up (rows of gate and up `stride` floats apart, out's `features`).
void silu_mul_rows(const float* gate, const float* up, int64_t stride, int64_t rows, int64_t features, float* out);

// A layer's KV cache, [rows, kv_heads, capacity, head_dim] for keys and values alike.
struct CacheView {
  float* keys;
  float* values;
  int64_t rows, kv_heads, capacity, head_dim;

  int64_t offset(int64_t row, int64_t kv_head, int64_t position) const {
    return ((row * kv_heads + kv_head) * capacity + position) * head_dim;
  }
};

// One token: its query and key heads (side by side in `query_key`) rotated by (cos, sin) of head_dim
// each; queries into `query_out`, keys and values (side by side in `value`) into the cache at (row,
// position).
void rotary_store_token(const float* query_key, const float* value, const float* cos, const float* sin,
                        int64_t query_heads, const CacheView& cache, int64_t row, int64_t position,
                        float* query_out);

// Which keys a token sees: row `b * width + offset` of `visible` ([trees, width, kv_length] booleans)
// for token t of tree b at `offset`; its keys and values lie in cache row `row`.
struct Visibility {
  const bool* visible;
  int64_t width, kv_length;
  const int64_t* token_tree;
  const int64_t* token_offset;
  const int64_t* token_row;
};

// Attention of `tokens` queries ([tokens, heads, head_dim]) on the cache, as `visibility` says;
// `softcap` 0 for none. out: [tokens, heads, head_dim].
void attend(const float* query, int64_t tokens, int64_t heads, const CacheView& cache, const Visibility& visibility,
            float scaling, float softcap, float* out);

}  // namespace reader_spec
