// Products of weights quantized per group of 32 inputs of a column, as GGUF files store them
// (kernels.h): 4 bits, W[n][k] = d[n][g] q[n][k] + m[n][g] with q in 0..15 (Q4_1); or 8 bits,
// W[n][k] = d[n][g] q[n][k] with q in -127..127 (Q8_0); d and m float16. A matrix that came from such
// a file is stored exactly, at 5 or 8.5 bits a weight.
//
// A row of x is rounded once per product to int16 (one scale per row, the full 15 bits: a group's
// sums of 32 products stay far inside int32). Per group, the integer dot products of the row with
// each column are exact; the group then adds d * sum (+ m * the sum of the row's integers in the
// group) to a float accumulator, and the row's scale multiplies the total.
//
// Layout, per block of 32 columns and group of 32 k, 16 pairs of k:
// - 4 bits ([blocks, in / 32, 512] bytes): each pair 32 bytes; bytes 0-15 hold columns 0-7 in their
//   low nibbles and 16-23 in their high ones, bytes 16-31 columns 8-15 and 24-31, each column's two
//   k side by side (column 8 h + c, k j at byte 16 h + 2 c + j). Widened to int16, a half's 16 bytes
//   give 8 columns' k pairs twice (low nibbles, high nibbles).
// - 8 bits ([blocks, in / 32, 1024] bytes, signed): each pair 64 bytes, column c's k j at byte 2 c + j.
//   Widened to int16, each 16 bytes give 8 columns' k pairs.
// vpmaddwd turns 8 columns' k pairs into one int32 per column: no lanes to fold or reorder. With
// AVX-512 VNNI, vpdpwssd does the same for 16 columns and adds in the same instruction.
// Scales (and minimums) as float16 bits (held in int16 tensors), [blocks, in / 32, 64] for 4 bits (the
// group's 32 scales, then its 32 minimums) and [blocks, in / 32, 32] for 8 bits.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define READER_GROUPED_AVX512 1
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define READER_GROUPED_AVX2 1
#endif

