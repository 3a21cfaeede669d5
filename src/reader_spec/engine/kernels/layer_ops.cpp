// The small operators between a layer's matrix products, each a single loop over the pass's rows.
//
// Every matrix product of a pass streams megabytes of weights through the caches, so the PyTorch
// operator that runs next finds its code and metadata evicted: on the development CPU a one-row
// RMSNorm or a view took several times as long after a product as alone (docs/runner.md,
// "The operators between the products"). At a few rows a pass is mostly that: norms, the gated
// activation, rotary embedding and cache writes cost more than the attention. Each op below
// replaces a chain of PyTorch operators by one call that touches little
// code. Rows are processed one at a time by the same code whatever their number, so a token's result
// does not depend on what else is in the pass (the lossless checks compare passes of any width).
//
// Attention is here too: PyTorch's CPU kernel costs many times its arithmetic at one query token
// (docs/runner.md, "Whole layers in one call, and a compiled attention"), and its result for a query
// may depend on the other queries of the call.
// `attend` computes each (token, head) alone: scores over the token's visible keys in cache order,
// softmax, then the values' weighted sum in the same order, each a fixed sequence of operations. A
// tree's token sees its context and its ancestors, which are the keys the same token sees in plain
// decoding, in the same order: its output is bitwise what plain decoding computes.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels.h"

