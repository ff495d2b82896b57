"""Pure-Python reference of the constraint semantics, one object per request, the way the first version worked.

It is the executable definition the native core is tested against (differential property tests), and the
"Python per-request" baseline of the benchmark. Written independently of the C++ data structures: choice
sequences keep the current item's prefix and scan the choices instead of walking a trie.

Shared semantics (docs/architecture.md §3.5 plus the edge cases every implementation must agree on):
  - after eos, or after a token the state did not allow, only eos is allowed (the request is over or broken);
  - a state that allows nothing allows eos, so a row never masks out every token.
"""

from __future__ import annotations

from collections.abc import Iterable

from serving_image.constraints.spec import AllowedTokensSpec, ChoiceSequenceSpec, ConstraintSpec, TokenDfaSpec


class ReferenceState:
    """The state of one request under one constraint, advanced token by token."""

    def __init__(self, spec: ConstraintSpec, eos_token_id: int):
        self.spec = spec
        self.eos = eos_token_id
        self.finished = False
        if isinstance(spec, TokenDfaSpec):
            self._out: dict[int, dict[int, int]] = {}
            for src, tok, dst in spec.edges:
                self._out.setdefault(src, {})[tok] = dst
            self._accept = frozenset(spec.accept)
            self.state = spec.start
        elif isinstance(spec, ChoiceSequenceSpec):
            self.prefix: tuple[int, ...] = ()
            self.sep_pos = -1  # position in the separator being emitted, -1 inside an item
            self.items = 0
            self.used: set[tuple[int, ...]] = set()
        elif isinstance(spec, AllowedTokensSpec):
            self._tokens = frozenset(spec.tokens) | {eos_token_id}
        else:
            raise TypeError(f"not a constraint spec: {spec!r}")

    @classmethod
    def replay(cls, spec: ConstraintSpec, eos_token_id: int, tokens: Iterable[int]) -> ReferenceState:
        state = cls(spec, eos_token_id)
        for t in tokens:
            state.advance(t)
        return state

    def allowed(self) -> frozenset[int]:
        if self.finished:
            return frozenset((self.eos,))
        spec = self.spec
        if isinstance(spec, AllowedTokensSpec):
            return self._tokens
        if isinstance(spec, TokenDfaSpec):
            out = set(self._out.get(self.state, {}))
            if self.state in self._accept:
                out.add(self.eos)
        else:
            out = self._choice_allowed(spec)
        return frozenset(out) if out else frozenset((self.eos,))

    def _choice_allowed(self, spec: ChoiceSequenceSpec) -> set[int]:
        if self.sep_pos >= 0:
            return {spec.separator[self.sep_pos]}
        n = len(self.prefix)
        open_choices = [c for c in spec.choices if not (spec.unique and c in self.used)]
        out = {c[n] for c in open_choices if len(c) > n and c[:n] == self.prefix}
        if self.prefix in open_choices:  # the item so far is a complete, usable choice
            done = self.items + 1
            more_left = not spec.unique or len(open_choices) > 1
            if (spec.max_items is None or done < spec.max_items) and more_left:
                out.add(spec.separator[0])
            if done >= spec.min_items:
                out.add(self.eos)
        return out

    def advance(self, token: int) -> None:
        if self.finished:
            return
        if token == self.eos or token not in self.allowed():
            self.finished = True
            return
        spec = self.spec
        if isinstance(spec, TokenDfaSpec):
            self.state = self._out[self.state][token]
        elif isinstance(spec, ChoiceSequenceSpec):
            if self.sep_pos >= 0:
                self.sep_pos += 1
                if self.sep_pos == len(spec.separator):
                    self.sep_pos = -1
            elif token == spec.separator[0]:  # never inside a choice (validated), so the item is complete
                self.used.add(self.prefix)
                self.items += 1
                self.prefix = ()
                self.sep_pos = 1 if len(spec.separator) > 1 else -1
            else:
                self.prefix = self.prefix + (token,)


def satisfies(spec: ConstraintSpec, eos_token_id: int, tokens: list[int], *, finished_by_eos: bool) -> str | None:
    """Why `tokens` (without a trailing eos) violate the constraint, or None. With `finished_by_eos`, the output
    ended with eos and must be a complete sentence; otherwise (length limit) it must be a valid prefix."""
    state = ReferenceState(spec, eos_token_id)
    for i, t in enumerate(tokens):
        if t not in state.allowed():
            return f"token {i} ({t}) is not allowed after {tokens[:i]}"
        state.advance(t)
    if finished_by_eos and eos_token_id not in state.allowed():
        return f"eos is not allowed after {tokens}"
    return None
