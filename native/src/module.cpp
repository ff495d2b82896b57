// Python bindings of the constraint engine (pybind11). Everything per row happens here in one call per step:
// `sync` reads the new tokens of every constrained row straight from vLLM's output lists (GIL held, no Python
// code per row), `fill`/`apply` run on the thread pool with the GIL released.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <string>
#include <string_view>
#include <thread>

#include "constraint_batch.hpp"
#include "constraint_json.hpp"
#include "mask_launch.hpp"

namespace py = pybind11;
using cons::Token;

namespace {

// One row's link to its request's token history (the engine's own list, which grows in place).
struct History {
  py::object tokens;  // a list, or None when the caller advances the row by hand
  size_t consumed = 0;
  int64_t last = -1;  // the last token consumed: a different value at that position means a rewritten history
  bool masked = false;  // masked by fill_apply since the last sync
};

class Engine {
 public:
  Engine(int32_t vocab, int32_t capacity, int threads) : batch_(vocab, capacity, threads) {
    histories_.resize(static_cast<size_t>(batch_.capacity()));
  }

  int32_t vocab() const { return batch_.vocab(); }
  int32_t words() const { return batch_.words(); }
  int32_t capacity() const { return batch_.capacity(); }
  int threads() const { return batch_.threads(); }

  void ensure_capacity(int32_t rows) {
    batch_.ensure_capacity(rows);
    histories_.resize(static_cast<size_t>(batch_.capacity()));
  }

  // numpy view of the bitmask, kept alive by the engine (re-fetch it after ensure_capacity).
  py::array bitmask(py::object self) {
    return py::array_t<int32_t>({static_cast<py::ssize_t>(batch_.capacity()), static_cast<py::ssize_t>(batch_.words())},
                                reinterpret_cast<int32_t*>(batch_.bitmask()), self);
  }

  void set_row(int32_t row, cons::MachinePtr m, py::object tokens) {
    if (!tokens.is_none() && !PyList_Check(tokens.ptr())) throw py::type_error("tokens must be a list or None");
    batch_.set(row, std::move(m));
    histories_[static_cast<size_t>(row)] = History{std::move(tokens), 0, -1};
  }
  void clear_row(int32_t row) {
    batch_.clear(row);
    histories_[static_cast<size_t>(row)] = History{};
  }
  void move_row(int32_t from, int32_t to) {
    batch_.move(from, to);
    if (from != to) {
      histories_[static_cast<size_t>(to)] = std::move(histories_[static_cast<size_t>(from)]);
      histories_[static_cast<size_t>(from)] = History{};
    }
  }
  void swap_rows(int32_t a, int32_t b) {
    batch_.swap(a, b);
    std::swap(histories_[static_cast<size_t>(a)], histories_[static_cast<size_t>(b)]);
  }

  // Advance every constrained row by the tokens appended to its list since the last sync. A list shorter than
  // what was consumed, or one whose last consumed token changed, is replayed from the start. -1 (and any
  // negative id) is an async-scheduling placeholder: consumption stops there until the engine fills it in.
  // Returns the number of rows rebuilt.
  int sync(int32_t limit) {
    int rebuilt = 0;
    const int32_t n = std::min(limit < 0 ? batch_.capacity() : limit, batch_.capacity());
    for (int32_t r = 0; r < n; ++r) {
      if (!batch_.constrained(r)) continue;
      History& h = histories_[static_cast<size_t>(r)];
      if (h.tokens.is_none()) continue;
      PyObject* list = h.tokens.ptr();
      const auto len = static_cast<size_t>(PyList_GET_SIZE(list));
      cons::RowState& st = batch_.state(r);
      const size_t before = h.consumed;
      bool was_masked = h.masked;
      h.masked = false;
      if (len < h.consumed || (h.consumed > 0 && read(list, h.consumed - 1) != h.last)) {
        st.reset(st.m);
        h.consumed = 0;
        h.last = -1;
        ++rebuilt;
        ++rebuilds_;
        was_masked = false;
      }
      while (h.consumed < len) {
        const int64_t t = read(list, h.consumed);
        if (t < 0) break;
        st.advance(t >= batch_.vocab() ? batch_.vocab() : static_cast<Token>(t));  // out of range: not allowed
        h.last = t;
        ++h.consumed;
      }
      // Masked last step yet nothing new: the engine threw that sample away (a partial prefill; or an async
      // placeholder still pending). Counted so that tests can observe chunked prefill from the inside.
      if (was_masked && h.consumed == before) ++stalls_;
    }
    return rebuilt;
  }

