// Drafting's hot loops in C++: the same rules as the pure Python functions they replace, to the bit.
//
// draft_tree: every source's weighted continuations merged into a prefix trie, then the nodes of
//   highest calibrated path probability in the union of the tries picked best first (tries.py:
//   build_continuation_trie, select_best_first). Floating-point operations run in the
//   same order as in Python, ties break the same way (children in insertion order, the heap by push
//   order), so both paths give identical proposals.
// draft_batch: the same for every request of a step, each source's match found and its trie built in
//   the n-gram tables here (reader.py: ReaderDrafter._source_matches, then draft_tree).
// lookup: a datastore's longest suffix of each query of a batch, by bisection on the memory-mapped
//   arrays, and the counted continuations of a sample of its occurrences (datastore.py:
//   Datastore.lookup); the queries run in parallel.
//
// A Python extension on the CPython API alone (no pybind11, no torch headers): it compiles in seconds
// and its calls cost about a microsecond.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// A prefix trie in flat arrays, children as sibling lists in insertion order; reused from call to call
// (clear keeps the capacity), so that building one allocates nothing once the buffers have grown.
struct Trie {
  std::vector<int64_t> token;
  std::vector<int> depth, first_child, last_child, next_sibling;
  std::vector<double> weight, child_weight;

  void clear() {
    token.assign(1, -1);
    depth.assign(1, 0);
    first_child.assign(1, -1);
    last_child.assign(1, -1);
    next_sibling.assign(1, -1);
    weight.assign(1, 0.0);
    child_weight.assign(1, 0.0);
  }

  int child(int node, int64_t tok) const {
    for (int c = first_child[node]; c >= 0; c = next_sibling[c])
      if (token[c] == tok) return c;
    return -1;
  }

  int add_child(int node, int64_t tok) {
    const int c = static_cast<int>(token.size());
    token.push_back(tok);
    depth.push_back(depth[node] + 1);
    first_child.push_back(-1);
    last_child.push_back(-1);
    next_sibling.push_back(-1);
    weight.push_back(0.0);
    child_weight.push_back(0.0);
    if (last_child[node] < 0) first_child[node] = c;
    else next_sibling[last_child[node]] = c;
    last_child[node] = c;
    return c;
  }
};

struct Source {
  PyObject* name;  // borrowed from the caller's arguments
  Trie trie;
  std::vector<long> contexts;  // per depth, the first calibration context of edges into it
  const std::vector<double>* table;  // calibrated estimates by cell: context x raw-estimate bucket
};

// How raw estimates are calibrated: the buckets' lower bounds, and how many agreement levels.
struct Calibration {
  std::vector<double> bounds;
  long agreement_levels;
};

// A Python int as int64; false with the Python error set.
bool as_int64(PyObject* obj, int64_t* out) {
  long long v = PyLong_AsLongLong(obj);
  if (v == -1 && PyErr_Occurred()) return false;
  *out = v;
  return true;
}

// build_continuation_trie over a sequence of (tokens, weight) pairs.
bool build_trie(PyObject* continuations, Trie* trie) {
  trie->clear();
  PyObject* items = PySequence_Fast(continuations, "continuations must be a sequence");
  if (!items) return false;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
  PyObject** item = PySequence_Fast_ITEMS(items);
  bool ok = true;
  for (Py_ssize_t i = 0; ok && i < n; ++i) {
    PyObject* pair = PySequence_Fast(item[i], "a continuation must be a (tokens, weight) pair");
    if (!pair || PySequence_Fast_GET_SIZE(pair) != 2) {
      if (pair) PyErr_SetString(PyExc_ValueError, "a continuation must be a (tokens, weight) pair");
      Py_XDECREF(pair);
      ok = false;
      break;
    }
    double w = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(pair, 1));
    if (w == -1.0 && PyErr_Occurred()) ok = false;
    PyObject* tokens = ok && !(w <= 0) ? PySequence_Fast(PySequence_Fast_GET_ITEM(pair, 0), "tokens") : nullptr;
    if (ok && !(w <= 0) && !tokens) ok = false;
    if (tokens) {
      int node = 0;
      trie->weight[0] += w;
      Py_ssize_t m = PySequence_Fast_GET_SIZE(tokens);
      PyObject** tok = PySequence_Fast_ITEMS(tokens);
      for (Py_ssize_t j = 0; j < m; ++j) {
        int64_t t;
        if (!as_int64(tok[j], &t)) {
          ok = false;
          break;
        }
        trie->child_weight[node] += w;
        int c = trie->child(node, t);
        if (c < 0) c = trie->add_child(node, t);
        trie->weight[c] += w;
        node = c;
      }
      Py_DECREF(tokens);
    }
    Py_DECREF(pair);
  }
  Py_DECREF(items);
  return ok;
}

struct Candidate {
  double prob;
  int64_t order;  // push order: ties pop first-pushed first
  int parent;
  int label;
  int64_t token;
  int nodes;  // offset of its per-source nodes in the shared node store
  long context;  // the labelling source's calibration context and raw estimate
  double raw;
};

struct Later {
  bool operator()(const Candidate& a, const Candidate& b) const {
    return a.prob < b.prob || (a.prob == b.prob && a.order > b.order);
  }
};

struct Entry {
  int64_t token;
  int nodes;     // offset of its per-source children (and raw estimates) in the scratch store
  int proposers;
};

class Selector {
 public:
  // Forget the last selection, keeping the buffers' capacity: one selector serves every call.
  void reset(const Source* sources, size_t count, const Calibration* calibration, Py_ssize_t max_breadth) {
    sources_ = sources;
    count_ = count;
    calibration_ = calibration;
    breadth_ = max_breadth;
    order_ = 0;
    store_.clear();
    scratch_.clear();  // a push that failed left its entries
    scratch_raw_.clear();
    heap_.clear();
    picked_.clear();
  }

