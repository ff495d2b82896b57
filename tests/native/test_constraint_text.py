"""A constraint read from its JSON text (`constraint_text` on a `json_text.JSONText`) gives what reading it into Python
values and `validate_constraint` give: the same checked text for a good spec, the same ConstraintError (field and
message) for a bad one. The one-pass read of an allowed_tokens list, and the native helpers under it, are checked
against plain Python on the edges of the JSON number grammar."""

from __future__ import annotations

import json
import random

import pytest

from serving_image.constraints import _native
from serving_image.constraints.spec import MAX_TOKEN_IDS, ConstraintError, constraint_text, validate_constraint
from serving_image.json_text import JSONText

VOCAB, EOS = 1024, 2
ALLOWED = '{"kind":"allowed_tokens","tokens":[5,7,9]}'

GOOD = [
    ALLOWED,
    '{"kind": "allowed_tokens", "tokens": [ 0 ,\n 1023,\t2 ]}',  # JSON whitespace; eos and the last id allowed
    '{"tokens":[9,5,5,7],"kind":"allowed_tokens"}',  # any member order, duplicates and any order of ids
    '{"kind":"allowed_tokens","tokens":[5,-0]}',  # JSON's -0 is the integer 0: read in full, accepted
    '{"k\\u0069nd":"allowed_tokens","tokens":[5]}',  # an escaped member name: read in full
    '{"kind":"regex","kind":"allowed_tokens","tokens":[5]}',  # the last of duplicate members, as json.loads
    json.dumps({"kind": "allowed_tokens", "tokens": random.Random(1).sample(range(VOCAB), 700)}),
    '{"kind":"choice_sequence","choices":[[5,9],[7]],"separator":[3]}',  # other kinds: read in full
    '{"kind":"token_dfa","start":0,"accept":[1],"edges":[[0,5,1]]}',
]
BAD = [
    '{"kind":"allowed_tokens","tokens":[]}',
    '{"kind":"allowed_tokens","tokens":[5,1024]}',
    '{"kind":"allowed_tokens","tokens":[5,-1]}',
    '{"kind":"allowed_tokens","tokens":[5,7.0]}',
    '{"kind":"allowed_tokens","tokens":[5,1e2]}',
    '{"kind":"allowed_tokens","tokens":[5,true]}',
    '{"kind":"allowed_tokens","tokens":[5,"7"]}',
    '{"kind":"allowed_tokens","tokens":[5,[7]]}',
    '{"kind":"allowed_tokens","tokens":[5,99999999999999999999999]}',
    '{"kind":"allowed_tokens","tokens":{"a":1}}',
    '{"kind":"allowed_tokens","tokens":null}',
    '{"kind":"allowed_tokens"}',
    '{"kind":"allowed_tokens","tokens":[5],"colour":1}',
    '{"kind":"regex","tokens":[5]}',
    '{"kind":5,"tokens":[5]}',
    '{"tokens":[5]}',
    '{"kind":"choice_sequence","choices":[[5,2]],"separator":[3]}',
]


def _outcome(call):
    try:
        return "ok", json.loads(call())
    except ConstraintError as exc:
        return "error", exc.field, str(exc)


@pytest.mark.parametrize("text", GOOD + BAD)
@pytest.mark.parametrize("vocab", [VOCAB, None])
def test_the_text_and_the_value_give_the_same_outcome(text, vocab):
    from_text = _outcome(lambda: constraint_text(JSONText(text.encode()), vocab, EOS))
    from_value = _outcome(lambda: constraint_text(json.loads(text), vocab, EOS))
    assert from_text == from_value
    if vocab is not None:  # without a vocabulary, ids above it are fine
        assert from_text[0] == ("ok" if text in GOOD else "error")


def test_a_checked_text_is_what_validate_constraint_accepts():
    text = constraint_text(JSONText(GOOD[1].encode()), VOCAB, EOS)
    assert validate_constraint(json.loads(text), VOCAB, EOS).tokens == (0, 1023, 2)


def test_more_ids_than_a_spec_may_hold_are_refused_either_way():
    text = '{"kind":"allowed_tokens","tokens":[' + ",".join(["1"] * (MAX_TOKEN_IDS + 1)) + "]}"
    with pytest.raises(ConstraintError, match=r"^constraint\.tokens\[1048576\]: the spec holds more than"):
        constraint_text(JSONText(text.encode()), VOCAB, EOS)


