// The constraint engine's core, free of Python: compiled machines (one per constraint spec, immutable and shared),
// per-row states advanced by generated tokens, and the batch that owns the packed bitmask (docs/architecture.md §3.5).
//
// Semantics every implementation must share (the Python reference in serving_image/constraints/reference.py is the
// executable definition; the differential tests hold both to it):
//   - token_dfa: allowed = labels of the edges leaving the state, plus eos when the state is accepting.
//   - choice_sequence: item (separator item)* eos; items are choices, between min_items and max_items of them, all
//     distinct when unique. Items are walked on a trie; a complete item that is a prefix of another may continue.
//   - allowed_tokens: the set plus eos.
//   - after eos, or after a token the state did not allow, the row is finished: only eos is allowed.
//   - a state that allows nothing allows eos, so a row never masks out every token.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <vector>

namespace cons {

using Token = int32_t;

// States of a token_dfa are below this (the Python validation's MAX_STATE_ID + 1).
constexpr int32_t kMaxStates = 1 << 20;

enum class Kind : uint8_t { TokenDfa = 0, ChoiceSequence = 1, AllowedTokens = 2 };

// A set of tokens stored either as a sorted list (sparse) or as a ready bitmask row (dense): filling a sparse
// set costs O(its size), independent of the vocabulary; a dense one is one row copy.
struct TokenSet {
  std::vector<Token> sparse;    // sorted, used when dense is empty
  std::vector<uint32_t> dense;  // words of a bitmask row, or empty
};

struct Machine {
  Kind kind = Kind::AllowedTokens;
  int32_t vocab = 0;
  int32_t words = 0;  // ceil(vocab / 32)
  Token eos = 0;

  // token_dfa: CSR of out-edges per state, sorted by token; allowed sets per state include eos when accepting.
  int32_t start = 0;
  std::vector<int32_t> edge_offsets;  // size num_states + 1
  std::vector<Token> edge_tokens;
  std::vector<int32_t> edge_targets;
  std::vector<TokenSet> state_sets;

  // choice_sequence: a trie over the choices sorted lexicographically, so that the choices below any node are
  // the contiguous range [lo, hi) of that order (the "unique" check is a scan of a bit range).
  std::vector<int32_t> child_offsets;  // size num_nodes + 1
  std::vector<Token> child_tokens;
  std::vector<int32_t> child_nodes;
  std::vector<int32_t> node_choice;  // choice ending at this node, or -1
  std::vector<int32_t> node_lo, node_hi;
  std::vector<Token> separator;
  int32_t num_choices = 0;
  int32_t min_items = 1;
  int32_t max_items = 0;  // already capped to num_choices when unique
  bool unique = false;

  // allowed_tokens
  TokenSet allowed;

  int32_t num_states() const { return static_cast<int32_t>(edge_offsets.size()) - 1; }
};

using MachinePtr = std::shared_ptr<const Machine>;

// Compilers validate defensively (std::invalid_argument) even though the Python layer validates first with
// messages that name the field: the core must never index out of bounds whatever it is given.
MachinePtr compile_token_dfa(int32_t vocab, Token eos, int32_t start, const std::vector<int32_t>& accept,
                             const std::vector<int32_t>& edges_flat /* from, token, to triples */);
MachinePtr compile_choice_sequence(int32_t vocab, Token eos, const std::vector<std::vector<Token>>& choices,
                                   const std::vector<Token>& separator, int32_t min_items,
                                   int32_t max_items /* < 0: unbounded */, bool unique);
MachinePtr compile_allowed_tokens(int32_t vocab, Token eos, const std::vector<Token>& tokens);
// The same machine from the set packed as bits (bit t % 8 of byte t / 8; docs/architecture.md §3.5).
MachinePtr compile_allowed_packed(int32_t vocab, Token eos, const uint8_t* bytes, size_t n);

// The state of one request, a function of its generated tokens alone.
struct RowState {
  MachinePtr m;            // null: the row is unconstrained and costs nothing
  int32_t node = 0;        // dfa state or trie node
  int32_t sep_pos = -1;    // choice_sequence: index in the separator being emitted, -1 inside an item
  int32_t items = 0;       // choice_sequence: completed items
  bool finished = false;   // eos seen or a disallowed token taken
  std::vector<uint64_t> used;  // choice_sequence with unique: choices already used

  void reset(MachinePtr machine);
  void advance(Token t);
  // The allowed set: either points `dense` at a ready bitmask row, or fills `out` (unsorted, no duplicates).
  void allowed(std::vector<Token>& out, const uint32_t*& dense) const;
  bool allows(Token t) const;

 private:
  bool choice_has_unused(int32_t lo, int32_t hi) const;
  bool choice_child_ok(int32_t child) const;
};

// Fill one bitmask row (`words` int32 words, bit t%32 of word t/32, 1 = allowed) for `state`; `dirty` lists the
// words this buffer row holds non-zero from its previous fill (or holds {-1} when it must be cleared whole).
void fill_row(const RowState& state, uint32_t* row, int32_t words, std::vector<int32_t>& dirty,
              std::vector<Token>& scratch);

// Set logits to -inf where the mask bit is 0, for `n` columns. Multiversioned for AVX-512/AVX2/baseline; `stream`
// writes fully masked words with non-temporal stores (for logits much larger than the caches).
void apply_row_f32(float* logits, const uint32_t* mask, int32_t n, bool stream);
void apply_row_bf16(uint16_t* logits, const uint32_t* mask, int32_t n, bool stream);

}  // namespace cons