  // push_children: every source's children of the path's nodes, the best calibrated estimate per token.
  bool push(int nodes, double prob, int index) {
    const size_t s = count_;
    entries_.clear();
    for (size_t k = 0; k < s; ++k) {
      int node = store_[nodes + k];
      if (node < 0) continue;
      const Trie& trie = sources_[k].trie;
      const double total = trie.child_weight[node] + 1.0;
      for (int child = trie.first_child[node]; child >= 0; child = trie.next_sibling[child]) {
        const int64_t tok = trie.token[child];
        Entry* entry = nullptr;
        for (auto& e : entries_)
          if (e.token == tok) {
            entry = &e;
            break;
          }
        if (!entry) {
          int at = static_cast<int>(scratch_.size());
          scratch_.insert(scratch_.end(), s, -1);
          scratch_raw_.insert(scratch_raw_.end(), s, 0.0);
          entries_.push_back({tok, at, 0});
          entry = &entries_.back();
        }
        scratch_[entry->nodes + k] = child;
        scratch_raw_[entry->nodes + k] = trie.weight[child] / total;
        ++entry->proposers;
      }
    }
    const size_t buckets = calibration_->bounds.size();
    ranked_.clear();
    for (const Entry& e : entries_) {
      const long agreement = std::min<long>(e.proposers, calibration_->agreement_levels) - 1;
      Candidate best{0.0, 0, index, -1, e.token, e.nodes, 0, 0.0};
      for (size_t k = 0; k < s; ++k) {
        int child = scratch_[e.nodes + k];
        if (child < 0) continue;
        if (best.label < 0) best.label = static_cast<int>(k);
        const Source& source = sources_[k];
        size_t d = static_cast<size_t>(source.trie.depth[child]) - 1;
        if (d >= source.contexts.size()) {
          PyErr_SetString(PyExc_IndexError, "a continuation is deeper than its source's calibration contexts");
          return false;
        }
        const double raw = scratch_raw_[e.nodes + k];
        const auto& bounds = calibration_->bounds;
        long bucket = static_cast<long>(std::upper_bound(bounds.begin(), bounds.end(), raw) - bounds.begin()) - 1;
        const long context = source.contexts[d] + agreement;
        const size_t cell = static_cast<size_t>(context) * buckets + static_cast<size_t>(std::max(bucket, 0L));
        if (context < 0 || cell >= source.table->size()) {
          PyErr_SetString(PyExc_IndexError, "a calibration context lies outside its source's table");
          return false;
        }
        const double calibrated = (*source.table)[cell];
        if (calibrated > best.prob) {
          best.prob = calibrated;
          best.label = static_cast<int>(k);
          best.context = context;
          best.raw = raw;
        }
      }
      ranked_.push_back(best);
    }
    std::stable_sort(ranked_.begin(), ranked_.end(),
                     [](const Candidate& a, const Candidate& b) { return -a.prob < -b.prob; });
    size_t keep = breadth_ > 0 ? std::min(ranked_.size(), static_cast<size_t>(breadth_)) : ranked_.size();
    for (size_t i = 0; i < keep; ++i) {
      Candidate c = ranked_[i];
      double p = prob * c.prob;
      if (p > 0.0) {
        int at = static_cast<int>(store_.size());
        store_.insert(store_.end(), scratch_.begin() + c.nodes, scratch_.begin() + c.nodes + s);
        c.prob = p;
        c.order = order_++;
        c.nodes = at;
        heap_.push_back(c);
        std::push_heap(heap_.begin(), heap_.end(), Later());
      }
    }
    scratch_.clear();
    scratch_raw_.clear();
    return true;
  }

  bool run(Py_ssize_t max_nodes) {
    int root = static_cast<int>(store_.size());
    store_.insert(store_.end(), count_, 0);
    if (!push(root, 1.0, -1)) return false;
    while (!heap_.empty() && static_cast<Py_ssize_t>(picked_.size()) < max_nodes) {
      std::pop_heap(heap_.begin(), heap_.end(), Later());
      Candidate c = heap_.back();
      heap_.pop_back();
      picked_.push_back(c);
      if (!push(c.nodes, c.prob, static_cast<int>(picked_.size()) - 1)) return false;
    }
    return true;
  }

  // (tokens, parents, probs, labels, (context, raw estimate) per node)
  PyObject* result() const {
    const Py_ssize_t n = static_cast<Py_ssize_t>(picked_.size());
    PyObject* tokens = PyTuple_New(n);
    PyObject* parents = PyTuple_New(n);
    PyObject* probs = PyTuple_New(n);
    PyObject* labels = PyTuple_New(n);
    PyObject* estimates = PyTuple_New(n);
    if (!tokens || !parents || !probs || !labels || !estimates) goto fail;
    for (Py_ssize_t i = 0; i < n; ++i) {
      const Candidate& c = picked_[i];
      PyTuple_SET_ITEM(tokens, i, PyLong_FromLongLong(c.token));
      PyTuple_SET_ITEM(parents, i, PyLong_FromLong(c.parent));
      PyTuple_SET_ITEM(probs, i, PyFloat_FromDouble(c.prob));
      PyObject* name = sources_[c.label].name;
      Py_INCREF(name);
      PyTuple_SET_ITEM(labels, i, name);
      PyTuple_SET_ITEM(estimates, i, Py_BuildValue("(ld)", c.context, c.raw));
    }
    for (Py_ssize_t i = 0; i < n; ++i)
      if (!PyTuple_GET_ITEM(tokens, i) || !PyTuple_GET_ITEM(parents, i) || !PyTuple_GET_ITEM(probs, i) ||
          !PyTuple_GET_ITEM(estimates, i))
        goto fail;
    return Py_BuildValue("(NNNNN)", tokens, parents, probs, labels, estimates);
  fail:
    Py_XDECREF(tokens);
    Py_XDECREF(parents);
    Py_XDECREF(probs);
    Py_XDECREF(labels);
    Py_XDECREF(estimates);
    return nullptr;
  }

 private:
  const Source* sources_ = nullptr;
  size_t count_ = 0;
  const Calibration* calibration_ = nullptr;
  Py_ssize_t breadth_ = 0;
  std::vector<int> store_;          // per candidate, its node in each source's trie (-1: absent)
  std::vector<int> scratch_;        // the same for the entries of one push
  std::vector<double> scratch_raw_; // and each source's raw estimate of the entry
  std::vector<Entry> entries_;
  std::vector<Candidate> ranked_;
  std::vector<Candidate> heap_;
  std::vector<Candidate> picked_;
  int64_t order_ = 0;
};

