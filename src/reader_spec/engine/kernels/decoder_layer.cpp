// Whole decoder layers of the Llama shape, all of a model's in one call (DecoderStack): RMSNorm, the
// fused query/key/value product, optional per-head query/key norms (Qwen3), rotary embedding with the
// cache write, attention, the output product, RMSNorm, the fused gate/up product, SiLU gating and the
// down product.
//
// The engine's Python layers run the same ops one by one (layer_ops.cpp, blocked_linear.cpp); between
// two of them the interpreter and PyTorch's dispatch cost microseconds each, and each matrix product
// evicts their code and data from the caches, so at a few rows those gaps were a quarter of a pass.
// Here nothing runs between the ops but the ops themselves, which are the same functions (kernels.h):
// a layer's output is bitwise the Python layer's.
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/matmul.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "kernels.h"

namespace {

using reader_spec::CacheView;

// One packed matrix: [blocks, in, 32] float32; int8 in the integer product's layout ([blocks,
// ceil(in / 4), 128] unsigned bytes) with one float32 scale per column; or quantized per group of 32 k
// in the grouped product's (4-bit [blocks, in / 32, 512] or 8-bit [blocks, in / 32, 1024] bytes) with
// float16 scales (and minimums) per group (their bits in an int16 tensor).
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
    int64_t depth = in_features, width = 32;
    if (grouped) {
      TORCH_CHECK(in_features % reader_spec::kWeightGroup == 0, "Linear: grouped weights need in % 32 == 0");
      TORCH_CHECK(this->weight.dim() == 3, "Linear: grouped weights are [blocks, in / 32, bytes per group]");
      group_bits = reader_spec::weight_group_bits(this->weight.size(2));
      depth = in_features / reader_spec::kWeightGroup;
      width = this->weight.size(2);
    } else if (quantized) {
      depth = (in_features + reader_spec::kIntegerGroup - 1) / reader_spec::kIntegerGroup;
      width = 32 * reader_spec::kIntegerGroup;
    }
    TORCH_CHECK(this->weight.device().is_cpu() && this->weight.dim() == 3 && this->weight.size(1) == depth &&
                    this->weight.size(2) == width && this->weight.is_contiguous(),
                "Linear: the weight must be a contiguous CPU [blocks, in, 32] (int8: [blocks, ceil(in / 4), 128], "
                "grouped: [blocks, in / 32, 512 or 1024])");
    TORCH_CHECK(quantized || this->weight.scalar_type() == at::kFloat, "Linear: float32, int8 or grouped weights");
    TORCH_CHECK(out_features <= this->weight.size(0) * 32, "Linear: out_features exceeds the blocks");
    if (quantized) {
      this->scales = scales->contiguous();
      const int64_t expected = grouped ? this->weight.size(0) * depth * reader_spec::weight_group_halves(group_bits)
                                       : this->weight.size(0) * 32;
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

  // Whether `kernel` is the float32 compiled product, which a caller can split itself (Product).
  bool splits(int64_t kernel) const { return kernel != 0 && !scales.defined(); }

  // Whether the product can run a pair of blocks `second` columns apart on one thread (gate and up).
  bool pairs_blocks(int64_t kernel, int64_t second) const {
    return splits(kernel) && !bias.defined() && second % reader_spec::kBlock == 0;
  }

  reader_spec::Product share(const float* x, int64_t rows, float* y, int64_t kernel) const {
    return {x, rows, weight.data_ptr<float>(), in_features, bias.defined() ? bias.data_ptr<float>() : nullptr, y,
            out_features, kernel == 2};
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

// The residual stream once per thread, in passes of a few rows: thread t of `threads` adds the
// previous product's output to streams[t] and norms it into normed[t] itself, then multiplies its
// share of the next product's blocks. With one stream, one thread normed it (reading the other
// threads' parts of the output from their cores), and then each other thread read the normed rows
// from that thread's core: two transfers between cores one after the other, at every norm.
struct ThreadStreams {
  int64_t threads = 0;  // 0: one stream, the caller's
  std::vector<float*> streams, normed;
};

// Thread `thread`'s share of `units`: [first, last).
std::pair<int64_t, int64_t> share_of(int64_t units, int64_t thread, int64_t threads) {
  return {units * thread / threads, units * (thread + 1) / threads};
}

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

  // Whether this layer can run with a stream per thread at these kernels: the products after the
  // norms split by the caller.
  bool norms_per_thread(const int64_t kernels[4]) const {
    return qkv->splits(kernels[0]) && gate_up->pairs_blocks(kernels[2], up_start);
  }

  // On every thread t: streams[t] += delta (where not null), normed[t] = its norm, then then(normed[t], t).
  template <typename Then>
  void per_thread_norm(const ThreadStreams& per_thread, const float* delta, const at::Tensor& weight, int64_t tokens,
                       int64_t features, const Then& then) const {
    at::parallel_for(0, per_thread.threads, 1, [&](int64_t first, int64_t last) {
      for (int64_t t = first; t < last; ++t) {
        reader_spec::add_rms_norm_rows(per_thread.streams[t], delta, weight.data_ptr<float>(), epsilon, tokens,
                                       features, per_thread.normed[t]);
        then(per_thread.normed[t], t);
      }
    });
  }

  // hidden: [tokens, hidden], the residual stream, to which `residual` (the previous layer's output,
  // if any) is added in place. cos, sin: [tokens, head_dim]. Token t is written at
  // (plan.visibility.token_row[t], position[t]) of the cache and attends as the plan says (see
  // attend). Returns this layer's MLP output, which the next layer adds. `kernels`: for qkv, output,
  // gate_up and down, which kernel multiplies this many rows (Linear's operator()). `per_thread`: a
  // stream per thread, the first `hidden` (threads 0: `hidden` alone).
  at::Tensor run(const at::Tensor& hidden, const c10::optional<at::Tensor>& residual, const at::Tensor& cos,
                 const at::Tensor& sin, const at::Tensor& key_cache, const at::Tensor& value_cache,
                 const int64_t* positions, const reader_spec::AttentionPlan& plan, const int64_t kernels[4],
                 const ThreadStreams& per_thread) {
    const int64_t tokens = hidden.size(0), features = hidden.size(1);
    TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.is_contiguous() && hidden.dim() == 2 &&
                    features == input_norm.numel(),
                "hidden must be a contiguous float32 [tokens, ", input_norm.numel(), "]");
    at::Tensor added;
    if (residual.has_value() && residual->defined()) {
      added = residual->contiguous();
      TORCH_CHECK(added.sizes() == hidden.sizes() && added.scalar_type() == at::kFloat, "residual must be like hidden");
    }
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
    const int64_t* rows = plan.visibility.token_row;
    const at::TensorOptions options = hidden.options();
    const at::Tensor normed = per_thread.threads > 0 ? at::Tensor() : at::empty({tokens, features}, options);
    float* h = hidden.data_ptr<float>();
    const float* delta = added.defined() ? added.data_ptr<float>() : nullptr;
    at::Tensor projected = at::empty({tokens, qkv->out_features}, options);
    float* p = projected.data_ptr<float>();
    if (per_thread.threads > 0) {
      per_thread_norm(per_thread, delta, input_norm, tokens, features, [&](const float* x, int64_t t) {
        const auto [first, last] = share_of(qkv->weight.size(0), t, per_thread.threads);
        qkv->share(x, tokens, p, kernels[0]).multiply(first, last);
      });
    } else {
      reader_spec::add_rms_norm_rows(h, delta, input_norm.data_ptr<float>(), epsilon, tokens, features,
                                     normed.data_ptr<float>());
      (*qkv)(normed.data_ptr<float>(), tokens, p, kernels[0]);
    }
    at::Tensor queries = at::empty({tokens, heads, head_dim}, options);
    reader_spec::for_rows(tokens, (heads + 2 * kv_heads) * head_dim, [&](int64_t t) {
      float* query_key = p + t * qkv->out_features;
      if (query_norm.defined()) {  // in place, each head alone
        reader_spec::add_rms_norm_rows(query_key, nullptr, query_norm.data_ptr<float>(), epsilon, heads, head_dim,
                                       query_key);
        reader_spec::add_rms_norm_rows(query_key + heads * head_dim, nullptr, key_norm.data_ptr<float>(), epsilon,
                                       kv_heads, head_dim, query_key + heads * head_dim);
      }
      reader_spec::rotary_store_token(query_key, query_key + value_start, cos.data_ptr<float>() + t * head_dim,
                                      sin.data_ptr<float>() + t * head_dim, heads, cache, rows[t], positions[t],
                                      queries.data_ptr<float>() + t * heads * head_dim);
    });
    at::Tensor attended = at::empty({tokens, heads * head_dim}, options);
    reader_spec::attend(queries.data_ptr<float>(), heads, cache, plan, static_cast<float>(scaling), 0.0f,
                        attended.data_ptr<float>());
    at::Tensor out = at::empty({tokens, features}, options);
    (*output)(attended.data_ptr<float>(), tokens, out.data_ptr<float>(), kernels[1]);
    at::Tensor gated = at::empty({tokens, gate_up->out_features}, options);
    at::Tensor activated = at::empty({tokens, intermediate}, options);
    // Each thread gates the features whose gate and up columns it has just multiplied, from its own
    // core's caches (silu_mul_rows read half of them from the other core's).
    const int64_t pairs = (intermediate + reader_spec::kBlock - 1) / reader_spec::kBlock;
    auto gate_and_up = [&](const float* x, int64_t first, int64_t last) {
      const reader_spec::Product product = gate_up->share(x, tokens, gated.data_ptr<float>(), kernels[2]);
      product.multiply(first, last);
      product.multiply(up_start / reader_spec::kBlock + first, up_start / reader_spec::kBlock + last);
      reader_spec::silu_mul_features(gated.data_ptr<float>(), gated.data_ptr<float>() + up_start,
                                     gate_up->out_features, tokens, intermediate, first * reader_spec::kBlock,
                                     std::min(last * reader_spec::kBlock, intermediate), activated.data_ptr<float>());
    };
    if (per_thread.threads > 0) {
      per_thread_norm(per_thread, out.data_ptr<float>(), mlp_norm, tokens, features, [&](const float* x, int64_t t) {
        const auto [first, last] = share_of(pairs, t, per_thread.threads);
        gate_and_up(x, first, last);
      });
    } else {
      reader_spec::add_rms_norm_rows(h, out.data_ptr<float>(), mlp_norm.data_ptr<float>(), epsilon, tokens,
                                     features, normed.data_ptr<float>());
      if (gate_up->pairs_blocks(kernels[2], up_start)) {
        at::parallel_for(0, pairs, 1, [&](int64_t first, int64_t last) {
          gate_and_up(normed.data_ptr<float>(), first, last);
        });
      } else {
        (*gate_up)(normed.data_ptr<float>(), tokens, gated.data_ptr<float>(), kernels[2]);
        reader_spec::silu_mul_rows(gated.data_ptr<float>(), gated.data_ptr<float>() + up_start,
                                   gate_up->out_features, tokens, intermediate, activated.data_ptr<float>());
      }
    }
    (*down)(activated.data_ptr<float>(), tokens, out.data_ptr<float>(), kernels[3]);
    return out;
  }
};

// Every layer of a model in one call: between two layers nothing but the layers runs, where a Python
// loop over the layers cost ~25 us a layer in the interpreter and the bindings (measured 2026-11-26 on
// the AMD EPYC host, about 0.75 ms of a 10 ms one-token draft pass).
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
      plans.push_back(reader_spec::plan_attention(
          {seen.data_ptr<bool>(), seen.size(1), seen.size(2), trees, offsets, rows}, tokens));
    }
    // A stream per thread where a norm's rows would be normed on one thread anyway (a few of them) and
    // every layer's products after its norms can be split by the layer.
    const int64_t threads = at::get_num_threads();
    bool per_thread =
        threads > 1 && hidden.is_contiguous() && tokens * hidden.size(1) <= reader_spec::kFeaturesPerThread;
    for (size_t i = 0; i < count && per_thread; ++i) {
      const int64_t layer_kernels[4] = {kernels.get(4 * i), 0, kernels.get(4 * i + 2), 0};
      per_thread = layers[i]->norms_per_thread(layer_kernels);
    }
    ThreadStreams streams;
    std::vector<at::Tensor> held;  // the other threads' streams and every thread's normed rows
    if (per_thread) {
      streams.threads = threads;
      held.push_back(at::empty({threads, hidden.size(0), hidden.size(1)}, hidden.options()));
      for (int64_t t = 0; t < threads; ++t) {
        streams.streams.push_back(t == 0 ? hidden.data_ptr<float>()
                                         : held.emplace_back(hidden.clone()).data_ptr<float>());
        streams.normed.push_back(held[0][t].data_ptr<float>());
      }
    }
    c10::optional<at::Tensor> residual;
    for (size_t i = 0; i < count; ++i) {
      TORCH_CHECK(key_caches[i].size(0) == cache_rows, "every layer's cache has the same rows");
      const int64_t layer_kernels[4] = {kernels.get(4 * i), kernels.get(4 * i + 1), kernels.get(4 * i + 2),
                                        kernels.get(4 * i + 3)};
      const int64_t kind = kinds[i];
      residual = layers[i]->run(hidden, residual, cos[kind], sin[kind], key_caches[i], value_caches[i], positions,
                                plans[kind], layer_kernels, streams);
    }
    at::Tensor normed = at::empty(hidden.sizes(), hidden.options());
    reader_spec::add_rms_norm_rows(hidden.data_ptr<float>(), residual->data_ptr<float>(), final_norm.data_ptr<float>(),
                                   final_epsilon, hidden.size(0), hidden.size(1), normed.data_ptr<float>());
    return normed;
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
