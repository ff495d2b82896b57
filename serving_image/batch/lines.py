"""One input line of a batch file, and the output and error lines it becomes, in OpenAI's batch line format:

    in:     {"custom_id": "...", "method": "POST", "url": "/v1/chat/completions", "body": {...}}
    out:    {"id": "batch_req_...", "custom_id": "...", "response": {"status_code": 200, "request_id": "...",
             "body": {...}}, "error": null}
    error:  the same with the endpoint's error response (status_code 4xx/5xx, body {"error": {..., "param"}}), or
            "response": null and "error": {"code", "message", "param"} for a line that never reached the endpoint

Only the envelope is checked here. The body is validated by the real-time endpoint itself when the worker sends it
(serving_image/openai_api: the same strict models, the same refusals naming the field), so a batch line is refused
exactly as the same request would be in real time, by the same code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

ENVELOPE_FIELDS = ("custom_id", "method", "url", "body")


@dataclass(frozen=True)
class RequestLine:
    index: int
    custom_id: str
    body: dict[str, Any]


@dataclass(frozen=True)
class BadLine:
    index: int
    custom_id: str | None
    code: str
    message: str
    param: str | None


def request_lines(content: bytes) -> list[str]:
    """The file's request lines: every non-blank line, in order (api.count_lines counts the same)."""
    return [line for line in content.decode("utf-8").splitlines() if line.strip()]


def parse_line(index: int, text: str, endpoint: str) -> RequestLine | BadLine:
    where = f"line {index + 1}"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return BadLine(index, None, "invalid_json", f"{where} is not valid JSON: {exc}", None)
    if not isinstance(value, dict):
        return BadLine(index, None, "invalid_json", f"{where} must be a JSON object", None)
    custom_id = value.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BadLine(index, None, "missing_required_parameter",
                       f"{where}: 'custom_id' must be a non-empty string", "custom_id")
    unknown = sorted(set(value) - set(ENVELOPE_FIELDS))
    if unknown:
        return BadLine(index, custom_id, "unsupported_parameter",
                       f"{where}: unknown field '{unknown[0]}' (a line holds {', '.join(ENVELOPE_FIELDS)})",
                       unknown[0])
    if value.get("method") != "POST":
        return BadLine(index, custom_id, "invalid_value", f"{where}: 'method' must be 'POST'", "method")
    if value.get("url") != endpoint:
        return BadLine(index, custom_id, "invalid_value",
                       f"{where}: 'url' is {value.get('url')!r}; this batch's endpoint is {endpoint}", "url")
    body = value.get("body")
    if not isinstance(body, dict):
        return BadLine(index, custom_id, "invalid_value", f"{where}: 'body' must be a JSON object", "body")
    if body.get("stream"):
        # Refused rather than dropped: a batch answer is one JSON object, never a stream of events.
        return BadLine(index, custom_id, "invalid_value", f"{where}: 'body.stream' must not be true in a batch",
                       "body.stream")
    return RequestLine(index, custom_id, body)


def line_id(batch_id: str, index: int) -> str:
    return f"batch_req_{batch_id.removeprefix('batch_')}_{index}"


def output_line(batch_id: str, index: int, custom_id: str, status: int, body: dict[str, Any]) -> dict[str, Any]:
    request_id = body.get("id") if isinstance(body.get("id"), str) else line_id(batch_id, index)
    return {"id": line_id(batch_id, index), "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}


def error_line(batch_id: str, bad: BadLine) -> dict[str, Any]:
    return {"id": line_id(batch_id, bad.index), "custom_id": bad.custom_id, "response": None,
            "error": {"code": bad.code, "message": bad.message, "param": bad.param}}
