// y = x @ W.T (+ bias) for a few rows of x, with W stored in column blocks: w[b, k, c] = W[32 b + c, k].
//
// A verification pass multiplies 1 to ~64 rows by every weight matrix: bandwidth-bound below ~10 rows,
// compute-bound above. Each block of 32 output columns is read once from memory, kept in L2, and
// multiplied by every row of x, each row's 32 sums held in registers over the whole of K. Summation
// runs over k in order for every row whatever the number of rows, so a token's output does not
// depend on what else is in the pass.
// (int8 weights are multiplied in integers: integer_product.cpp.)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <unistd.h>
#include <vector>

#include "kernels.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using reader_spec::load;
using reader_spec::Vec16;

constexpr int64_t kBlock = 32;
#ifdef __AVX512F__
// How far ahead in a block a tile of R > 1 rows requests its weights (AVX-512 hosts, where it was
// measured): about the memory's latency ahead, so further for more rows, which spend longer on each k.
// One row requests nothing: it reads its block in order and the hardware's stream prefetcher keeps
// up. On AVX2 (an AMD EPYC, Zen 3) no tile requests its own block: the stream prefetcher alone made
// products of 2-16 rows 2-19% faster (docs/runner.md).
template <int R>
constexpr int64_t kPrefetchBytes = std::max<int64_t>(3072, 1024 * R);
#endif
#ifdef __AVX512F__
constexpr int kMaxRows = 12;  // 24 accumulators + 2 weight vectors of the 32 zmm registers
#else
// AVX2 (16 ymm registers, each Vec16 two of them): a whole block holds 3 rows of sums (12 registers,
// the weights taken from L1 by each multiply-add). A tile of 6 rows over one half of the block at a
// time holds more sums per weight loaded, but it reads the block from memory as every other cache
// line, and from memory 3 + 3 whole-block tiles were 10-15% faster at 5-6 rows (docs/runner.md).
constexpr int kMaxRows = 3;
#endif

// The share of the next block a tile brings into the caches while it multiplies this one from L2: the bytes
// from `bytes`, (step / 65536) of them per k. Without it, the first tile of each block waits on memory
// and the others leave memory idle, so a pass of more rows than one tile adds its memory time to its
// compute time instead of overlapping them.
struct NextBlock {
  const char* bytes = nullptr;  // nullptr: nothing to fetch
  int64_t step = 0;
};

// R rows of x times one block of 32 columns. `columns`: how many of its 32 columns exist (only the
// matrix's last block may be partial). Each column's sum is the same sequence of operations whatever R
// is: it only decides how many independent sums are in flight.
template <int R>
void tile(const float* x, int64_t ldx, const float* w, int64_t k_size, const float* bias, float* y, int64_t ldy,
          int64_t columns, const NextBlock& next = {}) {
  Vec16 sums[R][2];
  for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = Vec16{};
  for (int64_t k = 0; k < k_size; ++k) {
    if (next.bytes != nullptr) __builtin_prefetch(next.bytes + ((k * next.step) >> 16));
    const float* w_k = w + k * kBlock;
#ifdef __AVX512F__
    if constexpr (R > 1) {
      __builtin_prefetch(reinterpret_cast<const char*>(w_k) + kPrefetchBytes<R>);
      __builtin_prefetch(reinterpret_cast<const char*>(w_k) + kPrefetchBytes<R> + 64);
    }
#endif
    const Vec16 low = load(w_k), high = load(w_k + 16);  // columns 0..15 and 16..31
    for (int r = 0; r < R; ++r) {
      const float value = x[r * ldx + k];
      sums[r][0] += value * low;
      sums[r][1] += value * high;
    }
  }
  float shift[kBlock] = {};  // the bias, zero past `columns`
  if (bias != nullptr) std::memcpy(shift, bias, columns * sizeof(float));
  for (int r = 0; r < R; ++r) {
    float out[kBlock];
    std::memcpy(out, &sums[r][0], sizeof(Vec16));
    std::memcpy(out + 16, &sums[r][1], sizeof(Vec16));
    for (int c = 0; c < kBlock; ++c) out[c] += shift[c];  // after the sum, as a separate addition (F.linear's bias)
    std::memcpy(y + r * ldy, out, columns * sizeof(float));
  }
}

// `rows` (at most kMaxRows) rows times one block, through the tile that holds exactly that many rows.
template <int R = kMaxRows>
void rows_tile(int rows, const float* x, int64_t ldx, const float* w, int64_t k_size, const float* bias, float* y,
               int64_t ldy, int64_t columns, const NextBlock& next = {}) {
  if constexpr (R > 1) {
    if (rows < R) return rows_tile<R - 1>(rows, x, ldx, w, k_size, bias, y, ldy, columns, next);
  }
  tile<R>(x, ldx, w, k_size, bias, y, ldy, columns, next);
}