  void advance(int32_t row, const std::vector<int64_t>& tokens) {
    cons::RowState& st = batch_.state(row);
    for (int64_t t : tokens) {
      if (t < 0) break;
      st.advance(t >= batch_.vocab() ? batch_.vocab() : static_cast<Token>(t));
    }
  }
  // Rebuild a row from its full token history (replay from the start state).
  void rebuild(int32_t row, const std::vector<int64_t>& tokens) {
    cons::RowState& st = batch_.state(row);
    st.reset(st.m);
    advance(row, tokens);
  }

  std::vector<int32_t> constrained_rows(int32_t limit) const {
    std::vector<int32_t> out;
    const int32_t n = std::min(limit < 0 ? batch_.capacity() : limit, batch_.capacity());
    for (int32_t r = 0; r < n; ++r)
      if (batch_.constrained(r)) out.push_back(r);
    return out;
  }
  int num_constrained() const { return static_cast<int>(constrained_rows(-1).size()); }

  void fill(py::array_t<int32_t, py::array::c_style | py::array::forcecast> rows, int threads) {
    const int32_t* p = rows.data();
    const int64_t n = rows.size();
    py::gil_scoped_release release;
    batch_.fill(p, n, threads);
  }

  // logits given as a raw pointer + geometry (the Python layer checked device, dtype and strides).
  void apply(uintptr_t ptr, int64_t nrows, int32_t ncols, int64_t row_stride, const std::string& dtype,
             py::array_t<int32_t, py::array::c_style | py::array::forcecast> logit_rows,
             py::array_t<int32_t, py::array::c_style | py::array::forcecast> mask_rows, int threads) {
    if (logit_rows.size() != mask_rows.size()) throw py::value_error("logit_rows and mask_rows differ in length");
    const int32_t* lr = logit_rows.data();
    const int32_t* mr = mask_rows.data();
    const int64_t n = logit_rows.size();
    for (int64_t i = 0; i < n; ++i)
      if (lr[i] < 0 || lr[i] >= nrows) throw py::index_error("logit row " + std::to_string(lr[i]) + " out of range");
    py::gil_scoped_release release;
    if (dtype == "float32") {
      batch_.apply_f32(reinterpret_cast<float*>(ptr), row_stride, ncols, lr, mr, n, threads);
    } else if (dtype == "bfloat16") {
      batch_.apply_bf16(reinterpret_cast<uint16_t*>(ptr), row_stride, ncols, lr, mr, n, threads);
    } else {
      py::gil_scoped_acquire acquire;
      throw py::value_error("unsupported logits dtype " + dtype + " (float32 or bfloat16)");
    }
  }

  // The step of the V1 processor in one call: fill the constrained rows below nrows and mask the same rows.
  int fill_apply(uintptr_t ptr, int64_t nrows, int32_t ncols, int64_t row_stride, const std::string& dtype,
                 int threads) {
    std::vector<int32_t> rows = constrained_rows(static_cast<int32_t>(std::min<int64_t>(nrows, INT32_MAX)));
    if (rows.empty()) return 0;
    if (dtype != "float32" && dtype != "bfloat16")
      throw py::value_error("unsupported logits dtype " + dtype + " (float32 or bfloat16)");
    for (int32_t r : rows) histories_[static_cast<size_t>(r)].masked = true;
    py::gil_scoped_release release;
    batch_.fill(rows.data(), static_cast<int64_t>(rows.size()), threads);
    if (dtype == "float32")
      batch_.apply_f32(reinterpret_cast<float*>(ptr), row_stride, ncols, rows.data(), rows.data(),
                       static_cast<int64_t>(rows.size()), threads);
    else
      batch_.apply_bf16(reinterpret_cast<uint16_t*>(ptr), row_stride, ncols, rows.data(), rows.data(),
                        static_cast<int64_t>(rows.size()), threads);
    return static_cast<int>(rows.size());
  }

