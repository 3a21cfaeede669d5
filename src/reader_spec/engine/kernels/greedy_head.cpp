// The output layer's greedy token per row: exactly argmax(blocked_linear(hidden, weight)) (the first of
// equal maxima, as torch.argmax), while reading the float32 matrix only for a few columns.
//
// Every logit is first approximated in integers (integer_product.cpp): the matrix as int8 with a
// scale per column (w_j ~ s_j q_j), the hidden state h in about 15 bits (two int8 levels with VNNI, h ~
// a q1 + b q2; one int16 level elsewhere, h ~ a q1). Integer dot products are exact in any order;
// approx_j = s_j (a I1_j + b I2_j), the second level absent where there is one.
// The distance to the float32 logit is bounded per column (see greedy_head.py):
//   |exact_j - approx_j| <= norm * slack[j] + error * col_norm[j]
// norm: max(|h|, |a q1| + |b q2|); error: |h - (a q1 + b q2)| with 5% to spare. The best column's
// exact logit is at least max_j(approx_j - bound_j), so only columns whose approx_j + bound_j reaches
// that floor can win; the blocks that hold them are multiplied by the full product's own tile, so
// their logits are bitwise the full product's. A row that is not finite gets -1 (the caller takes the
// full product's argmax; the op also says whether any row got it, so that the caller need not look).
//
// A row whose bound leaves one column needs no exact logit at all. Given the pass's draft trees (each
// row's parent row and token), a row's exact logits are computed only where its token can matter:
// at a root, or below a row whose token is its own (greedy acceptance walks only that path). The
// rows after a rejected draft are where the model is least sure, each sending tens of blocks through
// the exact product; they get -2, and rows are resolved in rounds down the trees.
//
// Most of such a row's cost is its integer products (on an AVX2 core about as much per row as reading
// the int8 copy once), and a draft's rejection is often plain long before the sweep ends: its token's
// exact logit at the parent row is computed first, and once the parent's floor (approx - bound, the
// largest over the columns swept so far by any thread) rises above it, the draft's row and every row
// below it leave the sweep and get -2 (TreePruning). The op also says how many rows it computed to the
// end, which prices the next passes (greedy_head.py).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace {

using reader_spec::Int16;
using reader_spec::IntegerRow;
using reader_spec::kLanes;
using reader_spec::load;
using reader_spec::select;
using reader_spec::Vec16;

using reader_spec::kBlock;
constexpr int64_t kGroup = reader_spec::kIntegerGroup;

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

constexpr int64_t kUnbounded = -1;  // not finite: the caller takes the full product
constexpr int64_t kUnneeded = -2;   // below a rejected draft: no one reads it
constexpr int64_t kPending = -3;

// Whether row r's token can be read by greedy acceptance, given the tokens found so far: 1 yes, 0 no,
// -1 not known until an ancestor's token is.
int needed(int64_t r, const int64_t* parents, const int64_t* drafted, const int64_t* tokens, const int8_t* need) {
  if (parents == nullptr || parents[r] < 0) return 1;
  const int64_t parent = parents[r];
  if (need[parent] != 1) return need[parent];
  if (tokens[parent] == kPending) return -1;
  return tokens[parent] == kUnbounded || tokens[parent] == drafted[r];
}

// One candidate block of one row: its best candidate, the first of equal maxima.
struct BlockWork {
  int64_t row, first, end;  // candidates [first, end) of the row, all in one block
  int64_t best;
  float best_logit;
};

