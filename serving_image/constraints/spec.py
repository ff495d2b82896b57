"""Constraint specs (docs/architecture.md §3.5): typed values and the one validation every front-end calls.

`validate_constraint` turns the JSON a client sent into a `ConstraintSpec`, or raises `ConstraintError` whose
message starts with the path of the offending field (``constraint.edges[3][1]: token id 99999 is outside the
vocabulary (0..1023)``), so the OpenAI API answers 400 and KServe INVALID_ARGUMENT naming it. Light on purpose:
no torch, no vLLM, so any front-end can import it; of the native core only its one-pass token id check (a large
allowed_tokens set is checked in each of the front-end, the stub and the worker).
"""

from __future__ import annotations

import base64
import binascii
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from serving_image.constraints._native import (
    json_allowed_tokens,
    json_allowed_tokens_packed,
    json_token_dfa,
    pack_token_ids,
    packed_token_ids,
    packed_tokens,
    token_ids_in_range,
)
from serving_image.json_text import JSONText, dumps_spec, loads

# Bounds that keep a compiled machine small whatever a client sends (the C++ core checks the same state bound).
MAX_STATE_ID = (1 << 20) - 1
MAX_TOKEN_IDS = 1 << 20  # token ids in one spec, all lists together
MAX_BITMASK_BYTES = MAX_TOKEN_IDS // 8  # an allowed_tokens bitmask covers ids below 2^20 at most

KINDS = ("token_dfa", "choice_sequence", "allowed_tokens")
ROOT = "constraint"


