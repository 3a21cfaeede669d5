// What the compiled files share: each routine is defined once (blocked_linear.cpp, integer_product.cpp,
// layer_ops.cpp), so the ops and the decoder layer that call it run the same machine code, and a
// token's arithmetic is the same whichever of them computes it.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace reader_spec {

// Sixteen lanes of 32 bits: one AVX-512 register, in GCC's portable vector types. Without AVX-512
// GCC keeps a 64-byte vector type in memory and expands every operation on it piece by piece (far
// slower on an AVX2 CPU: docs/runner.md, "An AVX2 host: the kernels' vectors back in registers"), so
// there the same sixteen lanes are a struct of native vectors (two of
// 32 bytes with AVX, four of 16 bytes elsewhere) whose operators act part by part. Either way each
// lane sees the same operations in the same order: a kernel's results do not depend on the ISA.
constexpr int kLanes = 16;
#ifdef __AVX512F__
typedef float Vec16 __attribute__((vector_size(64)));
typedef int32_t Int16 __attribute__((vector_size(64)));

inline Vec16 select(Int16 mask, Vec16 a, Vec16 b) { return mask ? a : b; }
inline Int16 select(Int16 mask, Int16 a, Int16 b) { return mask ? a : b; }
inline Int16 to_int(Vec16 v) { return __builtin_convertvector(v, Int16); }  // toward zero
inline Vec16 to_float(Int16 v) { return __builtin_convertvector(v, Vec16); }
inline Vec16 bits_as_float(Int16 v) { return (Vec16)v; }
#else
#ifdef __AVX__
constexpr int kPartBytes = 32;
#else
constexpr int kPartBytes = 16;
#endif
typedef float FloatPart __attribute__((vector_size(kPartBytes)));
typedef int32_t IntPart __attribute__((vector_size(kPartBytes)));
constexpr int kParts = 64 / kPartBytes, kPartLanes = kLanes / kParts;

// Sixteen lanes of `Lane` as kParts native vectors; comparisons give an Int16 of -1 (true) or 0.
template <typename Lane, typename Part>
struct Wide {
  Part part[kParts];

  Lane operator[](int lane) const { return part[lane / kPartLanes][lane % kPartLanes]; }

#define READER_SPEC_WIDE_OP(op)                                                                 \
  friend Wide operator op(Wide a, const Wide& b) {                                             \
    for (int p = 0; p < kParts; ++p) a.part[p] = a.part[p] op b.part[p];                       \
    return a;                                                                                  \
  }                                                                                            \
  friend Wide operator op(Wide a, Lane b) {                                                    \
    for (int p = 0; p < kParts; ++p) a.part[p] = a.part[p] op b;                               \
    return a;                                                                                  \
  }                                                                                            \
  friend Wide operator op(Lane a, Wide b) {                                                    \
    for (int p = 0; p < kParts; ++p) b.part[p] = a op b.part[p];                               \
    return b;                                                                                  \
  }                                                                                            \
  Wide& operator op##=(const Wide & b) { return *this = *this op b; }                          \
  Wide& operator op##=(Lane b) { return *this = *this op b; }
  READER_SPEC_WIDE_OP(+)
  READER_SPEC_WIDE_OP(-)
  READER_SPEC_WIDE_OP(*)
  READER_SPEC_WIDE_OP(/)
  READER_SPEC_WIDE_OP(&)
  READER_SPEC_WIDE_OP(|)
  READER_SPEC_WIDE_OP(<<)
  READER_SPEC_WIDE_OP(>>)
#undef READER_SPEC_WIDE_OP