namespace {

using reader_spec::kBlock;
constexpr int64_t kGroupK = reader_spec::kWeightGroup;  // k per scale (and minimum)
constexpr int64_t kPairs = kGroupK / 2;
#ifdef READER_GROUPED_AVX512
constexpr int kTileRows = 8;  // 8 rows x 32 columns of int32 sums in 16 of the 32 zmm registers
#else
constexpr int kTileRows = 3;  // AVX2: 3 rows x 32 columns of int32 sums in 12 of the 16 ymm registers
#endif
constexpr float kLargest = 32767;
constexpr int64_t kPrefetchBytes = 2048;

constexpr int64_t group_bytes(int bits) { return kBlock * kGroupK * bits / 8; }
constexpr int64_t group_halves(int bits) { return bits == 4 ? 2 * kBlock : kBlock; }  // (d, m) or d

// acc[r][c] += d[c] * (sum over the group's k of q[r][k] * w[c][k]) (+ m[c] * group_sum[r]), for R
// rows and one block of 32 columns, over all groups.
template <int Bits, int R>
void grouped_tile(const int16_t* q, int64_t k_size, const int32_t* sums, const uint8_t* w, const uint16_t* s,
                  float (*acc)[kBlock]) {
  constexpr int64_t kGroupBytes = group_bytes(Bits), kHalves = group_halves(Bits);
  const int64_t groups = k_size / kGroupK;
  for (int r = 0; r < R; ++r) std::fill(acc[r], acc[r] + kBlock, 0.0f);
#if defined(READER_GROUPED_AVX512)
  // A pair of k widened to int16 fills one zmm per 16 columns, and vpdpwssd multiplies and adds in
  // one instruction: a third of AVX2's instructions per row, so a tile holds 12 rows and the
  // weights' widening is shared by all of them. The integers and each column's float arithmetic are
  // AVX2's, lane for lane: the same results.
  constexpr int64_t kAhead = kPrefetchBytes / kGroupBytes;  // groups
  const __m512i low_nibbles = _mm512_set1_epi16(0x0f);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* bytes = w + g * kGroupBytes;
    const uint16_t* scales = s + g * kHalves;
    for (int64_t line = 0; line < kGroupBytes; line += 64) __builtin_prefetch(bytes + kPrefetchBytes + line);
    for (int64_t line = 0; line < 2 * kHalves; line += 64) __builtin_prefetch(scales + kAhead * kHalves + line / 2);
    __m512i dots[R][2];  // columns 0-15, 16-31
    for (int r = 0; r < R; ++r) dots[r][0] = dots[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 16  // rolled, GCC copies every sum through another register at each step
    for (int64_t pair = 0; pair < kPairs; ++pair) {
      const uint8_t* line = bytes + pair * (kGroupBytes / kPairs);
      __m512i weights[2];
      if constexpr (Bits == 4) {
        const __m512i widened = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(line)));
        weights[0] = _mm512_and_si512(widened, low_nibbles);
        weights[1] = _mm512_srli_epi16(widened, 4);
      } else {
        for (int j = 0; j < 2; ++j) {
          weights[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(line) + j));
        }
      }
      for (int r = 0; r < R; ++r) {
        int32_t two;
        std::memcpy(&two, q + r * k_size + g * kGroupK + 2 * pair, sizeof(two));
        const __m512i x = _mm512_set1_epi32(two);
        for (int j = 0; j < 2; ++j) dots[r][j] = _mm512_dpwssd_epi32(dots[r][j], weights[j], x);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 group_sum = _mm512_set1_ps(static_cast<float>(sums[r * groups + g]));
      for (int j = 0; j < 2; ++j) {
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales) + j));
        __m512 total = _mm512_loadu_ps(acc[r] + 16 * j);
        if constexpr (Bits == 4) {
          const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + kBlock) + j));
          total = _mm512_fmadd_ps(m, group_sum, total);
        }
        _mm512_storeu_ps(acc[r] + 16 * j, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(dots[r][j]), total));
      }
    }
  }
#elif defined(READER_GROUPED_AVX2)
  constexpr int64_t kAhead = kPrefetchBytes / kGroupBytes;  // groups
  const __m256i low_nibbles = _mm256_set1_epi16(0x0f);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* bytes = w + g * kGroupBytes;
    const uint16_t* scales = s + g * kHalves;
    for (int64_t line = 0; line < kGroupBytes; line += 64) __builtin_prefetch(bytes + kPrefetchBytes + line);
    for (int64_t line = 0; line < 2 * kHalves; line += 64) __builtin_prefetch(scales + kAhead * kHalves + line / 2);
    __m256i dots[R][4];  // columns 0-7, 8-15, 16-23, 24-31
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < 4; ++j) dots[r][j] = _mm256_setzero_si256();
    }
    for (int64_t pair = 0; pair < kPairs; ++pair) {
      const auto* line = reinterpret_cast<const __m128i*>(bytes + pair * (kGroupBytes / kPairs));
      __m256i weights[4];
      if constexpr (Bits == 4) {
        for (int half = 0; half < 2; ++half) {
          const __m256i widened = _mm256_cvtepu8_epi16(_mm_loadu_si128(line + half));
          weights[half] = _mm256_and_si256(widened, low_nibbles);
          weights[2 + half] = _mm256_srli_epi16(widened, 4);
        }
      } else {
        for (int j = 0; j < 4; ++j) weights[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(line + j));
      }
      for (int r = 0; r < R; ++r) {
        int32_t two;
        std::memcpy(&two, q + r * k_size + g * kGroupK + 2 * pair, sizeof(two));
        const __m256i x = _mm256_set1_epi32(two);
        for (int j = 0; j < 4; ++j) dots[r][j] = _mm256_add_epi32(dots[r][j], _mm256_madd_epi16(weights[j], x));
      }
    }
    // Each scale (and minimum) converted once for all rows.
    for (int j = 0; j < 4; ++j) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales) + j));
      const __m256 m = Bits == 4 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + kBlock) + j))
                                 : _mm256_setzero_ps();
      for (int r = 0; r < R; ++r) {
        __m256 total = _mm256_loadu_ps(acc[r] + 8 * j);
        if constexpr (Bits == 4) total = _mm256_fmadd_ps(m, _mm256_set1_ps(static_cast<float>(sums[r * groups + g])), total);
        _mm256_storeu_ps(acc[r] + 8 * j, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dots[r][j]), total));
      }
    }
  }