// A Python sequence of numbers as a vector; false with the Python error set.
template <typename T>
bool as_vector(PyObject* sequence, const char* what, std::vector<T>* out) {
  PyObject* items = PySequence_Fast(sequence, what);
  if (!items) return false;
  out->clear();
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(items); ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(items, i);
    T value = std::is_floating_point_v<T> ? static_cast<T>(PyFloat_AsDouble(item)) : static_cast<T>(PyLong_AsLong(item));
    if (value == static_cast<T>(-1) && PyErr_Occurred()) break;
    out->push_back(value);
  }
  Py_DECREF(items);
  return !PyErr_Occurred();
}

// The calibration arguments every drafting call takes: the raw-estimate buckets' lower bounds and the
// agreement levels. False with the Python error set.
bool as_calibration(PyObject* bounds, PyObject* agreement_levels, Calibration* out) {
  out->agreement_levels = PyLong_AsLong(agreement_levels);
  if (PyErr_Occurred() || !as_vector(bounds, "bounds must be a sequence", &out->bounds)) return false;
  if (out->bounds.empty() || out->agreement_levels < 1) {
    PyErr_SetString(PyExc_ValueError, "need at least one bucket bound and one agreement level");
    return false;
  }
  return true;
}

// The best nodes of the first `count` sources' tries, as draft_tree returns them. One selector serves
// every call of a thread (drafting calls this for every sequence of every step).
PyObject* select(const std::vector<Source>& sources, size_t count, const Calibration& calibration,
                 Py_ssize_t max_nodes, Py_ssize_t max_breadth) {
  thread_local Selector selector;
  selector.reset(sources.data(), count, &calibration, max_breadth);
  if (max_nodes > 0 && count > 0 && !selector.run(max_nodes)) return nullptr;
  return selector.result();
}

// draft_tree(sources, max_nodes, max_breadth, bounds, agreement_levels): sources is a sequence of
// (name, continuations, contexts, table); max_breadth 0 means unlimited.
PyObject* draft_tree(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError, "draft_tree(sources, max_nodes, max_breadth, bounds, agreement_levels)");
    return nullptr;
  }
  Py_ssize_t max_nodes = PyLong_AsSsize_t(args[1]);
  Py_ssize_t max_breadth = PyLong_AsSsize_t(args[2]);
  thread_local Calibration calibration;
  if (PyErr_Occurred() || !as_calibration(args[3], args[4], &calibration)) return nullptr;
  PyObject* items = PySequence_Fast(args[0], "sources must be a sequence");
  if (!items) return nullptr;
  // Reused from call to call: only the first `count` sources are this call's; the pools never shrink,
  // so their buffers keep their capacity.
  thread_local std::vector<Source> sources;
  thread_local std::vector<std::vector<double>> tables;
  const size_t count = static_cast<size_t>(PySequence_Fast_GET_SIZE(items));
  if (sources.size() < count) sources.resize(count);
  if (tables.size() < count) tables.resize(count);
  PyObject* result = nullptr;
  for (size_t k = 0; k < count; ++k) {
    PyObject* source = PySequence_Fast_GET_ITEM(items, static_cast<Py_ssize_t>(k));
    if (!PyTuple_Check(source) || PyTuple_GET_SIZE(source) != 4) {
      PyErr_SetString(PyExc_TypeError, "a source must be a (name, continuations, contexts, table) tuple");
      goto done;
    }
    sources[k].name = PyTuple_GET_ITEM(source, 0);
    sources[k].table = &tables[k];
    if (!build_trie(PyTuple_GET_ITEM(source, 1), &sources[k].trie) ||
        !as_vector(PyTuple_GET_ITEM(source, 2), "contexts must be a sequence", &sources[k].contexts) ||
        !as_vector(PyTuple_GET_ITEM(source, 3), "table must be a sequence", &tables[k]))
      goto done;
  }
  result = select(sources, count, calibration, max_nodes, max_breadth);
done:
  Py_DECREF(items);
  return result;
}

// Whether a suffix-array entry read while `matched` tokens agree can be an end of such a match: it must
// lie in [matched, size), or reading back from it would leave the token stream. Every entry of a sound
// array passes (position 0 is a separator, so a match of `matched` tokens ends at `matched` or later): a
// failure means a corrupt file, which datastore.py reports.
inline bool in_stream(int64_t end, int64_t matched, Py_ssize_t size) { return end >= matched && end < size; }

// Bisection of datastore.py's _longest_suffix: entries of [lo, hi) all end with the query's last
// `length` tokens, and are sorted by the token `length` places back. False where an entry it reads
// fails in_stream.
template <typename End>
bool longest_suffix_in(const uint32_t* tok, const End* sa, Py_ssize_t size, const std::vector<int64_t>& query,
                       Py_ssize_t* lo_out, Py_ssize_t* hi_out, Py_ssize_t* length_out) {
  Py_ssize_t lo = 0, hi = size, length = 0;
  const Py_ssize_t n = static_cast<Py_ssize_t>(query.size());
  bool sound = true;
  while (length < n) {
    const int64_t token = query[n - 1 - length];
    const int64_t back = length;
    auto key = [&](Py_ssize_t i) {
      const int64_t end = static_cast<int64_t>(sa[i]);
      if (!in_stream(end, back, size)) {
        sound = false;
        return int64_t{-1};
      }
      return static_cast<int64_t>(tok[end - back]);
    };
    Py_ssize_t a = lo, b = hi;  // first entry whose key is not below the token
    while (a < b) {
      Py_ssize_t mid = a + (b - a) / 2;
      const int64_t k = key(mid);
      if (!sound) return false;
      if (k < token) a = mid + 1;
      else b = mid;
    }
    Py_ssize_t c = a, d = hi;  // first entry whose key is above it
    while (c < d) {
      Py_ssize_t mid = c + (d - c) / 2;
      const int64_t k = key(mid);
      if (!sound) return false;
      if (k <= token) c = mid + 1;
      else d = mid;
    }
    if (a == c) break;
    lo = a;
    hi = c;
    ++length;
  }
  *lo_out = lo;
  *hi_out = hi;
  *length_out = length;
  return true;
}

constexpr uint32_t kSeparator = 0xFFFFFFFFu;
// What lookup raises (ValueError) on an entry that fails in_stream; the pure path says the same.
constexpr const char* kCorrupt = "an entry points outside the token stream";