  friend Wide operator-(Wide a) {
    for (int p = 0; p < kParts; ++p) a.part[p] = -a.part[p];
    return a;
  }

#define READER_SPEC_WIDE_COMPARE(op)                                                            \
  friend Wide<int32_t, IntPart> operator op(const Wide& a, const Wide& b) {                    \
    Wide<int32_t, IntPart> mask;                                                               \
    for (int p = 0; p < kParts; ++p) mask.part[p] = a.part[p] op b.part[p];                    \
    return mask;                                                                               \
  }                                                                                            \
  friend Wide<int32_t, IntPart> operator op(const Wide& a, Lane b) {                           \
    Wide<int32_t, IntPart> mask;                                                               \
    for (int p = 0; p < kParts; ++p) mask.part[p] = a.part[p] op b;                            \
    return mask;                                                                               \
  }
  READER_SPEC_WIDE_COMPARE(<)
  READER_SPEC_WIDE_COMPARE(>)
  READER_SPEC_WIDE_COMPARE(<=)
  READER_SPEC_WIDE_COMPARE(>=)
  READER_SPEC_WIDE_COMPARE(==)
  READER_SPEC_WIDE_COMPARE(!=)
#undef READER_SPEC_WIDE_COMPARE
};

typedef Wide<float, FloatPart> Vec16;
typedef Wide<int32_t, IntPart> Int16;

template <typename T>
inline T select(const Int16& mask, const T& a, const T& b) {
  T out;
  for (int p = 0; p < kParts; ++p) out.part[p] = mask.part[p] ? a.part[p] : b.part[p];
  return out;
}

inline Int16 to_int(const Vec16& v) {  // toward zero
  Int16 out;
  for (int p = 0; p < kParts; ++p) out.part[p] = __builtin_convertvector(v.part[p], IntPart);
  return out;
}

inline Vec16 to_float(const Int16& v) {
  Vec16 out;
  for (int p = 0; p < kParts; ++p) out.part[p] = __builtin_convertvector(v.part[p], FloatPart);
  return out;
}

inline Vec16 bits_as_float(const Int16& v) {
  Vec16 out;
  for (int p = 0; p < kParts; ++p) out.part[p] = (FloatPart)v.part[p];
  return out;
}
#endif

#ifdef __AVX512F__
template <typename Lane, typename Vector = std::conditional_t<std::is_same_v<Lane, float>, Vec16, Int16>>
inline Vector load(const Lane* p) {
  Vector v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename Lane, typename Vector>
inline void store(Lane* p, const Vector& v) {
  std::memcpy(p, &v, sizeof(v));
}
#else
// Part by part: one whole-struct copy goes through the stack (small stores, then wide loads that
// cannot be forwarded from them).
template <typename Lane, typename Vector = std::conditional_t<std::is_same_v<Lane, float>, Vec16, Int16>>
inline Vector load(const Lane* p) {
  Vector v;
  for (int i = 0; i < kParts; ++i) std::memcpy(&v.part[i], p + i * kPartLanes, sizeof(v.part[i]));
  return v;
}

template <typename Lane, typename Part>
inline void store(Lane* p, const Wide<Lane, Part>& v) {
  for (int i = 0; i < kParts; ++i) std::memcpy(p + i * kPartLanes, &v.part[i], sizeof(Part));
}
#endif

// `v` as it was computed: the compiler cannot fuse the multiplication that made it into a later
// addition (an empty asm, no instruction), so that a vector loop rounds exactly as the scalar loop it
// stands for, one of whose two products GCC fuses (-ffp-contract=fast).
inline Vec16 opaque(Vec16 v) {
#ifdef __AVX512F__
  __asm__("" : "+v"(v));
#else
  for (int p = 0; p < kParts; ++p) __asm__("" : "+x"(v.part[p]));
#endif
  return v;
}

// Columns per block of a packed matrix: the columns a kernel multiplies at a time.
constexpr int64_t kBlock = 32;
// Columns per panel of a float32 block: a block is two panels side by side ([2, k_size, 16] floats, the
// quantized layouts keep [k, 32] bytes), each k of a panel one 64-byte line, so that a core reads a
// block as two streams (layouts.to_blocks).
constexpr int64_t kPanel = 16;
constexpr int64_t kPanelsPerBlock = kBlock / kPanel;

// That `weight` is a float32 matrix in column blocks of two panels on the CPU, or a clear error.
inline void check_panels(const at::Tensor& weight, const char* op) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 3 &&
                  weight.size(0) % kPanelsPerBlock == 0 && weight.size(2) == kPanel && weight.is_contiguous(),
              op, ": the weight must be contiguous float32 [blocks x 2, K, 16] on the CPU");
}

