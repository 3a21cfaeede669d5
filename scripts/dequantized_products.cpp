// Would the float32 target read its weights from their exact 4-bit copy? The default model's 120 layer
// products timed three ways, with bitwise the same sums.
//
// The default model is a GGUF Q4_1 file: every layer weight is d * q + m with q in 0..15 and d, m
// float16, which float32 holds exactly (d * q is exact, so fma(d, q, m) rounds once, as the loader's
// d * q + m does). A product could therefore read 5 bits a weight instead of 32 and convert each weight
// to float before the float32 tile's multiply-adds, in the tile's order: the same sums, bit for bit.
// "float32": tiles of at most 3 rows over blocks stored as two panels (the engine's layout, 424 MB).
// "block": each block of 32 columns converted from the engine's int4 layout (grouped_product.cpp)
// into a float32 buffer first (one thread's L2), then the same tiles. "registers": converted 16
// bytes at a time into registers and multiplied at once, tiles of at most 2 rows. The conversion is
// arithmetic that the stream of a few rows would otherwise leave idle, or not: on a Zen 1 host (128-bit
// units) it took about 12 ms of the 1-row product's 21 (docs/runner.md, "Session 69").
//
//     g++ -O3 -march=native -fopenmp scripts/dequantized_products.cpp -o /tmp/dequantized_products
//     OMP_NUM_THREADS=2 /tmp/dequantized_products   # fastest of 7 milliseconds by rows, 2 rounds
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <vector>

namespace {

constexpr long kMaxIn = 1536, kMaxOut = 3072, kMaxRows = 8;
constexpr long kGroupBytes = 512, kGroupHalves = 64;  // per block of 32 columns and group of 32 k
float* x;  // kMaxRows rows of kMaxIn
float* y;  // kMaxRows rows of kMaxOut

struct Matrix {
  float* panels;      // [2 x blocks, in, 16]
  uint8_t* nibbles;   // [blocks, in / 32, 512]: per pair of k, 32 bytes (grouped_product.cpp's layout)
  uint16_t* halves;   // [blocks, in / 32, 64]: the group's 32 scales, then its 32 minimums (float16)
  long in, out;
};

double seconds() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// R rows times one block stored as two panels: each column's sum over k in order, by multiply-adds.
template <int R>
void tile(const float* x_rows, long k_size, const float* w, float* y_rows) {
  __m256 sums[R][4];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) sums[r][j] = _mm256_setzero_ps();
  }
  const float* second = w + k_size * 16;
  for (long k = 0; k < k_size; ++k) {
    __m256 a = _mm256_load_ps(w + k * 16), b = _mm256_load_ps(w + k * 16 + 8);
    __m256 c = _mm256_load_ps(second + k * 16), d = _mm256_load_ps(second + k * 16 + 8);
    __asm__("" : "+x"(a), "+x"(b), "+x"(c), "+x"(d));
    for (int r = 0; r < R; ++r) {
      const __m256 v = _mm256_broadcast_ss(x_rows + r * kMaxIn + k);
      sums[r][0] = _mm256_fmadd_ps(v, a, sums[r][0]);
      sums[r][1] = _mm256_fmadd_ps(v, b, sums[r][1]);
      sums[r][2] = _mm256_fmadd_ps(v, c, sums[r][2]);
      sums[r][3] = _mm256_fmadd_ps(v, d, sums[r][3]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(y_rows + r * kMaxOut + 8 * j, sums[r][j]);
  }
}

// Half h of a pair's 32 bytes as four vectors of 8 columns' weights: columns 8h.. at k and k + 1
// (low nibbles), columns 16 + 8h.. at k and k + 1 (high nibbles), each fma(d, q, m).
inline void convert(const uint8_t* half_bytes, const uint16_t* halves, int h, __m256 (&w)[4]) {
  const __m128i low = _mm_set1_epi8(0x0f);
  const __m128i by_k = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(half_bytes));
  const __m128i lo = _mm_shuffle_epi8(_mm_and_si128(v, low), by_k);
  const __m128i hi = _mm_shuffle_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), low), by_k);
  const auto* scales = reinterpret_cast<const __m128i*>(halves);
  const __m256 d_lo = _mm256_cvtph_ps(_mm_loadu_si128(scales + h)), m_lo = _mm256_cvtph_ps(_mm_loadu_si128(scales + 4 + h));
  const __m256 d_hi = _mm256_cvtph_ps(_mm_loadu_si128(scales + 2 + h)), m_hi = _mm256_cvtph_ps(_mm_loadu_si128(scales + 6 + h));
  auto as_float = [](__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); };
  w[0] = _mm256_fmadd_ps(d_lo, as_float(lo), m_lo);
  w[1] = _mm256_fmadd_ps(d_lo, as_float(_mm_srli_si128(lo, 8)), m_lo);
  w[2] = _mm256_fmadd_ps(d_hi, as_float(hi), m_hi);
  w[3] = _mm256_fmadd_ps(d_hi, as_float(_mm_srli_si128(hi, 8)), m_hi);
}

