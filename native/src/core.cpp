// Compilation of constraint specs into machines, and the per-row state machine (see constraint_core.hpp).
#include "constraint_core.hpp"

#include <algorithm>
#include <climits>
#include <cstring>
#include <limits>
#include <string>

#if defined(__SSE2__)
#include <emmintrin.h>
#include <xmmintrin.h>
#endif

namespace cons {
namespace {

[[noreturn]] void fail(const std::string& what) { throw std::invalid_argument(what); }

void check_vocab(int32_t vocab, Token eos) {
  if (vocab <= 0) fail("vocab must be positive");
  if (eos < 0 || eos >= vocab) fail("eos " + std::to_string(eos) + " outside the vocabulary");
}

void check_token(const char* what, Token t, int32_t vocab, Token eos) {
  if (t < 0 || t >= vocab) fail(std::string(what) + ": token id " + std::to_string(t) + " outside the vocabulary");
  if (t == eos) fail(std::string(what) + ": token id " + std::to_string(t) + " is the end-of-sequence token");
}

// Sparse while setting its bits is cheaper than copying a whole row; dense beyond that.
bool dense_set(size_t tokens, int32_t words) { return static_cast<int64_t>(tokens) * 8 > words; }

// Kept in both forms when dense: membership tests use the sorted list. Callers have checked every id against the
// vocabulary.
TokenSet make_set(std::vector<Token> tokens, int32_t words) {
  TokenSet s;
  if (dense_set(tokens.size(), words)) {
    // The bits first, the sorted list read back from them: linear whatever the order. Sorting instead cost 365 us
    // for 8k ids, because compile_allowed_tokens appends eos to a list clients send sorted, which sends introsort's
    // median-of-three into its heapsort fallback.
    s.dense.assign(static_cast<size_t>(words), 0u);
    for (Token t : tokens) s.dense[static_cast<size_t>(t >> 5)] |= 1u << (t & 31);
    tokens.clear();
    for (int32_t w = 0; w < words; ++w)
      for (uint32_t bits = s.dense[static_cast<size_t>(w)]; bits != 0; bits &= bits - 1)
        tokens.push_back(w * 32 + __builtin_ctz(bits));
  } else {
    std::sort(tokens.begin(), tokens.end());
    tokens.erase(std::unique(tokens.begin(), tokens.end()), tokens.end());
  }
  s.sparse = std::move(tokens);
  return s;
}

bool set_contains(const TokenSet& s, Token t) { return std::binary_search(s.sparse.begin(), s.sparse.end(), t); }

}  // namespace

MachinePtr compile_token_dfa(int32_t vocab, Token eos, int32_t start, const std::vector<int32_t>& accept,
                             const std::vector<int32_t>& edges_flat) {
  check_vocab(vocab, eos);
  if (edges_flat.size() % 3 != 0) fail("edges must be (from, token, to) triples");
  auto m = std::make_shared<Machine>();
  m->kind = Kind::TokenDfa;
  m->vocab = vocab;
  m->words = (vocab + 31) / 32;
  m->eos = eos;
  if (start < 0 || start >= kMaxStates) fail("start state out of range");
  int32_t num_states = start + 1;
  for (int32_t a : accept) {
    if (a < 0 || a >= kMaxStates) fail("accepting state out of range");
    num_states = std::max(num_states, a + 1);
  }
  const size_t num_edges = edges_flat.size() / 3;
  for (size_t i = 0; i < num_edges; ++i) {
    const int32_t from = edges_flat[3 * i], tok = edges_flat[3 * i + 1], to = edges_flat[3 * i + 2];
    if (from < 0 || from >= kMaxStates || to < 0 || to >= kMaxStates) fail("edge state out of range");
    check_token("edge", tok, vocab, eos);
    num_states = std::max(num_states, std::max(from, to) + 1);
  }
  m->start = start;
  // Sort edges by (from, token) into CSR; a repeated (from, token) must agree on its target (determinism).
  std::vector<size_t> order(num_edges);
  for (size_t i = 0; i < num_edges; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (edges_flat[3 * a] != edges_flat[3 * b]) return edges_flat[3 * a] < edges_flat[3 * b];
    return edges_flat[3 * a + 1] < edges_flat[3 * b + 1];
  });
  m->edge_offsets.assign(static_cast<size_t>(num_states) + 1, 0);
  for (size_t k = 0; k < num_edges; ++k) {
    const size_t i = order[k];
    const int32_t from = edges_flat[3 * i], tok = edges_flat[3 * i + 1], to = edges_flat[3 * i + 2];
    if (k > 0) {
      const size_t p = order[k - 1];
      if (edges_flat[3 * p] == from && edges_flat[3 * p + 1] == tok) {
        if (edges_flat[3 * p + 2] != to) fail("nondeterministic edges");
        continue;  // exact duplicate
      }
    }
    m->edge_tokens.push_back(tok);
    m->edge_targets.push_back(to);
    m->edge_offsets[static_cast<size_t>(from) + 1]++;
  }
  for (int32_t s = 0; s < num_states; ++s) m->edge_offsets[s + 1] += m->edge_offsets[s];
  std::vector<bool> accepting(static_cast<size_t>(num_states), false);
  for (int32_t a : accept) accepting[static_cast<size_t>(a)] = true;
  m->state_sets.resize(static_cast<size_t>(num_states));
  for (int32_t s = 0; s < num_states; ++s) {
    std::vector<Token> toks(m->edge_tokens.begin() + m->edge_offsets[s], m->edge_tokens.begin() + m->edge_offsets[s + 1]);
    if (accepting[static_cast<size_t>(s)] || toks.empty()) toks.push_back(eos);
    m->state_sets[static_cast<size_t>(s)] = make_set(std::move(toks), m->words);
  }
  return m;
}

