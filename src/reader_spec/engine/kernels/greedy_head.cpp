// The output layer's greedy token per row: exactly argmax(blocked_linear(hidden, weight)) (the first of
// equal maxima, as torch.argmax), while reading the float32 matrix only for a few columns.
//
// Every logit is first approximated in integers: the matrix as int8 with a scale per column (w_j ~
// s_j q_j), the hidden state h in about 15 bits. With AVX-512 VNNI, whose byte products are the fastest,
// as two int8 levels with a scale each (h ~ a q1 + b q2, the second quantizing what the first left; one
// int8 level is not enough, a hidden state's few large features would set a scale too coarse for the
// rest); elsewhere as one int16 level (h ~ a q1) at up to 14 bits, as many as the int32 sums allow
// for K features: AVX2 multiplies int16 pairs (vpmaddwd) with half the instructions two byte levels
// take. Integer dot products are exact in any order; approx_j = s_j (a I1_j + b I2_j), the second
// level absent where there is one.
// The distance to the float32 logit is bounded per column (see greedy_head.py):
//   |exact_j - approx_j| <= norm * slack[j] + error * col_norm[j]
// norm: max(|h|, |a q1| + |b q2|); error: |h - (a q1 + b q2)| with 5% to spare. The best column's
// exact logit is at least max_j(approx_j - bound_j), so only columns whose approx_j + bound_j reaches
// that floor can win; the blocks that hold them are multiplied by the full product's own tile, so
// their logits are bitwise the full product's. A row that is not finite gets -1 (the caller takes the
// full product's argmax).
#include <ATen/ATen.h>
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
using reader_spec::kLanes;
using reader_spec::load;
using reader_spec::select;
using reader_spec::to_float;
using reader_spec::Vec16;

constexpr int64_t kBlock = 32;
constexpr int64_t kGroup = 4;  // k per lane of the integer product (4 bytes of weights per column)
#ifdef __AVX512VNNI__
using Level = int8_t;     // one feature of a level of the hidden state
using Group = int32_t;    // the 4 features of a group, as the products broadcast them
constexpr int kLevels = 2;
constexpr int kTileRows = 4;  // 4 rows x 2 levels x 32 columns: 16 zmm accumulators
#else
using Level = int16_t;
using Group = int64_t;
constexpr int kLevels = 1;
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

// A row's hidden state in integers and what bounds the approximation it gives.
struct QuantizedRow {
  float scale[kLevels];
  int32_t sum[kLevels];  // of the level's q: the products multiply unsigned weights (w + 128); takes the 128 back
  float norm = 0, error = 0;
  bool finite = true;
};