// Drops a draft's row from the integer sweep once its parent's row is known to hold a logit above the
// draft's token (greedy acceptance then stops at the parent and reads nothing below it). The token's
// exact logit at the parent comes first, from the full product's own tile; the parent's floor is a
// lower bound of its largest exact logit: the largest approx - bound over the columns swept so far,
// and the exact logits of its drafts' tokens (so a draft below a likelier sibling leaves at once).
class TreePruning final : public reader_spec::RowPruning {
 public:
  TreePruning(const float* x, int64_t rows, int64_t k_size, const float* weight, int64_t out_features,
              const int64_t* parents, const int64_t* drafted, const float* approx, int64_t ldy, const float* slack,
              const float* col_norm)
      : RowPruning(rows), parents_(parents), approx_(approx), ldy_(ldy), out_features_(out_features), slack_(slack),
        col_norm_(col_norm), token_logit_(rows, std::numeric_limits<float>::quiet_NaN()), floor_(rows),
        children_(rows) {
    for (std::atomic<float>& f : floor_) f.store(-std::numeric_limits<float>::infinity(), std::memory_order_relaxed);
    for (int64_t r = 0; r < rows; ++r) {
      if (parents[r] >= 0 && drafted[r] >= 0 && drafted[r] < out_features) children_[parents[r]].push_back(r);
    }
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      float logits[kBlock];
      for (int64_t r = begin; r < end; ++r) {
        if (parents[r] < 0 || drafted[r] < 0 || drafted[r] >= out_features) continue;
        const int64_t block = drafted[r] / kBlock;
        reader_spec::blocked_product(x + parents[r] * k_size, 1, weight + block * k_size * kBlock, k_size, nullptr,
                                     logits, std::min(kBlock, out_features - block * kBlock), false);
        token_logit_[r] = logits[drafted[r] % kBlock];
      }
    });
    for (int64_t r = 0; r < rows; ++r) {
      float highest = -std::numeric_limits<float>::infinity();
      for (int64_t child : children_[r]) highest = std::max(highest, token_logit_[child]);  // NaN stays out
      raise_floor(r, highest);
    }
  }

  void start(const std::vector<reader_spec::IntegerRow>& rows) override {
    quantized_ = &rows;
    for (int64_t r = 0; r < static_cast<int64_t>(rows.size()); ++r) drop_rejected(r);
  }

  void block_done(int64_t block, const int64_t* rows, int64_t count) override {
    const int64_t first = block * kBlock, end = std::min(first + kBlock, out_features_);
    for (int64_t i = 0; i < count; ++i) {
      const int64_t r = rows[i];
      const reader_spec::IntegerRow& row = (*quantized_)[r];
      if (children_[r].empty() || !row.finite) continue;
      const float* approx = approx_ + r * ldy_;
      float highest = -std::numeric_limits<float>::infinity();
      int64_t j = first;
      if (end - first == kBlock) {
        Vec16 lows = Vec16{} - std::numeric_limits<float>::infinity();
        for (; j < end; j += kLanes) {
          const Vec16 low = load(approx + j) - bounds(slack_, col_norm_, j, row.norm, row.error);
          lows = select(low > lows, low, lows);
        }
        for (int lane = 0; lane < kLanes; ++lane) highest = std::max(highest, lows[lane]);
      }
      for (; j < end; ++j) highest = std::max(highest, approx[j] - (row.norm * slack_[j] + row.error * col_norm_[j]));
      raise_floor(r, highest);
      drop_rejected(r);
    }
  }

 private:
  void raise_floor(int64_t r, float value) {
    float current = floor_[r].load(std::memory_order_relaxed);
    while (value > current && !floor_[r].compare_exchange_weak(current, value, std::memory_order_relaxed)) {
    }
  }

  // Drops each active draft under row r whose token's logit there is below r's floor, and every row
  // below a dropped one (a parent comes before its children).
  void drop_rejected(int64_t r) {
    const float floor = floor_[r].load(std::memory_order_relaxed);
    for (int64_t child : children_[r]) {
      if (!active(child) || !(floor > token_logit_[child])) continue;
      drop(child);
      const int64_t rows = static_cast<int64_t>(floor_.size());
      for (int64_t below = child + 1; below < rows; ++below) {
        if (parents_[below] >= child && !active(parents_[below])) drop(below);
      }
    }
  }

  const int64_t* parents_;
  const float* approx_;
  int64_t ldy_, out_features_;
  const float* slack_;
  const float* col_norm_;
  const std::vector<reader_spec::IntegerRow>* quantized_ = nullptr;
  std::vector<float> token_logit_;  // per draft row: its token's exact logit at its parent (NaN: never dropped)
  std::vector<std::atomic<float>> floor_;
  std::vector<std::vector<int64_t>> children_;  // drafts under each row that may be dropped
};

