"""Random constraint specs, token streams and batch operations for the differential and sanitizer tests.

Specs are drawn from small alphabets so that prefixes are shared, items repeat, and random tokens often hit
allowed sets; vocabularies range from under one bitmask word's worth of rows to thousands of tokens so that both
the sparse and the dense representations of a set are exercised. Batch operations (constrain, clear, one-way move,
swap, or something done to one row's history) are drawn against `BatchModel`, the plain-Python model of which row
holds which request that both tests check the native batch against.
"""

from __future__ import annotations

import random
from typing import Any

from serving_image.constraints.reference import ReferenceState
from serving_image.constraints.spec import (
    AllowedTokensSpec,
    ChoiceSequenceSpec,
    ConstraintSpec,
    TokenDfaSpec,
    validate_constraint,
)

VOCABS = (40, 64, 1000, 4096)


def random_vocab(rng: random.Random) -> tuple[int, int]:
    vocab = rng.choice(VOCABS)
    eos = rng.choice((0, vocab - 1, rng.randrange(vocab)))
    return vocab, eos


def _tok(rng: random.Random, vocab: int, eos: int, alphabet: int = 12) -> int:
    """A token id != eos, usually from a small alphabet, sometimes anywhere in the vocabulary."""
    while True:
        t = rng.randrange(min(alphabet, vocab)) if rng.random() < 0.85 else rng.randrange(vocab)
        if t != eos:
            return t


