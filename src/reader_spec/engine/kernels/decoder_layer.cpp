// Whole decoder layers of the Llama shape, all of a model's in one call (DecoderStack): RMSNorm, the
// fused query/key/value product, optional per-head query/key norms (Qwen3), rotary embedding with the
// cache write, attention, the output product, RMSNorm, the fused gate/up product, SiLU gating and the
// down product.
//
// The engine's Python layers run the same ops one by one (layer_ops.cpp, blocked_linear.cpp); between
// two of them the interpreter and PyTorch's dispatch cost microseconds each, and each matrix product
// evicts their code and data from the caches, so at a few rows those gaps were a quarter of a pass.
// Here nothing runs between the ops but the ops themselves, which are the same functions (kernels.h):
// a layer's output is bitwise the Python layer's. A pass of many rows runs each op on all threads in
// turn (DecoderLayer.run); a pass of a few rows runs every layer as one team of threads, each taking
// its share of every op and waiting for the others between ops (DecoderLayer.run_member).
#include <ATen/Config.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/matmul.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#ifdef __linux__
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "kernels.h"

namespace {

using reader_spec::CacheView;

// One packed matrix: [blocks, in, 32] float32; int8 in the integer product's layout ([blocks,
// ceil(in / 4), 128] unsigned bytes) with one float32 scale per column; or quantized per group of 32 k
// in the grouped product's (4-bit [blocks, in / 32, 512] or 8-bit [blocks, in / 32, 1024] bytes) with
// float16 scales (and minimums) per group (their bits in an int16 tensor).
// One product that a caller splits by column blocks (Linear::share): float32 or quantized per group.
class Share {
 public:
  template <typename Kind, typename... Args>
  explicit Share(std::in_place_type_t<Kind> kind, Args&&... args) : product_(kind, std::forward<Args>(args)...) {}

  // Blocks [begin, end) times every row.
  void multiply(int64_t begin, int64_t end) const {
    std::visit([&](const auto& product) { product.multiply(begin, end); }, product_);
  }

 private:
  std::variant<reader_spec::Product, reader_spec::GroupedProduct> product_;
};

struct Linear : torch::CustomClassHolder {
  at::Tensor weight, scales, bias;
  int64_t in_features, out_features;
  int64_t group_bits = 0;  // 4 or 8 where quantized per group

  Linear(at::Tensor weight, c10::optional<at::Tensor> scales, c10::optional<at::Tensor> bias, int64_t in_features,
         int64_t out_features)
      : weight(std::move(weight)), in_features(in_features), out_features(out_features) {
    const bool quantized = this->weight.scalar_type() == at::kByte;
    TORCH_CHECK(quantized == (scales.has_value() && scales->defined()),
                "Linear: int8 and grouped weights need scales, float32 none");
    const bool grouped = quantized && scales->scalar_type() == at::kShort;  // float16 bits
    // unit_columns: output columns per entry of the weight's first dimension (a panel; quantized, a block)
    int64_t depth = in_features, width = reader_spec::kPanel, unit_columns = reader_spec::kPanel;
    if (grouped) {
      TORCH_CHECK(in_features % reader_spec::kWeightGroup == 0, "Linear: grouped weights need in % 32 == 0");
      TORCH_CHECK(this->weight.dim() == 3, "Linear: grouped weights are [blocks, in / 32, bytes per group]");
      group_bits = reader_spec::weight_group_bits(this->weight.size(2));
      depth = in_features / reader_spec::kWeightGroup;
      width = this->weight.size(2);
      unit_columns = reader_spec::kBlock;
    } else if (quantized) {
      depth = (in_features + reader_spec::kIntegerGroup - 1) / reader_spec::kIntegerGroup;
      width = reader_spec::kBlock * reader_spec::kIntegerGroup;
      unit_columns = reader_spec::kBlock;
    }
    TORCH_CHECK(this->weight.device().is_cpu() && this->weight.dim() == 3 && this->weight.size(1) == depth &&
                    this->weight.size(2) == width && this->weight.is_contiguous(),
                "Linear: the weight must be a contiguous CPU [blocks x 2, in, 16] (int8: [blocks, ceil(in / 4), "
                "128], grouped: [blocks, in / 32, 512 or 1024])");
    TORCH_CHECK(quantized || this->weight.scalar_type() == at::kFloat, "Linear: float32, int8 or grouped weights");
    TORCH_CHECK(quantized || this->weight.size(0) % reader_spec::kPanelsPerBlock == 0,
                "Linear: float32 weights are whole blocks of two panels");
    TORCH_CHECK(out_features <= this->weight.size(0) * unit_columns, "Linear: out_features exceeds the blocks");
    if (quantized) {
      this->scales = scales->contiguous();
      const int64_t expected = grouped ? this->weight.size(0) * depth * reader_spec::weight_group_halves(group_bits)
                                       : this->weight.size(0) * reader_spec::kBlock;
      TORCH_CHECK((grouped || this->scales.scalar_type() == at::kFloat) && this->scales.numel() >= expected,
                  "Linear: one float32 scale per stored column (int8) or float16 scales (and minimums) per group "
                  "(grouped)");
    }
    if (bias.has_value() && bias->defined()) {
      this->bias = bias->contiguous();
      TORCH_CHECK(this->bias.scalar_type() == at::kFloat && this->bias.numel() == out_features,
                  "Linear: one float32 bias per output");
    }
  }

