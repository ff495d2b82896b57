"""A constraint read from its JSON text (`constraint_text` on a `json_text.JSONText`) gives what reading it into Python
values and `validate_constraint` give: the same checked spec for a good one, the same ConstraintError (field and
message) for a bad one. The one-pass read of an allowed_tokens list, and the native helpers under it, are checked
against plain Python on the edges of the JSON number grammar. An allowed_tokens set is handed on packed when that is
shorter (its `bitmask` form): the same set, checked the same way."""

from __future__ import annotations

import base64
import json
import random

import pytest

from serving_image.constraints import _native
from serving_image.constraints.spec import (
    MAX_TOKEN_IDS,
    AllowedTokensSpec,
    ConstraintError,
    checked_plain_text,
    constraint_text,
    validate_constraint,
)
from serving_image.json_text import JSONText

VOCAB, EOS = 1024, 2
ALLOWED = '{"kind":"allowed_tokens","tokens":[5,7,9]}'


def packed(ids, nbytes=VOCAB // 8) -> str:
    """An allowed_tokens set's bitmask as a client writes it: bit t % 8 of byte t / 8, standard base64."""
    bits = bytearray(nbytes)
    for t in ids:
        bits[t // 8] |= 1 << (t % 8)
    return base64.b64encode(bytes(bits)).decode()


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
    # token_dfa in its plain form: any member order, JSON whitespace, exact repeats, no edges, the last state and id
    '{"edges":[ [0, 5, 1] ,\n[1,1023,2],[0,5,1]], "accept" : [2,0], "start":0, "kind":"token_dfa"}',
    '{"kind":"token_dfa","start":3,"accept":[3],"edges":[]}',
    '{"kind":"token_dfa","start":0,"accept":[1048575],"edges":[[0,7,1048575]]}',
    '{"kind":"token_dfa","start":0,"accept":[1],"edges":[[0,5,-0]]}',  # -0: read in full, accepted
    # allowed_tokens packed: ids 0 and the vocabulary's last (1023), a shorter mask than the vocabulary, whitespace
    '{"kind":"allowed_tokens","bitmask":"' + packed([0, 5, 1023]) + '"}',
    '{ "bitmask" : "' + packed([7], 1) + '" , "kind":"allowed_tokens" }',
    '{"kind":"allowed_tokens","bitmask":"' + packed(random.Random(2).sample(range(VOCAB), 500)) + '"}',
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
    '{"kind":"token_dfa","start":0,"accept":[1],"edges":[[0,2,1]]}',  # eos on an edge
    '{"kind":"token_dfa","start":0,"accept":[1],"edges":[[0,1024,1]]}',
    '{"kind":"token_dfa","start":0,"accept":[1],"edges":[[0,5,1],[0,5,2]]}',  # not deterministic
    '{"kind":"token_dfa","start":0,"accept":[1],"edges":[[0,5,1048576]]}',
    '{"kind":"token_dfa","start":1048576,"accept":[1],"edges":[]}',
    '{"kind":"token_dfa","start":0,"accept":[],"edges":[]}',
    '{"kind":"token_dfa","start":0,"accept":[1],"edges":[[0,5]]}',
    '{"kind":"token_dfa","start":0,"accept":[1],"edges":[[0,5,1,2]]}',
    '{"kind":"token_dfa","start":0,"accept":[1],"edges":[[0,5.0,1]]}',
    '{"kind":"token_dfa","start":0,"accept":[1],"edges":[[0,true,1]]}',
    '{"kind":"token_dfa","start":-1,"accept":[1],"edges":[]}',
    '{"kind":"token_dfa","start":0.5,"accept":[1],"edges":[]}',
    '{"kind":"token_dfa","start":0,"accept":[1]}',
    '{"kind":"token_dfa","start":0,"accept":[1],"edges":[],"tokens":[5]}',
    '{"kind":"token_dfa","start":0,"accept":[1],"edges":[[0,5,1]],"edges":[[0,5,1],[0,5,2]]}',  # the last one counts
    '{"kind":"token_dfa","start":0,"accept":1,"edges":[]}',
    '{"kind":"token_dfa","start":0,"accept":[1],"edges":[0,5,1]}',
    '{"kind":"allowed_tokens","bitmask":"' + packed([5, 1024], 129) + '"}',  # a bit beyond the vocabulary
    '{"kind":"allowed_tokens","bitmask":"' + packed([], 16) + '"}',  # no bit set
    '{"kind":"allowed_tokens","bitmask":""}',
    '{"kind":"allowed_tokens","bitmask":"AQ"}',  # unpadded
    '{"kind":"allowed_tokens","bitmask":"AQ==\\n"}',  # a character outside the alphabet
    '{"kind":"allowed_tokens","bitmask":[1]}',
    '{"kind":"allowed_tokens","bitmask":null}',
    '{"kind":"allowed_tokens","bitmask":"AQ==","tokens":[0]}',
    '{"kind":"allowed_tokens","bitmask":"AQ==","colour":1}',
    '{"kind":"allowed_tokens","bitmask":"' + "A" * (4 * (MAX_TOKEN_IDS // 8 // 3 + 1) + 4) + '"}',  # over 2^20 ids
]


def meaning(text: str, vocab=VOCAB, eos=EOS):
    """What a checked text asks for: its typed spec, an allowed_tokens set as a set (a list and its packed form hold
    the same ids, in another order and without repeats)."""
    spec = validate_constraint(json.loads(text), vocab, eos)
    return frozenset(spec.tokens) if isinstance(spec, AllowedTokensSpec) else spec


def _outcome(call, vocab, eos):
    try:
        return "ok", meaning(call(), vocab, eos)
    except ConstraintError as exc:
        return "error", exc.field, str(exc)


@pytest.mark.parametrize("text", GOOD + BAD)
@pytest.mark.parametrize(("vocab", "eos"), [(VOCAB, EOS), (None, EOS), (None, None)])
def test_the_text_and_the_value_give_the_same_outcome(text, vocab, eos):
    from_text = _outcome(lambda: constraint_text(JSONText(text.encode()), vocab, eos), vocab, eos)
    from_value = _outcome(lambda: constraint_text(json.loads(text), vocab, eos), vocab, eos)
    assert from_text == from_value
    if vocab is not None:  # without a vocabulary (or eos), ids above it (or eos on an edge) are fine
        assert from_text[0] == ("ok" if text in GOOD else "error")


@pytest.mark.parametrize("text", GOOD + BAD)
def test_the_plain_form_is_read_natively_only_when_the_full_read_accepts_it(text):
    """checked_plain_text never accepts what validate_constraint refuses (with or without a vocabulary and eos)."""
    for vocab, eos in ((VOCAB, EOS), (None, None)):
        fast = checked_plain_text(text.encode(), vocab, eos)
        if fast is not None:
            # raises if the native read was wrong
            assert meaning(fast, vocab, eos) == meaning(text, vocab, eos)


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
    from serving_image.constraints.machines import compile_plain_text, compile_spec

    ids = random.Random(5).sample(range(VOCAB), 400)
    text = json.dumps({"kind": "allowed_tokens", "tokens": ids})

    def allowed(machine):
        engine = _native.Engine(VOCAB, 1, 1)
        engine.set_row(0, machine, None)
        engine.fill([0], 1)
        return engine.bitmask()[0].copy()

    fast = compile_plain_text(text, VOCAB, EOS)
    assert fast is not None
    assert (allowed(fast) == allowed(compile_spec(validate_constraint(json.loads(text), VOCAB, EOS), VOCAB, EOS))).all()
    for other in ('{"kind":"allowed_tokens","tokens":[1,2.0]}', '{"kind":"allowed_tokens","tokens":[1024]}',
                  '{"kind":"choice_sequence","choices":[[5]],"separator":[3]}', "not json"):
        assert compile_plain_text(other, VOCAB, EOS) is None
    assert _native.compile_allowed_tokens_json(VOCAB, EOS, b'{"kind":"allowed_tokens","tokens":[1,2,3]}', 2) is None


def _masks_along(machine, prefixes):
    """The allowed set after each prefix of output tokens: what a row constrained by `machine` masks to."""
    out = []
    for prefix in prefixes:
        engine = _native.Engine(VOCAB, 1, 1)
        engine.set_row(0, machine, list(prefix))
        engine.sync()
        engine.fill([0], 1)
        out.append(engine.bitmask()[0].copy())
    return out


def test_a_plain_token_dfa_text_compiles_in_one_pass_to_the_parsed_values_machine():
    from serving_image.constraints.machines import compile_plain_text, compile_spec

    rng = random.Random(7)
    alphabet = rng.sample([t for t in range(VOCAB) if t != EOS], 6)
    edges = [[s, t, s + 1] for s in range(20) for t in alphabet[: 2 + s % 4]]
    edges += [[20, alphabet[0], 0], edges[0]]  # a cycle and an exact repeat
    rng.shuffle(edges)
    spec = {"edges": edges, "accept": [20, 7], "kind": "token_dfa", "start": 0}
    text = json.dumps(spec)
    fast = compile_plain_text(text, VOCAB, EOS)
    assert fast is not None and fast.kind == "token_dfa"
    slow = compile_spec(validate_constraint(spec, VOCAB, EOS), VOCAB, EOS)
    assert fast.num_states == slow.num_states == 21
    prefixes = [[]] + [[alphabet[0]] * n for n in (1, 7, 20, 21)] + [[alphabet[1], alphabet[0], alphabet[1]]]
    for a, b in zip(_masks_along(fast, prefixes), _masks_along(slow, prefixes), strict=True):
        assert (a == b).all()
    for other in ('{"kind":"token_dfa","start":0,"accept":[1],"edges":[[0,5,1],[0,5,2]]}',  # nondeterministic
                  '{"kind":"token_dfa","start":0,"accept":[1],"edges":[[0,2,1]]}',  # eos on an edge
                  '{"kind":"token_dfa","start":0,"accept":[1],"edges":[[0,1024,1]]}'):
        assert compile_plain_text(other, VOCAB, EOS) is None
    too_many = json.dumps({"kind": "token_dfa", "start": 0, "accept": [1], "edges": [[0, 5, 1]] * 3}).encode()
    assert _native.compile_token_dfa_json(VOCAB, EOS, too_many, 2) is None
    assert _native.json_token_dfa(too_many, VOCAB, EOS, 2) is False
    assert _native.json_token_dfa(too_many, VOCAB, EOS, 3) is True


@pytest.mark.parametrize(("text", "native"), [
    (GOOD[0], True),
    (GOOD[1], True),
    (GOOD[3], False),  # -0
    (GOOD[7], False),  # choice_sequence: always the full read
    (GOOD[8], True),
    (GOOD[9], True),
    (GOOD[10], True),
    (GOOD[11], True),
    (GOOD[12], False),  # -0
    (GOOD[13], True),  # packed
    (GOOD[14], True),
])
def test_which_good_specs_take_the_native_read(text, native):
    assert (checked_plain_text(text.encode(), VOCAB, EOS) is not None) is native


def test_a_long_allowed_list_is_handed_on_packed_and_a_short_one_as_its_list():
    """Packed when its base64 is shorter than the list (a quarter of a 32k vocabulary: 5.4 KB against 48 KB), by the
    native read and by the full one alike; without a vocabulary the list stays a list."""
    vocab = 32000
    ids = random.Random(4).sample(range(vocab), vocab // 4)
    for sent in (json.dumps({"kind": "allowed_tokens", "tokens": ids}),
                 json.dumps({"tokens": ids, "kind": "allowed_tokens"}, indent=1)):  # not the plain reader's layout
        for value in (JSONText(sent.encode()), json.loads(sent)):
            text = constraint_text(value, vocab, EOS)
            assert json.loads(text).keys() == {"kind", "bitmask"}
            assert len(text) < len(sent) // 8
            assert validate_constraint(json.loads(text), vocab, EOS).tokens == tuple(sorted(ids))
    short = json.dumps({"kind": "allowed_tokens", "tokens": ids[:40]})
    assert json.loads(constraint_text(JSONText(short.encode()), vocab, EOS))["tokens"] == ids[:40]
    assert json.loads(constraint_text(json.loads(short), vocab, EOS))["tokens"] == ids[:40]
    long = json.dumps({"kind": "allowed_tokens", "tokens": ids})
    assert json.loads(constraint_text(JSONText(long.encode()), None, None))["tokens"] == ids


@pytest.mark.parametrize(("text", "field", "reason"), [
    ('{"kind":"allowed_tokens","bitmask":"' + packed([5, 1030], 129) + '"}', "constraint.bitmask",
     "token id 1030 is outside the vocabulary (0..1023)"),
    ('{"kind":"allowed_tokens","bitmask":"AAAA"}', "constraint.bitmask",
     "allows no token: at least one bit must be set"),
    ('{"kind":"allowed_tokens","bitmask":""}', "constraint.bitmask", "must not be empty"),
    ('{"kind":"allowed_tokens","bitmask":7}', "constraint.bitmask", "must be a base64 string, got int"),
    ('{"kind":"allowed_tokens"}', "constraint.tokens",
     "is required for kind allowed_tokens (or bitmask, its packed form)"),
    ('{"kind":"allowed_tokens","bitmask":"AQ==","tokens":[0]}', "constraint.bitmask",
     "give the set once: tokens, or bitmask (its packed form), not both"),
])
def test_a_bad_bitmask_is_refused_naming_it(text, field, reason):
    with pytest.raises(ConstraintError) as caught:
        constraint_text(JSONText(text.encode()), VOCAB, EOS)
    assert (caught.value.field, caught.value.reason) == (field, reason)
    with pytest.raises(ConstraintError, match="^constraint.bitmask: is not base64"):
        constraint_text({"kind": "allowed_tokens", "bitmask": "AQ"}, VOCAB, EOS)


@pytest.mark.parametrize(("bits", "hi", "expected"), [
    (b"", 10, (0, -1)),
    (b"\x01", 10, (1, -1)),
    (b"\x00\x04", 10, (1, 10)),  # bit 2 of byte 1 is id 10: at the bound
    (b"\x00\x02", 10, (1, -1)),  # id 9
    (b"\xff" * 9 + b"\x80", 79, (73, 79)),  # the first at or above the bound, past whole words
    (b"\xff" * 9 + b"\x80", -1, (73, -1)),
    (b"\x80\x00", 7, (1, 7)),
])
def test_packed_tokens_counts_the_bits_and_finds_the_first_beyond_the_bound(bits, hi, expected):
    assert _native.packed_tokens(bits, hi) == expected
    assert _native.packed_tokens(bytearray(bits), hi) == expected


def test_a_packed_set_compiles_to_the_lists_machine():
    from serving_image.constraints.machines import compile_plain_text

    ids = random.Random(6).sample(range(VOCAB), 600)  # dense
    few = ids[:9]  # sparse: the machine keeps a list
    for chosen in (ids, few, [VOCAB - 1]):
        text = json.dumps({"kind": "allowed_tokens", "bitmask": packed(chosen)})
        listed = _native.compile_allowed_tokens(VOCAB, EOS, chosen)
        machine = compile_plain_text(text, VOCAB, EOS)
        assert machine is not None and machine.kind == "allowed_tokens"
        for prefix in ([], [chosen[0]], [chosen[0], EOS]):
            [a], [b] = _masks_along(machine, [prefix]), _masks_along(listed, [prefix])
            assert (a == b).all()
    for bad in (packed([5, 1024], 129), packed([], 8), "AQ", "AQ=\u00e9"):
        assert compile_plain_text(json.dumps({"kind": "allowed_tokens", "bitmask": bad}), VOCAB, EOS) is None
    assert _native.compile_allowed_packed(VOCAB, EOS, b"\x00" * 128 + b"\x01") is None  # id 1024
    assert _native.compile_allowed_packed(VOCAB, EOS, b"\x00" * 128) is None  # none


def test_the_native_read_and_the_full_read_pack_at_the_same_length():
    """One rule (`packed_chars`): a list is packed exactly when its array's text is longer than the packed text, by
    whichever read checked it. Around the bound for this vocabulary (172 characters), each length either way."""
    from serving_image.constraints.spec import packed_chars

    bound = packed_chars(VOCAB)
    for n in range(30, 60):
        ids = list(range(100, 100 + n))  # three digits and a comma each
        sent = json.dumps({"kind": "allowed_tokens", "tokens": ids}, separators=(",", ":"))
        listed = len(json.dumps(ids, separators=(",", ":")))
        forms = {"bitmask" in constraint_text(value, VOCAB, EOS)
                 for value in (JSONText(sent.encode()), json.loads(sent))}
        assert forms == {listed > bound}, (n, listed, bound)
