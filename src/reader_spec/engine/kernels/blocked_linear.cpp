// y = x @ W.T (+ bias) for a few rows of x, with W stored in column blocks of two panels:
// w[2 b + h, k, c] = W[32 b + 16 h + c, k].
//
// A verification pass multiplies 1 to ~64 rows by every weight matrix: bandwidth-bound below ~10 rows,
// compute-bound above. Each block of 32 output columns is read once from memory, kept in L2 (or, a
// chunk of it at a time, in L1), and multiplied by every row of x, a tile of rows at a time with its
// sums in registers. Summation runs over k in order for every row whatever the number of rows, so a
// token's output does not depend on what else is in the pass.
// (int8 weights are multiplied in integers: integer_product.cpp.)
#include <ATen/core/Tensor.h>
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

using reader_spec::check_panels;
using reader_spec::kBlock;
using reader_spec::kPanel;
// How far ahead in a block a tile requests its weights, where it requests at all (the caller's `ahead`,
// timed per matrix shape and row count: weights.py). The requests fill L2 only (prefetcht2): into L1
// they would hold the few fill buffers that the hardware's own prefetcher streams through. On an
// Intel Xeon with AVX-512 (a stream of the default model's 120 layer products) 4-16 KB ahead made
// products of 2-12 rows, one tile, faster, and 32 KB did not; products of several tiles, which bring
// the next block in as they go (NextBlock), gained nothing
// (docs/runner.md, "Requests into L2, timed per row count").
constexpr int64_t kAheadBytes = 8192;

#ifdef __AVX512F__
constexpr int kMaxRows = 12;  // 24 accumulators + 2 weight vectors of the 32 zmm registers
constexpr int kWholeBlockRows = kMaxRows;
#else
// AVX2 (16 ymm registers, each Vec16 two of them): a whole block holds 3 rows of sums (12 registers
// and the weights, reloaded for every row); a product of more than kStreamRows rows takes one panel of
// each block at a time instead (panel_tiles), up to 7 rows of 16 sums (see panel_tile).
constexpr int kStreamTileRows = 3;
#ifdef __AVX__
constexpr int kMaxRows = 7;
constexpr int kWholeBlockRows = kStreamTileRows;
#else
constexpr int kMaxRows = 6;
constexpr int kWholeBlockRows = kMaxRows;  // no panel tiles: whole-block tiles of every size
#endif
// Up to this many rows a product is bound by reading its matrix more than by its arithmetic: there
// whole-block tiles of at most 3 rows, the first reading both panels from memory, beat panel tiles.
// At 7 rows, panel tiles (then 4 + 3) made passes cheaper than whole-block tiles (3 + 2 + 2) on a
// Zen 1 host (docs/runner.md, "blocks stored as two panels, 7-row panel tiles"). Before blocks were
// stored as panels, a half-block tile read every other cache line, and 7 rows ran faster in
// whole-block tiles on a Zen 3 host (docs/runner.md, "Tiles that read a block in order").
constexpr int kStreamRows = 6;
#endif

// The share of the next block a tile brings into the caches while it multiplies this one from L2: the bytes
// from `bytes`, (step / 65536) of them per k. Without it, the first tile of each block waits on memory
// and the others leave memory idle, so a pass of more rows than one tile adds its memory time to its
// compute time instead of overlapping them. With AVX-512 into L2 only (`prefetcht2`): into L1 as well,
// the next block's lines (72 KB against a 32 KB L1) evicted those of this block that its other tiles
// read, and passes of 13-16 tokens took longer (a Zen 4 host; docs/runner.md,
// "a Zen 4 host; requests ahead per row count on the whole pass"). AVX2's tiles of a few rows keep
// requesting into L1, as measured on Zen 3 when they were written.
#ifdef __AVX512F__
constexpr int kNextBlockLocality = 1;
#else
constexpr int kNextBlockLocality = 3;
#endif
struct NextBlock {
  const char* bytes = nullptr;  // nullptr: nothing to fetch
  int64_t step = 0;
};

