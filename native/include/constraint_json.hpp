// A constraint spec read straight from its JSON text (native/src/module.cpp binds it; docs/architecture.md §3.5).
// Header-only so that the sanitizer driver (native/tests/json_driver.cpp) reads client text with the same code.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "constraint_core.hpp"

namespace cons {

// A constraint's token ids read straight from its JSON text: an allowed_tokens set of 8k ids is 48 KB of JSON, and
// read here it never becomes 8k Python ints in the front-end or the stub (docs/architecture.md §3.5). Conservative on
// purpose: anything it does not accept (-1) the caller reads in full, with the standard library, for the exact error.
class JsonTokens {
 public:
  JsonTokens(const char* p, const char* end) : p_(p), begin_(p), end_(end) {}

  // `{"kind": "allowed_tokens", "tokens": [...]}`, the two members in either order, each once, nothing else: the
  // number of ids (each a plain integer below `hi`, see `array`), and the array's [start, end) offsets in the text.
  int64_t allowed_tokens(int64_t hi, size_t* start, size_t* stop, std::vector<Token>* out = nullptr) {
    bool kind = false;
    int64_t count = -1;
    ws();
    if (!take('{')) return -1;
    for (;;) {
      std::string_view name;
      if (!key(&name)) return -1;
      if (name == "kind" && !kind) {
        if (!literal("\"allowed_tokens\"")) return -1;
        kind = true;
      } else if (name == "tokens" && count < 0) {
        *start = static_cast<size_t>(p_ - begin_);
        count = array(hi, out);
        if (count < 0) return -1;
        *stop = static_cast<size_t>(p_ - begin_);
      } else {
        return -1;  // another member, or one given twice
      }
      const int more = next_member();
      if (more < 0) return -1;
      if (more == 0) break;
    }
    ws();
    return kind && count >= 0 && p_ == end_ ? count : -1;
  }

  // `{"kind": "token_dfa", "start": s, "accept": [...], "edges": [[from, token, to], ...]}`, the four members in any
  // order, each once, nothing else. States are plain integers below `max_states`, at least one accepting; each edge's
  // token a plain integer below `hi` (hi < 0: below 2^31) other than `eos` (eos < 0: any), at most `max_ids` edges.
  // Fills `start`, `accept` and the edges as flat triples; false for anything else. Whether the edges are
  // deterministic is not checked here (`deterministic`, or the compiler).
  bool token_dfa(int64_t hi, int64_t eos, int64_t max_states, int64_t max_ids, int32_t* start,
                 std::vector<Token>* accept, std::vector<Token>* edges) {
    bool kind = false, has_start = false, has_accept = false, has_edges = false;
    ws();
    if (!take('{')) return false;
    for (;;) {
      std::string_view name;
      if (!key(&name)) return false;
      if (name == "kind" && !kind) {
        if (!literal("\"token_dfa\"")) return false;
        kind = true;
      } else if (name == "start" && !has_start) {
        const int64_t s = integer(max_states);
        if (s < 0) return false;
        *start = static_cast<int32_t>(s);
        has_start = true;
      } else if (name == "accept" && !has_accept) {
        if (array(max_states, accept) < 0) return false;
        has_accept = true;
      } else if (name == "edges" && !has_edges) {
        if (!triples(hi, eos, max_states, max_ids, edges)) return false;
        has_edges = true;
      } else {
        return false;  // another member, or one given twice
      }
      const int more = next_member();
      if (more < 0) return false;
      if (more == 0) break;
    }
    ws();
    return kind && has_start && has_accept && has_edges && p_ == end_;
  }

  // `[...]` of token ids written as plain non-negative integers (see `integer`; JSON whitespace between tokens), each
  // below `hi` (hi < 0: below 2^31), at least one: how many.
  int64_t array(int64_t hi, std::vector<Token>* out = nullptr) {
    const int64_t limit = hi >= 0 ? hi : (int64_t{1} << 31);
    ws();
    if (!take('[')) return -1;
    int64_t count = 0;
    for (;;) {
      ws();
      const int64_t value = integer(limit);  // also refuses an empty array
      if (value < 0) return -1;
      if (out) out->push_back(static_cast<Token>(value));
      ++count;
      ws();
      if (take(']')) return count;
      if (!take(',')) return -1;  // a fraction, an exponent, anything else
    }
  }

