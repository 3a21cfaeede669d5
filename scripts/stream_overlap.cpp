// Does a core's arithmetic hide under its memory stream? The simplest streaming product, timed.
//
// A layer product at batch 1 reads every weight once and multiplies it by each of the pass's rows:
// one row is bound by memory, and a few more rows add arithmetic that, on an ideal machine, hides
// under the stream until it takes as long as the stream itself. Here 106M floats (the default model's
// layer weights) are streamed on all OpenMP threads, each 8 floats multiplied into R rows' sums (R = 1
// to 8), from memory ("mem") and from a 768 KB buffer read again and again ("hot", in the L2
// caches: the arithmetic alone). Where mem(R) stays near mem(1) while hot(R) < mem(1), arithmetic
// overlaps the stream; where mem(R) grows with hot(R), the two add up, and every extra row of a
// verification pass costs time. "mem, 4 streams" reads each thread's share as 4 parts far apart, 128
// bytes of each in turn (as a kernel would read 4 column blocks in lockstep; the sums are shared, so
// this is no product): on a Zen 1 host a core then keeps more of memory's requests in flight, and 1-3
// rows took 20-35% less time than from one stream (docs/runner.md, "Session 67"; exact products read
// that way: scripts/lockstep_tiles.cpp).
//
//     g++ -O3 -march=native -fopenmp scripts/stream_overlap.cpp -o /tmp/stream_overlap
//     OMP_NUM_THREADS=2 /tmp/stream_overlap        # prints fastest-of-5 milliseconds by R, 3 rounds
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>

namespace {

constexpr long kFloats = 106L * 1000 * 1000;
constexpr long kHotFloats = 192L * 1000;  // 384 KB a thread on 2 threads: in a 512 KB L2
constexpr int kChains = 4;  // independent sums per row: 8 floats each

double seconds() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// Every thread streams its share of w as S parts read in turn, 8 * kChains floats of each; each 8
// floats are multiplied into R rows' sums.
template <int R, int S>
float stream(const float* w, long n, const float* x) {
  float total = 0;
#pragma omp parallel reduction(+ : total)
  {
    const long begin = n * omp_get_thread_num() / omp_get_num_threads();
    const long end = n * (omp_get_thread_num() + 1) / omp_get_num_threads();
    const long part = (end - begin) / S / (8 * kChains) * (8 * kChains);
    __m256 sums[R][kChains];
    for (auto& row : sums)
      for (auto& s : row) s = _mm256_setzero_ps();
    for (long i = 0; i < part; i += 8 * kChains) {
      for (int s = 0; s < S; ++s) {
        const float* p = w + begin + s * part + i;
        for (int c = 0; c < kChains; ++c) {
          const __m256 weights = _mm256_load_ps(p + 8 * c);
          for (int r = 0; r < R; ++r) sums[r][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r), weights, sums[r][c]);
        }
      }
    }
    float lanes[8];
    for (auto& row : sums) {
      for (auto& s : row) {
        _mm256_storeu_ps(lanes, s);
        for (float lane : lanes) total += lane;
      }
    }
  }
  return total;
}

using Stream = float (*)(const float*, long, const float*);
template <int S>
constexpr Stream kByRows[] = {stream<1, S>, stream<2, S>, stream<3, S>, stream<4, S>,
                              stream<5, S>, stream<6, S>, stream<7, S>, stream<8, S>};

// Fastest of 5 of streaming kFloats floats at each R, from `w` of `size` floats (read kFloats / size
// times), as S streams a thread.
template <int S>
void row_times(const char* label, const float* w, long size, const float* x) {
  std::printf("%s", label);
  float sink = 0;
  for (int r = 0; r < 8; ++r) {
    double best = 1e9;
    for (int round = 0; round < 5; ++round) {
      const double start = seconds();
      for (long done = 0; done < kFloats; done += size) sink += kByRows<S>[r](w, size, x);
      best = std::min(best, seconds() - start);
    }
    std::printf(" %d:%.1f", r + 1, best * 1e3);
  }
  std::printf(sink == 0.5f ? " \n" : "\n");  // the sums are used, so no product is optimized away
}

}  // namespace

int main() {
  float* w = static_cast<float*>(std::aligned_alloc(64, kFloats * sizeof(float)));
  for (long i = 0; i < kFloats; ++i) w[i] = 1e-3f * static_cast<float>(i % 7);
  float x[8];
  for (int r = 0; r < 8; ++r) x[r] = 0.5f + r;
  std::printf("%d threads; ms by rows R\n", omp_get_max_threads());
  for (int round = 0; round < 3; ++round) {
    row_times<1>("mem", w, kFloats, x);
    row_times<4>("mem, 4 streams", w, kFloats, x);
    row_times<1>("hot", w, kHotFloats, x);
  }
  std::free(w);
}