namespace {

using reader_spec::bits_as_float;
using reader_spec::Int16;
using reader_spec::kLanes;
using reader_spec::load;
using reader_spec::select;
using reader_spec::store;
using reader_spec::to_float;
using reader_spec::to_int;
using reader_spec::Vec16;

inline Vec16 splat(float value) { return Vec16{} + value; }

// The first `count` (< 16) floats at p, zeros after.
inline Vec16 load_partial(const float* p, int64_t count) {
  float lanes[kLanes] = {};
  std::memcpy(lanes, p, count * sizeof(float));
  return load(lanes);
}

// exp(x) lane by lane (Cephes' single-precision polynomial, about 1 ulp): range-reduced by powers of
// two, which are put back through the exponent bits.
__attribute__((always_inline)) inline Vec16 exp16(Vec16 x) {
  x = select(x < 88.3762626647949f, x, splat(88.3762626647949f));
  x = select(x > -88.3762626647949f, x, splat(-88.3762626647949f));
  const Vec16 scaled = x * 1.44269504088896341f + 0.5f;
  Int16 n = to_int(scaled);
  n += to_float(n) > scaled;  // truncation to floor: -1 where above
  const Vec16 whole = to_float(n);
  x = x - whole * 0.693359375f - whole * -2.12194440e-4f;
  Vec16 y = splat(1.9875691500e-4f);
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * (x * x) + x + 1.0f;
  const Int16 bits = (n + 127) << 23;
  return y * bits_as_float(bits);
}

// The sum of each of 16 vectors' lanes, as one vector (lane j: the sum of sums[j]), by a fixed tree
// of pairwise additions: a value depends only on its own vector, never on the other fifteen. The
// vectors come as `Folded`: where the tree's first round adds within a vector (AVX2: its two halves),
// `fold` does it as each vector is made, which spares storing and reloading it whole.
#ifdef __AVX512F__
using Folded = Vec16;
inline Folded fold(const Vec16& v) { return v; }

inline Vec16 lane_sums(const Folded (&sums)[16]) {
  Vec16 halves[8], quarters[4], eighths[2];
  for (int i = 0; i < 8; ++i) {  // lanes 0-7: vector 2i's halves added, 8-15: vector 2i+1's
    const Vec16 a = sums[2 * i], b = sums[2 * i + 1];
    halves[i] = __builtin_shuffle(a, b, Int16{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
                __builtin_shuffle(a, b, Int16{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
  }
  for (int i = 0; i < 4; ++i) {
    const Vec16 a = halves[2 * i], b = halves[2 * i + 1];
    quarters[i] = __builtin_shuffle(a, b, Int16{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}) +
                  __builtin_shuffle(a, b, Int16{4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31});
  }
  for (int i = 0; i < 2; ++i) {
    const Vec16 a = quarters[2 * i], b = quarters[2 * i + 1];
    eighths[i] = __builtin_shuffle(a, b, Int16{0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29}) +
                 __builtin_shuffle(a, b, Int16{2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31});
  }
  return __builtin_shuffle(eighths[0], eighths[1], Int16{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}) +
         __builtin_shuffle(eighths[0], eighths[1], Int16{1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31});
}
#elif defined(__AVX__)
// The same tree on the struct's two 8-lane halves: first each vector's halves added (lane l: s[l] +
// s[l+8]: the fold), then the three shuffle rounds above on eight lanes.
using Folded = reader_spec::FloatPart;
inline Folded fold(const Vec16& v) { return v.part[0] + v.part[1]; }

inline Vec16 lane_sums(const Folded (&halves)[16]) {
  using reader_spec::FloatPart;
  using reader_spec::IntPart;
  FloatPart quarters[8], eighths[4];
  for (int i = 0; i < 8; ++i) {  // lanes 0-3: vector 2i's h[l] + h[l+4], 4-7: vector 2i+1's
    const FloatPart a = halves[2 * i], b = halves[2 * i + 1];
    quarters[i] = __builtin_shuffle(a, b, IntPart{0, 1, 2, 3, 8, 9, 10, 11}) +
                  __builtin_shuffle(a, b, IntPart{4, 5, 6, 7, 12, 13, 14, 15});
  }
  for (int i = 0; i < 4; ++i) {  // lane pairs: vectors 4i..4i+3, q[l] + q[l+2]
    const FloatPart a = quarters[2 * i], b = quarters[2 * i + 1];
    eighths[i] = __builtin_shuffle(a, b, IntPart{0, 1, 4, 5, 8, 9, 12, 13}) +
                 __builtin_shuffle(a, b, IntPart{2, 3, 6, 7, 10, 11, 14, 15});
  }
  Vec16 out;
  for (int i = 0; i < 2; ++i) {  // lane m of part i: vector 8i+m, e[0] + e[1]
    const FloatPart a = eighths[2 * i], b = eighths[2 * i + 1];
    out.part[i] = __builtin_shuffle(a, b, IntPart{0, 2, 4, 6, 8, 10, 12, 14}) +
                  __builtin_shuffle(a, b, IntPart{1, 3, 5, 7, 9, 11, 13, 15});
  }
  return out;
}
#else
// The same tree on parts of native vectors: a lane's sum is ((s[l] + s[l+8]) + (s[l+4] + s[l+12])) +
// ((s[l+2] + s[l+10]) + (s[l+6] + s[l+14])) for l = 0 then 1, and those two added, as above.
using Folded = Vec16;
inline Folded fold(const Vec16& v) { return v; }

inline Vec16 lane_sums(const Folded (&sums)[16]) {
  float halves[16][8], out[16];
  for (int i = 0; i < 16; ++i) {
    for (int l = 0; l < 8; ++l) halves[i][l] = sums[i][l] + sums[i][l + 8];
  }
  for (int i = 0; i < 16; ++i) {
    float pairs[2];
    for (int l = 0; l < 2; ++l) {
      pairs[l] = (halves[i][l] + halves[i][l + 4]) + (halves[i][l + 2] + halves[i][l + 6]);
    }
    out[i] = pairs[0] + pairs[1];
  }
  return load(out);
}
#endif

using reader_spec::CacheView;

void check_float_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
}

constexpr int64_t kMaxHeadDim = 256;

using reader_spec::RunKeys;

// Buffers one thread reuses across its runs of attention.
struct AttentionScratch {
  std::vector<float> weights;
  std::vector<float> sums;  // per query: its values' weighted sums
  std::vector<float> totals;  // per query: the sum of its weights
  std::vector<const float*> weight_rows;
  std::vector<float*> sum_rows;
  std::vector<float> padded;  // values of a head_dim that is not a whole number of registers
  std::vector<int32_t> order;
};

// Keys and values are requested ahead of their use: each is a few cache lines of a row of the cache,
// which a batch's pass reads from memory (its rows are megabytes), and the hardware's stream
// prefetcher restarts at every 4 KB page (16 keys of 64 dims). With AVX-512 (measured on an AMD EPYC
// Zen 4 host) every line of every key is requested kKeysAhead keys ahead, the first kKeysAhead of a
// head before its scores, and keys and values into L2 only: decode passes of a batch took less time,
// passes of a few tokens of one sequence about as long (docs/runner.md,
// "attention's keys requested ahead into L2"). AVX2 builds keep what was measured on a Zen 3 host: a
// key right after the one before is left to the hardware (requesting every line of a run of
// consecutive keys made attention slower there; docs/runner.md, "The AVX2 host, third session"), the
// others requested 32 keys ahead into L1.
#ifdef __AVX512F__
constexpr int64_t kKeysAhead = 64;
constexpr bool kEveryKey = true;
constexpr int kRowLocality = 1;  // __builtin_prefetch's: 1 is prefetcht2, 3 prefetcht0
#else
constexpr int64_t kKeysAhead = 32;
constexpr bool kEveryKey = false;
constexpr int kRowLocality = 3;
#endif
constexpr int64_t kValuesAhead = 32;

inline void request_row(const float* row, int64_t dim) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t line = 0; line < dim * static_cast<int64_t>(sizeof(float)); line += 64) {
    __builtin_prefetch(bytes + line, 0, kRowLocality);
  }
}

inline void prefetch_rows(const float* base, const int32_t* keys_seen, int64_t begin, int64_t end, int64_t dim) {
  for (int64_t i = begin; i < end; ++i) {
    if (!kEveryKey && i > 0 && keys_seen[i] == keys_seen[i - 1] + 1) continue;
    request_row(base + keys_seen[i] * dim, dim);
  }
}

// Vectors of sums a loop keeps in registers: 16 of AVX-512's 32 zmm; on AVX2 a vector is two of the
// 16 ymm registers, and 4 of them leave room for the operands (more spill the sums to the stack: 16
// keys' dot products at once made a layer's attention slower; docs/runner.md,
// "The AVX2 host, third session").
#ifdef __AVX512F__
constexpr int kSumVectors = 16;
#else
constexpr int kSumVectors = 4;
#endif

// Sixteen dot products, scaled: lane i is scaling * (x . k[i]), each a vector of partial sums reduced by
// the same tree whatever the other keys are. Missing keys point at zeros.
template <int kChunks>
Vec16 scores_of(const float* x, const float* const (&k)[kLanes], int64_t dim, float scaling) {
  const int64_t chunks = kChunks > 0 ? kChunks : dim / kLanes, tail = kChunks > 0 ? 0 : dim % kLanes;
  // kSumVectors keys at a time: each key's sums are the same operations in the same order.
  Folded sums[kLanes];
  for (int first = 0; first < kLanes; first += kSumVectors) {
    Vec16 some[kSumVectors] = {};
    for (int64_t c = 0; c < chunks; ++c) {
      const Vec16 x_chunk = load(x + c * kLanes);
      for (int i = 0; i < kSumVectors; ++i) some[i] += x_chunk * load(k[first + i] + c * kLanes);
    }
    if (tail) {
      const Vec16 x_chunk = load_partial(x + chunks * kLanes, tail);
      for (int i = 0; i < kSumVectors; ++i) some[i] += x_chunk * load_partial(k[first + i] + chunks * kLanes, tail);
    }
    for (int i = 0; i < kSumVectors; ++i) sums[first + i] = fold(some[i]);
  }
  return lane_sums(sums) * scaling;
}

// One register of the ISA: the whole of a Vec16 with AVX-512, one of its parts elsewhere. The values'
// sums are taken in tiles of kValueQueries queries by kValueParts registers of lanes, so that each
// value register loaded serves several queries (with one query at a time, as many loads as
// multiply-adds); each lane sees the operations of the Vec16 code. AVX2: 12 sums, 2 values and a
// broadcast of the 16 registers; AVX-512: 16 sums of the 32.
#ifdef __AVX512F__
using Native = Vec16;
constexpr int kNativeLanes = kLanes;
constexpr int kValueQueries = 4, kValueParts = 4;
#else
using Native = reader_spec::FloatPart;
constexpr int kNativeLanes = reader_spec::kPartLanes;
constexpr int kValueQueries = 6, kValueParts = 2;
#endif

inline Native load_native(const float* p) {
  Native v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store_native(float* p, const Native& v) { std::memcpy(p, &v, sizeof(v)); }

// The values' weighted sums of kQ queries on kP registers of lanes from `first`: per lane, the keys'
// weighted values summed in cache order. A key a query does not see has weight 0 and adds exactly
// nothing, so each query's sums are the same sequence of roundings as over its own keys alone,
// whichever queries a tile takes it with. `fetch`: request every line of the row kValuesAhead keys
// ahead (the run's first tile; the later ones read the rows' other lines from the caches, which the
// hardware's prefetcher, seeing one line of each row, would not have brought).
template <int kQ, int kP>
void value_tile(const float* const* weights, const float* values, const int32_t* keys_seen, int64_t n,
                int64_t stride, int64_t first, bool fetch, float* const* sums) {
  Native acc[kQ][kP] = {};
  for (int64_t i = 0; i < n; ++i) {
    if (fetch && i + kValuesAhead < n) request_row(values + keys_seen[i + kValuesAhead] * stride, stride);
    const float* v = values + keys_seen[i] * stride + first;
    Native value[kP];
    for (int p = 0; p < kP; ++p) value[p] = load_native(v + p * kNativeLanes);
    for (int q = 0; q < kQ; ++q) {
      const float weight = weights[q][i];
      for (int p = 0; p < kP; ++p) acc[q][p] += weight * value[p];
    }
  }
  for (int q = 0; q < kQ; ++q) {
    for (int p = 0; p < kP; ++p) store_native(sums[q] + first + p * kNativeLanes, acc[q][p]);
  }
}

// value_tile for `count` queries and `parts` registers (at most kValueQueries and kValueParts).
template <int kQ = kValueQueries, int kP = kValueParts>
void value_tiles(int64_t count, int64_t parts, const float* const* weights, const float* values,
                 const int32_t* keys_seen, int64_t n, int64_t stride, int64_t first, bool fetch, float* const* sums) {
  if constexpr (kQ > 1) {
    if (count < kQ) {
      return value_tiles<kQ - 1, kP>(count, parts, weights, values, keys_seen, n, stride, first, fetch, sums);
    }
  }
  if constexpr (kP > 1) {
    if (parts < kP) {
      return value_tiles<kQ, kP - 1>(count, parts, weights, values, keys_seen, n, stride, first, fetch, sums);
    }
  }
  value_tile<kQ, kP>(weights, values, keys_seen, n, stride, first, fetch, sums);
}

// The keys that any of a run's `tokens` tokens sees (`visible[t]`: its row of the visibility mask), in
// cache order, and which of them each token sees as lane masks: the same for every key/value head.
void see_run(const bool* const* visible, int64_t tokens, int64_t kv_length, RunKeys& run) {
  std::vector<char> seen_by_any(kv_length, 0);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < kv_length; ++j) seen_by_any[j] |= visible[t][j];
  }
  run.keys.clear();
  for (int64_t j = 0; j < kv_length; ++j) {
    if (seen_by_any[j]) run.keys.push_back(static_cast<int32_t>(j));
  }
  const int64_t n = static_cast<int64_t>(run.keys.size()), blocks = (n + kLanes - 1) / kLanes;
  run.sees.resize(tokens * blocks);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t b = 0; b < blocks; ++b) {
      int32_t lanes[kLanes];
      for (int lane = 0; lane < kLanes; ++lane) {
        const int64_t i = b * kLanes + lane;
        lanes[lane] = i < n && visible[t][run.keys[i]] ? -1 : 0;
      }
      run.sees[t * blocks + b] = load(lanes);
    }
  }
}