  // Column blocks (float32: two panels each): the units a team's members share out.
  int64_t blocks() const { return group_bits ? weight.size(0) : weight.size(0) / reader_spec::kPanelsPerBlock; }

  // Whether `kernel` is a compiled product a caller can split itself (float32's Product, GroupedProduct).
  bool splits(int64_t kernel) const { return kernel != 0 && (!scales.defined() || group_bits != 0); }

  // Whether the product can run a pair of blocks `second` columns apart on one thread (gate and up).
  bool pairs_blocks(int64_t kernel, int64_t second) const {
    return splits(kernel) && !bias.defined() && second % reader_spec::kBlock == 0;
  }

  Share share(const float* x, int64_t rows, float* y, int64_t kernel) const {
    const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
    if (group_bits) {
      return Share(std::in_place_type<reader_spec::GroupedProduct>, x, rows, weight.data_ptr<uint8_t>(),
                   reinterpret_cast<const uint16_t*>(scales.data_ptr<int16_t>()), in_features, group_bits, b, y,
                   out_features);
    }
    return Share(std::in_place_type<reader_spec::Product>, x, rows, weight.data_ptr<float>(), in_features, b, y,
                 out_features, kernel == 2);
  }

  // y = x W^T + b for `rows` rows through `kernel`, as PackedLinear.kernel_at chose it for this many
  // rows: 0, PyTorch's batched matmul over the blocks (float32 only, where the compiled kernel loses);
  // 1, the compiled kernel; 2, the compiled kernel requesting its weights ahead (float32).
  void operator()(const float* x, int64_t rows, float* y, int64_t kernel) const {
    const bool compiled = kernel != 0;
    const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
    if (scales.defined()) {
      TORCH_CHECK(compiled, "Linear: int8 and grouped weights run through the compiled kernels only");
      if (group_bits) {
        reader_spec::grouped_product(x, rows, weight.data_ptr<uint8_t>(),
                                     reinterpret_cast<const uint16_t*>(scales.data_ptr<int16_t>()), in_features,
                                     group_bits, b, y, out_features);
      } else {
        reader_spec::integer_product(x, rows, weight.data_ptr<uint8_t>(), in_features, scales.data_ptr<float>(), b,
                                     y, out_features, out_features, false);
      }
    } else if (compiled) {
      reader_spec::blocked_product(x, rows, weight.data_ptr<float>(), in_features, b, y, out_features, kernel == 2);
    } else {
      const at::Tensor input = at::from_blob(const_cast<float*>(x), {rows, in_features}, weight.options());
      at::Tensor out = at::matmul(input, weight).transpose(0, 1).reshape({rows, -1}).narrow(1, 0, out_features);
      if (bias.defined()) out = out + bias;
      at::from_blob(y, {rows, out_features}, weight.options()).copy_(out);
    }
  }
};

at::Tensor checked_norm(const at::Tensor& weight, int64_t features, const char* name) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.numel() == features, name,
              " must be a float32 CPU vector of ", features);
  return weight.contiguous();
}