MachinePtr compile_choice_sequence(int32_t vocab, Token eos, const std::vector<std::vector<Token>>& choices_in,
                                   const std::vector<Token>& separator, int32_t min_items, int32_t max_items,
                                   bool unique) {
  check_vocab(vocab, eos);
  if (choices_in.empty()) fail("choices must not be empty");
  if (separator.empty()) fail("separator must not be empty");
  for (const auto& c : choices_in) {
    if (c.empty()) fail("a choice is empty");
    for (Token t : c) check_token("choice", t, vocab, eos);
  }
  for (Token t : separator) check_token("separator", t, vocab, eos);
  auto m = std::make_shared<Machine>();
  m->kind = Kind::ChoiceSequence;
  m->vocab = vocab;
  m->words = (vocab + 31) / 32;
  m->eos = eos;
  std::vector<std::vector<Token>> choices = choices_in;
  std::sort(choices.begin(), choices.end());
  for (size_t i = 1; i < choices.size(); ++i)
    if (choices[i] == choices[i - 1]) fail("duplicate choices");
  for (const auto& c : choices)
    if (std::find(c.begin(), c.end(), separator[0]) != c.end()) fail("separator's first token appears in a choice");
  m->num_choices = static_cast<int32_t>(choices.size());
  if (min_items < 1) fail("min_items must be at least 1");
  m->max_items = max_items < 0 ? INT32_MAX : max_items;
  m->unique = unique;
  if (unique) m->max_items = std::min(m->max_items, m->num_choices);
  if (min_items > m->max_items) fail("min_items exceeds max_items");
  m->min_items = min_items;
  m->separator = separator;

  // Trie by sorted insertion: a node's children arrive in token order, so a matching child is always the last.
  std::vector<std::vector<std::pair<Token, int32_t>>> kids(1);
  m->node_choice.assign(1, -1);
  m->node_lo.assign(1, 0);
  m->node_hi.assign(1, 0);
  for (int32_t i = 0; i < m->num_choices; ++i) {
    int32_t node = 0;
    m->node_hi[0] = i + 1;
    for (Token t : choices[static_cast<size_t>(i)]) {
      auto& ks = kids[static_cast<size_t>(node)];
      if (!ks.empty() && ks.back().first == t) {
        node = ks.back().second;
      } else {
        const auto fresh = static_cast<int32_t>(kids.size());
        ks.emplace_back(t, fresh);
        kids.emplace_back();
        m->node_choice.push_back(-1);
        m->node_lo.push_back(i);
        m->node_hi.push_back(i + 1);
        node = fresh;
      }
      m->node_hi[static_cast<size_t>(node)] = i + 1;
    }
    m->node_choice[static_cast<size_t>(node)] = i;
  }
  m->child_offsets.assign(kids.size() + 1, 0);
  for (size_t n = 0; n < kids.size(); ++n) {
    m->child_offsets[n + 1] = m->child_offsets[n] + static_cast<int32_t>(kids[n].size());
    for (const auto& [t, c] : kids[n]) {
      m->child_tokens.push_back(t);
      m->child_nodes.push_back(c);
    }
  }
  return m;
}

