// Would reading several column blocks in lockstep make draft rows cheap on this CPU? The default
// model's 120 layer products timed four ways, with exact sums per column in all.
//
// "[k, 32]": blocks of 32 columns stored [k, 32] (the engine's layout before session 68), each thread's
// blocks one after another, tiles of at most 3 rows (4 registers of sums a row, as AVX2's whole-block
// tiles are cut). "panels": the same tiles over blocks stored as two panels of 16 columns ([2, k, 16],
// the engine's layout since session 68), so each block is read as two streams of whole 64-byte lines.
// "far xS" and "adjacent xS": panels S at a time (6 / 3 / 2 for 1 / 2 / 3+ rows), from parts of the
// thread's share far apart or side by side, tiles of R rows x S panels x 2 registers (at most 12 sums);
// rows past 3 take a second tile over the same panels, from L2. On a Zen 1 host one stream a core
// leaves memory idle while the core multiplies; several streams keep it busy (docs/runner.md,
// "Session 67" and "Session 68", and scripts/stream_overlap.cpp).
//
//     g++ -O3 -march=native -fopenmp scripts/lockstep_tiles.cpp -o /tmp/lockstep_tiles
//     OMP_NUM_THREADS=2 /tmp/lockstep_tiles       # fastest of 7 by rows, every way, 2 rounds
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <vector>

namespace {

constexpr long kMaxIn = 1536, kMaxOut = 3072, kMaxRows = 8;
float* x;  // kMaxRows rows of kMaxIn
float* y;  // kMaxRows rows of kMaxOut

struct Matrix {
  float* w;
  long in, out;
};

double seconds() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// R rows (from row r0) times S blocks of 8 x P columns, every column's sum over k in order.
template <int R, int S, int P>
void tile(const float* const* w, long in, const long* column, int r0) {
  __m256 sums[S][R][P];  // every loop over them unrolled, so that they stay in registers
#pragma GCC unroll 8
  for (int b = 0; b < S; ++b)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) sums[b][r][p] = _mm256_setzero_ps();
  for (long k = 0; k < in; ++k) {
#pragma GCC unroll 8
    for (int b = 0; b < S; ++b) {
      __m256 weights[P];
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) weights[p] = _mm256_load_ps(w[b] + (k * P + p) * 8);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 value = _mm256_broadcast_ss(x + (r0 + r) * kMaxIn + k);
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) sums[b][r][p] = _mm256_fmadd_ps(value, weights[p], sums[b][r][p]);
      }
    }
  }
#pragma GCC unroll 8
  for (int b = 0; b < S; ++b)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) _mm256_storeu_ps(y + (r0 + r) * kMaxOut + column[b] + 8 * p, sums[b][r][p]);
}

// R rows times the N blocks group, group + stride, ... of 8 x P columns, in tiles of at most 3 rows.
template <int R, int N, int P>
void tiles(const Matrix& m, long group, long stride) {
  const float* w[N];
  long column[N];
  for (int b = 0; b < N; ++b) {
    const long block = group + b * stride;
    w[b] = m.w + block * m.in * 8 * P;
    column[b] = block * 8 * P;
  }
  for (int r0 = 0; r0 < R; r0 += 3) {
    if (R - r0 >= 3) tile<3, N, P>(w, m.in, column, r0);
    else if (R - r0 == 2) tile<2, N, P>(w, m.in, column, r0);
    else tile<1, N, P>(w, m.in, column, r0);
  }
}

// R rows over blocks of 8 x P columns, S at a time: from parts far apart, or side by side (kAdjacent).
template <int R, int S, int P, bool kAdjacent = false>
void product(const Matrix& m) {
  const long blocks = m.out / (8 * P);
#pragma omp parallel
  {
    const long first = blocks * omp_get_thread_num() / omp_get_num_threads();
    const long last = blocks * (omp_get_thread_num() + 1) / omp_get_num_threads();
    const long per_part = (last - first) / S;
    for (long j = 0; j < per_part; ++j) {
      if (kAdjacent) tiles<R, S, P>(m, first + j * S, 1);
      else tiles<R, S, P>(m, first + j, per_part);
    }
    for (long block = first + per_part * S; block < last; ++block) tiles<R, 1, P>(m, block, 0);
  }
}

template <int R, int S>
void compare(const std::vector<Matrix>& wide, const std::vector<Matrix>& panels) {
  double best[4] = {1e9, 1e9, 1e9, 1e9};
  for (int round = 0; round < 7; ++round) {
    double start = seconds();
    for (const Matrix& m : wide) product<R, 1, 4>(m);
    best[0] = std::min(best[0], seconds() - start);
    start = seconds();
    for (const Matrix& m : panels) product<R, 2, 2, true>(m);
    best[1] = std::min(best[1], seconds() - start);
    start = seconds();
    for (const Matrix& m : panels) product<R, S, 2>(m);
    best[2] = std::min(best[2], seconds() - start);
    start = seconds();
    for (const Matrix& m : panels) product<R, S, 2, true>(m);
    best[3] = std::min(best[3], seconds() - start);
  }
  std::printf("%d rows: [k, 32] %.1f ms, panels %.1f (%.2fx), far x%d %.1f (%.2fx), adjacent x%d %.1f (%.2fx)\n", R,
              best[0] * 1e3, best[1] * 1e3, best[1] / best[0], S, best[2] * 1e3, best[2] / best[0], S,
              best[3] * 1e3, best[3] / best[0]);
}

}  // namespace

int main() {
  std::vector<Matrix> wide, panels;  // blocks stored [k, 32], and as panels
  const long shapes[4][2] = {{576, 960}, {576, 576}, {576, 3072}, {1536, 576}};  // qkv, o, gate+up, down
  for (int layer = 0; layer < 30; ++layer) {
    for (const auto& shape : shapes) {
      for (auto* matrices : {&wide, &panels}) {
        const long bytes = (shape[0] * shape[1] * 4 + (2 << 20) - 1) / (2 << 20) * (2 << 20);
        Matrix m{static_cast<float*>(std::aligned_alloc(2 << 20, bytes)), shape[0], shape[1]};
        for (long i = 0; i < shape[0] * shape[1]; ++i) m.w[i] = 1e-3f * static_cast<float>(i % 7);
        matrices->push_back(m);
      }
    }
  }
  x = static_cast<float*>(std::aligned_alloc(64, kMaxRows * kMaxIn * sizeof(float)));
  y = static_cast<float*>(std::aligned_alloc(64, kMaxRows * kMaxOut * sizeof(float)));
  for (long i = 0; i < kMaxRows * kMaxIn; ++i) x[i] = 0.5f + static_cast<float>(i % 3);
  std::printf("%d threads; the default model's 120 layer products, fastest of 7\n", omp_get_max_threads());
  for (int round = 0; round < 2; ++round) {
    compare<1, 6>(wide, panels);
    compare<2, 3>(wide, panels);
    compare<3, 2>(wide, panels);
    compare<4, 2>(wide, panels);
    compare<5, 2>(wide, panels);
    compare<6, 2>(wide, panels);
    compare<7, 2>(wide, panels);
    compare<8, 2>(wide, panels);
  }
}