// Threads that already run together (one parallel region for a whole pass) waiting for each other
// between the steps of a layer: a counter and a generation number in shared memory, spun on. A wait
// costs a cache line's round trip between the cores; ending a parallel region and starting the next
// cost many times that, and empty regions added to a pass made it measurably slower (an AMD EPYC
// Zen 4 host; docs/runner.md, "a pass of a few rows as one team of threads"). As OpenMP's own
// barriers, a member spins (a few ms, as libgomp by default) before it sleeps: yielding the core
// instead, while another process ran on it, made passes several times slower (same section).
class SpinBarrier {
 public:
  // Called first by every member of a parallel_for over [0, total) with its chunk [first, last): the
  // members are the chunks, whose size only the first chunk's member knows for sure (OpenMP may give
  // the region fewer threads than asked, and a nested region runs all of it on one thread).
  void join(int64_t first, int64_t last, int64_t total) {
    if (first == 0) {
      parties_.store(static_cast<int32_t>((total + last - first - 1) / (last - first)), std::memory_order_release);
      wake(parties_);
    } else {
      until(parties_, 0);
    }
  }

  // Returns once every member has called it as many times.
  void wait() {
    const int32_t parties = parties_.load(std::memory_order_relaxed);
    if (parties == 1) return;
    const int32_t generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == parties - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.store(static_cast<int32_t>(static_cast<uint32_t>(generation) + 1), std::memory_order_seq_cst);
      wake(generation_);
    } else {
      until(generation_, generation);
    }
  }

 private:
  static constexpr int kSpins = 1 << 18;  // pauses: a few ms on a Zen 4 host, as libgomp spins

  // Returns once `word` is no longer `value`.
  void until(std::atomic<int32_t>& word, int32_t value) {
    for (int spins = 0; spins < kSpins; ++spins) {
      if (word.load(std::memory_order_acquire) != value) return;
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#elif defined(__aarch64__)
      __asm__ __volatile__("yield");
#endif
    }
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    while (word.load(std::memory_order_seq_cst) == value) {
#ifdef __linux__  // sleeps unless the word has changed already (the kernel looks under its lock)
      syscall(SYS_futex, reinterpret_cast<int32_t*>(&word), FUTEX_WAIT_PRIVATE, value, nullptr, nullptr, 0);
#else
      std::this_thread::yield();
#endif
    }
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
  }

  // After `word` changed: wakes the members asleep on it (a sleeper counts itself before it looks at
  // the word for the last time, so either it sees the change or it is counted here).
  void wake(std::atomic<int32_t>& word) {
#ifdef __linux__
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      syscall(SYS_futex, reinterpret_cast<int32_t*>(&word), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
    }
#else
    (void)word;
#endif
  }

  static_assert(sizeof(std::atomic<int32_t>) == sizeof(int32_t), "a futex is a plain 32-bit word");
  alignas(64) std::atomic<int32_t> parties_{0};
  alignas(64) std::atomic<int32_t> arrived_{0};
  alignas(64) std::atomic<int32_t> generation_{0};
  alignas(64) std::atomic<int32_t> sleepers_{0};
};

// The CPUs this process may run on: a team of more threads than that would wait at every step for
// members that are not running (a pass at 4 threads on 2 CPUs took many times as long: docs/runner.md,
// "a pass of a few rows as one team of threads").
int64_t usable_cpus() {
  static const int64_t cpus = [] {
#ifdef __linux__
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return static_cast<int64_t>(CPU_COUNT(&set));
#endif
    return static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency()));
  }();
  return cpus;
}

// One member of a pass's team: it does the shares of threads [first, last) of `threads` (one each
// unless the region got fewer threads than asked).
struct Member {
  int64_t first, last, threads;
  SpinBarrier* barrier;

  // Its share of `units` (blocks of a product, tokens): [begin, end).
  std::pair<int64_t, int64_t> share(int64_t units) const {
    return {units * first / threads, units * last / threads};
  }

  void wait() const { barrier->wait(); }
};

// What a team's pass works in, allocated once for all its layers. The residual stream once per
// thread: each member adds a layer's output to its own copy and norms its own rows, then multiplies
// its share of the next product. With one stream, one thread normed it (reading the other threads'
// parts of the output from their cores), and then each other thread read the normed rows from that
// thread's core: two transfers between cores one after the other, at every norm (docs/runner.md,
// "a residual stream per thread").
struct TeamBuffers {
  std::vector<float*> streams, normed;  // per thread
  float *projected, *queries, *attended, *out, *gated, *activated;
};

struct DecoderLayer : torch::CustomClassHolder {
  at::Tensor input_norm, query_norm, key_norm, mlp_norm;
  c10::intrusive_ptr<Linear> qkv, output, gate_up, down;
  int64_t heads, kv_heads, head_dim, value_start, up_start, intermediate;
  double epsilon, scaling;