// y = x @ W.T (+ bias) for `rows` rows of x side by side (`k_size` floats each), W in column blocks
// of two panels ([blocks x 2, k_size, 16]). `ahead`: request each block's weights into L2 a few KB ahead of the
// multiply-adds, where the hardware's prefetcher alone does not keep the memory busy (timed per shape
// and row count by the caller).
void blocked_product(const float* x, int64_t rows, const float* weight, int64_t k_size, const float* bias, float* y,
                     int64_t out_features, bool ahead);

// blocked_product a share at a time, for callers that split the blocks between threads themselves
// (a thread can then use its columns while they are in its own core's caches).
class Product {
 public:
  Product(const float* x, int64_t rows, const float* weight, int64_t k_size, const float* bias, float* y,
          int64_t out_features, bool ahead);

  int64_t blocks() const { return (out_features_ + kBlock - 1) / kBlock; }

  // Blocks [begin, end) times every row.
  void multiply(int64_t begin, int64_t end) const;

 private:
  const float *x_, *w_, *bias_;
  float* y_;
  int64_t k_size_, out_features_;
  bool ahead_;
  int64_t rows_;
  std::vector<int> sizes_;  // how the rows are cut into tiles
  std::vector<int64_t> starts_;
  int64_t tiles_per_share_;
};

// Integer products (integer_product.cpp): int8 weights with a float32 scale per column, W[n] ~
// scale[n] q[n], stored per block of 32 columns in groups of 4 k as unsigned bytes q + 128
// ([blocks, ceil(k_size / 4), 128], zero past k_size); each row of x in integers too: with AVX-512
// VNNI two int8 levels (x ~ a q1 + b q2, the second quantizing what the first left), elsewhere one
// int16 level of as many steps as int32 sums allow.
#ifdef __AVX512VNNI__
constexpr int kIntegerLevels = 2;
#else
constexpr int kIntegerLevels = 1;
#endif
constexpr int64_t kIntegerGroup = 4;

// A row of x in integers: each level's scale and sum of its integers, and (where asked for) what
// bounds the approximation: norm = max(|x|, |integers scaled|), error = |x - integers scaled| + 5%.
struct IntegerRow {
  float scale[kIntegerLevels];
  int32_t sum[kIntegerLevels];
  float norm = 0, error = 0;
  bool finite = true;  // false: x has inf or NaN (its outputs are not computed)
};

// Rows an integer product may stop computing partway: the greedy head's rows below a draft that is
// already known to be rejected (greedy_head.cpp). Before each block of its share the product computes
// only the rows still active (a dropped row's outputs in later blocks stay unwritten), and after it
// reports the rows it computed to `block_done`, which may drop rows; both threads' shares see a drop
// from their next block on.
class RowPruning {
 public:
  explicit RowPruning(int64_t rows) : active_(rows) {
    for (std::atomic<bool>& a : active_) a.store(true, std::memory_order_relaxed);
  }
  virtual ~RowPruning() = default;
  // Once, before any block: the rows as quantized (their bounds' norm and error).
  virtual void start(const std::vector<IntegerRow>& rows) = 0;
  // After block `block` of a thread's share, whose outputs for `rows` (`count` of them) are written.
  virtual void block_done(int64_t block, const int64_t* rows, int64_t count) = 0;
  bool active(int64_t row) const { return active_[row].load(std::memory_order_relaxed); }
  int64_t dropped() const { return dropped_.load(std::memory_order_relaxed); }

 protected:
  void drop(int64_t row) {
    if (active_[row].exchange(false, std::memory_order_relaxed)) dropped_.fetch_add(1, std::memory_order_relaxed);
  }

 private:
  std::vector<std::atomic<bool>> active_;
  std::atomic<int64_t> dropped_{0};
};