MachinePtr compile_allowed_tokens(int32_t vocab, Token eos, const std::vector<Token>& tokens) {
  check_vocab(vocab, eos);
  for (Token t : tokens)
    if (t < 0 || t >= vocab) fail("allowed token id " + std::to_string(t) + " outside the vocabulary");
  auto m = std::make_shared<Machine>();
  m->kind = Kind::AllowedTokens;
  m->vocab = vocab;
  m->words = (vocab + 31) / 32;
  m->eos = eos;
  std::vector<Token> toks = tokens;
  toks.push_back(eos);
  m->allowed = make_set(std::move(toks), m->words);
  return m;
}

MachinePtr compile_allowed_packed(int32_t vocab, Token eos, const uint8_t* bytes, size_t n) {
  check_vocab(vocab, eos);
  auto m = std::make_shared<Machine>();
  m->kind = Kind::AllowedTokens;
  m->vocab = vocab;
  m->words = (vocab + 31) / 32;
  m->eos = eos;
  // Straight into the row's words (bit t % 8 of byte t / 8 is bit t % 32 of word t / 32 on a little-endian host,
  // assembled byte by byte here so that the layout does not depend on the host), then the sorted list from them.
  std::vector<uint32_t> words(static_cast<size_t>(m->words), 0u);
  for (size_t i = 0; i < n; ++i) {
    if (bytes[i] == 0) continue;
    if (static_cast<int64_t>(8 * i) + 31 - __builtin_clz(bytes[i]) >= vocab)
      fail("allowed token id " + std::to_string(8 * i + 31 - __builtin_clz(bytes[i])) + " outside the vocabulary");
    words[i / 4] |= static_cast<uint32_t>(bytes[i]) << (8 * (i % 4));
  }
  words[static_cast<size_t>(eos >> 5)] |= 1u << (eos & 31);
  std::vector<Token> tokens;
  for (int32_t w = 0; w < m->words; ++w)
    for (uint32_t bits = words[static_cast<size_t>(w)]; bits != 0; bits &= bits - 1)
      tokens.push_back(w * 32 + __builtin_ctz(bits));
  if (dense_set(tokens.size(), m->words)) m->allowed.dense = std::move(words);
  m->allowed.sparse = std::move(tokens);
  return m;
}

// ---------------------------------------------------------------------------------------------------------------
void RowState::reset(MachinePtr machine) {
  m = std::move(machine);
  node = m ? (m->kind == Kind::TokenDfa ? m->start : 0) : 0;
  sep_pos = -1;
  items = 0;
  finished = false;
  used.clear();
  if (m && m->kind == Kind::ChoiceSequence && m->unique) used.assign(static_cast<size_t>((m->num_choices + 63) / 64), 0);
}

bool RowState::choice_has_unused(int32_t lo, int32_t hi) const {
  for (int32_t i = lo; i < hi;) {
    const uint64_t word = used[static_cast<size_t>(i >> 6)];
    if (word == ~uint64_t{0}) {
      i = (i | 63) + 1;
      continue;
    }
    if (!((word >> (i & 63)) & 1)) return true;
    ++i;
  }
  return false;
}

