"""KServe v2 HTTP (port 8000) with Triton's answers for its decoupled vLLM model (docs/kserve.md):

- `/v2/health/live`, `/v2/health/ready`, `/v2/models/{m}/ready`: 200, or 400 when not ready (Triton's codes);
- `/v2`, `/v2/models/{m}`, `/v2/models/{m}/config`: server and model metadata, the model configuration;
- `/v2/models/{m}/infer`: a well-formed request gets 501 and Triton's message (its HTTP front-end refuses decoupled
  models); a malformed one gets 400 naming the tensor or field;
- `/v2/models/{m}/generate` and `/generate_stream` (Triton's generate extension, the HTTP way to reach the vLLM
  model): inputs as top-level JSON keys, sampling parameters in `sampling_parameters` (a JSON string) or in
  `parameters`; the stream is server-sent events.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from google.protobuf.json_format import MessageToDict

from serving_image.engine.base import EngineUnavailableError
from serving_image.kserve.service import (
    DECOUPLED_HTTP_MESSAGE,
    TRITON_MODEL_VERSION,
    KServeModelService,
    ModelNotFound,
)
from serving_image.kserve.tensors import Tensor, TensorError, decode_json_input, to_json_output
from serving_image.kserve.translate import INPUT_TYPES, GenerateCall, KServeInputError

MAX_BODY_BYTES = 16 * 1024 * 1024


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


async def _json_body(request: Request, binary: bool = False) -> dict | tuple[dict, bytes]:
    """The JSON body; with `binary`, also the binary-data section that follows a JSON header of
    `Inference-Header-Content-Length` bytes (Triton's binary tensor data extension, which tritonclient.http uses)."""
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise KServeInputError("body", f"request body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}")
    rest = b""
    header_length = request.headers.get("inference-header-content-length")
    if binary and header_length is not None:
        try:
            cut = int(header_length)
        except ValueError:
            cut = -1
        if not 0 <= cut <= len(raw):
            raise KServeInputError("Inference-Header-Content-Length", "Inference-Header-Content-Length must be "
                                   f"an integer in 0..{len(raw)}, got {header_length!r}")
        raw, rest = raw[:cut], raw[cut:]
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise KServeInputError("body", f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise KServeInputError("body", "request body must be a JSON object")
    return (body, rest) if binary else body


def _infer_tensors(body: dict, binary: bytes = b"") -> tuple[list[Tensor], dict, list[str]]:
    inputs = body.get("inputs")
    if not isinstance(inputs, list):
        raise KServeInputError("inputs", "inputs must be a list of tensors")
    tensors = []
    offset = 0
    for i, item in enumerate(inputs):
        size = item.get("parameters", {}).get("binary_data_size") if isinstance(item, dict) and isinstance(
            item.get("parameters"), dict) else None
        chunk = None
        if size is not None:
            if not isinstance(size, int) or size < 0 or offset + size > len(binary):
                raise KServeInputError(f"inputs[{i}]", f"inputs[{i}].parameters.binary_data_size {size!r} does not "
                                       f"fit the {len(binary) - offset} bytes of binary data left")
            chunk, offset = binary[offset:offset + size], offset + size
        try:
            tensors.append(decode_json_input(item, i, chunk))
        except TensorError as exc:
            raise KServeInputError(exc.field, str(exc)) from exc
    if offset != len(binary):
        raise KServeInputError("body", f"{len(binary) - offset} bytes of binary data belong to no input")
    parameters = body.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise KServeInputError("parameters", "parameters must be an object")
    outputs = body.get("outputs") or []
    if not isinstance(outputs, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str)
                                                for o in outputs):
        raise KServeInputError("outputs", "outputs must be a list of {\"name\": ...} objects")
    return tensors, parameters, [o["name"] for o in outputs]


def _generate_tensors(body: dict) -> tuple[list[Tensor], dict]:
    tensors = []
    parameters = body.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise KServeInputError("parameters", "parameters must be an object")
    for key, value in body.items():
        if key in ("parameters", "id"):
            continue
        datatype = INPUT_TYPES.get(key)
        if datatype is None:
            raise KServeInputError(key, f"'{key}' is not an input of this model; inputs are "
                                   f"{', '.join(INPUT_TYPES)} (sampling parameters go in 'parameters')")
        if datatype == "BYTES":
            if not isinstance(value, str):
                raise KServeInputError(key, f"input '{key}' must be a string")
            tensors.append(Tensor(key, datatype, (1,), (value.encode("utf-8"),)))
        else:
            if not isinstance(value, bool):
                raise KServeInputError(key, f"input '{key}' must be true or false")
            tensors.append(Tensor(key, datatype, (1,), (value,)))
    return tensors, parameters


def create_kserve_app(service: KServeModelService) -> FastAPI:
    app = FastAPI(title="llm-serving KServe v2", docs_url=None, redoc_url=None, openapi_url=None)
    info = service.info

    @app.get("/v2/health/live")
    async def live() -> Response:
        return Response(status_code=200 if service.live() else 400)

    @app.get("/v2/health/ready")
    async def ready() -> Response:
        return Response(status_code=200 if service.ready() else 400)

    @app.get("/v2")
    async def server_metadata() -> dict:
        return service.server_metadata()

    @app.get("/v2/models/{model}/ready")
    @app.get("/v2/models/{model}/versions/{version}/ready")
    async def model_ready(model: str, version: str = "") -> Response:
        return Response(status_code=200 if service.model_ready(model, version) else 400)

    @app.get("/v2/models/{model}")
    @app.get("/v2/models/{model}/versions/{version}")
    async def model_metadata(model: str, version: str = "") -> JSONResponse:
        try:
            service.check_model(model, version)
        except ModelNotFound as exc:
            return _error(404, str(exc))
        return JSONResponse(service.model_metadata())

    @app.get("/v2/models/{model}/config")
    @app.get("/v2/models/{model}/versions/{version}/config")
    async def model_config(model: str, version: str = "") -> JSONResponse:
        try:
            service.check_model(model, version)
        except ModelNotFound as exc:
            return _error(404, str(exc))
        from serving_image.triton.repository import vllm_model_config

        return JSONResponse(MessageToDict(vllm_model_config(info.name), preserving_proto_field_name=True))

    @app.post("/v2/models/{model}/infer")
    @app.post("/v2/models/{model}/versions/{version}/infer")
    async def infer(model: str, request: Request, version: str = "") -> JSONResponse:
        try:
            service.check_model(model, version)
            body, binary = await _json_body(request, binary=True)
            tensors, parameters, outputs = _infer_tensors(body, binary)
            service.check_fits(service.parse(tensors, parameters, outputs, str(body.get("id", ""))))
        except ModelNotFound as exc:
            return _error(404, str(exc))
        except KServeInputError as exc:
            service.observe_rejected()
            return _error(400, str(exc))
        return _error(501, DECOUPLED_HTTP_MESSAGE)

    async def prepare(model: str, version: str, request: Request) -> GenerateCall | JSONResponse:
        try:
            service.check_model(model, version)
            body = await _json_body(request)
            tensors, parameters = _generate_tensors(body)
            request_id = str(body.get("id") or f"generate-{uuid.uuid4().hex}")
            return service.parse(tensors, parameters, [], request_id)
        except ModelNotFound as exc:
            return _error(404, str(exc))
        except KServeInputError as exc:
            service.observe_rejected()
            return _error(400, str(exc))

    def flat(call: GenerateCall, tensors: list[Tensor]) -> dict[str, Any]:
        body: dict[str, Any] = {"model_name": info.name, "model_version": TRITON_MODEL_VERSION,
                                "id": call.request.request_id}
        for tensor in tensors:
            data = to_json_output(tensor)["data"]
            body[tensor.name] = data[0] if len(data) == 1 else data
        return body

    @app.post("/v2/models/{model}/generate")
    @app.post("/v2/models/{model}/versions/{version}/generate")
    async def generate(model: str, request: Request, version: str = "") -> JSONResponse:
        call = await prepare(model, version, request)
        if isinstance(call, JSONResponse):
            return call
        if call.stream:
            return _error(400, "input 'stream': true needs /generate_stream")
        results = service.run(call)
        last = None
        try:
            async for result in results:
                last = result
        except KServeInputError as exc:
            return _error(400, str(exc))
        except EngineUnavailableError as exc:
            return _error(503, str(exc))
        finally:
            await results.aclose()
        assert last is not None
        return JSONResponse(flat(call, last.tensors))

    @app.post("/v2/models/{model}/generate_stream")
    @app.post("/v2/models/{model}/versions/{version}/generate_stream")
    async def generate_stream(model: str, request: Request, version: str = "") -> Response:
        call = await prepare(model, version, request)
        if isinstance(call, JSONResponse):
            return call
        results = service.run(call)
        # Pull the first response before answering 200, so that a refusal is a 400, not an event.
        try:
            first = await results.__anext__()
        except StopAsyncIteration:
            first = None
        except KServeInputError as exc:
            await results.aclose()
            return _error(400, str(exc))
        except EngineUnavailableError as exc:
            await results.aclose()
            return _error(503, str(exc))

        async def events() -> AsyncIterator[bytes]:
            try:
                if first is not None:
                    yield f"data: {json.dumps(flat(call, first.tensors))}\n\n".encode()
                async for result in results:
                    yield f"data: {json.dumps(flat(call, result.tensors))}\n\n".encode()
            except Exception as exc:  # the status line is sent: the error becomes the stream's last event
                yield f"data: {json.dumps({'error': str(exc)})}\n\n".encode()
            finally:
                await results.aclose()

        return StreamingResponse(events(), media_type="text/event-stream")

    return app