#else
  // The same integers by plain loops (the float sums may round differently).
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* bytes = w + g * kGroupBytes;
    const uint16_t* scales = s + g * kHalves;
    for (int r = 0; r < R; ++r) {
      int32_t dot[kBlock] = {};
      for (int64_t pair = 0; pair < kPairs; ++pair) {
        const int16_t* x = q + r * k_size + g * kGroupK + 2 * pair;
        if constexpr (Bits == 4) {
          for (int64_t b = 0; b < 32; ++b) {
            const uint8_t byte = bytes[pair * 32 + b];
            const int64_t column = 8 * (b / 16) + (b % 16) / 2;
            dot[column] += (byte & 0x0f) * x[b % 2];
            dot[16 + column] += (byte >> 4) * x[b % 2];
          }
        } else {
          for (int64_t b = 0; b < 64; ++b) dot[b / 2] += static_cast<int8_t>(bytes[pair * 64 + b]) * x[b % 2];
        }
      }
      for (int64_t c = 0; c < kBlock; ++c) {
        const float d = c10::detail::fp16_ieee_to_fp32_value(scales[c]);
        const float m = Bits == 4 ? c10::detail::fp16_ieee_to_fp32_value(scales[kBlock + c]) : 0.0f;
        acc[r][c] += m * static_cast<float>(sums[r * groups + g]) + d * static_cast<float>(dot[c]);
      }
    }
  }
#endif
}

template <int Bits, int R = kTileRows>
void grouped_rows(int rows, const int16_t* q, int64_t k_size, const int32_t* sums, const uint8_t* w,
                  const uint16_t* s, float (*acc)[kBlock]) {
  if constexpr (R > 1) {
    if (rows < R) return grouped_rows<Bits, R - 1>(rows, q, k_size, sums, w, s, acc);
  }
  grouped_tile<Bits, R>(q, k_size, sums, w, s, acc);
}

// y's columns of blocks [begin, end) for every row, in tiles of at most kTileRows rows.
template <int Bits>
void grouped_blocks(int64_t rows, const int16_t* q, const int32_t* sums, const float* row_scales,
                    const uint8_t* finite, const uint8_t* weight, const uint16_t* scales, int64_t k_size,
                    const float* bias, float* y, int64_t columns, int64_t begin, int64_t end) {
  const int64_t groups = k_size / kGroupK;
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
  float acc[kTileRows][kBlock];
  for (int64_t b = begin; b < end; ++b) {
    const int64_t count_columns = std::min(kBlock, columns - b * kBlock);
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t first = t * rows / tiles;
      const int count = static_cast<int>((t + 1) * rows / tiles - first);
      grouped_rows<Bits>(count, q + first * k_size, k_size, sums + first * groups,
                         weight + b * groups * group_bytes(Bits), scales + b * groups * group_halves(Bits), acc);
      for (int r = 0; r < count; ++r) {
        float* y_row = y + (first + r) * columns + b * kBlock;
        const float scale = row_scales[first + r];
        for (int64_t c = 0; c < count_columns; ++c) {
          y_row[c] = finite[first + r] ? scale * acc[r][c] + (bias != nullptr ? bias[b * kBlock + c] : 0.0f)
                                       : std::numeric_limits<float>::quiet_NaN();
        }
      }
    }
  }
}

}  // namespace