using Counted = std::vector<std::pair<std::vector<uint32_t>, Py_ssize_t>>;

// What follows `sampled` evenly spaced occurrences of [lo, hi) of a match of `length` tokens, up to
// max_depth tokens cut at a separator, counted per distinct continuation: most frequent first, ties in
// sampling order (datastore.py: Datastore.lookup). False where a sampled entry fails in_stream.
template <typename End>
bool count_continuations(const uint32_t* tok, const End* sa, Py_ssize_t size, Py_ssize_t lo, Py_ssize_t total,
                         Py_ssize_t length, Py_ssize_t sampled, Py_ssize_t max_depth, Counted* counted) {
  std::map<std::vector<uint32_t>, size_t> seen;
  std::vector<uint32_t> row;
  for (Py_ssize_t i = 0; i < sampled; ++i) {
    const int64_t end = static_cast<int64_t>(sa[lo + (static_cast<int64_t>(i) * total) / sampled]);
    if (!in_stream(end, length, size)) return false;
    row.clear();
    for (Py_ssize_t j = 1; j <= max_depth; ++j) {
      const uint32_t t = tok[std::min<int64_t>(end + j, size - 1)];
      if (t == kSeparator) break;
      row.push_back(t);
    }
    if (row.empty()) continue;
    auto [at, fresh] = seen.emplace(row, counted->size());
    if (fresh) counted->emplace_back(row, 0);
    ++(*counted)[at->second].second;
  }
  std::stable_sort(counted->begin(), counted->end(),
                   [](const auto& a, const auto& b) { return a.second > b.second; });
  return true;
}

struct Found {
  Py_ssize_t length = 0, occurrences = 0, sampled = 0;
  Counted continuations;
  bool corrupt = false;  // the suffix array pointed outside the token stream
};

// One query's longest suffix and counted continuations; reads the arrays only (no Python objects).
template <typename End>
Found search(const uint32_t* tok, const End* sa, Py_ssize_t size, const std::vector<int64_t>& query,
             Py_ssize_t max_occurrences, Py_ssize_t max_depth) {
  Found found;
  Py_ssize_t lo = 0, hi = 0;
  if (!longest_suffix_in(tok, sa, size, query, &lo, &hi, &found.length)) {
    found.corrupt = true;
  } else if (found.length > 0) {
    found.occurrences = hi - lo;
    found.sampled = std::min(max_occurrences, hi - lo);
    found.corrupt = !count_continuations(tok, sa, size, lo, hi - lo, found.length, found.sampled, max_depth,
                                         &found.continuations);
  }
  return found;
}

// (length, occurrences, sampled, continuations) as Datastore.lookup's Lookup takes them.
PyObject* as_python(const Found& found) {
  PyObject* continuations = PyTuple_New(static_cast<Py_ssize_t>(found.continuations.size()));
  if (!continuations) return nullptr;
  for (size_t i = 0; i < found.continuations.size(); ++i) {
    const auto& [row, count] = found.continuations[i];
    PyObject* key = PyTuple_New(static_cast<Py_ssize_t>(row.size()));
    if (!key) {
      Py_DECREF(continuations);
      return nullptr;
    }
    for (size_t j = 0; j < row.size(); ++j) PyTuple_SET_ITEM(key, j, PyLong_FromUnsignedLong(row[j]));
    PyTuple_SET_ITEM(continuations, i, Py_BuildValue("(Nn)", key, count));
  }
  return Py_BuildValue("(nnnN)", found.length, found.occurrences, found.sampled, continuations);
}

bool as_query(PyObject* sequence, std::vector<int64_t>* query) {
  PyObject* items = PySequence_Fast(sequence, "a query must be a sequence of token ids");
  if (!items) return false;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(items); ++i) {
    int64_t t;
    if (!as_int64(PySequence_Fast_GET_ITEM(items, i), &t)) {
      Py_DECREF(items);
      return false;
    }
    query->push_back(t);
  }
  Py_DECREF(items);
  return true;
}

// lookup(tokens, suffix_array, queries, max_occurrences, max_depth): for every query, (length,
// occurrences, sampled, continuations) of its longest suffix. tokens is a uint32 buffer, the suffix
// array an int32 or int64 buffer of the same length (little-endian, as the files store them). The
// searches of a batch run in parallel, without the GIL: each is a chain of dependent reads from
// memory, so they overlap well. Every entry is checked before it is used as a position (in_stream): a
// corrupt suffix array raises ValueError instead of reading outside the arrays.
PyObject* lookup(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError, "lookup(tokens, suffix_array, queries, max_occurrences, max_depth)");
    return nullptr;
  }
  const Py_ssize_t max_occurrences = PyLong_AsSsize_t(args[3]);
  const Py_ssize_t max_depth = PyLong_AsSsize_t(args[4]);
  if (PyErr_Occurred()) return nullptr;
  PyObject* items = PySequence_Fast(args[2], "queries must be a sequence");
  if (!items) return nullptr;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
  std::vector<std::vector<int64_t>> queries(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!as_query(PySequence_Fast_GET_ITEM(items, i), &queries[i])) {
      Py_DECREF(items);
      return nullptr;
    }
  }
  Py_DECREF(items);
  Py_buffer tokens, sa;
  if (PyObject_GetBuffer(args[0], &tokens, PyBUF_SIMPLE) < 0) return nullptr;
  if (PyObject_GetBuffer(args[1], &sa, PyBUF_SIMPLE) < 0) {
    PyBuffer_Release(&tokens);
    return nullptr;
  }
  const Py_ssize_t size = tokens.len / 4;
  PyObject* result = nullptr;
  if (tokens.len % 4 != 0 || size < 1 || (sa.len != size * 4 && sa.len != size * 8)) {
    PyErr_SetString(PyExc_ValueError, "the token and suffix arrays disagree in length");
  } else {
    const auto* tok = static_cast<const uint32_t*>(tokens.buf);
    const bool wide = sa.len == size * 8;
    std::vector<Found> found(static_cast<size_t>(n));
    Py_BEGIN_ALLOW_THREADS;
#pragma omp parallel for schedule(dynamic) if (n > 1)
    for (Py_ssize_t i = 0; i < n; ++i) {
      found[i] = wide ? search(tok, static_cast<const int64_t*>(sa.buf), size, queries[i], max_occurrences, max_depth)
                      : search(tok, static_cast<const int32_t*>(sa.buf), size, queries[i], max_occurrences, max_depth);
    }
    Py_END_ALLOW_THREADS;
    if (std::any_of(found.begin(), found.end(), [](const Found& f) { return f.corrupt; }))
      PyErr_SetString(PyExc_ValueError, kCorrupt);
    else
      result = PyList_New(n);
    for (Py_ssize_t i = 0; result && i < n; ++i) {
      PyObject* one = as_python(found[i]);
      if (!one) Py_CLEAR(result);
      else PyList_SET_ITEM(result, i, one);
    }
  }
  PyBuffer_Release(&sa);
  PyBuffer_Release(&tokens);
  return result;
}