@pytest.mark.parametrize(("array", "hi", "count"), [
    (b"[1,3,5]", 10, 3),
    (b" [ 0 ,\r\n9 ]\t", 10, 2),
    (b"[10]", 10, -1),  # at the bound
    (b"[2147483648]", -1, -1),  # no bound given: below 2^31
    (b"[2147483647]", -1, 1),
    (b"[]", 10, -1),
    (b"[01]", 10, -1),
    (b"[0]", 10, 1),
    (b"[1,]", 10, -1),
    (b"[,1]", 10, -1),
    (b"[1 2]", 10, -1),
    (b"[1]]", 10, -1),
    (b"[1", 10, -1),
    (b"[1.5]", 10, -1),
    (b"[1E1]", 10, -1),
    (b"[+1]", 10, -1),
    (b"[-1]", 10, -1),
    (b"[null]", 10, -1),
    (b"", 10, -1),
])
def test_the_token_array_is_read_only_as_plain_integers(array, hi, count):
    text = b'{"kind":"allowed_tokens","tokens":' + array + b"}"
    assert _native.json_allowed_tokens(text, hi)[0] == count
    assert _native.json_allowed_tokens(bytearray(text), hi)[0] == count


@pytest.mark.parametrize(("text", "hi", "expected"), [
    (b'{"kind":"allowed_tokens","tokens":[1,3]}', 10, (2, 34, 39)),
    (b' {"tokens" : [ 4 ] ,\n"kind":"allowed_tokens"} ', 10, (1, 13, 18)),
    (b'{"kind":"allowed_tokens","tokens":[1,10]}', 10, (-1, 0, 0)),
    (b'{"kind":"allowed_tokens","tokens":[1],"tokens":[2]}', 10, (-1, 0, 0)),
    (b'{"kind":"allowed_tokens","tokens":[1],"x":0}', 10, (-1, 0, 0)),
    (b'{"kind":"allowed_tokens "}', 10, (-1, 0, 0)),
    (b'{"tokens":[1]}', 10, (-1, 0, 0)),
    (b'{"kind":"allowed_tokens","tokens":[1]', 10, (-1, 0, 0)),
    (b'{"kind":"allowed_tokens","tokens":[1]}}', 10, (-1, 0, 0)),
])
def test_json_allowed_tokens_reads_exactly_the_plain_form(text, hi, expected):
    assert _native.json_allowed_tokens(text, hi) == expected
    count, start, stop = expected
    if count > 0:
        assert json.loads(text[start:stop]) == json.loads(text)["tokens"]


@pytest.mark.parametrize(("values", "hi", "exclude", "ok"), [
    ([1, 3, 5], 10, -1, True),
    ((1, 3, 5), 10, -1, True),
    ([1, 3, 5], 10, 3, False),
    ([1, 10], 10, -1, False),
    ([1, -1], 10, -1, False),
    ([1, True], 10, -1, False),  # a bool is not a token id
    ([1, 2.0], 10, -1, False),
    ([1, 2**70], -1, -1, False),
    ([1, 2**40], -1, -1, True),
    ("123", 10, -1, False),
])
def test_token_ids_in_range_is_the_python_check(values, hi, exclude, ok):
    assert _native.token_ids_in_range(values, hi, exclude) is ok


def test_an_allowed_set_compiles_the_same_in_any_order():
    """The set is built from its bits (linear in any order); it must allow exactly the ids given and eos."""
    ids = random.Random(3).sample(range(VOCAB), 300)
    engines = []
    for order in (sorted(ids), ids, sorted(ids, reverse=True), ids + ids[:50]):
        machine = _native.compile_allowed_tokens(VOCAB, EOS, order)
        engine = _native.Engine(VOCAB, 1, 1)
        engine.set_row(0, machine, None)
        engine.fill([0], 1)
        engines.append(engine.bitmask()[0].copy())
    expected = set(ids) | {EOS}
    allowed = {w * 32 + b for w, word in enumerate(engines[0]) for b in range(32) if (int(word) >> b) & 1}
    assert allowed == expected
    assert all((e == engines[0]).all() for e in engines)


def test_a_plain_allowed_tokens_text_compiles_in_one_pass_to_the_parsed_values_machine():
    from serving_image.constraints.engine import compile_allowed_tokens_text, compile_spec

    ids = random.Random(5).sample(range(VOCAB), 400)
    text = json.dumps({"kind": "allowed_tokens", "tokens": ids})

    def allowed(machine):
        engine = _native.Engine(VOCAB, 1, 1)
        engine.set_row(0, machine, None)
        engine.fill([0], 1)
        return engine.bitmask()[0].copy()

    fast = compile_allowed_tokens_text(text, VOCAB, EOS)
    assert fast is not None
    assert (allowed(fast) == allowed(compile_spec(validate_constraint(json.loads(text), VOCAB, EOS), VOCAB, EOS))).all()
    for other in ('{"kind":"allowed_tokens","tokens":[1,2.0]}', '{"kind":"allowed_tokens","tokens":[1024]}',
                  '{"kind":"choice_sequence","choices":[[5]],"separator":[3]}', "not json"):
        assert compile_allowed_tokens_text(other, VOCAB, EOS) is None
    assert _native.compile_allowed_tokens_json(VOCAB, EOS, b'{"kind":"allowed_tokens","tokens":[1,2,3]}', 2) is None