namespace reader_spec {

int64_t weight_group_bits(int64_t bytes_per_group) {
  TORCH_CHECK(bytes_per_group == group_bytes(4) || bytes_per_group == group_bytes(8),
              "grouped weights: ", group_bytes(4), " (4-bit) or ", group_bytes(8), " (8-bit) bytes per block and group, not ",
              bytes_per_group);
  return bytes_per_group == group_bytes(4) ? 4 : 8;
}

int64_t weight_group_halves(int64_t bits) { return group_halves(static_cast<int>(bits)); }

GroupedProduct::GroupedProduct(const float* x, int64_t rows, const uint8_t* weight, const uint16_t* scales,
                               int64_t k_size, int64_t bits, const float* bias, float* y, int64_t columns)
    : weight_(weight), scales_(scales), bias_(bias), y_(y), rows_(rows), k_size_(k_size), bits_(bits),
      columns_(columns), q_(rows * k_size), sums_(rows * (k_size / kGroupK)), row_scales_(rows), finite_(rows) {
  const int64_t groups = k_size / kGroupK;
  for (int64_t r = 0; r < rows; ++r) {
    int16_t* q = q_.data() + r * k_size;
    finite_[r] = round_row(x + r * k_size, k_size, kLargest, q, row_scales_[r]);
    for (int64_t g = 0; g < groups; ++g) {
      int32_t sum = 0;
      for (int64_t k = g * kGroupK; k < (g + 1) * kGroupK; ++k) sum += q[k];
      sums_[r * groups + g] = sum;
    }
  }
}

void GroupedProduct::multiply(int64_t begin, int64_t end) const {
  auto blocks = bits_ == 4 ? grouped_blocks<4> : grouped_blocks<8>;
  blocks(rows_, q_.data(), sums_.data(), row_scales_.data(), finite_.data(), weight_, scales_, k_size_, bias_, y_,
         columns_, begin, end);
}

void grouped_product(const float* x, int64_t rows, const uint8_t* weight, const uint16_t* scales, int64_t k_size,
                     int64_t bits, const float* bias, float* y, int64_t columns) {
  const GroupedProduct product(x, rows, weight, scales, k_size, bits, bias, y, columns);
  at::parallel_for(0, product.blocks(), 1, [&](int64_t begin, int64_t end) { product.multiply(begin, end); });
}

}  // namespace reader_spec

namespace {

// The bits of a weight and its scales in the layout above (checked), for an op named `op`.
int64_t checked_layout(const char* op, const at::Tensor& weight, const at::Tensor& scales, int64_t in_features) {
  TORCH_CHECK(in_features % kGroupK == 0, op, ": in_features must be a multiple of ", kGroupK);
  const int64_t groups = in_features / kGroupK;
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kByte && weight.is_contiguous() &&
                  weight.dim() == 3 && weight.size(1) == groups,
              op, ": the weight must be contiguous uint8 [blocks, in / 32, bytes per group]");
  const int64_t bits = reader_spec::weight_group_bits(weight.size(2));
  TORCH_CHECK(scales.device().is_cpu() && scales.scalar_type() == at::kShort && scales.is_contiguous() &&
                  scales.numel() == weight.size(0) * groups * group_halves(static_cast<int>(bits)),
              op, ": contiguous scales [blocks, in / 32, 64 (4-bit: scales, minimums) or 32 (8-bit)] "
              "(float16 bits as int16)");
  return bits;
}