// How `rows` rows are cut into tiles, each at most kMaxRows. AVX-512: equal tiles (16 rows: two of 8,
// not 12 and 4). AVX2: tiles of 3 and the rest, where the rest would be one row the last two 2 + 2: a
// tile of one row waits on the latency of its 4 multiply-add chains, two tiles of 2 keep 8 in flight.
std::vector<int> tile_sizes(int64_t rows) {
  std::vector<int> sizes;
#ifdef __AVX512F__
  const int64_t tiles = (rows + kMaxRows - 1) / kMaxRows;
  for (int64_t t = 0; t < tiles; ++t) sizes.push_back(static_cast<int>((t + 1) * rows / tiles - t * rows / tiles));
#else
  for (; rows > 0; rows -= sizes.back()) sizes.push_back(static_cast<int>(std::min<int64_t>(rows, kMaxRows)));
  if (sizes.size() >= 2 && sizes.back() == 1) {
    sizes[sizes.size() - 2] = 2;
    sizes.back() = 2;
  }
#endif
  return sizes;
}

// Bytes of x that a thread's L2 holds beside the block it multiplies: half of the L2.
int64_t rows_bytes_in_l2() {
  static const int64_t bytes = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return static_cast<int64_t>(l2 > 0 ? l2 : 512 * 1024) / 2;
  }();
  return bytes;
}

// y = x @ W.T (+ bias) for `rows` rows of x side by side, every block of columns (in parallel) times
// every tile of rows. Many rows (a prompt's chunk) are taken a share at a time, as many tiles as L2
// holds beside a block, each share times every block: otherwise every block reads all of x, from L3
// once x outgrows L2 (512 rows of 576 features: 1.2 MB per block of 72 KB).
void product(const float* x_data, int64_t rows, const float* w_data, int64_t k_size, const float* bias_data,
             float* y_data, int64_t out_features) {
  const int64_t blocks = (out_features + kBlock - 1) / kBlock;
  const int64_t block_stride = k_size * kBlock;
  const std::vector<int> sizes = tile_sizes(rows);
  const int64_t tiles = static_cast<int64_t>(sizes.size());
  std::vector<int64_t> starts(tiles + 1, 0);
  for (int64_t t = 0; t < tiles; ++t) starts[t + 1] = starts[t] + sizes[t];
  const int64_t row_bytes = k_size * static_cast<int64_t>(sizeof(float));
  const int64_t tiles_per_share = std::max<int64_t>(1, rows_bytes_in_l2() / (row_bytes * kMaxRows));
  const int64_t block_bytes = block_stride * static_cast<int64_t>(sizeof(float));
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t first_tile = 0; first_tile < tiles; first_tile += tiles_per_share) {
      const int64_t last_tile = std::min(tiles, first_tile + tiles_per_share);
      const int64_t share_tiles = last_tile - first_tile;
      for (int64_t b = begin; b < end; ++b) {
        for (int64_t t = first_tile; t < last_tile; ++t) {
          // One tile reads its block from memory itself; several share the
          // fetching of this thread's next block.
          NextBlock next;
          if (share_tiles > 1 && b + 1 < end) {
            const int64_t share = block_bytes / share_tiles;
            next.bytes = reinterpret_cast<const char*>(w_data + (b + 1) * block_stride) + (t - first_tile) * share;
            next.step = (share << 16) / k_size;
          }
          const int64_t column = b * kBlock;
          rows_tile(sizes[t], x_data + starts[t] * k_size, k_size, w_data + b * block_stride, k_size,
                    bias_data == nullptr ? nullptr : bias_data + column, y_data + starts[t] * out_features + column,
                    out_features, std::min(kBlock, out_features - column), next);
        }
      }
    }
  });
}

at::Tensor blocked_linear(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                          int64_t out_features) {
  TORCH_CHECK(input.device().is_cpu() && weight.device().is_cpu(), "blocked_linear runs on the CPU");
  TORCH_CHECK(input.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "blocked_linear: float32 input and weight only");
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
  product(x.data_ptr<float>(), rows, weight.data_ptr<float>(), k_size, bias_data, y.data_ptr<float>(), out_features);
  return y.view(out_shape);
}

}  // namespace

namespace reader_spec {

void blocked_product(const float* x, int64_t rows, const float* weight, int64_t k_size, const float* bias, float* y,
                     int64_t out_features) {
  product(x, rows, weight, k_size, bias, y, out_features);
}

}  // namespace reader_spec

TORCH_LIBRARY(reader_spec, m) {
  m.def("blocked_linear(Tensor input, Tensor weight, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(reader_spec, CPU, m) { m.impl("blocked_linear", &blocked_linear); }