// Rows to kLevels levels, 4 features per Group (k in order, zero past k_size): q [rows][levels][groups].
std::vector<QuantizedRow> quantize_rows(const float* x, int64_t rows, int64_t k_size, int64_t groups,
                                        std::vector<Group>& q) {
  std::vector<QuantizedRow> quantized(rows);
  q.assign(rows * kLevels * groups, 0);
  const float limit = static_cast<float>(largest_level(k_size));
  std::vector<float> rest(k_size);
  std::vector<double> approx(k_size);
  for (int64_t r = 0; r < rows; ++r) {
    const float* h = x + r * k_size;
    QuantizedRow& row = quantized[r];
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
void integer_tile(const Group* q, int64_t groups, const uint8_t* w, const QuantizedRow* rows,
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
void integer_rows(int rows, const Group* q, int64_t groups, const uint8_t* w, const QuantizedRow* quantized,
                  int32_t (*sums)[kLevels][kBlock]) {
  if constexpr (R > 1) {
    if (rows < R) return integer_rows<R - 1>(rows, q, groups, w, quantized, sums);
  }
  integer_tile<R>(q, groups, w, quantized, sums);
}

// What may separate a column's approximate logit from its exact one (the bound above).
inline Vec16 bounds(const float* slack, const float* col_norm, int64_t j, float norm, float error) {
  return norm * load(slack + j) + error * load(col_norm + j);
}

// The columns of one row that can still hold the largest exact logit, in order.
void candidates_of(const float* approx, const float* slack, const float* col_norm, int64_t columns, float norm,
                   float error, std::vector<int64_t>& candidates) {
  const int64_t whole = columns / kLanes * kLanes;
  auto bound = [&](int64_t j) { return norm * slack[j] + error * col_norm[j]; };
  // The floor: the largest approx - bound (a maximum does not depend on the order it is taken in).
  Vec16 lows = Vec16{} - std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < whole; j += kLanes) {
    const Vec16 low = load(approx + j) - bounds(slack, col_norm, j, norm, error);
    lows = select(low > lows, low, lows);
  }
  float floor = -std::numeric_limits<float>::infinity();
  for (int lane = 0; lane < kLanes; ++lane) floor = std::max(floor, lows[lane]);
  for (int64_t j = whole; j < columns; ++j) floor = std::max(floor, approx[j] - bound(j));
  candidates.clear();
  for (int64_t j = 0; j < whole; j += kLanes) {
    const Int16 reach = load(approx + j) + bounds(slack, col_norm, j, norm, error) >= floor;
    Int16 none{};
    if (std::memcmp(&reach, &none, sizeof(reach)) == 0) continue;
    for (int lane = 0; lane < kLanes; ++lane) {
      if (reach[lane]) candidates.push_back(j + lane);
    }
  }
  for (int64_t j = whole; j < columns; ++j) {
    if (approx[j] + bound(j) >= floor) candidates.push_back(j);
  }
}

void check(const at::Tensor& t, at::ScalarType type, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == type && t.is_contiguous(), "greedy_tokens: ", what);
}

at::Tensor greedy_tokens(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& weight_int8,
                         const at::Tensor& scales, const at::Tensor& slack, const at::Tensor& col_norm,
                         int64_t out_features) {
  check(weight, at::kFloat, "weight must be a contiguous float32 [blocks, K, 32]");
  TORCH_CHECK(weight.dim() == 3 && weight.size(2) == kBlock, "greedy_tokens: weight must be [blocks, K, 32]");
  const int64_t blocks = weight.size(0), k_size = weight.size(1), groups = (k_size + kGroup - 1) / kGroup;
  check(weight_int8, at::kByte, "the int8 copy must be contiguous uint8 (w + 128)");
  TORCH_CHECK(weight_int8.dim() == 3 && weight_int8.size(0) == blocks && weight_int8.size(1) == groups &&
                  weight_int8.size(2) == kBlock * kGroup,
              "greedy_tokens: the int8 copy must be [blocks, ceil(K / 4), 128]");
  for (const at::Tensor* t : {&scales, &slack, &col_norm}) {
    check(*t, at::kFloat, "scales, slack and column norms must be contiguous float32");
    TORCH_CHECK(t->numel() >= out_features, "greedy_tokens: one scale, slack and norm per column");
  }
  TORCH_CHECK(out_features <= blocks * kBlock, "greedy_tokens: out_features exceeds the blocks");
  TORCH_CHECK(hidden.device().is_cpu() && hidden.scalar_type() == at::kFloat && hidden.size(-1) == k_size,
              "greedy_tokens: hidden must be float32 [..., K]");
  const at::Tensor x = hidden.reshape({-1, k_size}).contiguous();
  const int64_t rows = x.size(0);
  std::vector<Group> q;
  const std::vector<QuantizedRow> quantized = quantize_rows(x.data_ptr<float>(), rows, k_size, groups, q);

  // Approximate logits of every row, blocks of columns in parallel.
  std::vector<float> approx(rows * blocks * kBlock);
  const uint8_t* w8 = weight_int8.data_ptr<uint8_t>();
  const float* scale = scales.data_ptr<float>();
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    int32_t sums[kTileRows][kLevels][kBlock];
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t first = t * rows / tiles;
        const int count = static_cast<int>((t + 1) * rows / tiles - first);
        integer_rows(count, q.data() + first * kLevels * groups, groups, w8 + b * groups * kBlock * kGroup,
                     quantized.data() + first, sums);
        for (int r = 0; r < count; ++r) {
          const QuantizedRow& row = quantized[first + r];
          float* out = approx.data() + (first + r) * blocks * kBlock + b * kBlock;
          for (int64_t half = 0; half < kBlock; half += kLanes) {
            Vec16 hidden_sums = row.scale[0] * to_float(load(sums[r][0] + half));
            if constexpr (kLevels == 2) hidden_sums += row.scale[1] * to_float(load(sums[r][1] + half));
            const Vec16 logits = load(scale + b * kBlock + half) * hidden_sums;
            reader_spec::store(out + half, logits);
          }
        }
      }
    }
  });

  // Per row: the columns that can still be the largest, and their exact logits.
  at::Tensor tokens = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* token_data = tokens.data_ptr<int64_t>();
  const float* w_data = weight.data_ptr<float>();
  const float* slack_data = slack.data_ptr<float>();
  const float* norm_data = col_norm.data_ptr<float>();
  const int64_t block_stride = k_size * kBlock;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> candidates;
    for (int64_t r = begin; r < end; ++r) {
      const QuantizedRow& row = quantized[r];
      if (!row.finite) {
        token_data[r] = -1;
        continue;
      }
      const float* a = approx.data() + r * blocks * kBlock;
      candidates_of(a, slack_data, norm_data, out_features, row.norm, row.error, candidates);
      // Each candidate's block through the full product's own tile: its logits are bitwise the full
      // product's (read in order, a block costs less than gathering one column of it).
      int64_t best = -1, block = -1;
      float best_logit = 0, logits[kBlock];
      for (const int64_t j : candidates) {
        if (j / kBlock != block) {
          block = j / kBlock;
          reader_spec::blocked_product(x.data_ptr<float>() + r * k_size, 1, w_data + block * block_stride, k_size,
                                       nullptr, logits, std::min(kBlock, out_features - block * kBlock));
        }
        if (best < 0 || logits[j % kBlock] > best_logit) {
          best = j;
          best_logit = logits[j % kBlock];
        }
      }
      token_data[r] = best;
    }
  });
  return tokens;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(reader_spec, m) {
  m.def(
      "greedy_tokens(Tensor hidden, Tensor weight, Tensor weight_int8, Tensor scales, Tensor slack, Tensor col_norm, "
      "int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(reader_spec, CPU, m) { m.impl("greedy_tokens", &greedy_tokens); }