def random_spec(rng: random.Random, vocab: int, eos: int) -> ConstraintSpec:
    kind = rng.choice(("token_dfa", "choice_sequence", "allowed_tokens"))
    if kind == "token_dfa":
        n = rng.randint(1, 6)
        edges, seen = [], set()
        for _ in range(rng.randint(0, 14)):
            src, tok = rng.randrange(n), _tok(rng, vocab, eos, 6)
            if (src, tok) not in seen:
                seen.add((src, tok))
                edges.append([src, tok, rng.randrange(n)])
        accept = sorted(rng.sample(range(n), rng.randint(1, n)))
        raw = {"kind": kind, "start": rng.randrange(n), "accept": accept, "edges": edges}
    elif kind == "choice_sequence":
        choices: list[list[int]] = []
        for _ in range(rng.randint(1, 6)):
            c = [_tok(rng, vocab, eos, 5) for _ in range(rng.randint(1, 4))]
            if c not in choices:
                choices.append(c)
        inside = {t for c in choices for t in c}
        first = _tok(rng, vocab, eos, 30)
        while first in inside:
            first = _tok(rng, vocab, eos, 30)
        separator = [first] + [_tok(rng, vocab, eos, 8) for _ in range(rng.randint(0, 2))]
        unique = rng.random() < 0.5
        top = len(choices) if unique else 6
        min_items = rng.randint(1, min(top, 3)) if rng.random() < 0.8 else rng.randint(1, top)
        max_items = rng.choice((None, rng.randint(min_items, min_items + 2)))
        raw = {"kind": kind, "choices": choices, "separator": separator, "min_items": min_items,
               "unique": unique}
        if max_items is not None:
            raw["max_items"] = max_items
    else:
        size = rng.choice((1, 3, 8, 40, vocab // 2))
        tokens = [rng.randrange(vocab) for _ in range(size)]
        raw = {"kind": kind, "tokens": tokens}
    return validate_constraint(raw, vocab, eos)


def next_token(rng: random.Random, allowed: frozenset[int], vocab: int, eos: int) -> int:
    """Mostly a token the state allows (to walk deep), sometimes eos or any token (violations)."""
    r = rng.random()
    if r < 0.02:
        return eos
    if r < 0.05:
        return rng.randrange(vocab)
    ordered = sorted(allowed)
    non_eos = [t for t in ordered if t != eos]
    return rng.choice(non_eos or ordered)


def script_line(row: int, spec: ConstraintSpec, eos: int) -> str:
    """The sanitizer driver's line that constrains `row` with `spec`."""
    if isinstance(spec, TokenDfaSpec):
        flat = " ".join(f"{a} {b} {c}" for a, b, c in spec.edges)
        acc = " ".join(map(str, spec.accept))
        return f"DFA {row} {eos} {spec.start} {len(spec.accept)} {acc} {len(spec.edges)} {flat}"
    if isinstance(spec, ChoiceSequenceSpec):
        ch = " ".join(f"{len(c)} {' '.join(map(str, c))}" for c in spec.choices)
        sep = f"{len(spec.separator)} {' '.join(map(str, spec.separator))}"
        mx = -1 if spec.max_items is None else spec.max_items
        return f"CHOICE {row} {eos} {len(spec.choices)} {ch} {sep} {spec.min_items} {mx} {int(spec.unique)}"
    assert isinstance(spec, AllowedTokensSpec)
    # Every other set by its id parity packed (compile_allowed_packed), the rest listed (compile_allowed_tokens)
    op = "PACKED" if sum(spec.tokens) % 2 else "ALLOWED"
    return f"{op} {row} {eos} {len(spec.tokens)} {' '.join(map(str, spec.tokens))}"


def known_prefix(tokens: list[int]) -> list[int]:
    """What a row may consume: everything before the first -1 placeholder."""
    return tokens[: tokens.index(-1)] if -1 in tokens else tokens


class BatchModel:
    """Which row of a batch holds which constrained request (its spec and its token history, the list the test
    mutates), after any sequence of batch operations; a row not in `rows` is unconstrained."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.rows: dict[int, tuple[ConstraintSpec, list[int]]] = {}

    def set(self, row: int, spec: ConstraintSpec, history: list[int]) -> None:
        self.rows[row] = (spec, history)

    def clear(self, row: int) -> None:
        self.rows.pop(row, None)

    def move(self, src: int, dst: int) -> None:
        """One-way: `dst` takes what `src` held (nothing, if `src` was empty) and `src` is left empty."""
        if src in self.rows:
            self.rows[dst] = self.rows.pop(src)
        else:
            self.rows.pop(dst, None)

    def swap(self, a: int, b: int) -> None:
        held_a, held_b = self.rows.pop(a, None), self.rows.pop(b, None)
        if held_a is not None:
            self.rows[b] = held_a
        if held_b is not None:
            self.rows[a] = held_b

    def reference(self, row: int, eos: int) -> ReferenceState:
        """The reference state of `row`: its spec replayed over the known prefix of its history."""
        spec, history = self.rows[row]
        return ReferenceState.replay(spec, eos, known_prefix(history))

    def allowed(self, row: int, eos: int) -> list[int]:
        return sorted(self.reference(row, eos).allowed())


def random_batch_op(rng: random.Random, model: BatchModel, vocab: int, eos: int,
                    prefilled: bool = False) -> tuple[Any, ...]:
    """Draw one batch operation, apply it to `model` and return it for the caller to apply to the batch under test:
    ("set", row, spec, history) (an empty history, or with `prefilled` sometimes a few arbitrary tokens),
    ("clear", row), ("move", src, dst), ("swap", a, b); or ("history", row) for a constrained row whose history
    the caller changes in its own way (the model holds the caller's list, so it sees the change)."""
    op = rng.random()
    row = rng.randrange(model.capacity)
    if op < 0.15 or not model.rows:
        spec = random_spec(rng, vocab, eos)
        history = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))] if prefilled and rng.random() < 0.3 else []
        model.set(row, spec, history)
        return ("set", row, spec, history)
    if op < 0.2:
        model.clear(row)
        return ("clear", row)
    if op < 0.27:
        dst = rng.randrange(model.capacity)
        model.move(row, dst)
        return ("move", row, dst)
    if op < 0.34:
        other = rng.randrange(model.capacity)
        model.swap(row, other)
        return ("swap", row, other)
    return ("history", rng.choice(sorted(model.rows)))