// Each of `count` weight rows summed over its first n weights in order, several rows at a time: one
// row's sum is a chain of dependent additions, and a row at a time would wait on each of them.
void weight_totals(const float* const* rows, int64_t count, int64_t n, float* totals) {
  constexpr int kAtOnce = 8;
  for (int64_t first = 0; first < count; first += kAtOnce) {
    const float* some[kAtOnce];
    for (int j = 0; j < kAtOnce; ++j) some[j] = rows[std::min<int64_t>(first + j, count - 1)];
    float sums[kAtOnce] = {};
    for (int64_t i = 0; i < n; ++i) {
      for (int j = 0; j < kAtOnce; ++j) sums[j] += some[j][i];
    }
    for (int j = 0; j < kAtOnce && first + j < count; ++j) totals[first + j] = sums[j];
  }
}

// The attention of `tokens` consecutive tokens of one cache row (tokens of one tree, whose keys and
// masks see_run has put in `run`) on one key/value head, for the `group` query heads that share
// it: each block of keys and each value is read once for all of them. A query's arithmetic is its own:
// scores of the keys (dot products, each reduced by the same tree), weights exp(score - max) over the
// keys it sees (0 elsewhere), then the values' weighted sum in cache order. `kChunks`: head_dim / 16
// where the dispatch knows it (loops unroll), 0 for any.
template <int kChunks>
void attend_run(const float* query, int64_t tokens, int64_t heads, int64_t group, int64_t kv_head,
                const CacheView& cache, int64_t row, float scaling, float softcap, float* out, const RunKeys& run,
                AttentionScratch& scratch) {
  const int64_t dim = cache.head_dim;
  const int64_t queries = tokens * group;
  const int32_t* keys_seen = run.keys.data();
  const int64_t n = static_cast<int64_t>(run.keys.size());
  const int64_t stride = (n + kLanes - 1) / kLanes * kLanes;
  scratch.weights.resize(queries * stride);
  const float* keys = cache.keys + cache.offset(row, kv_head, 0);
  const float* values = cache.values + cache.offset(row, kv_head, 0);
  auto head_of = [&](int64_t q) { return ((q / group) * heads + kv_head * group + q % group) * dim; };
  // Scores, 16 keys at a time (in L1 for every query).
  static const float zeros[kMaxHeadDim] = {};
  if (kEveryKey) prefetch_rows(keys, keys_seen, 0, std::min(n, kKeysAhead), dim);
  for (int64_t first = 0; first < n; first += kLanes) {
    const float* k[kLanes];
    for (int64_t i = 0; i < kLanes; ++i) k[i] = first + i < n ? keys + keys_seen[first + i] * dim : zeros;
    prefetch_rows(keys, keys_seen, first + kKeysAhead, std::min(n, first + kKeysAhead + kLanes), dim);
    for (int64_t q = 0; q < queries; ++q) {
      float* scores = scratch.weights.data() + q * stride + first;
      store(scores, scores_of<kChunks>(query + head_of(q), k, dim, scaling));
      if (softcap > 0) {
        for (int lane = 0; lane < kLanes; ++lane) scores[lane] = std::tanh(scores[lane] / softcap) * softcap;
      }
    }
  }
  // Scores to weights: exp(score - the largest score the query sees), 0 for keys it does not see,
  // sixteen keys at a time (a maximum does not depend on the order it is taken in).
  const int64_t blocks = stride / kLanes;
  const Vec16 lowest = splat(-std::numeric_limits<float>::infinity());
  for (int64_t q = 0; q < queries; ++q) {
    const Int16* sees = run.sees.data() + (q / group) * blocks;
    float* weights = scratch.weights.data() + q * stride;
    Vec16 largest = lowest;
    for (int64_t b = 0; b < blocks; ++b) {
      const Vec16 scores = load(weights + b * kLanes);
      largest = select(sees[b] & (scores > largest), scores, largest);
    }
    float best = -std::numeric_limits<float>::infinity();
    for (int lane = 0; lane < kLanes; ++lane) best = std::max(best, largest[lane]);
    for (int64_t b = 0; b < blocks; ++b) {
      const Vec16 exponentials = exp16(load(weights + b * kLanes) - best);
      store(weights + b * kLanes, select(sees[b], exponentials, Vec16{}));
    }
  }
  // The values' weighted sums by tiles of queries and registers (from a copy of the values padded with
  // zeros where head_dim is not a whole number of registers), then each divided by its weights' sum.
  int64_t value_stride = dim;
  if (dim % kNativeLanes != 0) {
    value_stride = (dim + kNativeLanes - 1) / kNativeLanes * kNativeLanes;
    scratch.padded.assign(n * value_stride, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(scratch.padded.data() + i * value_stride, values + keys_seen[i] * dim, dim * sizeof(float));
    }
    scratch.order.resize(n);
    for (int64_t i = 0; i < n; ++i) scratch.order[i] = static_cast<int32_t>(i);
    values = scratch.padded.data(), keys_seen = scratch.order.data();
  }
  scratch.sums.resize(queries * value_stride);
  scratch.totals.resize(queries);
  scratch.weight_rows.resize(queries);
  scratch.sum_rows.resize(queries);
  for (int64_t q = 0; q < queries; ++q) {
    scratch.weight_rows[q] = scratch.weights.data() + q * stride;
    scratch.sum_rows[q] = scratch.sums.data() + q * value_stride;
  }
  const int64_t parts = value_stride / kNativeLanes;
  for (int64_t q = 0; q < queries; q += kValueQueries) {
    for (int64_t part = 0; part < parts; part += kValueParts) {
      value_tiles(queries - q, parts - part, scratch.weight_rows.data() + q, values, keys_seen, n, value_stride,
                  part * kNativeLanes, q == 0 && part == 0, scratch.sum_rows.data() + q);
    }
  }
  weight_totals(scratch.weight_rows.data(), queries, n, scratch.totals.data());
  for (int64_t q = 0; q < queries; ++q) {
    const float total = scratch.totals[q];
    // No visible key (never in a pass the runner builds): zeros, a sum over nothing.
    const float inverse = total > 0 ? 1.0f / total : 0.0f;
    float* o = out + head_of(q);
    for (int64_t d = 0; d < dim; ++d) o[d] = scratch.sum_rows[q][d] * inverse;
  }
}