// ---------------------------------------------------------------------------------------------
// NgramTable: ngram_index.py's NgramIndex (the same lazily keyed n-grams and occurrence chains, so
// the same matches and occurrences in the same order), with n-grams keyed by a hash of their tokens
// and compared token by token on a hash hit (exact: a collision only costs a comparison).

struct Slot {
  uint64_t hash = 0;
  int32_t end = -1;  // -1: empty
  uint8_t n = 0;
};

inline uint64_t extend_hash(uint64_t hash, uint32_t token) {
  return (hash ^ (static_cast<uint64_t>(token) + 1)) * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
}

inline size_t spread(uint64_t hash) {
  hash ^= hash >> 31;
  hash *= 0xBF58476D1CE4E5B9ull;
  return static_cast<size_t>(hash ^ (hash >> 29));
}

struct Table {
  int max_ngram = 12;
  int suffix_match = 0;
  std::vector<uint32_t> tokens;
  std::vector<int32_t> prev;  // prev[p * max_ngram + n - 1]: the occurrence before p of p's n-gram
  std::vector<uint8_t> depth;  // how many of p's n-grams are keyed (the first new one included)
  std::vector<Slot> slots = std::vector<Slot>(1024);
  size_t used = 0;

  // Whether the n tokens ending at `end` in the text equal those ending at `probe` (read backwards).
  bool same(int32_t end, const uint32_t* probe, int n) const {
    for (int i = 0; i < n; ++i)
      if (tokens[end - i] != probe[-i]) return false;
    return true;
  }

  Slot* find(uint64_t hash, int n, const uint32_t* probe) {
    const size_t mask = slots.size() - 1;
    for (size_t i = spread(hash) & mask;; i = (i + 1) & mask) {
      Slot& slot = slots[i];
      if (slot.end < 0) return &slot;  // where it would go
      if (slot.hash == hash && slot.n == n && same(slot.end, probe, n)) return &slot;
    }
  }

  void put(Slot* slot, uint64_t hash, int n, int32_t end) {
    if (slot->end < 0) {
      *slot = {hash, end, static_cast<uint8_t>(n)};
      if (++used * 2 > slots.size()) grow();
    } else {
      slot->end = end;
    }
  }

  void grow() {
    std::vector<Slot> old(slots.size() * 2);
    old.swap(slots);
    const size_t mask = slots.size() - 1;
    for (const Slot& slot : old) {
      if (slot.end < 0) continue;
      size_t i = spread(slot.hash) & mask;
      while (slots[i].end >= 0) i = (i + 1) & mask;
      slots[i] = slot;
    }
  }

  // NgramIndex.append for one new position p (already in `tokens`).
  void index(int32_t p) {
    const int count = std::min(max_ngram, p + 1);
    prev.insert(prev.end(), max_ngram, -1);
    const uint32_t* at = &tokens[p];
    uint64_t hash = 0;
    int n = 1;
    for (; n <= count; ++n) {
      hash = extend_hash(hash, at[1 - n]);
      Slot* slot = find(hash, n, at);
      const int32_t q = slot->end;
      put(slot, hash, n, p);
      if (q < 0) {  // first occurrence of this n-gram: p becomes a leaf here
        depth.push_back(static_cast<uint8_t>(n));
        suffix_match = n - 1;
        return;
      }
      prev[static_cast<size_t>(p) * max_ngram + n - 1] = q;
      if (depth[q] == n && n <= q && n < max_ngram) {  // q was a leaf: give it its next key
        const uint64_t longer = extend_hash(hash, tokens[q - n]);
        put(find(longer, n + 1, &tokens[q]), longer, n + 1, q);
        depth[q] = static_cast<uint8_t>(n + 1);
      }
    }
    depth.push_back(static_cast<uint8_t>(count));
    suffix_match = count;
  }

  // NgramIndex.longest_match(query), the query given as its last `size` tokens (at most max_ngram),
  // ending at `at`.
  std::pair<int, int32_t> longest(const uint32_t* at, int size) {
    int length = 0;
    int32_t end = -1;
    uint64_t hash = 0;
    for (int n = 1; n <= size; ++n) {
      hash = extend_hash(hash, at[1 - n]);
      const int32_t q = find(hash, n, at)->end;
      if (q < 0) break;
      length = n;
      end = q;
    }
    if (length > 0 && length < size && depth[end] == length) {  // past a leaf's keys: compare directly
      while (length < size && length <= end && tokens[end - length] == at[-length]) ++length;
    }
    return {length, end};
  }

  // The end positions of up to `limit` occurrences of a match, newest first, each passed to `visit`.
  template <typename Visit>
  void each_occurrence(int length, int32_t end, Py_ssize_t limit, Visit visit) const {
    if (length == 0 || limit <= 0) return;
    if (depth[end] < length) {  // matched past a leaf's keys: it is the only occurrence
      visit(end);
      return;
    }
    for (Py_ssize_t found = 0; end >= 0 && found < limit; ++found) {
      visit(end);
      end = prev[static_cast<size_t>(end) * max_ngram + length - 1];
    }
  }

  std::vector<int32_t> occurrences(int length, int32_t end, Py_ssize_t limit) const {
    std::vector<int32_t> ends;
    each_occurrence(length, end, limit, [&](int32_t q) { ends.push_back(q); });
    return ends;
  }

  // The match of the text's own last `length` tokens before them (0: its longest), as own_match.
  std::pair<int, int32_t> own(int length) const {
    if (length == 0) length = suffix_match;
    if (length == 0) return {0, -1};
    return {length, prev[(tokens.size() - 1) * max_ngram + length - 1]};
  }