  // The host half of a step whose mask is applied elsewhere (the GPU): fill the constrained rows below `limit`
  // (GIL released) and return them, as an array the GPU apply takes as is (no Python list on the way).
  py::array_t<int32_t> fill_constrained(int32_t limit, int threads) {
    std::vector<int32_t> rows = constrained_rows(limit);
    for (int32_t r : rows) histories_[static_cast<size_t>(r)].masked = true;
    {
      py::gil_scoped_release release;
      batch_.fill(rows.data(), static_cast<int64_t>(rows.size()), threads);
    }
    return py::array_t<int32_t>(static_cast<py::ssize_t>(rows.size()), rows.data());
  }

  double write_bandwidth(py::array_t<float, py::array::c_style> buf, bool stream, int threads, int repeats) {
    float* p = buf.mutable_data();
    const int64_t n = buf.size();
    double best = 1e300;
    py::gil_scoped_release release;
    for (int i = 0; i < repeats; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      batch_.write_neg_inf(p, n, stream, threads);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return static_cast<double>(n) * sizeof(float) / best;
  }

  std::vector<Token> allowed(int32_t row) {
    std::vector<Token> out;
    const uint32_t* dense = nullptr;
    const cons::RowState& st = batch_.state(row);
    if (!st.m) throw py::value_error("row " + std::to_string(row) + " is unconstrained");
    st.allowed(out, dense);
    if (dense) {
      out.clear();
      for (int32_t t = 0; t < batch_.vocab(); ++t)
        if ((dense[t >> 5] >> (t & 31)) & 1u) out.push_back(t);
    }
    std::sort(out.begin(), out.end());
    return out;
  }
  bool finished(int32_t row) { return batch_.state(row).finished; }
  size_t consumed(int32_t row) const { return histories_.at(static_cast<size_t>(row)).consumed; }
  bool constrained(int32_t row) const { return batch_.constrained(row); }
  int64_t rescued() const { return batch_.rescued(); }

 private:
  static int64_t read(PyObject* list, size_t i) {
    PyObject* item = PyList_GET_ITEM(list, static_cast<py::ssize_t>(i));
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (overflow != 0) return INT32_MAX;  // a huge id: not in the vocabulary
    return v;
  }

  cons::Batch batch_;
  std::vector<History> histories_;

 public:
  int64_t stalls_ = 0;    // rows masked whose next sync found no new token
  int64_t rebuilds_ = 0;  // rows replayed because their history shrank or changed
};

}  // namespace

// The GPU apply's host-side logic (mask_launch.hpp), for the tests on machines without nvcc or a GPU.
py::dict gpu_plan(int64_t n, int32_t ncols, int32_t sm_count) {
  const lsm::Plan p = lsm::plan(n, ncols, sm_count);
  py::dict d;
  d["block_threads"] = p.block_threads;
  d["chunk_cols"] = p.chunk_cols;
  d["chunks_per_row"] = p.chunks_per_row;
  d["grid_blocks"] = p.grid_blocks;
  d["mask_words"] = p.mask_words;
  d["header_bytes"] = p.header_bytes;
  d["staging_bytes"] = p.staging_bytes;
  return d;
}

using I32Array = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

std::string gpu_validate(int64_t nrows, int32_t ncols, int64_t row_stride, int32_t dtype, int32_t words,
                         int32_t mask_capacity, I32Array logit_rows, I32Array mask_rows) {
  if (logit_rows.size() != mask_rows.size()) return "logit_rows/mask_rows: lengths differ";
  return lsm::validate({nrows, ncols, row_stride, dtype, words, mask_capacity, logit_rows.size(), logit_rows.data(),
                        mask_rows.data()});
}

py::bytes gpu_pack(py::array_t<uint32_t, py::array::c_style> bitmask, I32Array logit_rows, I32Array mask_rows,
                   int32_t ncols, int32_t sm_count) {
  if (bitmask.ndim() != 2) throw py::value_error("bitmask: 2-D expected");
  const auto words = static_cast<int32_t>(bitmask.shape(1));
  const std::string why = gpu_validate(logit_rows.size() ? *std::max_element(logit_rows.data(), logit_rows.data() +
                                                                              logit_rows.size()) + 1 : 0,
                                       ncols, ncols, 0, words, static_cast<int32_t>(bitmask.shape(0)), logit_rows,
                                       mask_rows);
  if (!why.empty()) throw py::value_error(why);
  const lsm::Plan p = lsm::plan(logit_rows.size(), ncols, sm_count);
  std::string out(static_cast<size_t>(p.staging_bytes), '\0');
  lsm::pack(p, bitmask.data(), words, logit_rows.data(), mask_rows.data(), logit_rows.size(), out.data());
  return py::bytes(out);
}

int64_t gpu_emulate(uintptr_t logits, int64_t nrows, int32_t ncols, int64_t row_stride, int32_t dtype,
                    py::array_t<uint32_t, py::array::c_style> bitmask, I32Array logit_rows, I32Array mask_rows,
                    int32_t sm_count) {
  if (bitmask.ndim() != 2) throw py::value_error("bitmask: 2-D expected");
  const auto words = static_cast<int32_t>(bitmask.shape(1));
  const std::string why = gpu_validate(nrows, ncols, row_stride, dtype, words, static_cast<int32_t>(bitmask.shape(0)),
                                       logit_rows, mask_rows);
  if (!why.empty()) throw py::value_error(why);
  const int64_t n = logit_rows.size();
  const lsm::Plan p = lsm::plan(n, ncols, sm_count);
  std::vector<uint64_t> staging(static_cast<size_t>((p.staging_bytes + 7) / 8));
  lsm::pack(p, bitmask.data(), words, logit_rows.data(), mask_rows.data(), n, staging.data());
  return lsm::emulate(p, reinterpret_cast<void*>(logits), row_stride, dtype, ncols, staging.data(), n);
}

// Token ids read straight from a list or tuple of Python ints in one C pass: no Python object and no pybind11
// caster per element (8k ids: about 20 us, against 450 through std::vector<int32_t>'s caster on the 2-core machine;
// a large allowed_tokens set crosses the front-end, the stub and the worker, docs/architecture.md §3.5). False at
// the first element that is not exactly an int (a bool is not a token id) within [0, hi) (hi < 0: no upper bound
// below 2^63) or equal to `exclude`; `out`, when given, receives the ids read so far.
bool read_token_ids(py::handle values, int64_t hi, int64_t exclude, std::vector<Token>* out) {
  PyObject* seq = values.ptr();
  if (!PyList_Check(seq) && !PyTuple_Check(seq)) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  if (out) out->reserve(out->size() + static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = items[i];
    if (!PyLong_CheckExact(item)) return false;
    int overflow = 0;
    const long long t = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow != 0 || t < 0 || (hi >= 0 && t >= hi) || t == exclude) return false;
    if (out) out->push_back(static_cast<Token>(t));
  }
  return true;
}