at::Tensor add_rms_norm(at::Tensor hidden, const c10::optional<at::Tensor>& delta, const at::Tensor& weight,
                        double epsilon) {
  check_float_cpu(hidden, "hidden");
  check_float_cpu(weight, "weight");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "hidden must be a contiguous [tokens, features]");
  const int64_t rows = hidden.size(0), features = hidden.size(1);
  TORCH_CHECK(weight.numel() == features, "weight has ", weight.numel(), " features, hidden ", features);
  at::Tensor added;
  if (delta.has_value() && delta->defined()) {
    check_float_cpu(*delta, "delta");
    TORCH_CHECK(delta->sizes() == hidden.sizes(), "delta and hidden differ in shape");
    added = delta->contiguous();
  }
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty_like(hidden);
  reader_spec::add_rms_norm_rows(hidden.data_ptr<float>(), added.defined() ? added.data_ptr<float>() : nullptr,
                                 w.data_ptr<float>(), static_cast<float>(epsilon), rows, features,
                                 out.data_ptr<float>());
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  check_float_cpu(gate, "gate");
  check_float_cpu(up, "up");
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.stride(1) == 1 && up.stride(1) == 1 &&
                  gate.stride(0) == up.stride(0),
              "gate and up must be [tokens, features] with contiguous rows the same distance apart");
  const int64_t rows = gate.size(0), features = gate.size(1);
  at::Tensor out = at::empty({rows, features}, gate.options());
  reader_spec::silu_mul_rows(gate.data_ptr<float>(), up.data_ptr<float>(), gate.stride(0), rows, features,
                             out.data_ptr<float>());
  return out;
}

