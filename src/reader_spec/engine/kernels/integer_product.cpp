// Products of int8 weights in integers (kernels.h): the output layer's greedy head approximates every
// logit with them (greedy_head.cpp), and a draft model's matrices are multiplied by them
// (``int8_linear``), where converting each weight to float would cost more than reading it.
//
// The row of x is quantized once per product: with AVX-512 VNNI, whose byte products are the
// fastest, as two int8 levels (one int8 level is not enough: a few large features would set a scale
// too coarse for the rest); elsewhere as one int16 level of up to 14 bits, as many as the int32 sums
// allow for K features, since AVX2 multiplies int16 pairs (vpmaddwd) with half the instructions two
// byte levels take. The weights are stored as unsigned bytes (w + 128, VNNI's unsigned operand);
// 128 times the row's sum of integers is taken back at the end.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels.h"

#if defined(__AVX512VNNI__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using reader_spec::Int16;
using reader_spec::IntegerRow;
using reader_spec::kLanes;
using reader_spec::load;
using reader_spec::to_float;
using reader_spec::Vec16;

using reader_spec::kBlock;
constexpr int64_t kGroup = reader_spec::kIntegerGroup;  // k per lane of the products (4 bytes per column)
constexpr int kLevels = reader_spec::kIntegerLevels;
#ifdef __AVX512VNNI__
using Level = int8_t;         // one feature of a level of x
using Group = int32_t;        // the 4 features of a group, as the products broadcast them
constexpr int kTileRows = 4;  // 4 rows x 2 levels x 32 columns: 16 zmm accumulators
#else
using Level = int16_t;
using Group = int64_t;
#ifdef __AVX2__
constexpr int kTileRows = 2;  // 2 rows x 16 columns as 4 vectors of column pairs: 8 of the 16 ymm registers
#else
constexpr int kTileRows = 4;
#endif
#endif
constexpr int64_t kPrefetchBytes = 2048;

// The largest |q| of a level: 127 in int8; in int16, what keeps every sum over K features of the
// unsigned weights (w + 128 <= 255) times q within int32.
int32_t largest_level(int64_t k_size) {
  if constexpr (sizeof(Level) == 1) {
    return 127;
  } else {
    return static_cast<int32_t>(std::min<int64_t>(32767, std::numeric_limits<int32_t>::max() / (255 * k_size)));
  }
}