  // Where the tokens after `end` run up to: `max_depth` of them, cut at the text's end and before `stop`.
  Py_ssize_t continuation_end(int32_t end, Py_ssize_t max_depth, long long stop) const {
    const Py_ssize_t from = end + 1;
    const Py_ssize_t to = std::min(static_cast<Py_ssize_t>(tokens.size()), from + std::max<Py_ssize_t>(max_depth, 0));
    for (Py_ssize_t j = from; j < to; ++j)
      if (static_cast<long long>(tokens[j]) == stop) return j;
    return to;
  }
};

struct NgramTable {
  PyObject_HEAD Table* table;
};

extern PyTypeObject NgramTableType;

PyObject* table_new(PyTypeObject* type, PyObject* args, PyObject*) {
  int max_ngram;
  if (!PyArg_ParseTuple(args, "i", &max_ngram)) return nullptr;
  if (max_ngram < 1 || max_ngram > 255) {
    PyErr_SetString(PyExc_ValueError, "max_ngram must lie in [1, 255]");
    return nullptr;
  }
  auto* self = reinterpret_cast<NgramTable*>(type->tp_alloc(type, 0));
  if (!self) return nullptr;
  self->table = new Table();
  self->table->max_ngram = max_ngram;
  return reinterpret_cast<PyObject*>(self);
}

void table_dealloc(PyObject* self) {
  delete reinterpret_cast<NgramTable*>(self)->table;
  Py_TYPE(self)->tp_free(self);
}

bool as_tokens(PyObject* sequence, std::vector<uint32_t>* out) {
  PyObject* items = PySequence_Fast(sequence, "tokens must be a sequence of ints");
  if (!items) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
  out->reserve(out->size() + static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    unsigned long long t = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(items, i));
    if (PyErr_Occurred() || t >= 0xFFFFFFFFull) {
      if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_OverflowError)) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "token ids must lie in [0, 4294967295)");
      }
      Py_DECREF(items);
      return false;
    }
    out->push_back(static_cast<uint32_t>(t));
  }
  Py_DECREF(items);
  return true;
}

PyObject* table_append(PyObject* self, PyObject* tokens) {
  Table& table = *reinterpret_cast<NgramTable*>(self)->table;
  std::vector<uint32_t> fresh;
  if (!as_tokens(tokens, &fresh)) return nullptr;
  const size_t first = table.tokens.size();
  table.tokens.insert(table.tokens.end(), fresh.begin(), fresh.end());
  for (size_t p = first; p < table.tokens.size(); ++p) table.index(static_cast<int32_t>(p));
  Py_RETURN_NONE;
}

// own_match(length): the text's own last `length` tokens matched before them (length 0: the longest).
PyObject* table_own_match(PyObject* self, PyObject* arg) {
  const Table& table = *reinterpret_cast<NgramTable*>(self)->table;
  long length = PyLong_AsLong(arg);
  if (length == -1 && PyErr_Occurred()) return nullptr;
  if (length < 0 || length > table.suffix_match) {
    PyErr_Format(PyExc_ValueError, "the text's suffix matches %d tokens, not %ld", table.suffix_match, length);
    return nullptr;
  }
  auto [matched, end] = table.own(static_cast<int>(length));
  return Py_BuildValue("(ii)", matched, end);
}

PyObject* table_longest_match(PyObject* self, PyObject* query) {
  Table& table = *reinterpret_cast<NgramTable*>(self)->table;
  PyObject* items = PySequence_Fast(query, "query must be a sequence of ints");
  if (!items) return nullptr;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
  PyObject* tail = PySequence_GetSlice(items, std::max<Py_ssize_t>(0, n - table.max_ngram), n);
  Py_DECREF(items);
  if (!tail) return nullptr;
  std::vector<uint32_t> tokens;
  const bool ok = as_tokens(tail, &tokens);
  Py_DECREF(tail);
  if (!ok) return nullptr;
  auto [length, end] = table.longest(tokens.data() + tokens.size() - 1, static_cast<int>(tokens.size()));
  return Py_BuildValue("(ii)", length, end);
}

// continuations(length, end, max_occurrences, max_depth, stop): what followed the newest occurrences,
// each cut before `stop` (-1: none), as (tokens, 1.0) pairs: the weighted continuations draft_tree takes.
PyObject* table_continuations(PyObject* self, PyObject* args) {
  const Table& table = *reinterpret_cast<NgramTable*>(self)->table;
  int length, end;
  Py_ssize_t limit, max_depth;
  long long stop;
  if (!PyArg_ParseTuple(args, "iinnL", &length, &end, &limit, &max_depth, &stop)) return nullptr;
  const std::vector<int32_t> ends = table.occurrences(length, end, limit);
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(ends.size()));
  PyObject* weight = PyFloat_FromDouble(1.0);
  if (!weight) Py_CLEAR(out);
  for (size_t i = 0; out && i < ends.size(); ++i) {
    const Py_ssize_t from = ends[i] + 1;
    const Py_ssize_t to = table.continuation_end(ends[i], max_depth, stop);
    PyObject* row = PyList_New(std::max<Py_ssize_t>(to - from, 0));
    PyObject* pair = row ? PyTuple_Pack(2, row, weight) : nullptr;
    Py_XDECREF(row);
    if (!pair) {
      Py_CLEAR(out);
      break;
    }
    for (Py_ssize_t j = from; j < to; ++j) PyList_SET_ITEM(row, j - from, PyLong_FromUnsignedLong(table.tokens[j]));
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), pair);
  }
  Py_XDECREF(weight);
  return out;
}

PyObject* table_occurrences(PyObject* self, PyObject* args) {
  const Table& table = *reinterpret_cast<NgramTable*>(self)->table;
  int length, end;
  Py_ssize_t limit;
  if (!PyArg_ParseTuple(args, "iin", &length, &end, &limit)) return nullptr;
  const std::vector<int32_t> ends = table.occurrences(length, end, limit);
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(ends.size()));
  for (size_t i = 0; out && i < ends.size(); ++i) PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), PyLong_FromLong(ends[i]));
  return out;
}