bool RowState::choice_child_ok(int32_t child) const {
  return !m->unique || choice_has_unused(m->node_lo[static_cast<size_t>(child)], m->node_hi[static_cast<size_t>(child)]);
}

void RowState::allowed(std::vector<Token>& out, const uint32_t*& dense) const {
  out.clear();
  dense = nullptr;
  if (!m) return;
  if (finished) {
    out.push_back(m->eos);
    return;
  }
  switch (m->kind) {
    case Kind::TokenDfa: {
      const TokenSet& s = m->state_sets[static_cast<size_t>(node)];
      if (!s.dense.empty()) dense = s.dense.data();
      else out = s.sparse;
      return;
    }
    case Kind::AllowedTokens:
      if (!m->allowed.dense.empty()) dense = m->allowed.dense.data();
      else out = m->allowed.sparse;
      return;
    case Kind::ChoiceSequence: {
      if (sep_pos >= 0) {
        out.push_back(m->separator[static_cast<size_t>(sep_pos)]);
        return;
      }
      for (int32_t k = m->child_offsets[node]; k < m->child_offsets[node + 1]; ++k)
        if (choice_child_ok(m->child_nodes[k])) out.push_back(m->child_tokens[k]);
      const int32_t c = m->node_choice[static_cast<size_t>(node)];
      if (c >= 0 && (!m->unique || !((used[static_cast<size_t>(c >> 6)] >> (c & 63)) & 1))) {
        // max_items is capped to the number of choices when unique, so a separator always leads somewhere.
        if (items + 1 < m->max_items) out.push_back(m->separator[0]);
        if (items + 1 >= m->min_items) out.push_back(m->eos);
      }
      if (out.empty()) out.push_back(m->eos);
      return;
    }
  }
}

bool RowState::allows(Token t) const {
  if (!m) return true;
  if (finished) return t == m->eos;
  switch (m->kind) {
    case Kind::TokenDfa:
      return set_contains(m->state_sets[static_cast<size_t>(node)], t);
    case Kind::AllowedTokens:
      return set_contains(m->allowed, t);
    case Kind::ChoiceSequence: {
      std::vector<Token> out;
      const uint32_t* dense = nullptr;
      allowed(out, dense);
      return std::find(out.begin(), out.end(), t) != out.end();
    }
  }
  return false;
}