using cons::JsonTokens;

// The packed form of an allowed_tokens set (docs/architecture.md §3.5): bit t % 8 of byte t / 8 is set when token t
// is allowed (on a little-endian host the same bytes as the core's int32 bitmask words). A quarter of a 32k
// vocabulary is 4 KB packed against 48 KB as a JSON list, and no process on the way reads it id by id.
struct PackedTokens {
  int64_t count = 0;       // bits set
  int64_t first_out = -1;  // the first set bit at or above `hi`, -1 when none
};

PackedTokens read_packed(const uint8_t* bytes, size_t n, int64_t hi) {
  PackedTokens r;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {  // eight bytes at a time: a 32k vocabulary is 4 KB
    uint64_t word;
    std::memcpy(&word, bytes + i, 8);
    r.count += __builtin_popcountll(word);
  }
  for (; i < n; ++i) r.count += __builtin_popcount(bytes[i]);
  if (hi >= 0)
    for (size_t j = static_cast<size_t>(hi / 8); j < n && r.first_out < 0; ++j)
      for (unsigned b = bytes[j]; b != 0; b &= b - 1)
        if (static_cast<int64_t>(8 * j) + __builtin_ctz(b) >= hi) {
          r.first_out = static_cast<int64_t>(8 * j) + __builtin_ctz(b);
          break;
        }
  return r;
}