PyObject* table_copy(PyObject* self, PyObject*) {
  auto* other = reinterpret_cast<NgramTable*>(NgramTableType.tp_alloc(&NgramTableType, 0));
  if (!other) return nullptr;
  other->table = new Table(*reinterpret_cast<NgramTable*>(self)->table);
  return reinterpret_cast<PyObject*>(other);
}

Py_ssize_t table_length(PyObject* self) {
  return static_cast<Py_ssize_t>(reinterpret_cast<NgramTable*>(self)->table->tokens.size());
}

PyMethodDef table_methods[] = {
    {"append", table_append, METH_O, "Index new tokens."},
    {"own_match", table_own_match, METH_O, "(length, end) of the text's own suffix of a length (0: longest)."},
    {"longest_match", table_longest_match, METH_O, "(length, end) of a query's longest suffix found."},
    {"occurrences", table_occurrences, METH_VARARGS, "End positions of a match's newest occurrences."},
    {"continuations", table_continuations, METH_VARARGS, "What followed a match's newest occurrences, weighted."},
    {"copy", table_copy, METH_NOARGS, "An independent copy."},
    {nullptr, nullptr, 0, nullptr}};

PySequenceMethods table_sequence = {table_length};

PyTypeObject NgramTableType = [] {
  PyTypeObject type{PyVarObject_HEAD_INIT(nullptr, 0)};
  type.tp_name = "reader_spec_retrieval.NgramTable";
  type.tp_basicsize = sizeof(NgramTable);
  type.tp_flags = Py_TPFLAGS_DEFAULT;
  type.tp_doc = "NgramIndex's tables in C++: NgramTable(max_ngram)";
  type.tp_new = table_new;
  type.tp_dealloc = table_dealloc;
  type.tp_methods = table_methods;
  type.tp_as_sequence = &table_sequence;
  return type;
}();


// ---------------------------------------------------------------------------------------------
// draft_batch: reader.py's ReaderDrafter._source_matches and draft_tree for every request of a step
// in one call, the tries built straight from the n-gram tables: the same drafts as the Python path,
// without the Python objects that carried the continuations from the tables to the tries (most of
// proposing's time for a batch).

enum SourceKind { kContext, kContextHalf, kHistory, kHistoryHalf, kDatastore, kSourceKinds };

struct DraftSettings {
  Py_ssize_t max_nodes, max_depth, max_occurrences, min_match, max_breadth;
  int use_context, half_matches;
  long long stop;  // where the history's continuations end (its separator)
  Calibration calibration;
  std::vector<long> match_bounds;
};

// The continuations of a table's match as a trie: what build_trie makes of table_continuations' pairs.
void build_trie(const Table& table, int length, int32_t end, const DraftSettings& settings, long long stop,
                Py_ssize_t depth, Trie* trie) {
  trie->clear();
  table.each_occurrence(length, end, settings.max_occurrences, [&](int32_t q) {
    trie->weight[0] += 1.0;
    int node = 0;
    const Py_ssize_t to = table.continuation_end(q, depth, stop);
    for (Py_ssize_t j = q + 1; j < to; ++j) {
      trie->child_weight[node] += 1.0;
      int c = trie->child(node, table.tokens[j]);
      if (c < 0) c = trie->add_child(node, table.tokens[j]);
      trie->weight[c] += 1.0;
      node = c;
    }
  });
}

// calibration.py's match_contexts: per depth d, the first calibration context of edges into it.
void match_contexts(long match_length, Py_ssize_t depth, const DraftSettings& settings, std::vector<long>* out) {
  const auto& bounds = settings.match_bounds;
  out->clear();
  for (Py_ssize_t d = 0; d < depth; ++d) {
    const long bucket = static_cast<long>(std::upper_bound(bounds.begin(), bounds.end(), match_length + d) - bounds.begin()) - 1;
    out->push_back(std::max(bucket, 0L) * settings.calibration.agreement_levels);
  }
}

// The last `size` tokens of a request's text (its indexed tokens, then `extra`), into `out`.
void text_tail(const Table& table, const std::vector<uint32_t>& extra, size_t size, std::vector<uint32_t>* out) {
  out->clear();
  const size_t from_extra = std::min(size, extra.size());
  const size_t from_table = std::min(size - from_extra, table.tokens.size());
  out->insert(out->end(), table.tokens.end() - static_cast<Py_ssize_t>(from_table), table.tokens.end());
  out->insert(out->end(), extra.end() - static_cast<Py_ssize_t>(from_extra), extra.end());
}

// A table's longest match of the text's last `size` tokens (at most its max_ngram).
std::pair<int, int32_t> longest_of(Table& table, const std::vector<uint32_t>& tail, size_t size) {
  const int n = static_cast<int>(std::min({size, tail.size(), static_cast<size_t>(table.max_ngram)}));
  if (n == 0) return {0, -1};
  return table.longest(tail.data() + tail.size() - 1, n);
}

// One call's requests, one at a time; kept from call to call, so that its tries and buffers keep their
// capacity.
class BatchDrafter {
 public:
  void reset(const DraftSettings* settings, PyObject* const* names, const std::vector<double>* tables,
             Table* history) {
    settings_ = settings;
    names_ = names;
    tables_ = tables;
    history_ = history;
  }

  // One request's tree: (tokens, parents, probs, labels, estimates), as draft_tree returns them.
  PyObject* draft(Table& context, const std::vector<uint32_t>& extra, PyObject* found) {
    if (settings_->max_nodes <= 0) return select(sources_, 0, settings_->calibration, 0, 0);
    const Py_ssize_t depth = std::min(settings_->max_depth, settings_->max_nodes);
    const size_t span = static_cast<size_t>(std::max(context.max_ngram, history_ ? history_->max_ngram : 0));
    text_tail(context, extra, span, &tail_);
    const bool extended = !extra.empty();
    count_ = 0;
    if (settings_->use_context) {
      auto [length, end] = extended ? longest_of(context, tail_, context.max_ngram) : context.own(0);
      add(kContext, context, length, end, -1, depth);
      if (settings_->half_matches && length >= 2) {
        auto [half, half_end] = extended ? longest_of(context, tail_, length / 2) : context.own(length / 2);
        add(kContextHalf, context, half, half_end, -1, depth);
      }
    }
    if (history_ != nullptr) {
      auto [length, end] = longest_of(*history_, tail_, tail_.size());
      add(kHistory, *history_, length, end, settings_->stop, depth);
      if (settings_->half_matches && length >= 2) {
        auto [half, half_end] = longest_of(*history_, tail_, length / 2);
        add(kHistoryHalf, *history_, half, half_end, settings_->stop, depth);
      }
    }
    if (found != Py_None) {
      long length;
      PyObject* continuations;
      if (!PyArg_ParseTuple(found, "lO", &length, &continuations)) return nullptr;
      if (length >= settings_->min_match) {
        Source& source = start_source(kDatastore, length, depth);
        if (!build_trie(continuations, &source.trie)) return nullptr;
      }
    }
    return select(sources_, count_, settings_->calibration, settings_->max_nodes, settings_->max_breadth);
  }