// f(k, h, w) for every half h of every pair of k (k, k + 1) of one block, converted (see convert).
template <typename F>
void for_each_half(const uint8_t* nibbles, const uint16_t* halves, long k_size, F f) {
  for (long g = 0; g < k_size / 32; ++g) {
    for (long pair = 0; pair < 16; ++pair) {
      for (int h = 0; h < 2; ++h) {
        __m256 w[4];
        convert(nibbles + g * kGroupBytes + pair * 32 + 16 * h, halves + g * kGroupHalves, h, w);
        f(g * 32 + 2 * pair, h, w);
      }
    }
  }
}

// One block from the int4 layout to two float32 panels ([2][k][16]).
void dequantize(const uint8_t* nibbles, const uint16_t* halves, long k_size, float* w) {
  float* second = w + k_size * 16;
  for_each_half(nibbles, halves, k_size, [&](long k, int h, const __m256 (&v)[4]) {
    _mm256_store_ps(w + k * 16 + 8 * h, v[0]);
    _mm256_store_ps(w + (k + 1) * 16 + 8 * h, v[1]);
    _mm256_store_ps(second + k * 16 + 8 * h, v[2]);
    _mm256_store_ps(second + (k + 1) * 16 + 8 * h, v[3]);
  });
}

// R rows times one block converted in registers: the same multiply-adds in the same order as `tile`.
template <int R>
void register_tile(const uint8_t* nibbles, const uint16_t* halves, long k_size, const float* x_rows,
                   float* y_rows) {
  __m256 sums[R][4];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) sums[r][j] = _mm256_setzero_ps();
  }
  for_each_half(nibbles, halves, k_size, [&](long k, int h, const __m256 (&w)[4]) {
    for (int r = 0; r < R; ++r) {
      const __m256 v0 = _mm256_broadcast_ss(x_rows + r * kMaxIn + k);
      const __m256 v1 = _mm256_broadcast_ss(x_rows + r * kMaxIn + k + 1);
      sums[r][h] = _mm256_fmadd_ps(v0, w[0], sums[r][h]);
      sums[r][2 + h] = _mm256_fmadd_ps(v0, w[2], sums[r][2 + h]);
      sums[r][h] = _mm256_fmadd_ps(v1, w[1], sums[r][h]);
      sums[r][2 + h] = _mm256_fmadd_ps(v1, w[3], sums[r][2 + h]);
    }
  });
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(y_rows + r * kMaxOut + 8 * j, sums[r][j]);
  }
}

enum class Way { kFloat32, kBlock, kRegisters };