void RowState::advance(Token t) {
  if (!m || finished) return;
  if (t == m->eos || !allows(t)) {
    finished = true;
    return;
  }
  switch (m->kind) {
    case Kind::AllowedTokens:
      return;
    case Kind::TokenDfa: {
      const auto b = m->edge_tokens.begin() + m->edge_offsets[node];
      const auto e = m->edge_tokens.begin() + m->edge_offsets[node + 1];
      const auto it = std::lower_bound(b, e, t);  // present: allows(t) and t != eos
      node = m->edge_targets[static_cast<size_t>(it - m->edge_tokens.begin())];
      return;
    }
    case Kind::ChoiceSequence: {
      if (sep_pos >= 0) {
        if (++sep_pos == static_cast<int32_t>(m->separator.size())) {
          sep_pos = -1;
          node = 0;
        }
        return;
      }
      const auto b = m->child_tokens.begin() + m->child_offsets[node];
      const auto e = m->child_tokens.begin() + m->child_offsets[node + 1];
      const auto it = std::lower_bound(b, e, t);
      if (it != e && *it == t) {
        node = m->child_nodes[static_cast<size_t>(it - m->child_tokens.begin())];
        return;
      }
      // The separator's first token (never inside a choice): the item at this node is complete.
      const int32_t c = m->node_choice[static_cast<size_t>(node)];
      if (m->unique) used[static_cast<size_t>(c >> 6)] |= uint64_t{1} << (c & 63);
      ++items;
      if (m->separator.size() == 1) {
        node = 0;
      } else {
        sep_pos = 1;
      }
      return;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
void fill_row(const RowState& state, uint32_t* row, int32_t words, std::vector<int32_t>& dirty,
              std::vector<Token>& scratch) {
  if (!dirty.empty() && dirty[0] < 0) {
    std::memset(row, 0, sizeof(uint32_t) * static_cast<size_t>(words));
  } else {
    for (int32_t w : dirty) row[w] = 0;
  }
  dirty.clear();
  const uint32_t* dense = nullptr;
  state.allowed(scratch, dense);
  if (dense) {
    std::memcpy(row, dense, sizeof(uint32_t) * static_cast<size_t>(words));
    dirty.push_back(-1);
    return;
  }
  for (Token t : scratch) {
    const int32_t w = t >> 5;
    if (row[w] == 0) dirty.push_back(w);
    row[w] |= 1u << (t & 31);
  }
}

// Two loops the compiler vectorises: a fully masked word is 32 plain stores, a mixed word a masked blend. With
// `stream`, fully masked words are written with non-temporal stores: for logits far larger than the caches this
// skips the read-for-ownership of every line, so the apply moves only the bytes it must write.
//
// x86-64 builds carry AVX-512, AVX2 and baseline versions of the kernels, picked at load time; other
// architectures (e.g. Grace/Graviton) get one portable version.
#if defined(__x86_64__) && defined(__GNUC__)
#define CONS_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CONS_MULTIVERSION
#endif

#if defined(__GNUC__)
#define CONS_ALWAYS_INLINE __attribute__((always_inline)) inline
#else
#define CONS_ALWAYS_INLINE inline
#endif

namespace {
#if defined(__SSE2__)
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
#endif

// The kernel for any element type T, `ninf` being T's -inf. Always inlined, so that each multiversioned entry point
// below compiles it for its own target (a shared out-of-line copy would be baseline code only).
template <typename T>
CONS_ALWAYS_INLINE void apply_row(T* logits, const uint32_t* mask, int32_t n, bool stream, const T ninf) {
  static_assert((32 * sizeof(T)) % 16 == 0, "a mask word's 32 elements must be whole 16-byte stores");
  const int32_t full = n / 32;
#if defined(__SSE2__)
  stream = stream && aligned16(logits);
  constexpr int kLanes = 16 / sizeof(T);
  alignas(16) T lanes[kLanes];
  for (int k = 0; k < kLanes; ++k) lanes[k] = ninf;
  const __m128i vninf = _mm_load_si128(reinterpret_cast<const __m128i*>(lanes));
#else
  stream = false;
#endif
  for (int32_t w = 0; w < full; ++w) {
    const uint32_t bits = mask[w];
    T* l = logits + static_cast<int64_t>(w) * 32;
    if (bits == 0xFFFFFFFFu) continue;
    if (bits == 0) {
#if defined(__SSE2__)
      if (stream) {
        for (int k = 0; k < 32; k += kLanes) _mm_stream_si128(reinterpret_cast<__m128i*>(l + k), vninf);
        continue;
      }
#endif
      for (int k = 0; k < 32; ++k) l[k] = ninf;
      continue;
    }
    for (int k = 0; k < 32; ++k) l[k] = ((bits >> k) & 1u) ? l[k] : ninf;
  }
  const int32_t rest = n - full * 32;
  if (rest > 0) {
    const uint32_t bits = mask[full];
    T* l = logits + static_cast<int64_t>(full) * 32;
    for (int k = 0; k < rest; ++k) l[k] = ((bits >> k) & 1u) ? l[k] : ninf;
  }
#if defined(__SSE2__)
  if (stream) _mm_sfence();  // order the streaming stores before the caller reads the logits
#endif
}
}  // namespace

CONS_MULTIVERSION void apply_row_f32(float* logits, const uint32_t* mask, int32_t n, bool stream) {
  apply_row<float>(logits, mask, n, stream, -std::numeric_limits<float>::infinity());
}

CONS_MULTIVERSION void apply_row_bf16(uint16_t* logits, const uint32_t* mask, int32_t n, bool stream) {
  apply_row<uint16_t>(logits, mask, n, stream, 0xFF80);  // bfloat16 -inf
}

}  // namespace cons