// Rows to kLevels levels, 4 features per Group (k in order, zero past k_size): q [rows][levels][groups].
// `bounds`: also each row's norm and error (the greedy head's bound; a product alone needs neither).
std::vector<IntegerRow> quantize_rows(const float* x, int64_t rows, int64_t k_size, int64_t groups,
                                      std::vector<Group>& q, bool bounds) {
  std::vector<IntegerRow> quantized(rows);
  q.assign(rows * kLevels * groups, 0);
  const float limit = static_cast<float>(largest_level(k_size));
  // A product alone in one level (AVX2): no remainder to carry, no bound; the same integers as below
  // at a third of the work (it ran on one thread before each product, a visible share of a one-token
  // draft pass: docs/model-drafter.md, "a cheaper draft level").
  if constexpr (kLevels == 1) {
    if (!bounds) {
      for (int64_t r = 0; r < rows; ++r) {
        IntegerRow& row = quantized[r];
        int16_t* values = reinterpret_cast<int16_t*>(q.data() + r * groups);  // one level: Level is int16_t
        row.finite = reader_spec::round_row(x + r * k_size, k_size, limit, values, row.scale[0]);
        row.sum[0] = 0;
        for (int64_t k = 0; k < k_size; ++k) row.sum[0] += values[k];
      }
      return quantized;
    }
  }
  std::vector<float> rest(k_size);
  std::vector<double> approx(k_size);
  for (int64_t r = 0; r < rows; ++r) {
    const float* h = x + r * k_size;
    IntegerRow& row = quantized[r];
    double squares = 0;
    for (int64_t k = 0; k < k_size; ++k) squares += static_cast<double>(h[k]) * h[k];
    if (!std::isfinite(squares)) {
      row.finite = false;
      continue;
    }
    std::copy(h, h + k_size, rest.begin());
    std::fill(approx.begin(), approx.end(), 0.0);
    double level_norms = 0;
    for (int level = 0; level < kLevels; ++level) {
      float largest = 0;
      for (int64_t k = 0; k < k_size; ++k) largest = std::max(largest, std::fabs(rest[k]));
      const float scale = largest / limit;
      row.scale[level] = scale;
      row.sum[level] = 0;
      Level* values = reinterpret_cast<Level*>(q.data() + (r * kLevels + level) * groups);
      double level_squares = 0;
      for (int64_t k = 0; k < k_size && scale > 0; ++k) {
        const float value = std::clamp(std::nearbyint(rest[k] / scale), -limit, limit);
        values[k] = static_cast<Level>(value);
        row.sum[level] += values[k];
        const double part = static_cast<double>(scale) * value;  // exact: 24 x 16 bits
        approx[k] += part;
        level_squares += part * part;
        rest[k] = static_cast<float>(h[k] - approx[k]);
      }
      level_norms += std::sqrt(level_squares);
    }
    if (!bounds) continue;
    double error_squares = 0;
    for (int64_t k = 0; k < k_size; ++k) error_squares += (h[k] - approx[k]) * (h[k] - approx[k]);
    row.norm = static_cast<float>(std::max(std::sqrt(squares), level_norms));
    row.error = static_cast<float>(1.05 * std::sqrt(error_squares));
  }
  return quantized;
}
// sums[r][level][c] = sum over k of q[r][level][k] * w[c][k] for R rows and one block of 32 columns;
// w: the block's unsigned bytes (w + 128) in groups of 4 k per column, [groups][32][4]. VNNI and AVX2
// multiply the unsigned bytes and take 128 times the row's sum of q back at the end.
template <int R>
void integer_tile(const Group* q, int64_t groups, const uint8_t* w, const IntegerRow* rows,
                  int32_t (*sums)[kLevels][kBlock]) {
#ifdef __AVX512VNNI__
  __m512i acc[R][kLevels][2];
  for (int r = 0; r < R; ++r) {
    for (int level = 0; level < kLevels; ++level) acc[r][level][0] = acc[r][level][1] = _mm512_setzero_si512();
  }
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* bytes = w + g * kBlock * kGroup;
    __builtin_prefetch(bytes + kPrefetchBytes);
    __builtin_prefetch(bytes + kPrefetchBytes + 64);
    const __m512i low = _mm512_loadu_si512(bytes), high = _mm512_loadu_si512(bytes + 64);
    for (int r = 0; r < R; ++r) {
      for (int level = 0; level < kLevels; ++level) {
        const __m512i x = _mm512_set1_epi32(q[(r * kLevels + level) * groups + g]);
        acc[r][level][0] = _mm512_dpbusd_epi32(acc[r][level][0], low, x);
        acc[r][level][1] = _mm512_dpbusd_epi32(acc[r][level][1], high, x);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int level = 0; level < kLevels; ++level) {
      const __m512i offset = _mm512_set1_epi32(128 * rows[r].sum[level]);
      _mm512_storeu_si512(sums[r][level], _mm512_sub_epi32(acc[r][level][0], offset));
      _mm512_storeu_si512(sums[r][level] + 16, _mm512_sub_epi32(acc[r][level][1], offset));
    }
  }
#elif defined(__AVX2__)
  if constexpr (R == 1) {
    // One row (a draft model's chain): the whole block in one sweep, 8 accumulators, so each weight
    // byte is read once; two sweeps of half a block took longer (docs/model-drafter.md,
    // "a cheaper draft level").
    __m256i acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_si256();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* bytes = w + g * kBlock * kGroup;
      __builtin_prefetch(bytes + kPrefetchBytes);
      __builtin_prefetch(bytes + kPrefetchBytes + 64);
      const __m256i x = _mm256_set1_epi64x(q[g]);
      for (int j = 0; j < 8; ++j) {
        const __m256i weights = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes) + j));
        acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(weights, x));
      }
    }
    int32_t pairs[8][8];
    for (int j = 0; j < 8; ++j) _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs[j]), acc[j]);
    const int32_t offset = 128 * rows[0].sum[0];
    for (int c = 0; c < kBlock; ++c) sums[0][0][c] = pairs[c / 4][2 * (c % 4)] + pairs[c / 4][2 * (c % 4) + 1] - offset;
    return;
  }
  // vpmaddwd multiplies int16 pairs and adds each pair into an int32: a group's 16 bytes of 4 columns
  // widened to int16 ([c0 k0..k3, c1 k0..k3, ...]) times the row's 4 q repeated give each column's
  // sums of (k0, k1) and of (k2, k3) side by side, added at the end. Half a block at a time (16
  // columns: 4 vectors per row), the second half reading the block again from L1.
  for (int half = 0; half < 2; ++half) {
    __m256i acc[R][4];
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_si256();
    }
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* bytes = w + g * kBlock * kGroup + half * kBlock * kGroup / 2;
      if (half == 0) {  // both halves' lines: the second half reads them after the whole K
        __builtin_prefetch(bytes + kPrefetchBytes);
        __builtin_prefetch(bytes + kPrefetchBytes + 64);
      }
      __m256i weights[4];
      for (int j = 0; j < 4; ++j) {
        weights[j] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes) + j));
      }
      for (int r = 0; r < R; ++r) {
        const __m256i x = _mm256_set1_epi64x(q[r * groups + g]);
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_add_epi32(acc[r][j], _mm256_madd_epi16(weights[j], x));
      }
    }
    for (int r = 0; r < R; ++r) {
      int32_t pairs[4][8];
      for (int j = 0; j < 4; ++j) _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs[j]), acc[r][j]);
      const int32_t offset = 128 * rows[r].sum[0];
      for (int c = 0; c < kBlock / 2; ++c) {
        sums[r][0][half * kBlock / 2 + c] = pairs[c / 4][2 * (c % 4)] + pairs[c / 4][2 * (c % 4) + 1] - offset;
      }
    }
  }