void run(const std::vector<Matrix>& matrices, int rows, Way way) {
  for (const Matrix& m : matrices) {
    const long blocks = m.out / 32, groups = m.in / 32;
#pragma omp parallel
    {
      static thread_local std::vector<float> buffer(kMaxIn * 32 + 16);  // one a thread, kept
      float* converted = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
#pragma omp for schedule(static)
      for (long b = 0; b < blocks; ++b) {
        const uint8_t* nibbles = m.nibbles + b * groups * kGroupBytes;
        const uint16_t* halves = m.halves + b * groups * kGroupHalves;
        const float* w = m.panels + b * m.in * 32;
        if (way == Way::kBlock) {
          dequantize(nibbles, halves, m.in, converted);
          w = converted;
        }
        const int most = way == Way::kRegisters ? 2 : 3;
        for (int first = 0; first < rows; first += most) {
          const int count = std::min(most, rows - first);
          const float* x_rows = x + first * kMaxIn;
          float* y_rows = y + first * kMaxOut + b * 32;
          if (way == Way::kRegisters) {
            count == 1 ? register_tile<1>(nibbles, halves, m.in, x_rows, y_rows)
                       : register_tile<2>(nibbles, halves, m.in, x_rows, y_rows);
          } else if (count == 1) {
            tile<1>(x_rows, m.in, w, y_rows);
          } else if (count == 2) {
            tile<2>(x_rows, m.in, w, y_rows);
          } else {
            tile<3>(x_rows, m.in, w, y_rows);
          }
        }
      }
    }
  }
}

}  // namespace

int main() {
  std::vector<Matrix> matrices;
  const long shapes[4][2] = {{576, 960}, {576, 576}, {576, 3072}, {1536, 576}};  // in, out: qkv, o, gate/up, down
  for (int layer = 0; layer < 30; ++layer) {
    for (const auto& shape : shapes) {
      Matrix m{nullptr, nullptr, nullptr, shape[0], shape[1]};
      const long units = (m.out / 32) * (m.in / 32);
      m.nibbles = static_cast<uint8_t*>(aligned_alloc(64, units * kGroupBytes));
      m.halves = static_cast<uint16_t*>(aligned_alloc(64, units * kGroupHalves * 2));
      m.panels = static_cast<float*>(aligned_alloc(64, m.out * m.in * 4));
      for (long i = 0; i < units * kGroupBytes; ++i) m.nibbles[i] = static_cast<uint8_t>(rand());
      for (long i = 0; i < units * kGroupHalves; ++i) m.halves[i] = static_cast<uint16_t>(0x2000 + (rand() & 0x3ff));
      for (long b = 0; b < m.out / 32; ++b) {
        dequantize(m.nibbles + b * (m.in / 32) * kGroupBytes, m.halves + b * (m.in / 32) * kGroupHalves, m.in,
                   m.panels + b * m.in * 32);
      }
      matrices.push_back(m);
    }
  }
  x = static_cast<float*>(aligned_alloc(64, kMaxRows * kMaxIn * 4));
  y = static_cast<float*>(aligned_alloc(64, kMaxRows * kMaxOut * 4));
  for (long i = 0; i < kMaxRows * kMaxIn; ++i) x[i] = rand() / static_cast<float>(RAND_MAX) - 0.5f;
  std::vector<float> reference(kMaxRows * kMaxOut);
  for (int round = 0; round < 2; ++round) {
    for (int rows : {1, 2, 3, 4, 6, 8}) {
      double best[3] = {1e9, 1e9, 1e9};
      bool same = true;
      for (int repeat = 0; repeat < 7; ++repeat) {
        for (Way way : {Way::kFloat32, Way::kBlock, Way::kRegisters}) {
          const double start = seconds();
          run(matrices, rows, way);
          best[static_cast<int>(way)] = std::min(best[static_cast<int>(way)], seconds() - start);
          if (way == Way::kFloat32) std::memcpy(reference.data(), y, reference.size() * 4);
          else same = same && std::memcmp(reference.data(), y, rows * kMaxOut * 4) == 0;  // the last matrix's
        }
      }
      printf("rows %d: float32 %.2f ms, block %.2f ms, registers %.2f ms%s\n", rows, best[0] * 1e3, best[1] * 1e3,
             best[2] * 1e3, same ? "" : "  (sums differ!)");
    }
  }
}
