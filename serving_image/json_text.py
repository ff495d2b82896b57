"""JSON text on the request path where payloads are large: a constraint's token list (an 8k-id `allowed_tokens` set
is about 48 KB of JSON) crosses the front-end, Triton and the stub, and each process read or wrote it with the
standard library's `json`: 0.7 ms to read and 0.8 ms to write such a list, against 0.25 and 0.04 with msgspec (a
dependency of vLLM's as well; measured 2026-12-06).

`loads` reads with msgspec and hands what msgspec refuses to `json.loads`, so the result and every error are the
standard library's: NaN and Infinity, which json accepts, and the exact message of malformed text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()
_fields_decoder = msgspec.json.Decoder(dict[str, msgspec.Raw])


@dataclass(frozen=True)
class JSONText:
    """A JSON object left as its text by `loads_keeping`: valid JSON (msgspec read past it), not yet read."""

    text: bytes


def loads(text: str | bytes) -> Any:
    """The value of JSON `text`, exactly as `json.loads(text)` gives it (see the module's docstring)."""
    try:
        return _decoder.decode(text)
    except msgspec.DecodeError:
        return json.loads(text)


def loads_keeping(text: str | bytes, keep: Mapping[str, Mapping | None]) -> Any:
    """`loads(text)`, except that in a JSON object the values `keep` names stay their text when they are objects:
    `keep[key]` None keeps the value as `JSONText`, a mapping applies to the value's own members (a nested object).

    For a document whose one large member is read elsewhere in one pass (a constraint's 8k-id token list, which
    `loads` would make into 8k Python ints). Anything msgspec does not read as an object of members (not an object,
    NaN anywhere, malformed text) is `loads(text)` whole: the standard library's value, or its error."""
    try:
        fields = _fields_decoder.decode(text)
    except msgspec.DecodeError:
        return loads(text)
    out: dict[str, Any] = {}
    for key, raw in fields.items():
        if key in keep and memoryview(raw)[:1] == b"{":
            inner = keep[key]
            out[key] = JSONText(bytes(raw)) if inner is None else loads_keeping(bytes(raw), inner)
        else:
            out[key] = _decoder.decode(raw)  # msgspec read it once already: it reads it again
    return out


def dumps_spec(spec_json: dict[str, Any]) -> str:
    """Compact JSON text (as `json.dumps(..., separators=(",", ":"))` writes it) of a constraint spec in its JSON
    form, `spec_to_json`'s output: objects, arrays, strings, booleans and integers only. Not for floats: msgspec
    writes a float NaN as null where json writes NaN."""
    return _encoder.encode(spec_json).decode()