  // qkv's outputs: queries at 0, keys right after them, values at `value_start`; gate_up's: gate at
  // 0, up at `up_start`, `intermediate` each.
  DecoderLayer(at::Tensor input_norm, c10::optional<at::Tensor> query_norm, c10::optional<at::Tensor> key_norm,
               at::Tensor mlp_norm, double epsilon, c10::intrusive_ptr<Linear> qkv, c10::intrusive_ptr<Linear> output,
               c10::intrusive_ptr<Linear> gate_up, c10::intrusive_ptr<Linear> down, int64_t heads, int64_t kv_heads,
               int64_t head_dim, int64_t value_start, int64_t up_start, int64_t intermediate, double scaling)
      : qkv(std::move(qkv)),
        output(std::move(output)),
        gate_up(std::move(gate_up)),
        down(std::move(down)),
        heads(heads),
        kv_heads(kv_heads),
        head_dim(head_dim),
        value_start(value_start),
        up_start(up_start),
        intermediate(intermediate),
        epsilon(epsilon),
        scaling(scaling) {
    const int64_t hidden = this->output->out_features;
    this->input_norm = checked_norm(input_norm, hidden, "input_norm");
    this->mlp_norm = checked_norm(mlp_norm, hidden, "mlp_norm");
    TORCH_CHECK(query_norm.has_value() == key_norm.has_value(), "query and key norms come together");
    if (query_norm.has_value()) {
      this->query_norm = checked_norm(*query_norm, head_dim, "query_norm");
      this->key_norm = checked_norm(*key_norm, head_dim, "key_norm");
    }
    TORCH_CHECK(heads % kv_heads == 0 && head_dim % 2 == 0, "heads must be a multiple of kv_heads, head_dim even");
    TORCH_CHECK(this->qkv->in_features == hidden && this->gate_up->in_features == hidden &&
                    this->output->in_features == heads * head_dim && this->down->in_features == intermediate &&
                    this->down->out_features == hidden,
                "the layer's matrices disagree on their sizes");
    TORCH_CHECK(value_start >= (heads + kv_heads) * head_dim &&
                    value_start + kv_heads * head_dim <= this->qkv->out_features &&
                    up_start >= intermediate && up_start + intermediate <= this->gate_up->out_features,
                "the parts of the fused products lie outside them");
  }

  // Whether a team can run this layer at these kernels: every product split by its members.
  bool runs_in_team(const int64_t kernels[4]) const {
    return qkv->splits(kernels[0]) && output->splits(kernels[1]) && gate_up->pairs_blocks(kernels[2], up_start) &&
           down->splits(kernels[3]);
  }

