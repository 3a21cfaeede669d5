// y = x @ W.T (+ bias) for a few rows of x, with W stored in column blocks: w[b, k, c] = W[32 b + c, k].
//
// A verification pass multiplies 1 to ~64 rows by every weight matrix: bandwidth-bound below ~10 rows,
// compute-bound above. Each block of 32 output columns is read once from memory, kept in L2, and
// multiplied by every row of x, each row's 32 sums held in registers over the whole of K. Summation
// runs over k in order for every row whatever the number of rows, so a token's output does not
// depend on what else is in the pass.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kPrefetch = 24;  // rows of the block ahead (3 KB)
typedef float Vec16 __attribute__((vector_size(64)));
#ifdef __AVX512F__
constexpr int kMaxRows = 8;  // 16 accumulators + 2 weight vectors of the 32 zmm registers
#else
constexpr int kMaxRows = 3;  // AVX2: each Vec16 is two ymm registers
#endif

inline Vec16 load(const float* p) {
  Vec16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <int R>
void tile(const float* x, int64_t ldx, const float* w, int64_t k_size, const float* bias, float* y,
          int64_t ldy, int64_t columns) {
  Vec16 low[R], high[R];
  Vec16 bias_low = {}, bias_high = {};
  if (bias != nullptr) {
    float padded[kBlock] = {};
    std::memcpy(padded, bias, columns * sizeof(float));
    bias_low = load(padded);
    bias_high = load(padded + 16);
  }
  for (int r = 0; r < R; ++r) {
    low[r] = Vec16{};
    high[r] = Vec16{};
  }
  for (int64_t k = 0; k < k_size; ++k) {
    __builtin_prefetch(w + (k + kPrefetch) * kBlock);
    __builtin_prefetch(w + (k + kPrefetch) * kBlock + 16);
    const Vec16 w_low = load(w + k * kBlock);
    const Vec16 w_high = load(w + k * kBlock + 16);
    for (int r = 0; r < R; ++r) {
      const float value = x[r * ldx + k];
      low[r] += value * w_low;
      high[r] += value * w_high;
    }
  }
  for (int r = 0; r < R; ++r) {
    float out[kBlock];
    low[r] += bias_low;  // after the sum, as a separate addition (what F.linear's bias does)
    high[r] += bias_high;
    std::memcpy(out, &low[r], sizeof(Vec16));
    std::memcpy(out + 16, &high[r], sizeof(Vec16));
    std::memcpy(y + r * ldy, out, columns * sizeof(float));
  }
}

template <int R = kMaxRows>
void rows_tile(int rows, const float* x, int64_t ldx, const float* w, int64_t k_size, const float* bias,
               float* y, int64_t ldy, int64_t columns) {
  if constexpr (R > 1) {
    if (rows < R) return rows_tile<R - 1>(rows, x, ldx, w, k_size, bias, y, ldy, columns);
  }
  tile<R>(x, ldx, w, k_size, bias, y, ldy, columns);
}

at::Tensor blocked_linear(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                          int64_t out_features) {
  TORCH_CHECK(input.device().is_cpu() && weight.device().is_cpu(), "blocked_linear runs on the CPU");
  TORCH_CHECK(input.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "blocked_linear: float32 only");
  TORCH_CHECK(weight.dim() == 3 && weight.size(2) == kBlock && weight.is_contiguous(), "weight must be [blocks, K, 32]");
  const int64_t k_size = weight.size(1);
  TORCH_CHECK(input.size(-1) == k_size, "input has ", input.size(-1), " features, the weight ", k_size);
  TORCH_CHECK(out_features <= weight.size(0) * kBlock, "out_features exceeds the weight's blocks");
  const at::Tensor x = input.reshape({-1, k_size}).contiguous();
  const int64_t rows = x.size(0);
  auto out_shape = input.sizes().vec();
  out_shape.back() = out_features;
  at::Tensor y = at::empty({rows, out_features}, x.options());
  const float* bias_data = nullptr;
  at::Tensor bias_contiguous;
  if (bias.has_value() && bias->defined()) {
    bias_contiguous = bias->contiguous();
    TORCH_CHECK(bias_contiguous.numel() == out_features, "bias has the wrong size");
    bias_data = bias_contiguous.data_ptr<float>();
  }
  const float* x_data = x.data_ptr<float>();
  const float* w_data = weight.data_ptr<float>();
  float* y_data = y.data_ptr<float>();
  const int64_t blocks = (out_features + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t column = b * kBlock;
      const int64_t columns = std::min(kBlock, out_features - column);
      const float* w_block = w_data + b * k_size * kBlock;
      const float* block_bias = bias_data == nullptr ? nullptr : bias_data + column;
      for (int64_t r = 0; r < rows; r += kMaxRows) {
        const int n = static_cast<int>(std::min<int64_t>(kMaxRows, rows - r));
        rows_tile(n, x_data + r * k_size, k_size, w_block, k_size, block_bias, y_data + r * out_features + column,
                  out_features, columns);
      }
    }
  });
  return y.view(out_shape);
}

}  // namespace

TORCH_LIBRARY(reader_spec, m) {
  m.def("blocked_linear(Tensor input, Tensor weight, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(reader_spec, CPU, m) { m.impl("blocked_linear", &blocked_linear); }