// x @ W.T (+ bias) for weights quantized per group in the layout above (4 or 8 bits, told by the
// weight's last dimension), x in float32 of any shape [..., K].
at::Tensor grouped_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& bias, int64_t in_features, int64_t out_features) {
  const int64_t bits = checked_layout("grouped_linear", weight, scales, in_features);
  TORCH_CHECK(out_features <= weight.size(0) * kBlock, "grouped_linear: out_features exceeds the blocks");
  const auto* halves = reinterpret_cast<const uint16_t*>(scales.data_ptr<int16_t>());
  return reader_spec::rows_product("grouped_linear", input, bias, in_features, out_features,
                                   [&](const float* x, int64_t rows, const float* b, float* y) {
                                     reader_spec::grouped_product(x, rows, weight.data_ptr<uint8_t>(), halves,
                                                                  in_features, bits, b, y, out_features);
                                   });
}

// Rows W[token] of the plain matrix, dequantized (an embedding lookup in an output layer it is tied
// to): q * d + m per weight, as PackedLinear's PyTorch path computes it (q * d is exact, so the
// result does not depend on whether the compiler fuses the two), in one loop instead of a dozen
// indexing ops (a visible share of a one-token draft pass on a Zen 1 host; docs/runner.md,
// "the self-draft's passes; what this host's integer units cannot give").
at::Tensor dequantized_rows(const at::Tensor& weight, const at::Tensor& scales, const at::Tensor& tokens,
                            int64_t in_features) {
  const int64_t bits = checked_layout("grouped_rows", weight, scales, in_features);
  TORCH_CHECK(tokens.device().is_cpu() && tokens.scalar_type() == at::kLong, "grouped_rows: tokens must be CPU longs");
  const at::Tensor flat = tokens.contiguous().view(-1);
  const int64_t count = flat.numel(), groups = in_features / kGroupK, rows = weight.size(0) * kBlock;
  const int64_t bytes_per_group = group_bytes(static_cast<int>(bits)), halves_per_group = group_halves(static_cast<int>(bits));
  const int64_t* token = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(token[i] >= 0 && token[i] < rows, "grouped_rows: token ", token[i], " outside the ", rows, " rows");
  }
  std::vector<int64_t> shape(tokens.sizes().begin(), tokens.sizes().end());
  shape.push_back(in_features);
  at::Tensor out = at::empty(shape, tokens.options().dtype(at::kFloat));
  float* y = out.data_ptr<float>();
  const auto* halves = reinterpret_cast<const uint16_t*>(scales.data_ptr<int16_t>());
  for (int64_t i = 0; i < count; ++i) {
    const int64_t block = token[i] / kBlock, column = token[i] % kBlock;
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* bytes = weight.data_ptr<uint8_t>() + (block * groups + g) * bytes_per_group;
      const uint16_t* group_halves_of = halves + (block * groups + g) * halves_per_group;
      const float d = c10::detail::fp16_ieee_to_fp32_value(group_halves_of[column]);
      const float m = bits == 4 ? c10::detail::fp16_ieee_to_fp32_value(group_halves_of[kBlock + column]) : 0.0f;
      float* row = y + i * in_features + g * kGroupK;
      for (int64_t pair = 0; pair < kPairs; ++pair) {
        for (int64_t j = 0; j < 2; ++j) {
          float q;
          if (bits == 4) {  // column 16 h' + 8 h + c: byte 16 h + 2 c + j of the pair, nibble h'
            const int64_t in_half = column % 16;
            const uint8_t byte = bytes[pair * 32 + in_half / 8 * 16 + in_half % 8 * 2 + j];
            q = static_cast<float>((byte >> (column / 16 * 4)) & 15);
          } else {  // column c's k j at byte 2 c + j of the pair
            q = static_cast<float>(static_cast<int8_t>(bytes[pair * 64 + 2 * column + j]));
          }
          row[2 * pair + j] = q * d + m;
        }
      }
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(reader_spec, m) {
  m.def("grouped_linear(Tensor input, Tensor weight, Tensor scales, Tensor? bias, int in_features, int out_features) -> Tensor");
  m.def("grouped_rows(Tensor weight, Tensor scales, Tensor tokens, int in_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(reader_spec, CPU, m) {
  m.impl("grouped_linear", &grouped_linear);
  m.impl("grouped_rows", &dequantized_rows);
}