 private:
  // The next source of the request's tree, labelled and calibrated as `kind`, its trie left to fill.
  Source& start_source(SourceKind kind, long length, Py_ssize_t depth) {
    if (sources_.size() <= count_) sources_.resize(count_ + 1);
    Source& source = sources_[count_++];
    source.name = names_[kind];
    source.table = &tables_[kind];
    match_contexts(length, depth, *settings_, &source.contexts);
    return source;
  }

  void add(SourceKind kind, const Table& table, int length, int32_t end, long long stop, Py_ssize_t depth) {
    if (length < settings_->min_match) return;
    build_trie(table, length, end, *settings_, stop, depth, &start_source(kind, length, depth).trie);
  }

  const DraftSettings* settings_ = nullptr;
  PyObject* const* names_ = nullptr;
  const std::vector<double>* tables_ = nullptr;
  Table* history_ = nullptr;
  std::vector<Source> sources_;
  size_t count_ = 0;
  std::vector<uint32_t> tail_;
};

// draft_batch(requests, history, names, tables, settings, bounds, agreement_levels, match_bounds):
// requests is a sequence of (NgramTable of the request's text, tokens drafted after it (empty: none),
// the datastore's (match length, continuations) or None); history the responses' NgramTable or None;
// names and tables the sources' labels and calibration tables in SourceKind's order (a table of a
// source not in use may be None); settings (max_nodes, max_depth, max_occurrences, min_match,
// max_breadth, use_context, half_matches, the history's stop token). A list of draft_tree's results.
PyObject* draft_batch(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 8) {
    PyErr_SetString(PyExc_TypeError,
                    "draft_batch(requests, history, names, tables, settings, bounds, agreement_levels, match_bounds)");
    return nullptr;
  }
  thread_local DraftSettings settings;
  if (!PyArg_ParseTuple(args[4], "nnnnnppL", &settings.max_nodes, &settings.max_depth, &settings.max_occurrences,
                        &settings.min_match, &settings.max_breadth, &settings.use_context, &settings.half_matches,
                        &settings.stop) ||
      !as_calibration(args[5], args[6], &settings.calibration) ||
      !as_vector(args[7], "match_bounds must be a sequence", &settings.match_bounds))
    return nullptr;
  Table* history = nullptr;
  if (args[1] != Py_None) {
    if (!PyObject_TypeCheck(args[1], &NgramTableType)) {
      PyErr_SetString(PyExc_TypeError, "history must be an NgramTable or None");
      return nullptr;
    }
    history = reinterpret_cast<NgramTable*>(args[1])->table;
  }
  if (!PyTuple_Check(args[2]) || PyTuple_GET_SIZE(args[2]) != kSourceKinds || !PyTuple_Check(args[3]) ||
      PyTuple_GET_SIZE(args[3]) != kSourceKinds) {
    PyErr_SetString(PyExc_TypeError, "names and tables must be tuples with an entry per source kind");
    return nullptr;
  }
  PyObject* names[kSourceKinds];
  thread_local std::vector<double> tables[kSourceKinds];
  for (int k = 0; k < kSourceKinds; ++k) {
    names[k] = PyTuple_GET_ITEM(args[2], k);
    PyObject* table = PyTuple_GET_ITEM(args[3], k);
    tables[k].clear();
    if (table != Py_None && !as_vector(table, "a calibration table must be a sequence", &tables[k])) return nullptr;
  }
  PyObject* items = PySequence_Fast(args[0], "requests must be a sequence");
  if (!items) return nullptr;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
  PyObject* out = PyList_New(n);
  thread_local BatchDrafter drafter;
  drafter.reset(&settings, names, tables, history);
  std::vector<uint32_t> extra;
  for (Py_ssize_t i = 0; out && i < n; ++i) {
    PyObject* request = PySequence_Fast_GET_ITEM(items, i);
    PyObject *table, *after, *found;
    if (!PyTuple_Check(request) || !PyArg_ParseTuple(request, "O!OO", &NgramTableType, &table, &after, &found)) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "a request must be a (table, extra tokens, found) tuple");
      Py_CLEAR(out);
      break;
    }
    extra.clear();
    PyObject* drafted = as_tokens(after, &extra)
                            ? drafter.draft(*reinterpret_cast<NgramTable*>(table)->table, extra, found)
                            : nullptr;
    if (!drafted) Py_CLEAR(out);
    else PyList_SET_ITEM(out, i, drafted);
  }
  Py_DECREF(items);
  return out;
}

PyMethodDef methods[] = {
    {"draft_tree", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(draft_tree)), METH_FASTCALL,
     "Merge sources' continuations into tries and pick the best nodes: (tokens, parents, probs, labels, "
     "(context, raw estimate) per node)."},
    {"draft_batch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(draft_batch)), METH_FASTCALL,
     "Every request's draft tree from its text, the history and the datastore's matches, in one call."},
    {"lookup", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(lookup)), METH_FASTCALL,
     "For each query, a datastore's longest suffix of it and the counted continuations of its occurrences."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "reader_spec_retrieval", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_reader_spec_retrieval() {
  if (PyType_Ready(&NgramTableType) < 0) return nullptr;
  PyObject* m = PyModule_Create(&module);
  if (!m) return nullptr;
  Py_INCREF(&NgramTableType);
  if (PyModule_AddObject(m, "NgramTable", reinterpret_cast<PyObject*>(&NgramTableType)) < 0) {
    Py_DECREF(&NgramTableType);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
