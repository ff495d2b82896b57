"""The served OpenAPI document (/openapi.json): request bodies from the strict request models, responses from the
official `openai` client's own response types, errors in OpenAI's shape. Fuzzing (schemathesis) runs against it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from serving_image.openai_api.protocol import Endpoint

REF = "#/components/schemas/{model}"

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
EMBEDDINGS_SCHEMA = {
    "type": "object",
    "required": ["object", "data", "model", "usage"],
    "properties": {
        "object": {"const": "list"},
        "model": {"type": "string"},
        "data": {"type": "array", "items": {"type": "object", "required": ["object", "index", "embedding"],
                                            "properties": {"object": {"const": "embedding"},
                                                           "index": {"type": "integer"},
                                                           "embedding": {"anyOf": [
                                                               {"type": "array", "items": {"type": "number"}},
                                                               {"type": "string"}]}}}},
        "usage": {"type": "object", "properties": {"prompt_tokens": {"type": "integer"},
                                                   "total_tokens": {"type": "integer"}}},
    },
}
SCORE_SCHEMA = {
    "type": "object",
    "required": ["id", "object", "model", "data"],
    "properties": {
        "id": {"type": "string"}, "object": {"const": "score"}, "model": {"type": "string"},
        "data": {"type": "array", "items": {"type": "object", "required": ["index", "candidate", "logprob", "tokens"],
                                            "properties": {"index": {"type": "integer"},
                                                           "candidate": {"type": "string"},
                                                           "logprob": {"type": "number"},
                                                           "tokens": {"type": "integer"}}}},
    },
}
# The error statuses the read-only endpoints can answer (FastAPI's generated 422 is never sent: bodies are parsed
# by the request models and refused as 400).
GET_ERRORS = {"/v1/models": ("401",), "/v1/models/{model_id}": ("401", "404")}
# The Batch API's routes (serving_image/batch/api.py, when the server has a batch store): what each may answer
# besides 200, every body the Error object.
BATCH_PREFIXES = ("/v1/files", "/v1/batches")
BATCH_ERRORS = {"400": "bad input", "401": "missing or wrong API key", "404": "no such file or batch for this key",
                "409": "the batch has ended already (cancel)", "413": "file too large",
                "429": "this key's file or batch limit", "503": "not ready"}
READY_SCHEMA = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"},
                                                                          "reason": {"type": ["string", "null"]}}}
ERROR_STATUSES = {"400": "bad input", "401": "missing or wrong API key", "404": "unknown model",
                  "413": "body too large", "429": "admission limit hit (see Retry-After)", "503": "not ready"}


def _schema(model: type[BaseModel], components: dict[str, Any]) -> dict:
    schema = model.model_json_schema(ref_template=REF)
    components.update(schema.pop("$defs", {}))
    return schema


def _response_schemas(components: dict[str, Any]) -> dict[str, dict]:
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    return {
        "chat": _schema(ChatCompletion, components),
        "completion": _schema(Completion, components),
        "embedding": EMBEDDINGS_SCHEMA,
        "score": SCORE_SCHEMA,
    }


def install_openapi(app: FastAPI, endpoints: Iterable[Endpoint]) -> None:
    endpoints = tuple(endpoints)  # read when the document is first asked for

    def build() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        spec = get_openapi(title=app.title, version="1", routes=app.routes)
        components = spec.setdefault("components", {}).setdefault("schemas", {})
        responses = _response_schemas(components)
        components["Error"] = ERROR_SCHEMA
        for endpoint in endpoints:
            ok: dict[str, Any] = {"application/json": {"schema": responses[endpoint.name]}}
            if endpoint.name in ("chat", "completion"):
                # One SSE event (OpenAPI 3.0/3.1 have no itemSchema; tools such as Schemathesis read `schema` as
                # the per-event schema): its data is one chunk object as JSON, then the literal [DONE].
                ok["text/event-stream"] = {"schema": {
                    "type": "object", "required": ["data"],
                    "properties": {"data": {"type": "string", "contentMediaType": "application/json",
                                            "description": "a chunk object as JSON; the last event's data is [DONE]"},
                                   "event": {"type": "string"}, "id": {"type": "string"}}}}
            # The POST endpoints are plain Starlette routes (app.py, POST_HANDLERS): described here, from ENDPOINTS
            operation = spec.setdefault("paths", {}).setdefault(endpoint.path, {}).setdefault("post", {
                "summary": endpoint.path.removeprefix("/v1/").replace("/", " ").replace("_", " ").title(),
                "operationId": f"{endpoint.path.strip('/').replace('/', '_')}_post"})
            body = _schema(endpoint.body, components)
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
            operation["responses"] = {"200": {"description": "OK", "content": ok}, **{
                status: {"description": why, "content": {"application/json": {"schema": {"$ref": REF.format(
                    model="Error")}}}} for status, why in ERROR_STATUSES.items()}}
        for path, operations in spec["paths"].items():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
            if path.startswith(BATCH_PREFIXES):
                for operation in operations.values():
                    for status, why in BATCH_ERRORS.items():
                        operation.setdefault("responses", {}).setdefault(status, {"description": why, "content": {
                            "application/json": {"schema": {"$ref": REF.format(model="Error")}}}})
            for status in GET_ERRORS.get(path, ()):
                operations["get"]["responses"][status] = {"description": ERROR_STATUSES[status], "content": {
                    "application/json": {"schema": {"$ref": REF.format(model="Error")}}}}
        ready = spec["paths"]["/health/ready"]["get"]["responses"]
        ready_json = {"application/json": {"schema": READY_SCHEMA}}
        ready["200"]["content"] = ready_json
        ready["503"] = {"description": "not ready, or draining", "content": ready_json}
        app.openapi_schema = spec
        return spec

    app.openapi = build