  // The cache this layer writes and reads, checked against the pass's inputs.
  CacheView checked_cache(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& key_cache, const at::Tensor& value_cache,
                          const reader_spec::AttentionPlan& plan) const {
    const int64_t tokens = hidden.size(0);
    TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.is_contiguous() && hidden.dim() == 2 &&
                    hidden.size(1) == input_norm.numel(),
                "hidden must be a contiguous float32 [tokens, ", input_norm.numel(), "]");
    TORCH_CHECK(key_cache.scalar_type() == at::kFloat && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                    key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes() &&
                    key_cache.size(1) == kv_heads && key_cache.size(3) == head_dim,
                "the caches must be contiguous float32 [rows, ", kv_heads, ", capacity, ", head_dim, "]");
    const CacheView cache{key_cache.data_ptr<float>(), value_cache.data_ptr<float>(), key_cache.size(0), kv_heads,
                          key_cache.size(2), head_dim};
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == tokens * head_dim &&
                    sin.numel() == tokens * head_dim && cos.scalar_type() == at::kFloat,
                "cos and sin must be contiguous float32 [tokens, head_dim]");
    TORCH_CHECK(plan.visibility.kv_length <= cache.capacity && plan.tokens == tokens,
                "the plan's tokens or keys do not fit this layer's cache");
    return cache;
  }

  // Token t's query and key heads normed (Qwen3) and rotated, queries into `queries`, keys and values
  // into the cache.
  void rotate_token(float* projected, int64_t t, const float* cos, const float* sin, const CacheView& cache,
                    const int64_t* rows, const int64_t* positions, float* queries) const {
    float* query_key = projected + t * qkv->out_features;
    if (query_norm.defined()) {  // in place, each head alone
      reader_spec::add_rms_norm_rows(query_key, nullptr, query_norm.data_ptr<float>(), epsilon, heads, head_dim,
                                     query_key);
      reader_spec::add_rms_norm_rows(query_key + heads * head_dim, nullptr, key_norm.data_ptr<float>(), epsilon,
                                     kv_heads, head_dim, query_key + heads * head_dim);
    }
    reader_spec::rotary_store_token(query_key, query_key + value_start, cos + t * head_dim, sin + t * head_dim, heads,
                                    cache, rows[t], positions[t], queries + t * heads * head_dim);
  }

  // Gate and up blocks [first, last) of gate_up's pairs (gate block b and up block up_start / 32 + b)
  // times x, then SiLU gating of those features: the thread that multiplied them gates them, from its
  // own core's caches (silu_mul_rows read half of them from the other core's).
  void gate_and_up(const float* x, int64_t tokens, int64_t first, int64_t last, int64_t kernel, float* gated,
                   float* activated) const {
    const Share product = gate_up->share(x, tokens, gated, kernel);
    product.multiply(first, last);
    product.multiply(up_start / reader_spec::kBlock + first, up_start / reader_spec::kBlock + last);
    reader_spec::silu_mul_features(gated, gated + up_start, gate_up->out_features, tokens, intermediate,
                                   first * reader_spec::kBlock, std::min(last * reader_spec::kBlock, intermediate),
                                   activated);
  }

  int64_t gate_up_pairs() const { return (intermediate + reader_spec::kBlock - 1) / reader_spec::kBlock; }

  // hidden: [tokens, hidden], the residual stream, to which `residual` (the previous layer's output,
  // if any) is added in place. cos, sin: [tokens, head_dim]. Token t is written at
  // (plan.visibility.token_row[t], position[t]) of the cache and attends as the plan says (see
  // attend). Returns this layer's MLP output, which the next layer adds. `kernels`: for qkv, output,
  // gate_up and down, which kernel multiplies this many rows (Linear's operator()). Each op splits its
  // own work between threads.
  at::Tensor run(const at::Tensor& hidden, const c10::optional<at::Tensor>& residual, const at::Tensor& cos,
                 const at::Tensor& sin, const at::Tensor& key_cache, const at::Tensor& value_cache,
                 const int64_t* positions, const reader_spec::AttentionPlan& plan, const int64_t kernels[4]) {
    const CacheView cache = checked_cache(hidden, cos, sin, key_cache, value_cache, plan);
    const int64_t tokens = hidden.size(0), features = hidden.size(1);
    at::Tensor added;
    if (residual.has_value() && residual->defined()) {
      added = residual->contiguous();
      TORCH_CHECK(added.sizes() == hidden.sizes() && added.scalar_type() == at::kFloat, "residual must be like hidden");
    }
    const at::TensorOptions options = hidden.options();
    const at::Tensor normed = at::empty({tokens, features}, options);
    float* h = hidden.data_ptr<float>();
    reader_spec::add_rms_norm_rows(h, added.defined() ? added.data_ptr<float>() : nullptr,
                                   input_norm.data_ptr<float>(), epsilon, tokens, features, normed.data_ptr<float>());
    at::Tensor projected = at::empty({tokens, qkv->out_features}, options);
    (*qkv)(normed.data_ptr<float>(), tokens, projected.data_ptr<float>(), kernels[0]);
    at::Tensor queries = at::empty({tokens, heads, head_dim}, options);
    reader_spec::for_rows(tokens, (heads + 2 * kv_heads) * head_dim, [&](int64_t t) {
      rotate_token(projected.data_ptr<float>(), t, cos.data_ptr<float>(), sin.data_ptr<float>(), cache,
                   plan.visibility.token_row, positions, queries.data_ptr<float>());
    });
    at::Tensor attended = at::empty({tokens, heads * head_dim}, options);
    reader_spec::attend(queries.data_ptr<float>(), heads, cache, plan, static_cast<float>(scaling), 0.0f,
                        attended.data_ptr<float>());
    at::Tensor out = at::empty({tokens, features}, options);
    (*output)(attended.data_ptr<float>(), tokens, out.data_ptr<float>(), kernels[1]);
    reader_spec::add_rms_norm_rows(h, out.data_ptr<float>(), mlp_norm.data_ptr<float>(), epsilon, tokens, features,
                                   normed.data_ptr<float>());
    at::Tensor gated = at::empty({tokens, gate_up->out_features}, options);
    at::Tensor activated = at::empty({tokens, intermediate}, options);
    if (gate_up->pairs_blocks(kernels[2], up_start)) {
      at::parallel_for(0, gate_up_pairs(), 1, [&](int64_t first, int64_t last) {
        gate_and_up(normed.data_ptr<float>(), tokens, first, last, kernels[2], gated.data_ptr<float>(),
                    activated.data_ptr<float>());
      });
    } else {
      (*gate_up)(normed.data_ptr<float>(), tokens, gated.data_ptr<float>(), kernels[2]);
      reader_spec::silu_mul_rows(gated.data_ptr<float>(), gated.data_ptr<float>() + up_start, gate_up->out_features,
                                 tokens, intermediate, activated.data_ptr<float>());
    }
    (*down)(activated.data_ptr<float>(), tokens, out.data_ptr<float>(), kernels[3]);
    return out;
  }

  // `member`'s part of this layer in a team's pass (DecoderStack::forward): each step split between
  // the members, who wait for each other between steps (no member waits for a region to start or
  // end). `delta`: the previous layer's output, which every member adds to its own stream (null for
  // the first layer); this layer's goes to buffers.out.
  void run_member(const Member& member, const float* delta, const float* cos, const float* sin,
                  const CacheView& cache, const int64_t* positions, const reader_spec::AttentionPlan& plan,
                  const reader_spec::AttentionShares& shares, const int64_t kernels[4],
                  const TeamBuffers& buffers) const {
    const int64_t tokens = plan.tokens, features = input_norm.numel();
    float* stream = buffers.streams[member.first];
    float* normed = buffers.normed[member.first];
    reader_spec::add_rms_norm_rows(stream, delta, input_norm.data_ptr<float>(), epsilon, tokens, features, normed);
    const auto [qkv_first, qkv_last] = member.share(qkv->blocks());
    qkv->share(normed, tokens, buffers.projected, kernels[0]).multiply(qkv_first, qkv_last);
    member.wait();
    const auto [token_first, token_last] = member.share(tokens);
    for (int64_t t = token_first; t < token_last; ++t) {
      rotate_token(buffers.projected, t, cos, sin, cache, plan.visibility.token_row, positions, buffers.queries);
    }
    member.wait();
    for (int64_t thread = member.first; thread < member.last; ++thread) {
      reader_spec::attend_share(buffers.queries, heads, cache, plan, shares, thread, static_cast<float>(scaling), 0.0f,
                                buffers.attended);
    }
    member.wait();
    const auto [output_first, output_last] = member.share(output->blocks());
    output->share(buffers.attended, tokens, buffers.out, kernels[1]).multiply(output_first, output_last);
    member.wait();
    reader_spec::add_rms_norm_rows(stream, buffers.out, mlp_norm.data_ptr<float>(), epsilon, tokens, features,
                                   normed);
    const auto [pair_first, pair_last] = member.share(gate_up_pairs());
    gate_and_up(normed, tokens, pair_first, pair_last, kernels[2], buffers.gated, buffers.activated);
    member.wait();
    const auto [down_first, down_last] = member.share(down->blocks());
    down->share(buffers.activated, tokens, buffers.out, kernels[3]).multiply(down_first, down_last);
    member.wait();
  }
};