#else
  // The same integers by plain vector code: each lane's 4 bytes unpacked, 128 taken off each weight.
  (void)rows;
  Int16 acc[R][kLevels][2] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* bytes = w + g * kBlock * kGroup;
    const int32_t* words = reinterpret_cast<const int32_t*>(bytes);
    const Int16 packed[2] = {load(words), load(words + kLanes)};
    for (int i = 0; i < 4; ++i) {
      Int16 weights[2];
      for (int half = 0; half < 2; ++half) weights[half] = ((packed[half] >> (8 * i)) & 0xff) - 128;
      for (int r = 0; r < R; ++r) {
        for (int level = 0; level < kLevels; ++level) {
          const int32_t x = reinterpret_cast<const Level*>(q + (r * kLevels + level) * groups + g)[i];
          for (int half = 0; half < 2; ++half) acc[r][level][half] += weights[half] * x;
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int level = 0; level < kLevels; ++level) {
      for (int half = 0; half < 2; ++half) reader_spec::store(sums[r][level] + half * kLanes, acc[r][level][half]);
    }
  }
#endif
}

template <int R = kTileRows>
void integer_rows(int rows, const Group* q, int64_t groups, const uint8_t* w, const IntegerRow* quantized,
                  int32_t (*sums)[kLevels][kBlock]) {
  if constexpr (R > 1) {
    if (rows < R) return integer_rows<R - 1>(rows, q, groups, w, quantized, sums);
  }
  integer_tile<R>(q, groups, w, quantized, sums);
}


}  // namespace