// y[r][c] = scale[c] * sum over levels of (level scale * integer dot product) (+ bias[c]) for the
// first `columns` columns, `ldy` floats per row of y. Integer sums are exact in any order, so a row's
// outputs do not depend on the rows beside it. `bounds`: also compute each row's norm and error.
// `pruning`: rows may be dropped partway (see RowPruning).
std::vector<IntegerRow> integer_product(const float* x, int64_t rows, const uint8_t* weight, int64_t k_size,
                                        const float* scales, const float* bias, float* y, int64_t ldy,
                                        int64_t columns, bool bounds, RowPruning* pruning = nullptr);

// A row of x in integers of at most `limit` in magnitude (below 2^22) at one scale, the largest |x| /
// limit: q[k] = clamp(nearbyint(x[k] / scale), -limit, limit), rounded to nearest with ties to even,
// sixteen lanes at a time (the integer products round their inputs before every product, on one
// thread: one lane at a time, through std::nearbyint, that was a visible cost on a Zen 1 host;
// docs/runner.md, "the self-draft's passes; what this host's integer units cannot give").
// Returns false, writing nothing, where x holds inf or NaN; a row of zeros gets scale 0 and no integers.
inline bool round_row(const float* x, int64_t k_size, float limit, int16_t* q, float& scale) {
  const float most = std::numeric_limits<float>::max();
  const int64_t whole = k_size / kLanes * kLanes;
  Vec16 largest{};
  Int16 finite = Int16{} == 0;
  for (int64_t k = 0; k < whole; k += kLanes) {
    const Vec16 v = load(x + k);
    const Vec16 magnitude = select(v < 0.0f, 0.0f - v, v);
    finite = finite & (magnitude <= most);  // false for inf and NaN
    largest = select(magnitude > largest, magnitude, largest);
  }
  float top = 0;
  bool all_finite = true;
  for (int lane = 0; lane < kLanes; ++lane) {
    top = std::max(top, largest[lane]);
    all_finite = all_finite && finite[lane] != 0;
  }
  for (int64_t k = whole; k < k_size; ++k) {
    const float magnitude = std::fabs(x[k]);
    all_finite = all_finite && magnitude <= most;
    top = std::max(top, magnitude);
  }
  scale = top / limit;
  if (!all_finite || scale == 0) return all_finite;
  // Clamped first (the bounds are integers: the same result), then rounded by adding and taking back
  // 1.5 x 2^23, past which a float holds integers only.
  const float magic = 12582912.0f;
  for (int64_t k = 0; k < whole; k += kLanes) {
    const Vec16 scaled = load(x + k) / scale;
    const Vec16 clamped = select(scaled > limit, Vec16{} + limit, select(scaled < -limit, Vec16{} - limit, scaled));
    const Int16 integers = to_int((clamped + magic) - magic);
    for (int lane = 0; lane < kLanes; ++lane) q[k + lane] = static_cast<int16_t>(integers[lane]);
  }
  for (int64_t k = whole; k < k_size; ++k) {
    q[k] = static_cast<int16_t>(std::clamp(std::nearbyint(x[k] / scale), -limit, limit));
  }
  return true;
}

// Products of weights quantized per group of kWeightGroup k of a column (grouped_product.cpp), as
// GGUF stores them: 4 bits, W[n][k] = d[n][g] q[n][k] + m[n][g] (q in 0..15), or 8 bits,
// W[n][k] = d[n][g] q[n][k] (q in -127..127), d and m float16, stored per block of 32 columns as that
// file says; y = x @ W.T (+ bias) for `rows` rows, `columns` floats per row of y. k_size must be a
// multiple of kWeightGroup. weight_group_bits: the bits of a layout with that many bytes per block
// and group (checked); weight_group_halves: float16 values per block and group of its scales.
constexpr int64_t kWeightGroup = 32;
int64_t weight_group_bits(int64_t bytes_per_group);
int64_t weight_group_halves(int64_t bits);
void grouped_product(const float* x, int64_t rows, const uint8_t* weight, const uint16_t* scales, int64_t k_size,
                     int64_t bits, const float* bias, float* y, int64_t columns);

