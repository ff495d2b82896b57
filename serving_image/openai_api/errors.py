"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, with the right status code."""

from __future__ import annotations

import json
from collections.abc import Mapping

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from serving_image.json_text import loads, loads_keeping


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers: dict[str, str] = {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def json_object(raw: bytes | bytearray, keep: Mapping[str, Mapping | None] | None = None) -> dict:
    """A request body as a JSON object, or 400 `invalid_json` saying why not; the members `keep` names stay their
    text when they are objects (json_text.loads_keeping)."""
    try:
        # msgspec first: a constraint's token list can make a body of 48 KB (json_text.py)
        body = loads_keeping(raw, keep) if keep else loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    return body


# Tags pydantic inserts into a location after a discriminated union's field (the `type` values).
_TYPE_LABELS = {"str", "int", "float", "bool", "none", "dict", "list", "bytes"}
_UNION_TAGS = {"response_format": {"text", "json_object", "json_schema"}}


def _loc(loc: tuple) -> str:
    """Pydantic's location as the field path a client would write: messages[0].content, response_format.type."""
    out = ""
    previous = None
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif previous in _UNION_TAGS and part in _UNION_TAGS[previous]:
            pass  # the union branch, not a field
        elif isinstance(part, str) and ("[" in part or part in _TYPE_LABELS
                                        or part.startswith(("function-", "union", "literal"))):
            pass  # union-branch labels such as "list[TextPart]" or "function-after[...]"
        else:
            out += f".{part}" if out else str(part)
        previous = part
    return out


def from_validation_error(exc: ValidationError, endpoint: str = "") -> APIError:
    """The first problem, named by its field path (the client fixes one thing at a time; the rest are listed)."""
    from serving_image.openai_api.fields import refusal_reason

    errors = exc.errors()
    # Prefer "unknown field" errors: they are the ones that would otherwise be silent drops.
    errors.sort(key=lambda e: e["type"] != "extra_forbidden")
    first = errors[0]
    param = _loc(first["loc"]) or None
    from serving_image.openai_api.protocol import FieldValueError

    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, FieldValueError):  # a model-level check names its field itself
        param = ".".join(p for p in (param, cause.field) if p)
    if first["type"] == "extra_forbidden":
        reason = refusal_reason(endpoint, param) or "this server does not know it"
        message = (f"Unsupported parameter: '{param}' is not supported by this server ({reason}); it would be "
                   "ignored, so the request is refused (see docs/openai-fields.md)")
        code = "unsupported_parameter"
    elif first["type"] == "missing":
        message = f"Missing required parameter: '{param}'"
        code = "missing_required_parameter"
    else:
        message = f"Invalid value for '{param}': {first['msg'].removeprefix('Value error, ')}"
        code = "invalid_value"
    if len(errors) > 1:
        others = ", ".join(sorted({_loc(e["loc"]) or "(body)" for e in errors[1:]} - {param}))
        if others:
            message += f" (also invalid: {others})"
    return APIError(400, message, param=param, code=code)