// R rows of x times one block of 32 columns, its two panels read side by side. `columns`: how many of
// its 32 columns exist (only the matrix's last block may be partial). Each column's sum is the same
// sequence of operations whatever R is: it only decides how many independent sums are in flight.
template <int R>
void tile(const float* x, int64_t ldx, const float* w, int64_t k_size, const float* bias, float* y, int64_t ldy,
          int64_t columns, const NextBlock& next, bool ahead) {
  Vec16 sums[R][2];
  for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = Vec16{};
  const float* second_panel = w + k_size * kPanel;
  for (int64_t k = 0; k < k_size; ++k) {
    if (next.bytes != nullptr) __builtin_prefetch(next.bytes + ((k * next.step) >> 16), 0, kNextBlockLocality);
    const float* low_k = w + k * kPanel;
    const float* high_k = second_panel + k * kPanel;
    if (ahead) {  // see kAheadBytes: as far ahead in k as when a block's k step was two adjacent lines
      __builtin_prefetch(reinterpret_cast<const char*>(low_k) + kAheadBytes / 2, 0, 1);
      __builtin_prefetch(reinterpret_cast<const char*>(high_k) + kAheadBytes / 2, 0, 1);
    }
    const Vec16 low = load(low_k), high = load(high_k);  // columns 0..15 and 16..31
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

#if !defined(__AVX512F__) && defined(__AVX__)
// A product of more than kStreamRows rows on AVX2 (panel_tiles): its tiles take turns over one panel of
// the block at a time, each over all of k with its sums in registers, reading the panel from
// L2 (the block's first tile from memory), while their multiply-add steps request the thread's next
// block a line at a time, spread evenly over the block's steps of all tiles. So memory is read at the pace
// of the arithmetic all the time, not by the first tile of a block alone: the next block requested in
// bursts while the other tiles multiply from L2 left most requested lines to arrive late (a Zen 3
// host: a core keeps far more requests in flight when they are spread than in bursts, and the default
// model's layer products of 8-32 rows ran faster; docs/runner.md, "The AVX2 host once more"). Tiles
// that took turns over chunks of 64 k instead (8 KB, read again from L1) stored and reloaded their sums
// at every chunk and ran slower at 12-32 rows on a Zen 1 host (docs/runner.md,
// "AVX2 products of 8 rows and more keep their sums in registers"). A thread's last block requests
// nothing: past it lie another thread's blocks, or the end of the matrix (a block's worth of requests
// past the end made a product of 7 blocks several times slower on that host, same section). These
// products make their own requests: the caller's `ahead` does not apply.

// The next block's lines, one requested every (65536 / step) multiply-add steps: line (step x i) / 65536
// at the block's i-th step, counted over all its tiles and panels.
struct LineRequests {
  const char* bytes;  // nullptr: nothing to request (the thread's last block)
  int64_t step;
  int64_t first;  // the count of this tile's first step in this panel
};

constexpr int kRegisterWeightRows = 6;  // the most rows whose panel tile keeps both weight vectors in registers

// R rows times one panel (`count` of its 16 columns exist), plus bias: per k two weight vectors,
// R broadcasts and 2R multiply-adds (12 sums + 2 weights + 1 broadcast of the 16 registers at 6 rows;
// at 7 rows the 14 sums and the broadcast leave no register for the weights, which the multiply-adds
// then read from L1 themselves: one 7-row tile made the default model's layer products of 7 and of
// 13-14 rows faster than two or three tiles of at most 6 rows on a Zen 1 host; docs/runner.md,
// "blocks stored as two panels, 7-row panel tiles"). Each column's sum is the same sequence of
// operations as in `tile`.
template <int R>
void panel_tile(const float* x, int64_t ldx, const float* w, int64_t k_size, const float* bias, float* y, int64_t ldy,
                int64_t count, const LineRequests& requests) {
  using reader_spec::FloatPart;
  constexpr int kPart = kPanel / 2;
  FloatPart sums[R][2] = {};
  for (int64_t k = 0; k < k_size; ++k) {
    if (requests.bytes != nullptr) {
      __builtin_prefetch(requests.bytes + (((requests.first + k) * requests.step) >> 16) * 64, 0, kNextBlockLocality);
    }
    const float* w_k = w + k * kPanel;
    FloatPart low, high;
    std::memcpy(&low, w_k, sizeof(low));
    std::memcpy(&high, w_k + kPart, sizeof(high));
    // Both in registers where they fit: for tiles of up to 4 rows GCC otherwise folds the loads into
    // the multiply-adds, loading each weight R times, which made 4-row tiles slower from L1 on a Zen 3
    // host (docs/runner.md, "weights in registers, the floor in the passes' rounds"). An empty asm: no
    // instruction, no change in result.
    if constexpr (R <= kRegisterWeightRows) __asm__("" : "+x"(low), "+x"(high));
    for (int r = 0; r < R; ++r) {
      const float value = x[r * ldx + k];
      sums[r][0] += value * low;
      sums[r][1] += value * high;
    }
  }
  for (int r = 0; r < R; ++r) {
    float out[kPanel];
    std::memcpy(out, sums[r], sizeof(out));
    if (bias != nullptr) {
      for (int64_t c = 0; c < count; ++c) out[c] += bias[c];  // after the sum, as in `tile`
    }
    std::memcpy(y + r * ldy, out, count * sizeof(float));
  }
}

// panel_tile for `rows` (at most kMaxRows) rows.
template <int R = kMaxRows>
void rows_panel_tile(int rows, const float* x, int64_t ldx, const float* w, int64_t k_size, const float* bias, float* y,
                     int64_t ldy, int64_t count, const LineRequests& requests) {
  if constexpr (R > 1) {
    if (rows < R) return rows_panel_tile<R - 1>(rows, x, ldx, w, k_size, bias, y, ldy, count, requests);
  }
  panel_tile<R>(x, ldx, w, k_size, bias, y, ldy, count, requests);
}

// y = the tiles' rows x one block, a panel at a time, every tile of [first_tile, last_tile) over it in
// turn (the panel's lines stay in L1 and L2 between tiles), requesting `next_block` meanwhile.
void panel_tiles(const std::vector<int>& sizes, const std::vector<int64_t>& starts, int64_t first_tile,
                 int64_t last_tile, const float* x_data, int64_t k_size, const float* w, const float* bias,
                 float* y_data, int64_t ldy, int64_t columns, const char* next_block) {
  const int panels = columns > kPanel ? 2 : 1;
  const int64_t tiles = last_tile - first_tile;
  const int64_t lines = k_size * kBlock * static_cast<int64_t>(sizeof(float)) / 64;
  LineRequests requests{next_block, (lines << 16) / (panels * tiles * k_size), 0};
  for (int panel = 0; panel < panels; ++panel) {
    const int64_t count = std::min<int64_t>(kPanel, columns - panel * kPanel);
    for (int64_t t = 0; t < tiles; ++t) {
      requests.first = (panel * tiles + t) * k_size;
      const int64_t start = starts[first_tile + t];
      rows_panel_tile(sizes[first_tile + t], x_data + start * k_size, k_size, w + panel * k_size * kPanel, k_size,
                      bias == nullptr ? nullptr : bias + panel * kPanel, y_data + start * ldy + panel * kPanel, ldy,
                      count, requests);
    }
  }
}
#endif

// `rows` (at most kWholeBlockRows) rows times one block, through the tile that holds exactly that many rows.
template <int R = kWholeBlockRows>
void rows_tile(int rows, const float* x, int64_t ldx, const float* w, int64_t k_size, const float* bias, float* y,
               int64_t ldy, int64_t columns, const NextBlock& next, bool ahead) {
  if constexpr (R > 1) {
    if (rows < R) return rows_tile<R - 1>(rows, x, ldx, w, k_size, bias, y, ldy, columns, next, ahead);
  }
  tile<R>(x, ldx, w, k_size, bias, y, ldy, columns, next, ahead);
}

// How `rows` rows are cut into tiles: equal tiles of at most kMaxRows (16 rows: two of 8 on AVX-512,
// 6 + 5 + 5 on AVX2), except on AVX2 up to kStreamRows rows, whole-block tiles of 3 and the rest. There
// a tile of 1 to 4 rows waits on the latency of its multiply-adds, not their rate, so a last tile of 1
// row goes with the one before as 2 + 2 (4 rows: not 3 + 1).
std::vector<int> tile_sizes(int64_t rows) {
  std::vector<int> sizes;
#if !defined(__AVX512F__)
  if (rows <= kStreamRows) {
    for (; rows > 0; rows -= sizes.back()) sizes.push_back(static_cast<int>(std::min<int64_t>(rows, kStreamTileRows)));
    if (sizes.size() >= 2 && sizes.back() == 1) {
      sizes[sizes.size() - 2] = 2;
      sizes.back() = 2;
    }
    return sizes;
  }
#endif
  const int64_t tiles = (rows + kMaxRows - 1) / kMaxRows;
  for (int64_t t = 0; t < tiles; ++t) sizes.push_back(static_cast<int>((t + 1) * rows / tiles - t * rows / tiles));
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

}  // namespace

namespace reader_spec {

Product::Product(const float* x, int64_t rows, const float* w, int64_t k_size, const float* bias, float* y,
                 int64_t out_features, bool ahead)
    : x_(x), w_(w), bias_(bias), y_(y), k_size_(k_size), out_features_(out_features), ahead_(ahead), rows_(rows),
      sizes_(tile_sizes(rows)), starts_(sizes_.size() + 1, 0) {
  for (size_t t = 0; t < sizes_.size(); ++t) starts_[t + 1] = starts_[t] + sizes_[t];
  const int64_t row_bytes = k_size * static_cast<int64_t>(sizeof(float));
  tiles_per_share_ = std::max<int64_t>(1, rows_bytes_in_l2() / (row_bytes * kMaxRows));
}

// Many rows (a prompt's chunk) are taken a share at a time, as many tiles as L2 holds beside a block,
// each share times every block: otherwise every block reads all of x, from L3 once x outgrows L2 (512
// rows of 576 features: 1.2 MB per block of 72 KB).
void Product::multiply(int64_t begin, int64_t end) const {
  const int64_t tiles = static_cast<int64_t>(sizes_.size());
  const int64_t block_stride = k_size_ * kBlock;
  const int64_t block_bytes = block_stride * static_cast<int64_t>(sizeof(float));
  for (int64_t first_tile = 0; first_tile < tiles; first_tile += tiles_per_share_) {
    const int64_t last_tile = std::min(tiles, first_tile + tiles_per_share_);
    const int64_t share_tiles = last_tile - first_tile;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t column = b * kBlock;
      const float* bias = bias_ == nullptr ? nullptr : bias_ + column;
#if !defined(__AVX512F__) && defined(__AVX__)
      if (rows_ > kStreamRows) {
        const char* next_block = b + 1 < end ? reinterpret_cast<const char*>(w_ + (b + 1) * block_stride) : nullptr;
        panel_tiles(sizes_, starts_, first_tile, last_tile, x_, k_size_, w_ + b * block_stride, bias, y_ + column,
                    out_features_, std::min(kBlock, out_features_ - column), next_block);
        continue;
      }
#endif
      for (int64_t t = first_tile; t < last_tile; ++t) {
        // One tile reads its block from memory itself (prefetching a few k ahead); several share the
        // fetching of this thread's next block.
        NextBlock next;
        if (share_tiles > 1 && b + 1 < end) {
          const int64_t share = block_bytes / share_tiles;
          next.bytes = reinterpret_cast<const char*>(w_ + (b + 1) * block_stride) + (t - first_tile) * share;
          next.step = (share << 16) / k_size_;
        }
        rows_tile(sizes_[t], x_ + starts_[t] * k_size_, k_size_, w_ + b * block_stride, k_size_, bias,
                  y_ + starts_[t] * out_features_ + column, out_features_, std::min(kBlock, out_features_ - column),
                  next, ahead_);
      }
    }
  }
}

}  // namespace reader_spec

namespace {

at::Tensor blocked_linear(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                          int64_t out_features, bool ahead) {
  check_panels(weight, "blocked_linear");
  TORCH_CHECK(out_features <= weight.size(0) * kPanel, "blocked_linear: out_features exceeds the weight's blocks");
  const int64_t k_size = weight.size(1);
  return reader_spec::rows_product("blocked_linear", input, bias, k_size, out_features,
                                   [&](const float* x, int64_t rows, const float* b, float* y) {
                                     reader_spec::blocked_product(x, rows, weight.data_ptr<float>(), k_size, b, y,
                                                                  out_features, ahead);
                                   });
}

// Rows of the plain matrix, W[token] (an embedding lookup in an output layer it is tied to): each is
// a column of its panel, one float per k, 64 bytes apart. One loop over k for all tokens reads them
// as interleaved strided streams, faster than PyTorch's indexing (division, remainder, an indexed
// gather: docs/runner.md, "the host's bookkeeping around a pass and a step, cut further").
at::Tensor blocked_rows(const at::Tensor& weight, const at::Tensor& tokens) {
  check_panels(weight, "blocked_rows");
  TORCH_CHECK(tokens.device().is_cpu() && tokens.scalar_type() == at::kLong, "blocked_rows: tokens must be CPU longs");
  const at::Tensor flat = tokens.contiguous().view(-1);
  const int64_t count = flat.numel(), k_size = weight.size(1), rows = weight.size(0) * kPanel;
  const int64_t* token = flat.data_ptr<int64_t>();
  std::vector<const float*> columns(count);
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(token[i] >= 0 && token[i] < rows, "blocked_rows: token ", token[i], " outside the ", rows, " rows");
    columns[i] = weight.data_ptr<float>() + (token[i] / kPanel * k_size) * kPanel + token[i] % kPanel;
  }
  std::vector<int64_t> shape(tokens.sizes().begin(), tokens.sizes().end());
  shape.push_back(k_size);
  at::Tensor out = at::empty(shape, weight.options());
  float* y = out.data_ptr<float>();
  for (int64_t k = 0; k < k_size; ++k) {
    for (int64_t i = 0; i < count; ++i) y[i * k_size + k] = columns[i][k * kPanel];
  }
  return out;
}

}  // namespace

namespace reader_spec {

void blocked_product(const float* x, int64_t rows, const float* weight, int64_t k_size, const float* bias, float* y,
                     int64_t out_features, bool ahead) {
  const Product product(x, rows, weight, k_size, bias, y, out_features, ahead);
  at::parallel_for(0, product.blocks(), 1, [&](int64_t begin, int64_t end) { product.multiply(begin, end); });
}

}  // namespace

TORCH_LIBRARY(reader_spec, m) {
  m.def("blocked_linear(Tensor input, Tensor weight, Tensor? bias, int out_features, bool ahead=False) -> Tensor");
  m.def("blocked_rows(Tensor weight, Tensor tokens) -> Tensor");
}

TORCH_LIBRARY_IMPL(reader_spec, CPU, m) {
  m.impl("blocked_linear", &blocked_linear);
  m.impl("blocked_rows", &blocked_rows);
}