// grouped_product a share at a time, as Product is blocked_product's: each row of x is rounded to int16
// once, when the product is made (a team's members each make their own: the same integers).
class GroupedProduct {
 public:
  GroupedProduct(const float* x, int64_t rows, const uint8_t* weight, const uint16_t* scales, int64_t k_size,
                 int64_t bits, const float* bias, float* y, int64_t columns);

  int64_t blocks() const { return (columns_ + kBlock - 1) / kBlock; }

  // Blocks [begin, end) times every row.
  void multiply(int64_t begin, int64_t end) const;

 private:
  const uint8_t* weight_;
  const uint16_t* scales_;
  const float* bias_;
  float* y_;
  int64_t rows_, k_size_, bits_, columns_;
  std::vector<int16_t> q_;        // [rows][k]
  std::vector<int32_t> sums_;     // [rows][groups]: each group's sum of integers
  std::vector<float> row_scales_; // [rows]
  std::vector<uint8_t> finite_;   // [rows]: 0 where the row holds inf or NaN (its outputs are NaN)
};

// What the product ops (blocked_linear, int8_linear, grouped_linear) do around their kernel: `input`
// ([..., in_features], float32) seen as rows, the optional float32 bias checked (one per output),
// and y = product(x, rows, bias or null, y) returned with input's leading shape.
template <typename Product>
at::Tensor rows_product(const char* op, const at::Tensor& input, const c10::optional<at::Tensor>& bias,
                        int64_t in_features, int64_t out_features, Product product) {
  TORCH_CHECK(input.device().is_cpu() && input.scalar_type() == at::kFloat, op, ": float32 CPU input");
  TORCH_CHECK(input.size(-1) == in_features, op, ": input has ", input.size(-1), " features, not ", in_features);
  at::Tensor bias_contiguous;
  if (bias.has_value() && bias->defined()) {
    bias_contiguous = bias->contiguous();
    TORCH_CHECK(bias_contiguous.scalar_type() == at::kFloat && bias_contiguous.numel() == out_features, op,
                ": one float32 bias per output");
  }
  const at::Tensor x = input.reshape({-1, in_features}).contiguous();
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  product(x.data_ptr<float>(), x.size(0), bias_contiguous.defined() ? bias_contiguous.data_ptr<float>() : nullptr,
          y.data_ptr<float>());
  auto out_shape = input.sizes().vec();
  out_shape.back() = out_features;
  return y.view(out_shape);
}

// Features (of all rows) per thread below which a row-wise op runs on the calling thread alone: a pass
// of a few tokens would wait longer for the other threads than its rows take. Waking the other
// thread costs about as long as the gated activation of one 1,536-feature row (docs/runner.md,
// "A prompt on both threads" and "The AVX2 host once more").
constexpr int64_t kFeaturesPerThread = 8192;

// fn(r) for every row r in [0, rows) of `features` features each, split between threads where there
// are enough. Each row is computed alone, so the split changes no result.
template <typename Fn>
void for_rows(int64_t rows, int64_t features, const Fn& fn) {
  const int64_t grain = std::max<int64_t>(1, kFeaturesPerThread / std::max<int64_t>(features, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) fn(r);
  });
}

// Row by row: hidden += delta (where delta is not null), normed = weight * hidden / rms(hidden).
void add_rms_norm_rows(float* hidden, const float* delta, const float* weight, float epsilon, int64_t rows,
                       int64_t features, float* normed);

// Row by row: out = silu(gate) * up (rows of gate and up `stride` floats apart, out's `features`).
void silu_mul_rows(const float* gate, const float* up, int64_t stride, int64_t rows, int64_t features, float* out);

// silu_mul_rows on the features [begin, end) of every row, on the calling thread (`begin` a multiple
// of 16): each feature is computed as silu_mul_rows computes it.
void silu_mul_features(const float* gate, const float* up, int64_t stride, int64_t rows, int64_t features,
                       int64_t begin, int64_t end, float* out);

