"""KServe v2 HTTP (port 8000) fronting Triton embedded in this process, as serving_image/kserve/triton_grpc.py does
for gRPC: every answer comes from Triton through the C API binding (serving_image/triton/capi).

- `/v2/health/live`, `/v2/health/ready` (false while draining), `/v2/models/{m}[/versions/{v}]/ready`: 200 or 400;
- `/v2`, `/v2/models/{m}[/versions/{v}]`, `.../config`, `.../stats`, `POST /v2/repository/index`: Triton's JSON;
- `/v2/models/{m}/generate` and `/generate_stream` (Triton's generate extension): top-level keys that name inputs
  of the model become those inputs (datatypes from Triton's model metadata), `parameters` becomes the request's
  parameters; the stream is server-sent events; a refusal before the first response is an HTTP status, later errors
  are the stream's last event; a client that goes away cancels the request in Triton;
- `/v2/models/{m}/infer`: a decoupled model gets 501 and Triton's message, as Triton's own front-end answers; other
  models answer unary inference, JSON or with the binary tensor extension (serving_image/kserve/infer_json.py).

Every inference request writes one record with the caller's trace id and experiment arm (kserve/request_log.py).

Error statuses follow Triton's mapping of its error codes (INVALID_ARG 400, NOT_FOUND 404, UNAVAILABLE 503,
UNSUPPORTED 501, INTERNAL 500). Difference, documented in docs/kserve.md: Triton 2.51's own generate endpoint
answers 400 for every error response.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serving_image.kserve.infer_json import (
    BINARY_CONTENT_TYPE,
    HEADER_LENGTH,
    InferBodyError,
    infer_response_body,
    parse_infer_body,
)
from serving_image.kserve.request_log import HttpRecordMiddleware
from serving_image.triton.capi import ErrorCode, TritonError
from serving_image.triton.capi.inference import NUMPY_DTYPES, Input, infer

log = logging.getLogger(__name__)

# Triton's HTTP front-end's answer to /infer on a decoupled model, word for word (see triton_grpc.py).
DECOUPLED_HTTP_MESSAGE = "HTTP end point doesn't support models with decoupled transaction policy"

MAX_BODY_BYTES = 16 * 1024 * 1024
HTTP_STATUS = {ErrorCode.INVALID_ARG: 400, ErrorCode.NOT_FOUND: 404, ErrorCode.UNAVAILABLE: 503,
               ErrorCode.UNSUPPORTED: 501, ErrorCode.ALREADY_EXISTS: 409, ErrorCode.CANCELLED: 499,
               ErrorCode.INTERNAL: 500, ErrorCode.UNKNOWN: 500}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _triton_error(exc: TritonError) -> JSONResponse:
    return _error(HTTP_STATUS.get(exc.code, 500), exc.message)


def _version(text: str) -> int:
    try:
        return int(text) if text else -1
    except ValueError:
        raise TritonError(ErrorCode.INVALID_ARG, f"model version '{text}' is not a number") from None


def generate_inputs(body: dict, metadata: dict) -> tuple[list[Input], dict[str, Any]]:
    """Triton's generate extension: top-level keys naming model inputs become inputs; `parameters` the request's
    parameters. Raises TritonError(INVALID_ARG) naming the key."""
    types = {i["name"]: i["datatype"] for i in metadata.get("inputs", [])}
    parameters = body.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise TritonError(ErrorCode.INVALID_ARG, "'parameters' must be a JSON object")
    for key, value in parameters.items():
        if not isinstance(value, bool | int | float | str):
            raise TritonError(ErrorCode.INVALID_ARG, f"parameter '{key}': expected a string, number or boolean")
    inputs = []
    for key, value in body.items():
        if key in ("parameters", "id"):
            continue
        datatype = types.get(key)
        if datatype is None:
            raise TritonError(ErrorCode.INVALID_ARG, f"'{key}' is not an input of model '{metadata.get('name')}'; "
                              f"its inputs are {', '.join(types)} (parameters go in 'parameters')")
        values = value if isinstance(value, list) else [value]
        try:
            if datatype == "BYTES":
                if not all(isinstance(v, str) for v in values):
                    raise ValueError("expected a string")
                inputs.append(Input.from_bytes(key, values, (len(values),)))
            elif datatype == "BOOL":
                if not all(isinstance(v, bool) for v in values):
                    raise ValueError("expected true or false")
                inputs.append(Input.from_numpy(key, np.array(values, dtype=np.bool_)))
            elif datatype in NUMPY_DTYPES:
                inputs.append(Input.from_numpy(key, np.array(values, dtype=NUMPY_DTYPES[datatype])))
            else:
                raise ValueError(f"datatype {datatype} cannot be given as JSON here")
        except (ValueError, TypeError, OverflowError) as exc:
            raise TritonError(ErrorCode.INVALID_ARG, f"input '{key}' ({datatype}): {exc}") from None
    return inputs, parameters


def json_outputs(model: str, version: str, outputs: dict[str, np.ndarray]) -> dict[str, Any]:
    body: dict[str, Any] = {"model_name": model, "model_version": version or "1"}
    for name, array in outputs.items():
        values = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v
                  for v in np.asarray(array).reshape(-1).tolist()]
        body[name] = values[0] if len(values) == 1 else values
    return body


def create_triton_http_app(triton, is_draining: Callable[[], bool] = lambda: False,
                           api_keys: tuple[str, ...] = ()) -> FastAPI:
    """`api_keys`: not empty, every path but the health probes' answers only a caller with one (kserve/auth.py)."""
    server = triton.server
    app = FastAPI(title="llm-serving KServe v2 (embedded Triton)", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(HttpRecordMiddleware)  # one request record per inference request (kserve/request_log.py)
    if api_keys:  # added last, so it runs first: a refused caller leaves no request record and reaches no handler
        from serving_image.kserve.auth import BearerKeyMiddleware

        app.add_middleware(BearerKeyMiddleware, api_keys=tuple(api_keys))

    @app.get("/v2/health/live")
    async def live() -> Response:
        return Response(status_code=200 if server.live() else 400)

    @app.get("/v2/health/ready")
    async def ready() -> Response:
        return Response(status_code=200 if not is_draining() and server.ready() else 400)

    @app.get("/v2")
    async def server_metadata() -> JSONResponse:
        return JSONResponse(server.metadata())

    @app.post("/v2/repository/index")
    async def repository_index(request: Request) -> JSONResponse:
        raw = await request.body()
        ready_only = bool(json.loads(raw).get("ready")) if raw.strip() else False
        return JSONResponse(server.model_index(ready_only=ready_only))

    @app.get("/v2/models/{model}/ready")
    @app.get("/v2/models/{model}/versions/{version}/ready")
    async def model_ready(model: str, version: str = "") -> Response:
        try:
            ok = server.model_ready(model, _version(version)) and not is_draining()
        except TritonError:
            ok = False
        return Response(status_code=200 if ok else 400)

    @app.get("/v2/models/{model}")
    @app.get("/v2/models/{model}/versions/{version}")
    async def model_metadata(model: str, version: str = "") -> JSONResponse:
        try:
            return JSONResponse(server.model_metadata(model, _version(version)))
        except TritonError as exc:
            return _triton_error(exc)

    @app.get("/v2/models/{model}/config")
    @app.get("/v2/models/{model}/versions/{version}/config")
    async def model_config(model: str, version: str = "") -> JSONResponse:
        try:
            return JSONResponse(server.model_config(model, _version(version)))
        except TritonError as exc:
            return _triton_error(exc)

    @app.get("/v2/models/{model}/stats")
    @app.get("/v2/models/{model}/versions/{version}/stats")
    async def model_stats(model: str, version: str = "") -> JSONResponse:
        try:
            return JSONResponse(server.model_statistics(model, _version(version)))
        except TritonError as exc:
            return _triton_error(exc)

    @app.post("/v2/models/{model}/infer")
    @app.post("/v2/models/{model}/versions/{version}/infer")
    async def unary(model: str, request: Request, version: str = "") -> Response:
        try:
            number = _version(version)
            decoupled = server.model_is_decoupled(model, number)
        except TritonError as exc:
            return _triton_error(exc)
        if decoupled:
            return _error(501, DECOUPLED_HTTP_MESSAGE)
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            return _error(400, f"request body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}")
        try:
            call = parse_infer_body(raw, request.headers.get(HEADER_LENGTH))
        except InferBodyError as exc:
            return _error(400, str(exc))
        try:
            stream = infer(server, model, call.inputs, request_id=call.request_id, version=number,
                           parameters=call.parameters, outputs=call.outputs)
        except TritonError as exc:
            return _triton_error(exc)
        outputs: dict[str, np.ndarray] = {}
        try:
            async for response in stream:
                if response.error is not None:
                    return _triton_error(response.error)
                outputs.update(response.outputs)
        finally:
            stream.cancel()  # no-op once finished; a client gone mid-call cancels the request
        try:
            body, headers = infer_response_body(call, model, version, outputs)
        except InferBodyError as exc:
            return _error(500, str(exc))
        return Response(body, media_type=BINARY_CONTENT_TYPE if headers else "application/json", headers=headers)

    async def start(model: str, version: str, request: Request):
        """The request's stream and its first response, or an error response (nothing sent yet)."""
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            return _error(400, f"request body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _error(400, f"request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        try:
            number = _version(version)
            inputs, parameters = generate_inputs(body, server.model_metadata(model, number))
            stream = infer(server, model, inputs, request_id=str(body.get("id", "")), version=number,
                           parameters=parameters)
        except TritonError as exc:
            return _triton_error(exc)
        responses = aiter(stream)
        try:
            first = await anext(responses, None)
        except BaseException:
            stream.cancel()
            raise
        if first is not None and first.error is not None:
            return _triton_error(first.error)
        return stream, responses, first

    @app.post("/v2/models/{model}/generate")
    @app.post("/v2/models/{model}/versions/{version}/generate")
    async def generate(model: str, request: Request, version: str = "") -> JSONResponse:
        started = await start(model, version, request)
        if isinstance(started, Response):
            return started
        stream, responses, response = started
        outputs: dict[str, np.ndarray] = {}
        try:
            while response is not None:
                if response.error is not None:
                    return _triton_error(response.error)
                outputs.update(response.outputs)
                response = await anext(responses, None)
        finally:
            stream.cancel()  # a no-op once finished; a client gone mid-request cancels it in Triton
        return JSONResponse(json_outputs(model, version, outputs))

    @app.post("/v2/models/{model}/generate_stream")
    @app.post("/v2/models/{model}/versions/{version}/generate_stream")
    async def generate_stream(model: str, request: Request, version: str = "") -> Response:
        started = await start(model, version, request)
        if isinstance(started, Response):
            return started
        stream, responses, first = started

        async def events() -> AsyncIterator[bytes]:
            response = first
            try:
                while response is not None:
                    if response.error is not None:
                        yield f"data: {json.dumps({'error': response.error.message})}\n\n".encode()
                        return
                    if response.outputs:
                        yield f"data: {json.dumps(json_outputs(model, version, response.outputs))}\n\n".encode()
                    response = await anext(responses, None)
            finally:
                stream.cancel()

        return StreamingResponse(events(), media_type="text/event-stream")

    return app