reader_spec::CacheView cache_view(at::Tensor& key_cache, at::Tensor& value_cache) {
  check_float_cpu(key_cache, "key_cache");
  check_float_cpu(value_cache, "value_cache");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  value_cache.sizes() == key_cache.sizes(),
              "caches must be contiguous [rows, kv_heads, capacity, head_dim] of one shape");
  return {key_cache.data_ptr<float>(), value_cache.data_ptr<float>(), key_cache.size(0), key_cache.size(1),
          key_cache.size(2),           key_cache.size(3)};
}

at::Tensor rotary_store(const at::Tensor& query_key, const at::Tensor& value, const at::Tensor& cos,
                        const at::Tensor& sin, at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& rows,
                        const at::Tensor& positions, int64_t query_heads) {
  for (const at::Tensor& t : {query_key, value, cos, sin}) check_float_cpu(t, "operand");
  const reader_spec::CacheView cache = cache_view(key_cache, value_cache);
  TORCH_CHECK(query_key.dim() == 3 && query_key.stride(2) == 1 && query_key.stride(1) == query_key.size(2),
              "query_key must be [tokens, heads, head_dim] with heads side by side");
  TORCH_CHECK(value.dim() == 3 && value.stride(2) == 1 && value.stride(1) == value.size(2),
              "value must be [tokens, kv_heads, head_dim] with heads side by side");
  const int64_t tokens = query_key.size(0), dim = query_key.size(2);
  TORCH_CHECK(dim % 2 == 0 && query_key.size(1) - query_heads == cache.kv_heads && value.size(1) == cache.kv_heads &&
                  dim == cache.head_dim,
              "query_key, value and the caches disagree on heads or head_dim");
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  TORCH_CHECK(c.numel() == tokens * dim && s.numel() == tokens * dim, "cos and sin must be [tokens, head_dim]");
  const at::Tensor row_of = rows.to(at::kLong).contiguous(), position_of = positions.to(at::kLong).contiguous();
  TORCH_CHECK(row_of.numel() == tokens && position_of.numel() == tokens, "one row and position per token");
  at::Tensor queries = at::empty({tokens, query_heads, dim}, query_key.options());
  const int64_t* rp = row_of.data_ptr<int64_t>();
  const int64_t* pp = position_of.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(rp[t] >= 0 && rp[t] < cache.rows && pp[t] >= 0 && pp[t] < cache.capacity, "token outside the cache");
  }
  reader_spec::for_rows(tokens, (query_heads + 2 * cache.kv_heads) * dim, [&](int64_t t) {
    reader_spec::rotary_store_token(query_key.data_ptr<float>() + t * query_key.stride(0),
                                    value.data_ptr<float>() + t * value.stride(0), c.data_ptr<float>() + t * dim,
                                    s.data_ptr<float>() + t * dim, query_heads, cache, rp[t], pp[t],
                                    queries.data_ptr<float>() + t * query_heads * dim);
  });
  return queries;
}