 private:
  // A plain non-negative integer below `limit`: digits only (no sign, no leading zero); -1 otherwise. What follows
  // it (a fraction, an exponent) is refused by the caller, which expects `,`, `]` or `}` next.
  int64_t integer(int64_t limit) {
    if (p_ == end_ || static_cast<unsigned>(*p_ - '0') > 9) return -1;
    if (*p_ == '0' && p_ + 1 < end_ && static_cast<unsigned>(p_[1] - '0') <= 9) return -1;  // no leading zeros
    int64_t value = 0;
    while (p_ < end_ && static_cast<unsigned>(*p_ - '0') <= 9) {
      value = value * 10 + (*p_++ - '0');
      if (value >= limit) return -1;
    }
    return value;
  }

  // `[[from, token, to], ...]` (possibly empty), flat into `out`.
  bool triples(int64_t hi, int64_t eos, int64_t max_states, int64_t max_ids, std::vector<Token>* out) {
    const int64_t limit = hi >= 0 ? hi : (int64_t{1} << 31);
    ws();
    if (!take('[')) return false;
    ws();
    if (take(']')) return true;
    for (int64_t n = 1;; ++n) {
      if (n > max_ids) return false;
      ws();
      if (!take('[')) return false;
      for (int k = 0; k < 3; ++k) {
        ws();
        const int64_t v = integer(k == 1 ? limit : max_states);
        if (v < 0 || (k == 1 && v == eos)) return false;
        out->push_back(static_cast<Token>(v));
        ws();
        if (!take(k == 2 ? ']' : ',')) return false;
      }
      ws();
      if (take(']')) return true;
      if (!take(',')) return false;
    }
  }

  // A member's name and its colon: `"name" :`. An escaped name is refused (read in full by the caller).
  bool key(std::string_view* name) {
    ws();
    if (!take('"')) return false;
    const char* k = p_;
    while (p_ < end_ && *p_ != '"' && *p_ != '\\') ++p_;
    *name = std::string_view(k, static_cast<size_t>(p_ - k));
    if (!take('"')) return false;
    ws();
    if (!take(':')) return false;
    ws();
    return true;
  }

  bool literal(std::string_view value) {
    if (static_cast<size_t>(end_ - p_) < value.size() || std::string_view(p_, value.size()) != value) return false;
    p_ += value.size();
    return true;
  }

  // After a member: 1 at `,` (another follows), 0 at `}` (the object ends), -1 at anything else.
  int next_member() {
    ws();
    if (take('}')) return 0;
    return take(',') ? 1 : -1;
  }

  void ws() {
    while (p_ < end_ && (*p_ == ' ' || *p_ == '\t' || *p_ == '\n' || *p_ == '\r')) ++p_;
  }
  bool take(char c) {
    if (p_ == end_ || *p_ != c) return false;
    ++p_;
    return true;
  }
  const char* p_;
  const char* begin_;
  const char* end_;
};

// Whether flat (from, token, to) triples send each (from, token) to one state at most (exact repeats allowed), as
// validate_constraint requires of a token_dfa.
inline bool deterministic(const std::vector<Token>& flat) {
  std::vector<std::array<Token, 3>> edges(flat.size() / 3);
  for (size_t i = 0; i < edges.size(); ++i) edges[i] = {flat[3 * i], flat[3 * i + 1], flat[3 * i + 2]};
  std::sort(edges.begin(), edges.end());
  for (size_t i = 1; i < edges.size(); ++i)
    if (edges[i][0] == edges[i - 1][0] && edges[i][1] == edges[i - 1][1] && edges[i][2] != edges[i - 1][2])
      return false;
  return true;
}

}  // namespace cons
