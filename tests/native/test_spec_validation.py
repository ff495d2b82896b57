"""`validate_constraint`: typed specs for good input, and for bad input a ConstraintError naming the field."""

from __future__ import annotations

import pytest

from serving_image.constraints import (
    AllowedTokensSpec,
    ChoiceSequenceSpec,
    ConstraintError,
    TokenDfaSpec,
    spec_to_json,
    validate_constraint,
)

VOCAB, EOS = 1024, 2

DFA = {"kind": "token_dfa", "start": 0, "accept": [2], "edges": [[0, 17, 1], [1, 42, 2], [1, 17, 1]]}
CHOICES = {"kind": "choice_sequence", "choices": [[5, 9], [5, 11, 12], [7]], "separator": [3],
           "min_items": 1, "max_items": 3, "unique": True}
ALLOWED = {"kind": "allowed_tokens", "tokens": [5, 7, 9]}


def test_architecture_examples_validate_to_typed_specs():
    dfa = validate_constraint(DFA, VOCAB, EOS)
    assert dfa == TokenDfaSpec(start=0, accept=(2,), edges=((0, 17, 1), (1, 42, 2), (1, 17, 1)))
    ch = validate_constraint(CHOICES, VOCAB, EOS)
    assert ch == ChoiceSequenceSpec(choices=((5, 9), (5, 11, 12), (7,)), separator=(3,), min_items=1, max_items=3,
                                    unique=True)
    assert validate_constraint(ALLOWED, VOCAB, EOS) == AllowedTokensSpec(tokens=(5, 7, 9))
    for raw in (DFA, CHOICES, ALLOWED):
        assert validate_constraint(spec_to_json(validate_constraint(raw, VOCAB, EOS)), VOCAB, EOS) == \
            validate_constraint(raw, VOCAB, EOS)


def test_defaults_of_choice_sequence():
    spec = validate_constraint({"kind": "choice_sequence", "choices": [[5]], "separator": [3]}, VOCAB, EOS)
    assert (spec.min_items, spec.max_items, spec.unique) == (1, None, False)


def _edit(base: dict, **changes) -> dict:
    out = {k: v for k, v in base.items() if k not in changes or changes[k] is not _DROP}
    out.update({k: v for k, v in changes.items() if v is not _DROP})
    return out


_DROP = object()


@pytest.mark.parametrize(
    ("raw", "field", "words"),
    [
        ("not json", "constraint", "must be a JSON object"),
        ({"start": 0}, "constraint.kind", "must be one of token_dfa, choice_sequence, allowed_tokens (got missing)"),
        ({"kind": "regex"}, "constraint.kind", "(got 'regex')"),
        (_edit(DFA, colour=1), "constraint.colour", "unknown field for kind token_dfa"),
        (_edit(DFA, accept=_DROP), "constraint.accept", "is required for kind token_dfa"),
        (_edit(DFA, edges=[[0, 17, 1], [1, 42, 2], [1, 17, 1], [2, 99999, 0]]), "constraint.edges[3][1]",
         "token id 99999 is outside the vocabulary (0..1023)"),
        (_edit(DFA, edges=[[0, 17]]), "constraint.edges[0]", "must be [from_state, token_id, to_state]"),
        (_edit(DFA, edges=[[0, "a", 1]]), "constraint.edges[0][1]", "must be an integer, got a string"),
        (_edit(DFA, edges=[[0, True, 1]]), "constraint.edges[0][1]", "must be an integer, got a boolean"),
        (_edit(DFA, edges=[[0, 2, 1]]), "constraint.edges[0][1]", "is the end-of-sequence token"),
        (_edit(DFA, edges=[[-1, 5, 1]]), "constraint.edges[0][0]", "state -1 is outside"),
        (_edit(DFA, edges=[[0, 5, 1], [0, 5, 2]]), "constraint.edges[1][2]",
         "state 0 already goes to state 1 on token 5 (constraint.edges[0])"),
        (_edit(DFA, start=1 << 20), "constraint.start", "is outside 0..1048575"),
        (_edit(DFA, accept=[]), "constraint.accept", "must not be empty"),
        (_edit(DFA, accept=3), "constraint.accept", "must be an array, got int"),
        (_edit(CHOICES, choices=[]), "constraint.choices", "must not be empty"),
        (_edit(CHOICES, choices=[[5], []]), "constraint.choices[1]", "must not be empty"),
        (_edit(CHOICES, choices=[[5, 9], [7], [5, 9]]), "constraint.choices[2]", "duplicates constraint.choices[0]"),
        (_edit(CHOICES, choices=[[5, -4]]), "constraint.choices[0][1]", "token id -4 is negative"),
        (_edit(CHOICES, separator=[]), "constraint.separator", "must not be empty"),
        (_edit(CHOICES, separator=[9, 3]), "constraint.separator[0]", "also appears in constraint.choices[0]"),
        (_edit(CHOICES, min_items=0), "constraint.min_items", "must be at least 1"),
        (_edit(CHOICES, min_items=4, max_items=None), "constraint.min_items",
         "4 distinct items cannot be made from 3 choices"),
        (_edit(CHOICES, max_items=0), "constraint.max_items", "0 is less than min_items (1)"),
        (_edit(CHOICES, unique="yes"), "constraint.unique", "must be a boolean, got a string"),
        (_edit(ALLOWED, tokens=[5, 1024]), "constraint.tokens[1]", "token id 1024 is outside the vocabulary"),
        (_edit(ALLOWED, tokens=None), "constraint.tokens", "must be an array, got null"),
    ],
)
def test_bad_specs_name_the_field(raw, field, words):
    with pytest.raises(ConstraintError) as err:
        validate_constraint(raw, VOCAB, EOS)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}: ")
    assert words in str(err.value)
    assert isinstance(err.value, ValueError)


def test_the_issue_example_message_verbatim():
    raw = _edit(DFA, edges=[[0, 17, 1], [1, 42, 2], [1, 17, 1], [1, 99999, 2]])
    with pytest.raises(ConstraintError, match=r"^constraint\.edges\[3\]\[1\]: token id 99999 is outside the "
                                              r"vocabulary \(0\.\.1023\)$"):
        validate_constraint(raw, VOCAB, EOS)


def test_without_vocabulary_only_the_vocabulary_checks_are_skipped():
    """vLLM's validate_params runs before the vocabulary is known: structure is still checked."""
    assert validate_constraint(_edit(ALLOWED, tokens=[10**6]), None, None).tokens == (10**6,)
    with pytest.raises(ConstraintError, match=r"constraint\.tokens\[0\]: token id -1 is negative"):
        validate_constraint(_edit(ALLOWED, tokens=[-1]), None, None)
    with pytest.raises(ConstraintError, match=r"constraint\.edges\[1\]\[2\]"):
        validate_constraint(_edit(DFA, edges=[[0, 5, 1], [0, 5, 2]]), None, None)