// Cache entries moved within their rows, in every cache at once (a pass's accepted drafts next to their
// context): entry sources[i] of row rows[i] to destinations[i], all read before any is written, as an
// indexed copy does. One call for the whole model: after a pass has swept the caches, the two indexed
// copies a layer cost a step far more than their work (docs/runner.md,
// "the host's bookkeeping around a pass and a step, cut further").
void move_entries(const std::vector<at::Tensor>& caches, const at::Tensor& rows, const at::Tensor& destinations,
                  const at::Tensor& sources) {
  const int64_t count = rows.numel();
  for (const at::Tensor* t : {&rows, &destinations, &sources}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous() &&
                    t->numel() == count,
                "move_entries: rows, destinations and sources must be contiguous 1-D longs of one length");
  }
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* destination = destinations.data_ptr<int64_t>();
  const int64_t* source = sources.data_ptr<int64_t>();
  for (const at::Tensor& cache : caches) {  // every cache checked before any entry moves
    TORCH_CHECK(cache.device().is_cpu() && cache.dim() == 4 && cache.is_contiguous(),
                "move_entries: each cache must be a contiguous CPU [rows, heads, capacity, head_dim]");
    for (int64_t i = 0; i < count; ++i) {
      TORCH_CHECK(row[i] >= 0 && row[i] < cache.size(0) && destination[i] >= 0 && destination[i] < cache.size(2) &&
                      source[i] >= 0 && source[i] < cache.size(2),
                  "move_entries: entry ", i, " outside the cache");
    }
  }
  std::vector<char> moved;
  for (const at::Tensor& cache : caches) {
    const int64_t heads = cache.size(1), capacity = cache.size(2);
    const int64_t entry = cache.size(3) * static_cast<int64_t>(cache.element_size());
    char* base = static_cast<char*>(cache.data_ptr());
    auto entry_at = [&](int64_t i, int64_t head, int64_t position) {
      return base + ((row[i] * heads + head) * capacity + position) * entry;
    };
    moved.resize(count * heads * entry);
    for (int64_t i = 0; i < count; ++i) {
      for (int64_t head = 0; head < heads; ++head) {
        std::memcpy(moved.data() + (i * heads + head) * entry, entry_at(i, head, source[i]), entry);
      }
    }
    for (int64_t i = 0; i < count; ++i) {
      for (int64_t head = 0; head < heads; ++head) {
        std::memcpy(entry_at(i, head, destination[i]), moved.data() + (i * heads + head) * entry, entry);
      }
    }
  }
}

at::Tensor attention(const at::Tensor& query, at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& visible,
                     const at::Tensor& token_tree, const at::Tensor& token_offset, const at::Tensor& token_row,
                     double scaling, double softcap) {
  check_float_cpu(query, "query");
  const reader_spec::CacheView cache = cache_view(key_cache, value_cache);
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous() && query.size(2) == cache.head_dim,
              "query must be a contiguous [tokens, heads, head_dim]");
  TORCH_CHECK(query.size(1) % cache.kv_heads == 0, "query heads must be a multiple of the cache's heads");
  TORCH_CHECK(cache.head_dim <= kMaxHeadDim, "head_dim above ", kMaxHeadDim);
  TORCH_CHECK(visible.scalar_type() == at::kBool && visible.dim() == 3 && visible.is_contiguous(),
              "visible must be contiguous [trees, width, kv_length] booleans");
  TORCH_CHECK(visible.size(2) <= cache.capacity, "visible spans more keys than the cache holds");
  const int64_t tokens = query.size(0);
  for (const at::Tensor* t : {&token_tree, &token_offset, &token_row}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == tokens,
                "token_tree, token_offset and token_row: one long per token");
  }
  const int64_t* trees = token_tree.data_ptr<int64_t>();
  const int64_t* offsets = token_offset.data_ptr<int64_t>();
  const int64_t* rows = token_row.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(trees[t] >= 0 && trees[t] < visible.size(0) && offsets[t] >= 0 && offsets[t] < visible.size(1) &&
                    rows[t] >= 0 && rows[t] < cache.rows,
                "token ", t, " outside visible or the cache");
  }
  at::Tensor out = at::empty_like(query);
  const reader_spec::Visibility visibility{visible.data_ptr<bool>(), visible.size(1), visible.size(2), trees, offsets,
                                           rows};
  reader_spec::attend(query.data_ptr<float>(), query.size(1), cache, reader_spec::plan_attention(visibility, tokens, cache.kv_heads, at::get_num_threads()),
                      static_cast<float>(scaling), static_cast<float>(softcap), out.data_ptr<float>());
  return out;
}

}  // namespace

