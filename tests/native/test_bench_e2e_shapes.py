"""The end-to-end benchmark's peer comparison is fair only if its constraints are equivalent to xgrammar's
(bench/constraints_e2e.py): every text over the chosen alphabet has exactly one tokenization, and the token-level
DFA / choice sequence allow exactly the token sequences whose text the regex / choice allows."""

from __future__ import annotations

import random
import re

import pytest

from bench.constraints_e2e import Shapes
from serving_image.constraints.reference import ReferenceState
from serving_image.constraints.spec import validate_constraint


@pytest.fixture(scope="module")
def shapes(demo_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(demo_model_dir))
    return tokenizer, Shapes(tokenizer, len(tokenizer), output_len=12)


def _accepts(spec: dict, tokens: list[int], eos: int) -> bool:
    state = ReferenceState(validate_constraint(spec, None, None), eos)
    for t in tokens:
        if t not in state.allowed():
            return False
        state.advance(t)
    return state.allowed() == {eos}


def test_every_text_over_the_alphabet_has_one_tokenization(shapes):
    tokenizer, s = shapes
    assert len(s.alphabet) >= 3
    pieces = [tokenizer.decode([i]) for i in range(len(tokenizer))]
    multi = [p for p in pieces if len(p) > 1 and set(p) <= set(s.alphabet)]
    assert not multi  # no token spells two or more alphabet characters
    rng = random.Random(0)
    for _ in range(50):
        text = "".join(rng.choice(list(s.alphabet)) for _ in range(rng.randint(1, 30)))
        assert tokenizer.encode(text, add_special_tokens=False) == [s.alphabet[c] for c in text]


def test_the_dfa_and_the_regex_allow_the_same_outputs(shapes):
    _, s = shapes
    rng = random.Random(1)
    chars = list(s.alphabet)
    for length in (s.L - 1, s.L, s.L + 1):
        text = "".join(rng.choice(chars) for _ in range(length))
        tokens = [s.alphabet[c] for c in text]
        assert bool(re.fullmatch(s.regex, text)) == _accepts(s.dfa, tokens, s.eos) == (length == s.L)


def test_the_choice_sequence_and_the_choice_allow_the_same_outputs(shapes):
    _, s = shapes
    for text in s.strings:
        assert _accepts(s.choice, [s.alphabet[c] for c in text], s.eos)
    other = "".join(reversed(s.strings[0]))
    if other not in s.strings:
        assert not _accepts(s.choice, [s.alphabet[c] for c in other], s.eos)