// A layer's KV cache, [rows, kv_heads, capacity, head_dim] for keys and values alike.
struct CacheView {
  float* keys;
  float* values;
  int64_t rows, kv_heads, capacity, head_dim;

  int64_t offset(int64_t row, int64_t kv_head, int64_t position) const {
    return ((row * kv_heads + kv_head) * capacity + position) * head_dim;
  }
};

// One token: its query and key heads (side by side in `query_key`) rotated by (cos, sin) of head_dim
// each; queries into `query_out`, keys and values (side by side in `value`) into the cache at (row,
// position).
void rotary_store_token(const float* query_key, const float* value, const float* cos, const float* sin,
                        int64_t query_heads, const CacheView& cache, int64_t row, int64_t position,
                        float* query_out);

// Which keys a token sees: row `b * width + offset` of `visible` ([trees, width, kv_length] booleans)
// for token t of tree b at `offset`; its keys and values lie in cache row `row`.
struct Visibility {
  const bool* visible;
  int64_t width, kv_length;
  const int64_t* token_tree;
  const int64_t* token_offset;
  const int64_t* token_row;
};

// The most tokens in a run of a pass's tokens (consecutive tokens of one tree, attention's unit of
// work, with one key/value head): its queries share each key block and value row read.
constexpr int64_t kRunTokens = 4;

// The keys of one run: the keys any of its tokens sees, in cache order, and which of them each token
// sees.
struct RunKeys {
  std::vector<int32_t> keys;
  std::vector<Int16> sees;  // per token of the run and block of 16 keys: lanes of -1 where it sees the key
};

// A pass's runs and their keys, worked out once for every layer that attends as `visibility` says
// (where each layer worked them out again, that was a visible share of attention's time at a few
// tokens; docs/runner.md, "attention planned once per pass").
struct AttentionPlan {
  Visibility visibility;
  int64_t tokens;
  std::vector<int64_t> starts;  // run i: tokens [starts[i], starts[i + 1])
  std::vector<RunKeys> runs;
};

// The plan of a pass's attention, for a model with `kv_heads` key/value heads on `threads` threads
// (which only choose how the tokens are cut into runs: a run's tokens compute what they would alone).
AttentionPlan plan_attention(const Visibility& visibility, int64_t tokens, int64_t kv_heads, int64_t threads);

// A pass's attention split between threads: its items (one run of tokens on one key/value head),
// thread t taking items [bounds[t], bounds[t + 1]); fewer threads than asked where the pass is small.
struct AttentionShares {
  bool by_head;  // items head by head (a few runs), else run by run
  int64_t runs, kv_heads;
  std::vector<int64_t> bounds;

  int64_t threads() const { return static_cast<int64_t>(bounds.size()) - 1; }

  // Runs in the order first, last, second, second to last... (share_attention says why).
  int64_t run_of(int64_t item) const {
    const int64_t order = by_head ? item % runs : item / kv_heads;
    return order % 2 == 0 ? order / 2 : runs - 1 - order / 2;
  }

  int64_t kv_head_of(int64_t item) const { return by_head ? item / runs : item % kv_heads; }
};

AttentionShares share_attention(const AttentionPlan& plan, int64_t kv_heads, int64_t group, int64_t head_dim,
                                int64_t threads);

// Attention of the plan's tokens' queries ([tokens, heads, head_dim]) on the cache; `softcap` 0 for
// none. out: [tokens, heads, head_dim]. attend_share: thread `thread`'s items alone, on the calling
// thread (nothing past shares.threads()).
void attend(const float* query, int64_t heads, const CacheView& cache, const AttentionPlan& plan, float scaling,
            float softcap, float* out);
void attend_share(const float* query, int64_t heads, const CacheView& cache, const AttentionPlan& plan,
                  const AttentionShares& shares, int64_t thread, float scaling, float softcap, float* out);

}  // namespace reader_spec