// The packed set of `ids` (each in [0, vocab)): ceil(vocab / 8) bytes.
std::string pack_ids(const std::vector<Token>& ids, int32_t vocab) {
  std::string packed((static_cast<size_t>(vocab) + 7) / 8, '\0');
  for (Token t : ids) packed[static_cast<size_t>(t) >> 3] |= static_cast<char>(1u << (t & 7));
  return packed;
}

std::vector<Token> packed_ids(const uint8_t* bytes, size_t n) {
  std::vector<Token> ids;
  for (size_t i = 0; i < n; ++i)
    for (unsigned b = bytes[i]; b != 0; b &= b - 1) ids.push_back(static_cast<Token>(8 * i + __builtin_ctz(b)));
  return ids;
}

// The bytes of a bytes-like object (GIL held while they are read: a bytearray could change under a released read).
std::string_view byte_view(const py::buffer& buf, py::buffer_info& info) {
  info = buf.request();
  if (info.ndim != 1 || info.itemsize != 1) throw py::type_error("a bytes-like object expected");
  return {static_cast<const char*>(info.ptr), static_cast<size_t>(info.size)};
}

// A reader over a bytes-like object's text; `info` keeps the buffer alive and must outlive the reader.
JsonTokens json_reader(const py::buffer& text, py::buffer_info& info) {
  info = text.request();
  if (info.ndim != 1 || info.itemsize != 1) throw py::type_error("text: a bytes-like object expected");
  const char* begin = static_cast<const char*>(info.ptr);
  return JsonTokens(begin, begin + info.size);
}