namespace reader_spec {

void add_rms_norm_rows(float* hidden, const float* delta, const float* weight, float epsilon, int64_t rows,
                       int64_t features, float* normed) {
  const int64_t vectors = features / kLanes * kLanes;
  for_rows(rows, features, [&](int64_t r) {
    float* row = hidden + r * features;
    if (delta != nullptr) {
      const float* add = delta + r * features;
      for (int64_t i = 0; i < features; ++i) row[i] += add[i];
    }
    Vec16 squares{};
    for (int64_t i = 0; i < vectors; i += kLanes) {
      const Vec16 v = load(row + i);
      squares += v * v;
    }
    float sum = 0;
    for (int lane = 0; lane < kLanes; ++lane) sum += squares[lane];
    for (int64_t i = vectors; i < features; ++i) sum += row[i] * row[i];
    const float inverse = 1.0f / std::sqrt(sum / static_cast<float>(features) + epsilon);
    float* out = normed + r * features;  // may be the row itself (a norm in place)
    for (int64_t i = 0; i < features; ++i) out[i] = weight[i] * (row[i] * inverse);
  });
}

// One row's features [begin, end): vectors of 16 up to the last whole one of the row, then scalars.
static void silu_mul_span(const float* gate, const float* up, int64_t features, int64_t begin, int64_t end,
                          float* out) {
  const int64_t vectors = std::min(end, features / kLanes * kLanes);
  int64_t i = begin;
  for (; i < vectors; i += kLanes) {
    const Vec16 x = load(gate + i);
    store(out + i, x / (1.0f + exp16(-x)) * load(up + i));
  }
  for (; i < end; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

void silu_mul_rows(const float* gate, const float* up, int64_t stride, int64_t rows, int64_t features, float* out) {
  for_rows(rows, features, [&](int64_t r) {
    silu_mul_span(gate + r * stride, up + r * stride, features, 0, features, out + r * features);
  });
}

void silu_mul_features(const float* gate, const float* up, int64_t stride, int64_t rows, int64_t features,
                       int64_t begin, int64_t end, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    silu_mul_span(gate + r * stride, up + r * stride, features, begin, end, out + r * features);
  }
}

void rotary_store_token(const float* query_key, const float* value, const float* cos, const float* sin,
                        int64_t query_heads, const CacheView& cache, int64_t row, int64_t position, float* query_out) {
  const int64_t dim = cache.head_dim, half = dim / 2;
  for (int64_t head = 0; head < query_heads + cache.kv_heads; ++head) {
    const float* x = query_key + head * dim;
    float* out = head >= query_heads ? cache.keys + cache.offset(row, head - query_heads, position)
                                     : query_out + head * dim;
    // Sixteen pairs at a time, each lane as the scalar loop below computes it (GCC fuses x[i] * cos[i]
    // and x[i + half] * cos[i + half]): the scalar loop alone was a visible share of a pass of a few
    // tokens on a Zen 4 host (docs/runner.md, "rotary embedding in vectors").
    int64_t i = 0;
    for (; i + kLanes <= half; i += kLanes) {
      const Vec16 low = load(x + i), high = load(x + i + half);
      store(out + i, low * load(cos + i) - opaque(high * load(sin + i)));
      store(out + i + half, high * load(cos + i + half) + opaque(low * load(sin + i + half)));
    }
    for (; i < half; ++i) {
      out[i] = x[i] * cos[i] - x[i + half] * sin[i];
      out[i + half] = x[i + half] * cos[i + half] + x[i] * sin[i + half];
    }
  }
  for (int64_t kv_head = 0; kv_head < cache.kv_heads; ++kv_head) {
    std::memcpy(cache.values + cache.offset(row, kv_head, position), value + kv_head * dim, dim * sizeof(float));
  }
}

// How many runs a pass of one tree of `tokens` tokens is cut into: at least one per kRunTokens
// tokens, and more where that many runs times the key/value heads would not split evenly between
// the threads (a tree of up to 4 tokens as one run: 3 heads shared 2:1 by two threads; the thread with
// one head then waited at every layer on an AMD EPYC Zen 4 host; docs/runner.md,
// "a pass of a few rows as one team of threads"). A thread that
// takes two runs of one head reads its keys and values from memory once, then from its own caches.
int64_t runs_of_one_tree(int64_t tokens, int64_t kv_heads, int64_t threads) {
  const int64_t fewest = (tokens + kRunTokens - 1) / kRunTokens;
  int64_t best = fewest;
  double best_busy = 0;
  for (int64_t runs = fewest; runs <= tokens; ++runs) {
    const int64_t items = runs * kv_heads, rounds = (items + threads - 1) / threads;
    const double busy = static_cast<double>(items) / static_cast<double>(rounds * threads);
    if (busy > best_busy) best = runs, best_busy = busy;
  }
  return best;
}

AttentionPlan plan_attention(const Visibility& visibility, int64_t tokens, int64_t kv_heads, int64_t threads) {
  // A run's tokens attend to the cache row of its first token, and a pass is one tree where its first
  // and last tokens are: each tree's tokens must come together, in one row, as the runner packs them
  // (otherwise tokens would attend, without an error, to another row's keys).
  const int64_t* tree = visibility.token_tree;
  std::vector<char> done(tokens > 0 ? *std::max_element(tree, tree + tokens) + 1 : 0, 0);
  for (int64_t t = 1; t < tokens; ++t) {
    if (tree[t] == tree[t - 1]) {
      TORCH_CHECK(visibility.token_row[t] == visibility.token_row[t - 1], "attention: the tokens of tree ", tree[t],
                  " lie in more than one cache row");
    } else {
      done[tree[t - 1]] = 1;
      TORCH_CHECK(!done[tree[t]], "attention: the tokens of tree ", tree[t], " are not consecutive");
    }
  }
  AttentionPlan plan{visibility, tokens, {}, {}};
  const bool one_tree = tokens > 0 && visibility.token_tree[0] == visibility.token_tree[tokens - 1];
  if (one_tree) {
    const int64_t runs = runs_of_one_tree(tokens, kv_heads, std::max<int64_t>(threads, 1));
    for (int64_t run = 0; run < runs; ++run) plan.starts.push_back(run * tokens / runs);
  } else {
    for (int64_t t = 0; t < tokens; ++t) {
      if (t == 0 || visibility.token_tree[t] != visibility.token_tree[t - 1] ||
          t - plan.starts.back() == kRunTokens) {
        plan.starts.push_back(t);
      }
    }
  }
  plan.starts.push_back(tokens);
  plan.runs.resize(plan.starts.size() - 1);
  const int64_t grain = std::max<int64_t>(1, kFeaturesPerThread / std::max<int64_t>(visibility.kv_length, 1));
  at::parallel_for(0, static_cast<int64_t>(plan.runs.size()), grain, [&](int64_t begin, int64_t end) {
    std::vector<const bool*> visible;
    for (int64_t run = begin; run < end; ++run) {
      visible.clear();
      for (int64_t t = plan.starts[run]; t < plan.starts[run + 1]; ++t) {
        visible.push_back(visibility.visible +
                          (visibility.token_tree[t] * visibility.width + visibility.token_offset[t]) *
                              visibility.kv_length);
      }
      see_run(visible.data(), static_cast<int64_t>(visible.size()), visibility.kv_length, plan.runs[run]);
    }
  });
  return plan;
}

AttentionShares share_attention(const AttentionPlan& plan, int64_t kv_heads, int64_t group, int64_t head_dim,
                                int64_t threads) {
  constexpr int64_t kHeadMajorRuns = 8;
  const std::vector<int64_t>& starts = plan.starts;
  const int64_t runs = static_cast<int64_t>(plan.runs.size());
  // Runs in the order first, last, second, second to last...: a thread takes a contiguous share of the
  // items, and a prompt's later runs see more keys, so in cache order the last of two threads would get
  // three times the first's work in a causal chunk (docs/runner.md). A pass of a few runs takes them
  // head by head (item i: head i / runs), so that a thread reads a head's keys and values once for all
  // its runs of a row, where run by run each thread read every head's (passes of 5-9 tokens slightly
  // faster on an AMD EPYC Zen 4 host; docs/runner.md, "attention shared by tokens and head by head");
  // a prompt's chunk, run by run (item i: head i %
  // kv_heads), so that a thread reads one run's keys and masks at a time.
  AttentionShares shares{runs <= kHeadMajorRuns, runs, kv_heads, {}};
  const int64_t items = runs * kv_heads;
  // Items of about 64k multiply-adds or more per thread: below that, threads cost more than they save.
  const int64_t work =
      std::max<int64_t>(1, plan.visibility.kv_length * group * head_dim * plan.tokens / std::max<int64_t>(runs, 1));
  const int64_t grain = std::max<int64_t>(1, 65536 / work);
  const int64_t used = std::max<int64_t>(1, std::min<int64_t>(threads, (items + grain - 1) / grain));
  // Each thread's share holds about as many tokens as the others': runs differ in length (5 tokens are
  // runs of 4 and 1), and shares of equal item counts gave one thread 12 of the 15 (token, head) pairs
  // (an AMD EPYC Zen 4 host: attention of 5 and of 13 tokens took less time; docs/runner.md,
  // "attention shared by tokens and head by head").
  std::vector<int64_t> tokens_before(items + 1, 0);
  for (int64_t item = 0; item < items; ++item) {
    const int64_t run = shares.run_of(item);
    tokens_before[item + 1] = tokens_before[item] + starts[run + 1] - starts[run];
  }
  shares.bounds.assign(used + 1, items);
  for (int64_t thread = 0, item = 0; thread < used; ++thread) {
    const double target = static_cast<double>(thread) * tokens_before[items] / used;
    while (item < items && std::abs(tokens_before[item + 1] - target) <= std::abs(tokens_before[item] - target)) ++item;
    shares.bounds[thread] = item;
  }
  return shares;
}

void attend_share(const float* query, int64_t heads, const CacheView& cache, const AttentionPlan& plan,
                  const AttentionShares& shares, int64_t thread, float scaling, float softcap, float* out) {
  if (thread >= shares.threads()) return;
  const auto attend_run_of = cache.head_dim == 64    ? attend_run<4>
                             : cache.head_dim == 128 ? attend_run<8>
                                                     : attend_run<0>;
  const int64_t group = heads / cache.kv_heads, dim = cache.head_dim;
  AttentionScratch scratch;
  for (int64_t item = shares.bounds[thread]; item < shares.bounds[thread + 1]; ++item) {
    const int64_t run = shares.run_of(item), first = plan.starts[run], count = plan.starts[run + 1] - first;
    attend_run_of(query + first * heads * dim, count, heads, group, shares.kv_head_of(item), cache,
                  plan.visibility.token_row[first], scaling, softcap, out + first * heads * dim, plan.runs[run],
                  scratch);
  }
}

void attend(const float* query, int64_t heads, const CacheView& cache, const AttentionPlan& plan, float scaling,
            float softcap, float* out) {
  const AttentionShares shares =
      share_attention(plan, cache.kv_heads, heads / cache.kv_heads, cache.head_dim, at::get_num_threads());
  at::parallel_for(0, shares.threads(), 1, [&](int64_t first_thread, int64_t last_thread) {
    for (int64_t thread = first_thread; thread < last_thread; ++thread) {
      attend_share(query, heads, cache, plan, shares, thread, scaling, softcap, out);
    }
  });
}

}  // namespace reader_spec

TORCH_LIBRARY_FRAGMENT(reader_spec, m) {
  m.def("add_rms_norm(Tensor(a!) hidden, Tensor? delta, Tensor weight, float epsilon) -> Tensor");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def(
      "rotary_store(Tensor query_key, Tensor value, Tensor cos, Tensor sin, Tensor(a!) key_cache, "
      "Tensor(b!) value_cache, Tensor rows, Tensor positions, int query_heads) -> Tensor");
  m.def(
      "attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor visible, Tensor token_tree, "
      "Tensor token_offset, Tensor token_row, float scaling, float softcap) -> Tensor");
  m.def("move_entries(Tensor(a!)[] caches, Tensor rows, Tensor destinations, Tensor sources) -> ()");
}

TORCH_LIBRARY_IMPL(reader_spec, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rotary_store", &rotary_store);
  m.impl("attention", &attention);
  m.impl("move_entries", &move_entries);
}
