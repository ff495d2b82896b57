// Replay driver for the core, built by tests/native/test_sanitizers.py with -fsanitize=address,undefined (a
// standalone program: preloading libasan into Python is fragile). It reads a script of batch operations on stdin,
// runs them through cons::Batch (thread pool, bitmask fill with dirty-word tracking, float32/bfloat16 apply) and
// prints, at every QUERY, each constrained row's allowed tokens as read back from the bitmask. The test compares
// that output with the pure-Python reference. Internal cross-checks (bitmask vs RowState::allowed, logits vs
// bitmask) abort on mismatch.
//
// Script (whitespace separated):
//   BATCH vocab capacity threads
//   DFA row eos start n_accept a.. n_edges (from tok to)..
//   CHOICE row eos n_choices (len t..).. sep_len s.. min max unique
//   ALLOWED row eos n t..
//   TOK row t | CLEAR row | MOVE src dst | SWAP a b | SHRINK row k | QUERY
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "constraint_batch.hpp"

namespace {

[[noreturn]] void die(const std::string& why) {
  std::fprintf(stderr, "driver: %s\n", why.c_str());
  std::abort();
}

template <typename T>
T next(std::istream& in) {
  T v;
  if (!(in >> v)) die("truncated script");
  return v;
}

std::vector<int32_t> read_list(std::istream& in) {
  const int n = next<int>(in);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = next<int32_t>(in);
  return v;
}

float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace

int main() {
  std::istream& in = std::cin;
  std::string op;
  std::unique_ptr<cons::Batch> batch;
  std::vector<cons::MachinePtr> machines;
  std::vector<std::vector<int32_t>> history;  // per row, what it has consumed (for SHRINK's replay)
  int queries = 0;
  while (in >> op) {
    if (op == "BATCH") {
      const auto vocab = next<int32_t>(in);
      const auto capacity = next<int32_t>(in);
      const int threads = next<int>(in);
      batch = std::make_unique<cons::Batch>(vocab, capacity, threads);
      machines.assign(static_cast<size_t>(capacity), nullptr);
      history.assign(static_cast<size_t>(capacity), {});
      continue;
    }
    if (!batch) die("BATCH must come first");
    const int32_t vocab = batch->vocab();
    if (op == "DFA" || op == "CHOICE" || op == "ALLOWED" || op == "PACKED") {
      const auto row = next<int32_t>(in);
      const auto eos = next<int32_t>(in);
      cons::MachinePtr m;
      if (op == "DFA") {
        const auto start = next<int32_t>(in);
        const auto accept = read_list(in);
        const int n = next<int>(in);
        std::vector<int32_t> flat(static_cast<size_t>(3 * n));
        for (auto& x : flat) x = next<int32_t>(in);
        m = cons::compile_token_dfa(vocab, eos, start, accept, flat);
      } else if (op == "CHOICE") {
        const int n = next<int>(in);
        std::vector<std::vector<int32_t>> choices;
        for (int i = 0; i < n; ++i) choices.push_back(read_list(in));
        const auto sep = read_list(in);
        const auto mn = next<int32_t>(in);
        const auto mx = next<int32_t>(in);
        const int unique = next<int>(in);
        m = cons::compile_choice_sequence(vocab, eos, choices, sep, mn, mx, unique != 0);
      } else if (op == "ALLOWED") {
        m = cons::compile_allowed_tokens(vocab, eos, read_list(in));
      } else {  // the same list, packed as bits into a buffer of exactly its size (ASan sees a read past it)
        const auto ids = read_list(in);
        int32_t top = vocab - 1;  // an id beyond the vocabulary gets its byte: the compiler must refuse it
        for (int32_t t : ids) top = std::max(top, t);
        std::vector<uint8_t> bits(static_cast<size_t>(top) / 8 + 1, 0);
        for (int32_t t : ids) bits.at(static_cast<size_t>(t) / 8) |= static_cast<uint8_t>(1u << (t % 8));
        const std::unique_ptr<uint8_t[]> exact(new uint8_t[bits.size()]);
        std::copy(bits.begin(), bits.end(), exact.get());
        m = cons::compile_allowed_packed(vocab, eos, exact.get(), bits.size());
      }
      batch->set(row, m);
      machines[static_cast<size_t>(row)] = m;
      history[static_cast<size_t>(row)].clear();
    } else if (op == "TOK") {
      const auto row = next<int32_t>(in);
      const auto t = next<int32_t>(in);
      batch->state(row).advance(t);
      history[static_cast<size_t>(row)].push_back(t);
    } else if (op == "CLEAR") {
      const auto row = next<int32_t>(in);
      batch->clear(row);
      machines[static_cast<size_t>(row)] = nullptr;
      history[static_cast<size_t>(row)].clear();
    } else if (op == "MOVE") {
      const auto a = next<int32_t>(in), b = next<int32_t>(in);
      batch->move(a, b);
      if (a != b) {
        machines[static_cast<size_t>(b)] = machines[static_cast<size_t>(a)];
        history[static_cast<size_t>(b)] = history[static_cast<size_t>(a)];
        machines[static_cast<size_t>(a)] = nullptr;
        history[static_cast<size_t>(a)].clear();
      }
    } else if (op == "SWAP") {
      const auto a = next<int32_t>(in), b = next<int32_t>(in);
      batch->swap(a, b);
      std::swap(machines[static_cast<size_t>(a)], machines[static_cast<size_t>(b)]);
      std::swap(history[static_cast<size_t>(a)], history[static_cast<size_t>(b)]);
    } else if (op == "SHRINK") {  // a shorter history (preemption): rebuild by replay
      const auto row = next<int32_t>(in);
      const auto k = next<size_t>(in);
      auto& h = history[static_cast<size_t>(row)];
      h.resize(h.size() > k ? h.size() - k : 0);
      cons::RowState& st = batch->state(row);
      st.reset(st.m);
      for (int32_t t : h) st.advance(t);
    } else if (op == "QUERY") {
      ++queries;
      std::vector<int32_t> rows;
      for (int32_t r = 0; r < batch->capacity(); ++r)
        if (batch->constrained(r)) rows.push_back(r);
      batch->fill(rows.data(), static_cast<int64_t>(rows.size()), 0);
      const int32_t words = batch->words();
      const int32_t cap = batch->capacity();
      // Logits: row r holds r + column / vocab (finite); after apply a column is -inf iff its bit is 0.
      std::vector<float> f32(static_cast<size_t>(cap) * static_cast<size_t>(vocab));
      std::vector<uint16_t> bf(f32.size(), 0x3F80);  // 1.0
      for (size_t i = 0; i < f32.size(); ++i) f32[i] = 1.0f + static_cast<float>(i % 7);
      batch->apply_f32(f32.data(), vocab, vocab, rows.data(), rows.data(), static_cast<int64_t>(rows.size()), 0);
      batch->apply_bf16(bf.data(), vocab, vocab, rows.data(), rows.data(), static_cast<int64_t>(rows.size()), 0);
      std::vector<int32_t> scratch;
      for (int32_t r : rows) {
        const uint32_t* mask = batch->bitmask() + static_cast<size_t>(r) * static_cast<size_t>(words);
        std::vector<int32_t> from_mask;
        for (int32_t t = 0; t < words * 32; ++t) {
          const bool bit = (mask[t >> 5] >> (t & 31)) & 1u;
          if (t >= vocab) {
            if (bit) die("bit set beyond the vocabulary");
            continue;
          }
          if (bit) from_mask.push_back(t);
          const size_t at = static_cast<size_t>(r) * static_cast<size_t>(vocab) + static_cast<size_t>(t);
          if (std::isinf(f32[at]) == bit) die("float32 apply disagrees with the bitmask");
          if (std::isinf(bf16_to_float(bf[at])) == bit) die("bfloat16 apply disagrees with the bitmask");
        }
        const uint32_t* dense = nullptr;
        batch->state(r).allowed(scratch, dense);
        if (!dense) {
          std::sort(scratch.begin(), scratch.end());
          if (scratch != from_mask) die("sparse allowed set disagrees with the bitmask");
        }
        std::printf("Q%d row %d:", queries, r);
        for (int32_t t : from_mask) std::printf(" %d", t);
        std::printf("\n");
      }
      // Unconstrained rows are untouched by apply.
      for (int32_t r = 0; r < cap; ++r) {
        if (batch->constrained(r)) continue;
        for (int32_t t = 0; t < vocab; ++t)
          if (std::isinf(f32[static_cast<size_t>(r) * static_cast<size_t>(vocab) + static_cast<size_t>(t)]))
            die("an unconstrained row was masked");
      }
    } else {
      die("unknown op " + op);
    }
  }
  std::printf("DONE %d\n", queries);
  return 0;
}
