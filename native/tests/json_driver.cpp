// The JSON readers of constraint specs (native/include/constraint_json.hpp), built by tests/native/test_sanitizers.py
// with -fsanitize=address,undefined: they read client text, so every text is handed to them in a heap buffer of
// exactly its size, where a read one byte past the end is an ASan report. For each record on stdin it prints what
// the readers found; the test compares that with the extension's answers for the same texts.
//
// Records: `ALLOWED hi length\n<length bytes>\n` and `DFA hi eos max_ids length\n<length bytes>\n`.
// Output, one line each: `ALLOWED count start stop` (count -1 when refused), `DFA 1 start accepts edges deterministic`
// or `DFA 0`.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "constraint_json.hpp"

namespace {

[[noreturn]] void die(const char* why) {
  std::fprintf(stderr, "driver: %s\n", why);
  std::abort();
}

std::unique_ptr<char[]> read_text(std::istream& in, size_t length) {
  if (in.get() != '\n') die("expected a newline before the text");
  std::unique_ptr<char[]> text(new char[length == 0 ? 1 : length]);  // exactly the text: no terminator to lean on
  if (!in.read(text.get(), static_cast<std::streamsize>(length))) die("truncated text");
  return text;
}

}  // namespace

int main() {
  std::istream& in = std::cin;
  std::string op;
  while (in >> op) {
    if (op == "ALLOWED") {
      int64_t hi = 0;
      size_t length = 0;
      if (!(in >> hi >> length)) die("truncated record");
      const auto text = read_text(in, length);
      size_t start = 0, stop = 0;
      std::vector<cons::Token> ids;
      const int64_t count = cons::JsonTokens(text.get(), text.get() + length).allowed_tokens(hi, &start, &stop, &ids);
      if (count >= 0 && static_cast<size_t>(count) != ids.size()) die("count and ids disagree");
      if (count < 0) start = stop = 0;
      std::printf("ALLOWED %lld %zu %zu\n", static_cast<long long>(count < 0 ? -1 : count), start, stop);
    } else if (op == "DFA") {
      int64_t hi = 0, eos = 0, max_ids = 0;
      size_t length = 0;
      if (!(in >> hi >> eos >> max_ids >> length)) die("truncated record");
      const auto text = read_text(in, length);
      int32_t start = 0;
      std::vector<cons::Token> accept, edges;
      const bool ok = cons::JsonTokens(text.get(), text.get() + length)
                          .token_dfa(hi, eos, cons::kMaxStates, max_ids, &start, &accept, &edges);
      if (ok) {
        if (edges.size() % 3 != 0) die("edges are not triples");
        std::printf("DFA 1 %d %zu %zu %d\n", start, accept.size(), edges.size() / 3,
                    cons::deterministic(edges) ? 1 : 0);
      } else {
        std::printf("DFA 0\n");
      }
    } else {
      die("unknown record");
    }
  }
  return 0;
}