PYBIND11_MODULE(_native, m) {
  m.doc() = "llm-serving native constraint engine";
  m.attr("ABI_VERSION") = 4;
  m.def("hardware_threads", []() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); },
        "Number of hardware threads the engine's thread pool may use.");

  m.def("gpu_plan", &gpu_plan, py::arg("n"), py::arg("ncols"), py::arg("sm_count"),
        "The GPU apply's launch plan (native/include/mask_launch.hpp).");
  m.def("gpu_validate", &gpu_validate, py::arg("nrows"), py::arg("ncols"), py::arg("row_stride"), py::arg("dtype"),
        py::arg("words"), py::arg("mask_capacity"), py::arg("logit_rows"), py::arg("mask_rows"),
        "'' when the GPU apply would accept these arguments, else why not.");
  m.def("gpu_pack", &gpu_pack, py::arg("bitmask"), py::arg("logit_rows"), py::arg("mask_rows"), py::arg("ncols"),
        py::arg("sm_count"), "The staging buffer the GPU apply would copy to the device.");
  m.def("gpu_emulate", &gpu_emulate, py::arg("logits"), py::arg("nrows"), py::arg("ncols"), py::arg("row_stride"),
        py::arg("dtype"), py::arg("bitmask"), py::arg("logit_rows"), py::arg("mask_rows"), py::arg("sm_count"),
        "The GPU kernel emulated on host memory (raw pointer to the logits); returns the rows rescued.");

  py::class_<cons::Machine, std::shared_ptr<cons::Machine>>(m, "Machine", "A compiled constraint (immutable).")
      .def_property_readonly("kind", [](const cons::Machine& mm) {
        return mm.kind == cons::Kind::TokenDfa ? "token_dfa"
               : mm.kind == cons::Kind::ChoiceSequence ? "choice_sequence" : "allowed_tokens";
      })
      .def_readonly("vocab", &cons::Machine::vocab)
      .def_readonly("eos", &cons::Machine::eos)
      .def_property_readonly("num_states", [](const cons::Machine& mm) {
        return mm.kind == cons::Kind::TokenDfa ? mm.num_states()
               : mm.kind == cons::Kind::ChoiceSequence ? static_cast<int32_t>(mm.node_choice.size()) : 1;
      });

  // The compilers return shared_ptr<const Machine>; pybind holds them as shared_ptr<Machine>.
  auto unconst = [](cons::MachinePtr p) { return std::const_pointer_cast<cons::Machine>(p); };
  m.def("compile_token_dfa",
        [unconst](int32_t vocab, int32_t eos, int32_t start, const std::vector<int32_t>& accept,
                  const std::vector<int32_t>& edges_flat) {
          return unconst(cons::compile_token_dfa(vocab, eos, start, accept, edges_flat));
        },
        py::arg("vocab"), py::arg("eos"), py::arg("start"), py::arg("accept"), py::arg("edges_flat"));
  m.def("compile_choice_sequence",
        [unconst](int32_t vocab, int32_t eos, const std::vector<std::vector<int32_t>>& choices,
                  const std::vector<int32_t>& separator, int32_t min_items, int32_t max_items, bool unique) {
          return unconst(cons::compile_choice_sequence(vocab, eos, choices, separator, min_items, max_items, unique));
        },
        py::arg("vocab"), py::arg("eos"), py::arg("choices"), py::arg("separator"), py::arg("min_items"),
        py::arg("max_items"), py::arg("unique"));
  m.def("token_ids_in_range",
        [](py::handle values, int64_t hi, int64_t exclude) { return read_token_ids(values, hi, exclude, nullptr); },
        py::arg("values"), py::arg("hi"), py::arg("exclude"),
        "Whether `values` (a list or tuple) holds only ints (not bools) in [0, hi) (hi < 0: no upper bound), none "
        "equal to `exclude`; one C pass.");
  // The GIL stays held while the text is read: a bytearray could change under a released read.
  m.def("json_allowed_tokens",
        [](const py::buffer& text, int64_t hi) {
          py::buffer_info info;
          size_t start = 0, stop = 0;
          int64_t count = json_reader(text, info).allowed_tokens(hi, &start, &stop);
          if (count < 0) count = -1, start = 0, stop = 0;
          return std::make_tuple(count, static_cast<int64_t>(start), static_cast<int64_t>(stop));
        },
        py::arg("text"), py::arg("hi"),
        "(count, start, end) of the token array when `text` is exactly an allowed_tokens spec whose ids are plain "
        "integers in [0, hi) (hi < 0: below 2^31), at least one (any order of its two members, JSON whitespace); "
        "(-1, 0, 0) otherwise.");
  m.def("json_allowed_tokens_packed",
        [](const py::buffer& text, int32_t vocab, int64_t pack_above) -> py::tuple {
          py::buffer_info info;
          std::vector<Token> ids;
          size_t start = 0, stop = 0;
          const int64_t count = json_reader(text, info).allowed_tokens(vocab, &start, &stop, &ids);
          if (count < 0) return py::make_tuple(-1, 0, 0, py::none());
          const auto s0 = static_cast<int64_t>(start), s1 = static_cast<int64_t>(stop);
          if (s1 - s0 <= pack_above) return py::make_tuple(count, s0, s1, py::none());
          return py::make_tuple(count, s0, s1, py::bytes(pack_ids(ids, vocab)));
        },
        py::arg("text"), py::arg("vocab"), py::arg("pack_above"),
        "json_allowed_tokens(text, vocab) and, when the token array's text is longer than `pack_above` characters, "
        "the set packed (bit t % 8 of byte t / 8, ceil(vocab / 8) bytes): (count, start, end, packed or None); "
        "(-1, 0, 0, None) for any other text.");
  m.def("pack_token_ids",
        [](py::handle values, int32_t vocab) -> py::object {
          std::vector<Token> ids;
          if (!read_token_ids(values, vocab, -1, &ids)) return py::none();
          return py::bytes(pack_ids(ids, vocab));
        },
        py::arg("values"), py::arg("vocab"),
        "The packed set of `values` (a list or tuple of ints in [0, vocab)), ceil(vocab / 8) bytes; None when one is "
        "not such an int.");
  m.def("packed_tokens",
        [](const py::buffer& packed, int64_t hi) {
          py::buffer_info info;
          const std::string_view b = byte_view(packed, info);
          const PackedTokens r = read_packed(reinterpret_cast<const uint8_t*>(b.data()), b.size(), hi);
          return std::make_tuple(r.count, r.first_out);
        },
        py::arg("packed"), py::arg("hi"),
        "(bits set, the first set bit at or above hi or -1) of a packed set; hi < 0: no bound.");
  m.def("packed_token_ids",
        [](const py::buffer& packed) {
          py::buffer_info info;
          const std::string_view b = byte_view(packed, info);
          return packed_ids(reinterpret_cast<const uint8_t*>(b.data()), b.size());
        },
        py::arg("packed"), "The token ids of a packed set, ascending.");
  m.def("compile_allowed_packed",
        [unconst](int32_t vocab, int32_t eos, const py::buffer& packed) -> py::object {
          py::buffer_info info;
          const std::string_view b = byte_view(packed, info);
          const auto* bytes = reinterpret_cast<const uint8_t*>(b.data());
          const PackedTokens r = read_packed(bytes, b.size(), vocab);
          if (r.count == 0 || r.first_out >= 0) return py::none();
          return py::cast(unconst(cons::compile_allowed_packed(vocab, eos, bytes, b.size())));
        },
        py::arg("vocab"), py::arg("eos"), py::arg("packed"),
        "The machine of a packed allowed_tokens set (at least one bit, none at or above vocab); None otherwise.");
  m.def("compile_allowed_tokens_json",
        [unconst](int32_t vocab, int32_t eos, const py::buffer& text, int64_t max_ids) -> py::object {
          py::buffer_info info;
          std::vector<Token> ids;
          size_t start = 0, stop = 0;
          const int64_t count = json_reader(text, info).allowed_tokens(vocab, &start, &stop, &ids);
          if (count <= 0 || count > max_ids) return py::none();
          return py::cast(unconst(cons::compile_allowed_tokens(vocab, eos, ids)));
        },
        py::arg("vocab"), py::arg("eos"), py::arg("text"), py::arg("max_ids"),
        "The machine of an allowed_tokens spec's JSON text in the form json_allowed_tokens reads (ids below vocab, "
        "at most max_ids), read and compiled in one pass; None for any other text.");
  m.def("json_token_dfa",
        [](const py::buffer& text, int64_t hi, int64_t eos, int64_t max_ids) {
          py::buffer_info info;
          int32_t start = 0;
          std::vector<Token> accept, edges;
          return json_reader(text, info).token_dfa(hi, eos, cons::kMaxStates, max_ids, &start, &accept, &edges) &&
                 cons::deterministic(edges);
        },
        py::arg("text"), py::arg("hi"), py::arg("eos"), py::arg("max_ids"),
        "Whether `text` is exactly a token_dfa spec in the plain form (JsonTokens::token_dfa: plain integers, states "
        "below 2^20, edge tokens in [0, hi) (hi < 0: below 2^31) other than eos (eos < 0: any), at most max_ids "
        "edges) whose edges are deterministic: what validate_constraint accepts, read in one pass.");
  m.def("compile_token_dfa_json",
        [unconst](int32_t vocab, int32_t eos, const py::buffer& text, int64_t max_ids) -> py::object {
          py::buffer_info info;
          int32_t start = 0;
          std::vector<Token> accept, edges;
          if (!json_reader(text, info).token_dfa(vocab, eos, cons::kMaxStates, max_ids, &start, &accept, &edges))
            return py::none();
          try {
            return py::cast(unconst(cons::compile_token_dfa(vocab, eos, start, accept, edges)));
          } catch (const std::invalid_argument&) {
            return py::none();  // not deterministic: the caller's full read names the edge
          }
        },
        py::arg("vocab"), py::arg("eos"), py::arg("text"), py::arg("max_ids"),
        "The machine of a token_dfa spec's JSON text in the form json_token_dfa reads, read and compiled in one "
        "pass; None for any other text or a nondeterministic one.");
  m.def("compile_allowed_tokens",
        [unconst](int32_t vocab, int32_t eos, py::handle tokens) {
          std::vector<Token> ids;
          // The fast read for what validate_constraint accepted; anything else through pybind11's caster, whose
          // errors (and the compiler's, naming an id outside the vocabulary) are the ones callers have always seen.
          if (!read_token_ids(tokens, vocab, -1, &ids)) ids = tokens.cast<std::vector<Token>>();
          return unconst(cons::compile_allowed_tokens(vocab, eos, ids));
        },
        py::arg("vocab"), py::arg("eos"), py::arg("tokens"));

  py::class_<Engine>(m, "Engine", "Per-row constraint states of a batch, its bitmask and a thread pool.")
      .def(py::init<int32_t, int32_t, int>(), py::arg("vocab"), py::arg("capacity"), py::arg("threads") = 0)
      .def_property_readonly("vocab", &Engine::vocab)
      .def_property_readonly("words", &Engine::words)
      .def_property_readonly("capacity", &Engine::capacity)
      .def_property_readonly("threads", &Engine::threads)
      .def("ensure_capacity", &Engine::ensure_capacity, py::arg("rows"))
      .def("bitmask", [](py::object self) { return self.cast<Engine&>().bitmask(self); })
      .def("set_row",
           [](Engine& e, int32_t row, std::shared_ptr<cons::Machine> mm, py::object tokens) {
             e.set_row(row, std::move(mm), std::move(tokens));
           },
           py::arg("row"), py::arg("machine"), py::arg("tokens") = py::none())
      .def("clear_row", &Engine::clear_row, py::arg("row"))
      .def("move_row", &Engine::move_row, py::arg("src"), py::arg("dst"))
      .def("swap_rows", &Engine::swap_rows, py::arg("a"), py::arg("b"))
      .def("sync", &Engine::sync, py::arg("limit") = -1)
      .def("advance", &Engine::advance, py::arg("row"), py::arg("tokens"))
      .def("rebuild", &Engine::rebuild, py::arg("row"), py::arg("tokens"))
      .def("constrained_rows", &Engine::constrained_rows, py::arg("limit") = -1)
      .def("num_constrained", &Engine::num_constrained)
      .def("constrained", &Engine::constrained, py::arg("row"))
      .def("fill", &Engine::fill, py::arg("rows"), py::arg("threads") = 0)
      .def("apply", &Engine::apply, py::arg("ptr"), py::arg("nrows"), py::arg("ncols"), py::arg("row_stride"),
           py::arg("dtype"), py::arg("logit_rows"), py::arg("mask_rows"), py::arg("threads") = 0)
      .def("fill_apply", &Engine::fill_apply, py::arg("ptr"), py::arg("nrows"), py::arg("ncols"),
           py::arg("row_stride"), py::arg("dtype"), py::arg("threads") = 0)
      .def("fill_constrained", &Engine::fill_constrained, py::arg("limit") = -1, py::arg("threads") = 0,
           "Fill the constrained rows below `limit`; returns them (int32 array).")
      .def("write_bandwidth", &Engine::write_bandwidth, py::arg("buffer"), py::arg("stream"), py::arg("threads") = 0,
           py::arg("repeats") = 5, "Best bytes/s writing -inf over `buffer` (float32) with the apply's store loop.")
      .def("allowed", &Engine::allowed, py::arg("row"))
      .def("finished", &Engine::finished, py::arg("row"))
      .def("consumed", &Engine::consumed, py::arg("row"))
      .def_readonly("stalls", &Engine::stalls_)
      .def_readonly("rebuilds", &Engine::rebuilds_)
      .def_property_readonly("rescued", &Engine::rescued);
}