namespace reader_spec {

std::vector<IntegerRow> integer_product(const float* x, int64_t rows, const uint8_t* weight, int64_t k_size,
                                        const float* scales, const float* bias, float* y, int64_t ldy,
                                        int64_t columns, bool bounds, RowPruning* pruning) {
  const int64_t groups = (k_size + kGroup - 1) / kGroup, blocks = (columns + kBlock - 1) / kBlock;
  std::vector<Group> q;
  const std::vector<IntegerRow> quantized = quantize_rows(x, rows, k_size, groups, q, bounds);
  if (pruning != nullptr) pruning->start(quantized);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    int32_t sums[kTileRows][kLevels][kBlock];
    float out[kBlock];
    // The rows this share computes, their integers and quantization: all rows, or once pruning has
    // dropped some, copies of the active ones side by side (the tiles read consecutive rows).
    std::vector<int64_t> live(rows);
    for (int64_t r = 0; r < rows; ++r) live[r] = r;
    const Group* live_q = q.data();
    const IntegerRow* live_rows = quantized.data();
    std::vector<Group> kept_q;
    std::vector<IntegerRow> kept_rows;
    int64_t seen_drops = 0;
    for (int64_t b = begin; b < end; ++b) {
      if (pruning != nullptr && pruning->dropped() != seen_drops) {
        seen_drops = pruning->dropped();
        live.clear();
        kept_q.clear();
        kept_rows.clear();
        for (int64_t r = 0; r < rows; ++r) {
          if (!pruning->active(r)) continue;
          live.push_back(r);
          kept_q.insert(kept_q.end(), q.begin() + r * kLevels * groups, q.begin() + (r + 1) * kLevels * groups);
          kept_rows.push_back(quantized[r]);
        }
        live_q = kept_q.data();
        live_rows = kept_rows.data();
      }
      const int64_t count_rows = static_cast<int64_t>(live.size());
      const int64_t count_columns = std::min(kBlock, columns - b * kBlock);
      const int64_t tiles = (count_rows + kTileRows - 1) / kTileRows;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t first = t * count_rows / tiles;
        const int count = static_cast<int>((t + 1) * count_rows / tiles - first);
        integer_rows(count, live_q + first * kLevels * groups, groups, weight + b * groups * kBlock * kGroup,
                     live_rows + first, sums);
        for (int r = 0; r < count; ++r) {
          const IntegerRow& row = live_rows[first + r];
          float* y_row = y + live[first + r] * ldy + b * kBlock;
          if (!row.finite) {  // inf or NaN in x: no integers say anything of it
            std::fill(y_row, y_row + count_columns, std::numeric_limits<float>::quiet_NaN());
            continue;
          }
          for (int64_t half = 0; half < kBlock; half += kLanes) {
            Vec16 row_sums = row.scale[0] * to_float(load(sums[r][0] + half));
            if constexpr (kLevels == 2) row_sums += row.scale[1] * to_float(load(sums[r][1] + half));
            reader_spec::store(out + half, load(scales + b * kBlock + half) * row_sums);
          }
          if (bias != nullptr) {
            for (int64_t c = 0; c < count_columns; ++c) out[c] += bias[b * kBlock + c];
          }
          std::memcpy(y_row, out, count_columns * sizeof(float));
        }
      }
      if (pruning != nullptr) pruning->block_done(b, live.data(), count_rows);
    }
  });
  return quantized;
}

}  // namespace reader_spec

namespace {

// x @ W.T (+ bias) for int8 weights in the integer product's layout, x in float32 of any shape [..., K].
at::Tensor int8_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias, int64_t in_features, int64_t out_features) {
  const int64_t groups = (in_features + kGroup - 1) / kGroup;
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kByte && weight.is_contiguous() &&
                  weight.dim() == 3 && weight.size(1) == groups && weight.size(2) == kBlock * kGroup,
              "int8_linear: the weight must be contiguous uint8 [blocks, ceil(in / 4), 128]");
  TORCH_CHECK(out_features <= weight.size(0) * kBlock, "int8_linear: out_features exceeds the blocks");
  TORCH_CHECK(scales.device().is_cpu() && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() >= weight.size(0) * kBlock,
              "int8_linear: one contiguous float32 scale per stored column");
  return reader_spec::rows_product("int8_linear", input, bias, in_features, out_features,
                                   [&](const float* x, int64_t rows, const float* b, float* y) {
                                     reader_spec::integer_product(x, rows, weight.data_ptr<uint8_t>(), in_features,
                                                                  scales.data_ptr<float>(), b, y, out_features,
                                                                  out_features, false);
                                   });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(reader_spec, m) {
  m.def("int8_linear(Tensor input, Tensor weight, Tensor scales, Tensor? bias, int in_features, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(reader_spec, CPU, m) { m.impl("int8_linear", &int8_linear); }