// Every layer of a model in one call: between two layers nothing but the layers runs, where a Python
// loop over the layers cost a visible share of a one-token draft pass in the interpreter and the
// bindings (an AMD EPYC host; docs/runner.md, "A pass's bookkeeping and the layer loop").
struct DecoderStack : torch::CustomClassHolder {
  std::vector<c10::intrusive_ptr<DecoderLayer>> layers;
  std::vector<int64_t> kinds;  // each layer's attention kind: which of cos, sin and visible it takes
  at::Tensor final_norm;       // the model's norm after the last layer (RMSNorm, as the layers')
  double final_epsilon = 0;

  void set_final_norm(at::Tensor weight, double epsilon) {
    TORCH_CHECK(!layers.empty(), "DecoderStack: the final norm comes after the layers");
    final_norm = checked_norm(weight, layers.back()->input_norm.numel(), "final_norm");
    final_epsilon = epsilon;
  }

  void add(c10::intrusive_ptr<DecoderLayer> layer, int64_t kind) {
    layers.push_back(std::move(layer));
    kinds.push_back(kind);
  }

  // DecoderLayer.run layer after layer, starting without a residual: cos, sin and visible one
  // per kind, key and value caches one per layer, `kernels` four per layer. Returns the final norm of
  // the residual stream, the last layer's MLP output added (one op fewer after the pass: each costs
  // tens of microseconds there, docs/runner.md).
  at::Tensor forward(at::Tensor hidden, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin,
                     std::vector<at::Tensor> key_caches, std::vector<at::Tensor> value_caches, at::Tensor position,
                     std::vector<at::Tensor> visible, at::Tensor token_tree, at::Tensor token_offset,
                     at::Tensor token_row, c10::List<int64_t> kernels) {
    const size_t count = layers.size();
    TORCH_CHECK(count > 0 && final_norm.defined(), "DecoderStack: no layers or no final norm");
    TORCH_CHECK(key_caches.size() == count && value_caches.size() == count, "one key and value cache per layer");
    TORCH_CHECK(kernels.size() == 4 * count, "four kernels per layer");
    for (const int64_t kind : kinds) {
      TORCH_CHECK(kind >= 0 && static_cast<size_t>(kind) < cos.size() && static_cast<size_t>(kind) < sin.size() &&
                      static_cast<size_t>(kind) < visible.size(),
                  "cos, sin and visible: one per kind of layer");
    }
    const int64_t tokens = hidden.size(0);
    for (const at::Tensor* t : {&position, &token_tree, &token_offset, &token_row}) {
      TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == tokens,
                  "position, token_tree, token_offset and token_row: one long per token");
    }
    const int64_t* rows = token_row.data_ptr<int64_t>();
    const int64_t* positions = position.data_ptr<int64_t>();
    const int64_t* trees = token_tree.data_ptr<int64_t>();
    const int64_t* offsets = token_offset.data_ptr<int64_t>();
    const int64_t cache_rows = key_caches[0].size(0);
    std::vector<reader_spec::AttentionPlan> plans;
    for (const at::Tensor& seen : visible) {
      TORCH_CHECK(seen.scalar_type() == at::kBool && seen.dim() == 3 && seen.is_contiguous(),
                  "visible must be contiguous [trees, width, kv_length] booleans");
      for (int64_t t = 0; t < tokens; ++t) {
        TORCH_CHECK(rows[t] >= 0 && rows[t] < cache_rows && positions[t] >= 0 && positions[t] < seen.size(2) &&
                        trees[t] >= 0 && trees[t] < seen.size(0) && offsets[t] >= 0 && offsets[t] < seen.size(1),
                    "token ", t, " outside the cache or visible");
      }
      plans.push_back(reader_spec::plan_attention({seen.data_ptr<bool>(), seen.size(1), seen.size(2), trees, offsets, rows},
                                                  tokens, layers[0]->kv_heads, at::get_num_threads()));
    }
    std::vector<int64_t> layer_kernels(4 * count);
    for (size_t i = 0; i < 4 * count; ++i) layer_kernels[i] = kernels.get(i);
    for (size_t i = 0; i < count; ++i) {
      TORCH_CHECK(key_caches[i].size(0) == cache_rows, "every layer's cache has the same rows");
    }
    at::Tensor residual;
    if (in_team(hidden, layer_kernels)) {
      residual = forward_team(hidden, cos, sin, key_caches, value_caches, positions, plans, layer_kernels);
    } else {
      c10::optional<at::Tensor> last;
      for (size_t i = 0; i < count; ++i) {
        const int64_t kind = kinds[i];
        last = layers[i]->run(hidden, last, cos[kind], sin[kind], key_caches[i], value_caches[i], positions,
                              plans[kind], &layer_kernels[4 * i]);
      }
      residual = *last;
    }
    at::Tensor normed = at::empty(hidden.sizes(), hidden.options());
    reader_spec::add_rms_norm_rows(hidden.data_ptr<float>(), residual.data_ptr<float>(), final_norm.data_ptr<float>(),
                                   final_epsilon, hidden.size(0), hidden.size(1), normed.data_ptr<float>());
    return normed;
  }

  // Whether a pass runs as a team: a few rows (their norms would run on one thread anyway), every
  // product split by the layer, and OpenMP threads, which all run at once (a team's members wait for
  // each other, which threads of a pool that takes tasks in turn might never do), no more of them
  // than CPUs.
  bool in_team(const at::Tensor& hidden, const std::vector<int64_t>& layer_kernels) const {
    const int64_t threads = at::get_num_threads();
    if (!AT_PARALLEL_OPENMP || threads < 2 || threads > usable_cpus() || !hidden.is_contiguous() ||
        hidden.numel() > reader_spec::kFeaturesPerThread) {
      return false;
    }
    for (size_t i = 0; i < layers.size(); ++i) {
      if (!layers[i]->runs_in_team(&layer_kernels[4 * i])) return false;
    }
    return true;
  }

  // The layers as one parallel region: every thread runs every layer, its share of each step
  // (DecoderLayer.run_member), instead of one region per step (five a layer). Returns the last
  // layer's output; `hidden` holds the residual stream before it.
  at::Tensor forward_team(const at::Tensor& hidden, const std::vector<at::Tensor>& cos,
                          const std::vector<at::Tensor>& sin, const std::vector<at::Tensor>& key_caches,
                          const std::vector<at::Tensor>& value_caches, const int64_t* positions,
                          const std::vector<reader_spec::AttentionPlan>& plans,
                          const std::vector<int64_t>& layer_kernels) const {
    const int64_t threads = at::get_num_threads(), tokens = hidden.size(0), features = hidden.size(1);
    std::vector<CacheView> caches;
    int64_t projected = 0, queries = 0, gated = 0, activated = 0;
    for (size_t i = 0; i < layers.size(); ++i) {
      const DecoderLayer& layer = *layers[i];
      caches.push_back(layer.checked_cache(hidden, cos[kinds[i]], sin[kinds[i]], key_caches[i], value_caches[i],
                                           plans[kinds[i]]));
      projected = std::max(projected, layer.qkv->out_features);
      queries = std::max(queries, layer.heads * layer.head_dim);
      gated = std::max(gated, layer.gate_up->out_features);
      activated = std::max(activated, layer.intermediate);
    }
    // Attention's split per kind of layer (the first layer of a kind stands for the others, whose
    // heads must match it).
    std::vector<reader_spec::AttentionShares> shares(plans.size());
    std::vector<const DecoderLayer*> first_of_kind(plans.size(), nullptr);
    for (size_t i = 0; i < layers.size(); ++i) {
      const DecoderLayer& layer = *layers[i];
      const DecoderLayer*& first = first_of_kind[kinds[i]];
      if (first == nullptr) {
        first = &layer;
        shares[kinds[i]] = reader_spec::share_attention(plans[kinds[i]], layer.kv_heads, layer.heads / layer.kv_heads,
                                                        layer.head_dim, threads);
      }
      TORCH_CHECK(layer.heads == first->heads && layer.kv_heads == first->kv_heads &&
                      layer.head_dim == first->head_dim,
                  "layers of one attention kind must have the same heads");
    }
    const at::TensorOptions options = hidden.options();
    const at::Tensor work = at::empty({tokens * (projected + 2 * queries + features + gated + activated)}, options);
    const at::Tensor per_thread = at::empty({2 * threads - 1, tokens, features}, options);
    TeamBuffers buffers;
    buffers.projected = work.data_ptr<float>();
    buffers.queries = buffers.projected + tokens * projected;
    buffers.attended = buffers.queries + tokens * queries;
    buffers.out = buffers.attended + tokens * queries;
    buffers.gated = buffers.out + tokens * features;
    buffers.activated = buffers.gated + tokens * gated;
    for (int64_t t = 0; t < threads; ++t) {
      float* stream = t == 0 ? hidden.data_ptr<float>() : per_thread[threads + t - 1].data_ptr<float>();
      if (t > 0) std::memcpy(stream, hidden.data_ptr<float>(), tokens * features * sizeof(float));
      buffers.streams.push_back(stream);
      buffers.normed.push_back(per_thread[t].data_ptr<float>());
    }
    SpinBarrier barrier;
    at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
      barrier.join(first, last, threads);
      const Member member{first, last, threads, &barrier};
      for (size_t i = 0; i < layers.size(); ++i) {
        const int64_t kind = kinds[i];
        layers[i]->run_member(member, i == 0 ? nullptr : buffers.out, cos[kind].data_ptr<float>(),
                              sin[kind].data_ptr<float>(), caches[i], positions, plans[kind], shares[kind],
                              &layer_kernels[4 * i], buffers);
      }
    });
    return work.narrow(0, tokens * (projected + 2 * queries), tokens * features).view({tokens, features});
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(reader_spec, m) {
  m.class_<Linear>("Linear").def(
      torch::init<at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>, int64_t, int64_t>());
  m.class_<DecoderLayer>("DecoderLayer")
      .def(torch::init<at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>, at::Tensor, double,
                       c10::intrusive_ptr<Linear>, c10::intrusive_ptr<Linear>, c10::intrusive_ptr<Linear>,
                       c10::intrusive_ptr<Linear>, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double>());
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<>())
      .def("add", &DecoderStack::add)
      .def("set_final_norm", &DecoderStack::set_final_norm)
      .def("forward", &DecoderStack::forward);
}
