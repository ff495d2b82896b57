"""The OpenAI-compatible HTTP front-end (port 9000, docs/architecture.md §3.2) over the served-model interface.

Endpoints: /v1/models, /v1/completions, /v1/chat/completions (SSE streaming), /v1/embeddings, the /v1/score
extension, /health/ready and /health/live. Every request body is parsed by a strict model (fields.py classifies
every OpenAI field); errors have OpenAI's shape and status codes, and nothing a client sends yields a 500.

The handlers are module-level: what they share (engine, limits, admission) is the `ServerState` on
`app.state.server` (state.py), and each POST request runs in one `RequestScope` (request_scope.py) that owns its
admission, outcome and log record. The POST handlers live by endpoint in generation.py, embeddings.py and scoring.py.
No request metrics are recorded here: the served engine is Triton embedded in the process (serving_image/startup.py),
which counts every request itself (nv_inference_request_success, nv_inference_count, ...) for the metrics proxy.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Route
from starlette.types import Receive

from serving_image.openai_api.admission import PRIORITY_HEADER, Admission, APIConfig, check_api_key
from serving_image.openai_api.embeddings import embed
from serving_image.openai_api.errors import APIError, bad_request, from_validation_error, json_object
from serving_image.openai_api.generation import generate
from serving_image.openai_api.openapi import install_openapi
from serving_image.openai_api.protocol import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    EMBEDDINGS,
    ENDPOINTS,
    SCORE,
    Endpoint,
)
from serving_image.openai_api.request_scope import CLIENT_CLOSED_REQUEST, RequestScope, trace_id_from
from serving_image.openai_api.scoring import score
from serving_image.openai_api.state import ServerState, server_state
from serving_image.request_context import EXPERIMENT_HEADER, experiment_from
from serving_image.served_model import ServedModel

log = logging.getLogger(__name__)

# A POST endpoint's handler: the parsed body in, the response out; what it holds belongs to the scope.
Handler = Callable[[ServerState, RequestScope, Any, Receive], Awaitable[Response]]

router = APIRouter()


_KEEP_CONSTRAINT = {"constraint": None}


def create_app(served_model: ServedModel, is_draining: Callable[[], bool] = lambda: False,
               config: APIConfig | None = None, extensions: Sequence[Callable[[FastAPI], None]] = ()) -> FastAPI:
    """The OpenAI front-end's app over `served_model`. `extensions` mount more routes on it before its OpenAPI
    document is built: the Batch API (serving_image/batch/api.py `mounted`), which startup adds when a store is
    configured."""
    config = config or APIConfig()
    app = FastAPI(title="llm-serving OpenAI-compatible API", docs_url=None, redoc_url=None)
    app.state.server = ServerState(served_model=served_model, config=config, admission=Admission(config),
                                   is_draining=is_draining)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unexpected)
    app.router.routes[:0] = [_post_route(endpoint, handler) for endpoint, handler in POST_HANDLERS.items()]
    app.include_router(router)
    for extension in extensions:
        extension(app)
    install_openapi(app, ENDPOINTS)
    return app


# -- errors, all in OpenAI's shape ---------------------------------------------------------------------------------


async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None,
                    type_="invalid_request_error").response()


async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    return bad_request(f"invalid request: {exc.errors()[0]['msg']}").response()


async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error")  # a bug of ours, not the client's input: say so
    return APIError(500, f"internal error ({type(exc).__name__})", type_="server_error").response()


# -- probes and models ---------------------------------------------------------------------------------------------


@router.get("/health/live", response_class=PlainTextResponse)
async def live() -> PlainTextResponse:
    return PlainTextResponse("live")


@router.get("/health/ready")
async def ready(request: Request) -> JSONResponse:
    server = server_state(request)
    if server.is_draining():
        return JSONResponse({"status": "draining"}, status_code=503)
    if server.served_model.is_ready():
        return JSONResponse({"status": "ready", "model": server.model.name, "version": server.model.version})
    return JSONResponse({"status": "not ready", "reason": server.served_model.dead_reason}, status_code=503)


def _model_card(server: ServerState) -> dict:
    return {"id": server.model.name, "object": "model", "created": 0, "owned_by": "llm-serving"}


@router.get("/v1/models")
async def models(request: Request) -> dict:
    server = server_state(request)
    check_api_key(server.config, request.headers.get("authorization"))
    return {"object": "list", "data": [_model_card(server)]}


@router.get("/v1/models/{model_id}")
async def model(model_id: str, request: Request) -> dict:
    server = server_state(request)
    check_api_key(server.config, request.headers.get("authorization"))
    if model_id != server.model.name:
        raise APIError(404, f"The model '{model_id}' does not exist", param="model", code="model_not_found")
    return _model_card(server)


# -- inference -----------------------------------------------------------------------------------------------------


# Each POST endpoint and its handler. They are served as plain Starlette routes, first in the router: FastAPI's
# route machinery (its dependency solving, its endpoint wrapper) took about an eighth of the front-end's main
# thread per request under load, for handlers that take nothing but the request (docs/kserve.md, "The front's
# Python per request"). Exception handlers apply to them as to every route; the OpenAPI document describes them
# from ENDPOINTS (openapi.py).
POST_HANDLERS: dict[Endpoint, Handler] = {CHAT_COMPLETIONS: generate, COMPLETIONS: generate, EMBEDDINGS: embed,
                                          SCORE: score}


def _post_route(endpoint: Endpoint, handler: Handler) -> Route:
    async def serve(request: Request) -> Response:
        return await _serve(request, endpoint, handler)

    return Route(endpoint.path, serve, methods=["POST"], name=endpoint.name, include_in_schema=False)


async def _serve(request: Request, endpoint: Endpoint, handler: Handler) -> Response:
    """Parse and handle one POST request inside its scope. The scope closes when the block is left (an APIError
    leaves it too, on its way to `_api_error`), or, for a stream, when the response has sent its last event."""
    server = server_state(request)
    with server.open_request(endpoint) as scope:
        scope.trace_id = trace_id_from(request.headers.get("traceparent"))
        scope.experiment = _experiment(request)
        scope.batch = _is_batch(request)
        try:
            scope.body = await _parse_body(request, server, endpoint)
        except ClientDisconnect:
            # The client left while sending its body: nobody to answer, and not the server's error (a 500 with a
            # traceback before): recorded as a client that left
            scope.outcome.canceled()
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return await handler(server, scope, scope.body, request.receive)


def _experiment(request: Request) -> str | None:
    try:
        return experiment_from(request.headers.get(EXPERIMENT_HEADER))
    except ValueError as exc:
        raise bad_request(str(exc), param=EXPERIMENT_HEADER, code="invalid_value") from None


def _is_batch(request: Request) -> bool:
    value = request.headers.get(PRIORITY_HEADER, "realtime").strip().lower()
    if value not in ("batch", "realtime"):
        raise bad_request(f"header {PRIORITY_HEADER}: {value!r} is neither 'batch' nor 'realtime'",
                          param=PRIORITY_HEADER, code="invalid_value")
    return value == "batch"


async def _parse_body(request: Request, server: ServerState, endpoint: Endpoint) -> BaseModel:
    """The request body as `endpoint`'s model, once the caller is known, the server is ready, and the body is within
    the size limit, valid JSON, valid for the model, and for the model this server serves."""
    config = server.config
    check_api_key(config, request.headers.get("authorization"))
    if server.is_draining() or not server.served_model.is_ready():
        raise APIError(503, f"not ready: {server.served_model.dead_reason or 'draining'}", type_="service_unavailable",
                       code="not_ready")
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > config.max_body_bytes:
        raise APIError(413, f"request body is {declared} bytes; the limit is {config.max_body_bytes}",
                       code="request_too_large")
    raw = bytearray()
    async for chunk in request.stream():
        raw.extend(chunk)
        if len(raw) > config.max_body_bytes:
            raise APIError(413, f"request body exceeds the limit of {config.max_body_bytes} bytes",
                           code="request_too_large")
    # A constraint's token list is read once, in one pass, by the translation (constraints/spec.py, constraint_text)
    body = json_object(raw, _KEEP_CONSTRAINT if "constraint" in endpoint.body.model_fields else None)
    try:
        parsed = endpoint.body.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc, endpoint.path) from exc
    if parsed.model != server.model.name:
        raise APIError(404, f"The model '{parsed.model}' does not exist; this server serves '{server.model.name}'",
                       param="model", code="model_not_found")
    return parsed