std::tuple<at::Tensor, bool, int64_t> greedy_tokens(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& weight_int8,
                         const at::Tensor& scales, const at::Tensor& slack, const at::Tensor& col_norm,
                         int64_t out_features, const c10::optional<at::Tensor>& parents,
                         const c10::optional<at::Tensor>& drafted) {
  reader_spec::check_panels(weight, "greedy_tokens");
  const int64_t blocks = weight.size(0) / reader_spec::kPanelsPerBlock, k_size = weight.size(1);
  const int64_t groups = (k_size + kGroup - 1) / kGroup;
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
  TORCH_CHECK(parents.has_value() == drafted.has_value(), "greedy_tokens: give both parents and drafted tokens");
  const int64_t* parent_data = nullptr;
  const int64_t* drafted_data = nullptr;
  if (parents.has_value()) {
    check(*parents, at::kLong, "parents must be contiguous int64");
    check(*drafted, at::kLong, "drafted tokens must be contiguous int64");
    TORCH_CHECK(parents->numel() == rows && drafted->numel() == rows, "greedy_tokens: one parent and token per row");
    parent_data = parents->data_ptr<int64_t>();
    drafted_data = drafted->data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r) {
      TORCH_CHECK(parent_data[r] >= -1 && parent_data[r] < r, "greedy_tokens: a row's parent must come before it");
    }
  }
  // Approximate logits of every row (padding columns included), blocks of columns in parallel; every
  // one is written, so the buffer is not zeroed first (8 rows: 1.5 MB).
  const std::unique_ptr<float[]> approx(new float[rows * blocks * kBlock]);
  std::unique_ptr<TreePruning> pruning;
  if (parent_data != nullptr && rows > 1) {
    pruning = std::make_unique<TreePruning>(x.data_ptr<float>(), rows, k_size, weight.data_ptr<float>(),
                                            out_features, parent_data, drafted_data, approx.get(), blocks * kBlock,
                                            slack.data_ptr<float>(), col_norm.data_ptr<float>());
  }
  const std::vector<IntegerRow> quantized =
      reader_spec::integer_product(x.data_ptr<float>(), rows, weight_int8.data_ptr<uint8_t>(), k_size,
                                   scales.data_ptr<float>(), nullptr, approx.get(), blocks * kBlock, blocks * kBlock,
                                   true, pruning.get());

  // Per row: the columns that can still be the largest; one of them is the token.
  at::Tensor tokens = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* token_data = tokens.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> candidates(rows);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (pruning != nullptr && !pruning->active(r)) {  // below a rejected draft, left partway
        token_data[r] = kUnneeded;
        continue;
      }
      if (!quantized[r].finite) {
        token_data[r] = kUnbounded;
        continue;
      }
      candidates_of(approx.get() + r * blocks * kBlock, slack.data_ptr<float>(), col_norm.data_ptr<float>(),
                    out_features, quantized[r].norm, quantized[r].error, candidates[r]);
      token_data[r] = candidates[r].size() == 1 ? candidates[r][0] : kPending;
    }
  });

  // Rows with several candidates, in rounds down the trees: each round takes every row now known to
  // be read and sends its candidates' blocks through the full product's own tile (its logits are
  // bitwise the full product's; read in order, a block costs less than gathering one column of it).
  const float* w_data = weight.data_ptr<float>();
  const int64_t block_stride = k_size * kBlock;
  std::vector<int8_t> need(rows);
  std::vector<BlockWork> work;
  while (true) {
    work.clear();
    for (int64_t r = 0; r < rows; ++r) {
      need[r] = needed(r, parent_data, drafted_data, token_data, need.data());
      if (need[r] != 1 || token_data[r] != kPending) continue;
      const std::vector<int64_t>& row = candidates[r];
      const int64_t count = row.size();
      for (int64_t first = 0, end = 1; first < count; first = end++) {
        while (end < count && row[end] / kBlock == row[first] / kBlock) ++end;
        work.push_back({r, first, end, -1, 0});
      }
    }
    if (work.empty()) break;
    at::parallel_for(0, static_cast<int64_t>(work.size()), 4, [&](int64_t begin, int64_t end) {
      float logits[kBlock];
      for (int64_t i = begin; i < end; ++i) {
        BlockWork& item = work[i];
        const int64_t* row = candidates[item.row].data();
        const int64_t block = row[item.first] / kBlock;
        reader_spec::blocked_product(x.data_ptr<float>() + item.row * k_size, 1, w_data + block * block_stride, k_size,
                                     nullptr, logits, std::min(kBlock, out_features - block * kBlock), false);
        for (int64_t c = item.first; c < item.end; ++c) {
          if (item.best < 0 || logits[row[c] % kBlock] > item.best_logit) {
            item.best = row[c];
            item.best_logit = logits[row[c] % kBlock];
          }
        }
      }
    });
    for (size_t i = 0; i < work.size();) {  // a row's blocks in column order: the first of equal maxima
      BlockWork best = work[i];
      for (++i; i < work.size() && work[i].row == best.row; ++i) {
        if (work[i].best_logit > best.best_logit) best = work[i];
      }
      token_data[best.row] = best.best;
    }
  }
  bool unbounded = false;
  for (int64_t r = 0; r < rows; ++r) {
    if (token_data[r] == kPending) token_data[r] = kUnneeded;
    unbounded = unbounded || token_data[r] == kUnbounded;
  }
  return {tokens, unbounded, rows - (pruning != nullptr ? pruning->dropped() : 0)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(reader_spec, m) {
  m.def(
      "greedy_tokens(Tensor hidden, Tensor weight, Tensor weight_int8, Tensor scales, Tensor slack, Tensor col_norm, "
      "int out_features, Tensor? parents=None, Tensor? drafted=None) -> (Tensor, bool, int)");
}

TORCH_LIBRARY_IMPL(reader_spec, CPU, m) { m.impl("greedy_tokens", &greedy_tokens); }