class ConstraintError(ValueError):
    """A malformed constraint; `field` is the path of the offending value (e.g. ``constraint.edges[3][1]``)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


@dataclass(frozen=True)
class ConstraintSpec:
    """Base of the three kinds; `kind` is the JSON discriminator."""

    @property
    def kind(self) -> str:  # pragma: no cover - overridden
        raise NotImplementedError


@dataclass(frozen=True)
class TokenDfaSpec(ConstraintSpec):
    start: int
    accept: tuple[int, ...]
    edges: tuple[tuple[int, int, int], ...]  # (from, token, to)

    @property
    def kind(self) -> str:
        return "token_dfa"


@dataclass(frozen=True)
class ChoiceSequenceSpec(ConstraintSpec):
    choices: tuple[tuple[int, ...], ...]
    separator: tuple[int, ...]
    min_items: int = 1
    max_items: int | None = None  # None: unbounded (at most len(choices) when unique)
    unique: bool = False

    @property
    def kind(self) -> str:
        return "choice_sequence"


@dataclass(frozen=True)
class AllowedTokensSpec(ConstraintSpec):
    tokens: tuple[int, ...]

    @property
    def kind(self) -> str:
        return "allowed_tokens"


_FIELDS = {
    "token_dfa": ({"kind", "start", "accept", "edges"}, {"kind", "start", "accept", "edges"}),
    "choice_sequence": (
        {"kind", "choices", "separator", "min_items", "max_items", "unique"},
        {"kind", "choices", "separator"},
    ),
    "allowed_tokens": ({"kind", "tokens", "bitmask"}, {"kind"}),  # and one of tokens, bitmask
}


class _Checker:
    """Walks a spec with the field path at hand; `vocab_size`/`eos_token_id` may be None (vLLM's
    `validate_params` runs before the engine knows them: ranges are then checked again in the worker)."""

    def __init__(self, vocab_size: int | None, eos_token_id: int | None):
        self.vocab_size = vocab_size
        self.eos = eos_token_id
        self.count = 0

    @staticmethod
    def integer(value: Any, field: str) -> int:
        # bool is an int in Python; JSON true is not a token id.
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConstraintError(field, f"must be an integer, got {_describe(value)}")
        return value

    @staticmethod
    def array(value: Any, field: str, *, nonempty: bool) -> list[Any]:
        if not isinstance(value, list | tuple):
            raise ConstraintError(field, f"must be an array, got {_describe(value)}")
        if nonempty and not value:
            raise ConstraintError(field, "must not be empty")
        return list(value)

    def token(self, value: Any, field: str, *, eos_ok: bool) -> int:
        t = self.integer(value, field)
        self.count += 1
        if self.count > MAX_TOKEN_IDS:
            raise ConstraintError(field, f"the spec holds more than {MAX_TOKEN_IDS} token ids")
        if t < 0:
            raise ConstraintError(field, f"token id {t} is negative")
        if self.vocab_size is not None and t >= self.vocab_size:
            raise ConstraintError(field, f"token id {t} is outside the vocabulary (0..{self.vocab_size - 1})")
        if not eos_ok and self.eos is not None and t == self.eos:
            raise ConstraintError(
                field, f"token id {t} is the end-of-sequence token, which the constraint itself places"
            )
        return t

    def tokens_fast(self, values: list[Any], *, eos_ok: bool) -> tuple[int, ...] | None:
        """The whole array at once when every element is a plain int that `token` would accept: one C pass (8k ids:
        20 us, against 380 for Python's set, min and max passes on this machine); None otherwise, and the caller
        walks it element by element for the exact error."""
        if not values or self.count + len(values) > MAX_TOKEN_IDS:
            return None
        hi = -1 if self.vocab_size is None else self.vocab_size
        exclude = -1 if eos_ok or self.eos is None else self.eos
        if not token_ids_in_range(values, hi, exclude):
            return None
        self.count += len(values)
        return tuple(values)

    def bitmask(self, value: Any, field: str) -> tuple[int, ...]:
        """The ids of an allowed_tokens set in its packed form: base64 of bytes whose bit t % 8 of byte t / 8 is set
        when token t is allowed."""
        packed = decode_bitmask(value, field)
        count, first_out = packed_tokens(packed, -1 if self.vocab_size is None else self.vocab_size)
        if first_out >= 0:
            raise ConstraintError(field, f"token id {first_out} is outside the vocabulary (0..{self.vocab_size - 1})")
        if count == 0:
            raise ConstraintError(field, "allows no token: at least one bit must be set")
        self.count += count
        return tuple(packed_token_ids(packed))

    def state(self, value: Any, field: str) -> int:
        s = self.integer(value, field)
        if s < 0 or s > MAX_STATE_ID:
            raise ConstraintError(field, f"state {s} is outside 0..{MAX_STATE_ID}")
        return s


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list | tuple):
        return "an array"
    return type(value).__name__


def validate_constraint(spec: object, vocab_size: int | None, eos_token_id: int | None) -> ConstraintSpec:
    """Check a constraint as a client sent it and return its typed form.

    Raises `ConstraintError` (a `ValueError`) naming the first offending field. `vocab_size` and `eos_token_id`
    are the served model's; either may be None to check only what does not depend on them.
    """
    if not isinstance(spec, Mapping):
        raise ConstraintError(ROOT, f"must be a JSON object, got {_describe(spec)}")
    kind = spec.get("kind")
    if kind not in KINDS:
        got = "missing" if "kind" not in spec else repr(kind)
        raise ConstraintError(f"{ROOT}.kind", f"must be one of {', '.join(KINDS)} (got {got})")
    allowed, required = _FIELDS[kind]
    for key in spec:
        if key not in allowed:
            raise ConstraintError(
                f"{ROOT}.{key}", f"unknown field for kind {kind} (allowed: {', '.join(sorted(allowed))})"
            )
    for key in sorted(required):
        if key not in spec:
            raise ConstraintError(f"{ROOT}.{key}", f"is required for kind {kind}")
    c = _Checker(vocab_size, eos_token_id)
    if kind == "token_dfa":
        return _token_dfa(spec, c)
    if kind == "choice_sequence":
        return _choice_sequence(spec, c)
    return _allowed_tokens(spec, c)


def _token_dfa(spec: Mapping[str, Any], c: _Checker) -> TokenDfaSpec:
    start = c.state(spec["start"], f"{ROOT}.start")
    accept = tuple(
        c.state(a, f"{ROOT}.accept[{i}]")
        for i, a in enumerate(c.array(spec["accept"], f"{ROOT}.accept", nonempty=True))
    )
    edges: list[tuple[int, int, int]] = []
    seen: dict[tuple[int, int], tuple[int, int]] = {}  # (from, token) -> (to, index)
    for i, edge in enumerate(c.array(spec["edges"], f"{ROOT}.edges", nonempty=False)):
        field = f"{ROOT}.edges[{i}]"
        triple = c.array(edge, field, nonempty=False)
        if len(triple) != 3:
            raise ConstraintError(field, f"must be [from_state, token_id, to_state], got {len(triple)} values")
        src = c.state(triple[0], f"{field}[0]")
        tok = c.token(triple[1], f"{field}[1]", eos_ok=False)
        dst = c.state(triple[2], f"{field}[2]")
        prior = seen.get((src, tok))
        if prior is not None and prior[0] != dst:
            raise ConstraintError(
                f"{field}[2]",
                f"state {src} already goes to state {prior[0]} on token {tok} ({ROOT}.edges[{prior[1]}]): "
                "a token_dfa must be deterministic",
            )
        seen[(src, tok)] = (dst, i)
        edges.append((src, tok, dst))
    return TokenDfaSpec(start=start, accept=accept, edges=tuple(edges))


def _choice_sequence(spec: Mapping[str, Any], c: _Checker) -> ChoiceSequenceSpec:
    choices: list[tuple[int, ...]] = []
    first_seen: dict[tuple[int, ...], int] = {}
    for i, choice in enumerate(c.array(spec["choices"], f"{ROOT}.choices", nonempty=True)):
        field = f"{ROOT}.choices[{i}]"
        items = c.array(choice, field, nonempty=True)
        toks = c.tokens_fast(items, eos_ok=False) or tuple(
            c.token(t, f"{field}[{j}]", eos_ok=False) for j, t in enumerate(items)
        )
        if toks in first_seen:
            raise ConstraintError(field, f"duplicates {ROOT}.choices[{first_seen[toks]}]")
        first_seen[toks] = i
        choices.append(toks)
    separator_items = c.array(spec["separator"], f"{ROOT}.separator", nonempty=True)
    separator = c.tokens_fast(separator_items, eos_ok=False) or tuple(
        c.token(t, f"{ROOT}.separator[{j}]", eos_ok=False) for j, t in enumerate(separator_items)
    )
    # After a complete item the separator's first token must say "next item" unambiguously.
    for i, choice in enumerate(choices):
        if separator[0] in choice:
            raise ConstraintError(
                f"{ROOT}.separator[0]",
                f"token {separator[0]} also appears in {ROOT}.choices[{i}]: the separator must start with a token "
                "that no choice contains",
            )
    min_items = c.integer(spec.get("min_items", 1), f"{ROOT}.min_items")
    if min_items < 1:
        raise ConstraintError(f"{ROOT}.min_items", f"must be at least 1, got {min_items}")
    max_raw = spec.get("max_items")
    max_items = None if max_raw is None else c.integer(max_raw, f"{ROOT}.max_items")
    if max_items is not None and max_items < min_items:
        raise ConstraintError(f"{ROOT}.max_items", f"{max_items} is less than min_items ({min_items})")
    unique = spec.get("unique", False)
    if not isinstance(unique, bool):
        raise ConstraintError(f"{ROOT}.unique", f"must be a boolean, got {_describe(unique)}")
    if unique and min_items > len(choices):
        raise ConstraintError(
            f"{ROOT}.min_items",
            f"{min_items} distinct items cannot be made from {len(choices)} choices (unique is true)",
        )
    return ChoiceSequenceSpec(
        choices=tuple(choices), separator=separator, min_items=min_items, max_items=max_items, unique=unique
    )


def _allowed_tokens(spec: Mapping[str, Any], c: _Checker) -> AllowedTokensSpec:
    if ("tokens" in spec) == ("bitmask" in spec):
        if "bitmask" in spec:
            raise ConstraintError(f"{ROOT}.bitmask",
                                  "give the set once: tokens, or bitmask (its packed form), not both")
        raise ConstraintError(f"{ROOT}.tokens", "is required for kind allowed_tokens (or bitmask, its packed form)")
    if "bitmask" in spec:
        return AllowedTokensSpec(tokens=c.bitmask(spec["bitmask"], f"{ROOT}.bitmask"))
    items = c.array(spec["tokens"], f"{ROOT}.tokens", nonempty=True)
    tokens = c.tokens_fast(items, eos_ok=True) or tuple(
        c.token(t, f"{ROOT}.tokens[{i}]", eos_ok=True)  # eos is always allowed anyway
        for i, t in enumerate(items)
    )
    return AllowedTokensSpec(tokens=tokens)


def spec_to_json(spec: ConstraintSpec) -> dict[str, Any]:
    """The JSON form of a typed spec (what a client would send)."""
    if isinstance(spec, TokenDfaSpec):
        edges = [list(e) for e in spec.edges]
        return {"kind": spec.kind, "start": spec.start, "accept": list(spec.accept), "edges": edges}
    if isinstance(spec, ChoiceSequenceSpec):
        out: dict[str, Any] = {
            "kind": spec.kind,
            "choices": [list(ch) for ch in spec.choices],
            "separator": list(spec.separator),
            "min_items": spec.min_items,
            "unique": spec.unique,
        }
        if spec.max_items is not None:
            out["max_items"] = spec.max_items
        return out
    if isinstance(spec, AllowedTokensSpec):
        return {"kind": spec.kind, "tokens": list(spec.tokens)}
    raise TypeError(f"not a constraint spec: {spec!r}")


def decode_bitmask(value: Any, field: str) -> bytes:
    """The bytes of an allowed_tokens bitmask as sent (standard base64, padded), or `ConstraintError` naming `field`."""
    if not isinstance(value, str):
        raise ConstraintError(field, f"must be a base64 string, got {_describe(value)}")
    if len(value) > 4 * ((MAX_BITMASK_BYTES + 2) // 3):
        raise ConstraintError(field, f"covers more than {MAX_TOKEN_IDS} token ids ({MAX_BITMASK_BYTES} bytes)")
    try:
        packed = binascii.a2b_base64(value, strict_mode=True)  # b64decode's validate: 23 us for 5 KB, this 3
    except (binascii.Error, ValueError) as exc:
        raise ConstraintError(field, f"is not base64 (the standard alphabet, padded): {exc}") from None
    if not packed:
        raise ConstraintError(field, "must not be empty")
    return packed


def packed_chars(vocab_size: int) -> int:
    """The length of a packed set's base64 (ceil(vocab_size / 8) bytes). A set is handed on packed when its token
    array's JSON is longer than this (8k ids of a 32k vocabulary: 48 KB against 5.4 KB), by the native read of the
    list (`json_allowed_tokens_packed`'s `pack_above`) and by `spec_text` alike."""
    return 4 * (((vocab_size + 7) // 8 + 2) // 3)


def bitmask_text(packed: bytes) -> str:
    """The JSON text of an allowed_tokens set in its packed form."""
    return '{"kind":"allowed_tokens","bitmask":"' + base64.b64encode(packed).decode() + '"}'


def plain_bitmask(text: bytes) -> bytes | None:
    """The packed set when `text` is exactly an allowed_tokens spec in its packed form (`kind` and `bitmask`, nothing
    else, the bitmask valid base64 of at most MAX_BITMASK_BYTES); None for any other text. Its ids are not checked
    here (`packed_tokens`)."""
    if b'"bitmask"' not in text:
        return None
    try:
        value = loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.keys() != {"kind", "bitmask"} or value["kind"] != "allowed_tokens":
        return None
    try:
        return decode_bitmask(value["bitmask"], "")
    except ConstraintError:
        return None


def checked_plain_text(text: bytes, vocab_size: int | None, eos_token_id: int | None) -> str | None:
    """The checked text of a spec in its plain form, read in one native pass without a Python value per token id;
    None for any other text, which `validate_constraint` then reads in full and names. `vocab_size` and `eos_token_id`
    may be None, as for `validate_constraint`.

    The plain forms are what clients write: an object with exactly its kind's required members, in any order, each
    once, with integers written as plain digits (no sign, fraction or exponent) and JSON whitespace.
      - allowed_tokens as a list: written back packed when the vocabulary is known and its bitmask's base64 is
        shorter than the list (`packed_chars`; 8k ids of a 32k vocabulary: 5.4 KB against 48 KB, so the stub and
        vLLM's processes carry and read a ninth of it), else compactly around the token array as sent (8k ids:
        30 us, against 250 to read them into Python ints and check them);
      - allowed_tokens packed (`kind` and `bitmask` only): the text as sent, once its bits are checked;
      - token_dfa: the text as sent, once its states, edge tokens (not eos) and determinism are checked (256 edges:
        about 10 us, against 300 for the Python walk, which the worker ran for every request on the engine's path).
    choice_sequence is always read in full (its separator rule and optional members are Python's)."""
    hi = -1 if vocab_size is None else vocab_size
    if vocab_size is None:
        count, start, stop = json_allowed_tokens(text, -1)
        packed = None
    else:
        # eos is allowed; packed when its array is longer than the packed text
        count, start, stop, packed = json_allowed_tokens_packed(text, vocab_size, packed_chars(vocab_size))
    if 0 < count <= MAX_TOKEN_IDS:
        if packed is not None:
            return bitmask_text(packed)
        return '{"kind":"allowed_tokens","tokens":' + text[start:stop].decode() + "}"
    packed = plain_bitmask(text)
    if packed is not None:
        count, first_out = packed_tokens(packed, hi)
        return text.decode() if count > 0 and first_out < 0 else None  # msgspec read it: valid UTF-8
    if json_token_dfa(text, hi, -1 if eos_token_id is None else eos_token_id, MAX_TOKEN_IDS):
        return text.decode()  # only ASCII digits and JSON punctuation were accepted
    return None


def spec_text(spec: ConstraintSpec, vocab_size: int | None) -> str:
    """The JSON text a request carries for a checked spec: its JSON form (`spec_to_json`), an allowed_tokens set
    packed when the vocabulary is known and that is shorter (`checked_plain_text`)."""
    text = dumps_spec(spec_to_json(spec))
    if isinstance(spec, AllowedTokensSpec) and vocab_size is not None:
        listed = len(text) - len('{"kind":"allowed_tokens","tokens":}')  # the token array's text, as the native read
        if listed > packed_chars(vocab_size):
            packed = pack_token_ids(spec.tokens, vocab_size)
            if packed is not None:
                return bitmask_text(packed)
    return text


def constraint_text(value: object, vocab_size: int | None, eos_token_id: int | None) -> str:
    """A constraint as a client sent it, checked (`validate_constraint`'s rules and errors) and written as the JSON
    text a request carries to vLLM (SamplingParams.extra_args["constraint"], docs/architecture.md §3.5).

    `value` is its JSON value, or its text when the document around it was read with `json_text.loads_keeping`: a spec
    in its plain form is then checked without becoming Python values (`checked_plain_text`); any other text is read
    and checked in full, so a bad constraint gets the same error whichever way it came."""
    if isinstance(value, JSONText):
        fast = checked_plain_text(value.text, vocab_size, eos_token_id)
        if fast is not None:
            return fast
        value = loads(value.text)
    return spec_text(validate_constraint(value, vocab_size, eos_token_id), vocab_size)


# The texts the stub checked with the served model's vocabulary (`remember_checked`), until the constraint processor's
# admission check (vLLM's validate_params, which runs in the same process: the stub hosts AsyncLLM) takes one: parsing
# and checking again such a spec cost that check 0.5-1 ms for an 8k-id list. Keyed by identity (vLLM's copies of
# SamplingParams keep the same str), bounded: a text handed to vLLM is taken at once, one whose request failed before
# admission ages out.
_CHECKED: OrderedDict[int, str] = OrderedDict()
_CHECKED_MAX = 64


def remember_checked(text: str) -> str:
    """Remember `text`, a constraint_text result checked with the served vocabulary, until `take_checked` takes it;
    returns it."""
    _CHECKED[id(text)] = text
    while len(_CHECKED) > _CHECKED_MAX:
        _CHECKED.popitem(last=False)
    return text


def take_checked(text: object) -> bool:
    """Whether `text` is the very string `remember_checked` remembered in this process (and not taken yet); it is
    forgotten."""
    return _CHECKED.pop(id(text), None) is text
