"""The OpenAI-compatible HTTP front-end (port 9000, docs/architecture.md §3.2) over the engine interface.

Endpoints: /v1/models, /v1/completions, /v1/chat/completions (SSE streaming), /v1/embeddings, the /v1/score
extension, /health/ready and /health/live. Every request body is parsed by a strict model (fields.py classifies
every OpenAI field); errors have OpenAI's shape and status codes, and nothing a client sends yields a 500.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import struct
import time
import uuid
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive

from serving_image.engine.base import (
    Engine,
    EngineInputError,
    EngineRequest,
    EngineUnavailableError,
    OutputTotals,
    context_window_error,
)
from serving_image.metrics.frontend import FrontendMetrics
from serving_image.openai_api import translate
from serving_image.openai_api.admission import Admission, APIConfig, check_api_key
from serving_image.openai_api.errors import APIError, bad_request, from_validation_error
from serving_image.openai_api.openapi import install_openapi
from serving_image.openai_api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    ScoreRequest,
)
from serving_image.openai_api.streaming import (
    Outcome,
    StreamPlan,
    engine_error,
    first_then_rest,
    merged,
    stream_events,
    unless_disconnected,
)

request_log = logging.getLogger("llm_serving.requests")
log = logging.getLogger(__name__)

ENDPOINTS = {
    "chat": ("/v1/chat/completions", ChatCompletionRequest, "chatcmpl"),
    "completion": ("/v1/completions", CompletionRequest, "cmpl"),
    "embedding": ("/v1/embeddings", EmbeddingRequest, "embd"),
    "score": ("/v1/score", ScoreRequest, "score"),
}
_METADATA_FIELDS = ("user", "metadata", "safety_identifier", "prompt_cache_key")


def create_app(engine: Engine, metrics: FrontendMetrics | None = None,
               is_draining: Callable[[], bool] = lambda: False, config: APIConfig | None = None) -> FastAPI:
    config = config or APIConfig()
    app = FastAPI(title="llm-serving OpenAI-compatible API", docs_url=None, redoc_url=None)
    info = engine.info
    admission = Admission(config)
    app.state.admission = admission
    if metrics is not None:
        metrics.register_model(info.name, info.version)

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None,
                        type_="invalid_request_error").response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return bad_request(f"invalid request: {exc.errors()[0]['msg']}").response()

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")  # a bug of ours, not the client's input: say so
        return APIError(500, f"internal error ({type(exc).__name__})", type_="server_error").response()

    @app.get("/health/live", response_class=PlainTextResponse)
    async def live() -> PlainTextResponse:
        return PlainTextResponse("live")

    @app.get("/health/ready")
    async def ready() -> JSONResponse:
        if is_draining():
            return JSONResponse({"status": "draining"}, status_code=503)
        if engine.is_ready():
            return JSONResponse({"status": "ready", "model": info.name, "version": info.version})
        return JSONResponse({"status": "not ready", "reason": engine.dead_reason}, status_code=503)

    def model_card() -> dict:
        return {"id": info.name, "object": "model", "created": 0, "owned_by": "llm-serving"}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        check_api_key(config, request.headers.get("authorization"))
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str, request: Request) -> dict:
        check_api_key(config, request.headers.get("authorization"))
        if model_id != info.name:
            raise APIError(404, f"The model '{model_id}' does not exist", param="model", code="model_not_found")
        return model_card()

    async def parse(request: Request, kind: str):
        endpoint, model_cls, _ = ENDPOINTS[kind]
        check_api_key(config, request.headers.get("authorization"))
        if is_draining() or not engine.is_ready():
            raise APIError(503, f"not ready: {engine.dead_reason or 'draining'}", type_="service_unavailable",
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
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object", code="invalid_json")
        try:
            parsed = model_cls.model_validate(body)
        except ValidationError as exc:
            raise from_validation_error(exc, endpoint) from exc
        if parsed.model != info.name:
            raise APIError(404, f"The model '{parsed.model}' does not exist; this server serves '{info.name}'",
                           param="model", code="model_not_found")
        return parsed

    def finish(request_id: str, kind: str, parsed, outcome: Outcome, started: float) -> None:
        duration = time.perf_counter() - started
        record = {"request_id": request_id, "endpoint": kind, "model": info.name, "version": info.version,
                  "status": outcome.status, "prompt_tokens": outcome.prompt_tokens,
                  "completion_tokens": outcome.completion_tokens, "duration_s": round(duration, 4)}
        for field in _METADATA_FIELDS:
            value = getattr(parsed, field, None)
            if value is not None:
                record[field] = value
        request_log.info(json.dumps(record))
        if metrics is not None:
            metrics.observe(info.name, info.version, success=outcome.status == 200, duration_s=duration,
                            failure_reason=outcome.failure, first_response_s=outcome.first_response_s)

    async def run(request: Request, kind: str, handler) -> Response:
        started = time.perf_counter()
        outcome = Outcome()
        request_id = f"{ENDPOINTS[kind][2]}-{uuid.uuid4().hex}"
        parsed = None
        pending = contextlib.ExitStack()  # nv_inference_pending_request_count, until the last byte is sent
        if metrics is not None:
            pending.enter_context(metrics.pending(info.name, info.version))

        def done() -> None:
            pending.close()
            finish(request_id, kind, parsed, outcome, started)

        try:
            parsed = await parse(request, kind)
            response = await handler(parsed, request_id, outcome, started, done, request.receive)
        except APIError as exc:
            outcome.status = exc.status
            outcome.failure = "REJECTED" if exc.status < 500 else "BACKEND"
            response = exc.response()
        except BaseException:
            pending.close()
            raise
        if not isinstance(response, StreamingResponse):
            done()
        return response

    # -- completions and chat ----------------------------------------------------------------------------------

    def engine_requests(parsed, request_id: str) -> list[EngineRequest]:
        spec = translate.sampling_spec(parsed, info)
        try:
            if isinstance(parsed, ChatCompletionRequest):
                text = engine.render_chat(translate.chat_messages(parsed))
                prompts = [engine.encode_prompt(text, add_special_tokens=False)]
            else:
                raw = parsed.prompt
                items = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else raw
                prompts = []
                for i, item in enumerate(items):
                    name = f"prompt[{i}]" if len(items) > 1 else "prompt"
                    if isinstance(item, list):
                        bad = [t for t in item if not 0 <= t < info.vocab_size]
                        if bad:
                            raise bad_request(f"{name}: token id {bad[0]} is outside the vocabulary "
                                              f"(0..{info.vocab_size - 1})", param=name)
                        prompts.append(list(item))
                    elif item == "":
                        raise bad_request(f"{name} is empty", param=name)
                    else:
                        prompts.append(engine.encode_prompt(item, add_special_tokens=True))
        except EngineInputError as exc:
            raise bad_request(str(exc), param=exc.param) from exc
        requests = []
        for i, ids in enumerate(prompts):
            param = "messages" if isinstance(parsed, ChatCompletionRequest) else (
                f"prompt[{i}]" if len(prompts) > 1 else "prompt")
            field = "max_completion_tokens" if getattr(parsed, "max_completion_tokens", None) else "max_tokens"
            if error := context_window_error(len(ids), spec.max_tokens, info.max_model_len, prompt_field=param,
                                             max_tokens_field=field):
                raise bad_request(str(error), param=error.param, code="context_length_exceeded")
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            requests.append(EngineRequest(rid, ids, spec, add_special_tokens=False))
        return requests

    def budget(requests: list[EngineRequest]) -> int:
        total = 0
        for req in requests:
            out = req.sampling.max_tokens or (info.max_model_len - len(req.prompt))
            total += len(req.prompt) + out * req.sampling.n
        return total

    async def start_streams(requests: list[EngineRequest]):
        streams = []
        try:
            for req in requests:
                streams.append(await first_then_rest(engine.generate(req)))
        except (EngineInputError, EngineUnavailableError) as exc:
            for req in requests:
                await engine.abort(req.request_id)
            raise engine_error(exc) from exc
        return streams

    async def generate(parsed, request_id: str, outcome: Outcome, started: float, on_done,
                       receive: Receive) -> Response:
        chat = isinstance(parsed, ChatCompletionRequest)
        requests = engine_requests(parsed, request_id)
        tokens = admission.admit(budget(requests))
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                admission.release(tokens)

        try:
            streams = await start_streams(requests)
            outcome.first_response_s = time.perf_counter() - started
            n = requests[0].sampling.n
            want_logprobs = requests[0].sampling.logprobs is not None
            echo_texts = ([engine.decode(list(r.prompt)) for r in requests]
                          if not chat and parsed.echo else None)
            if parsed.stream:
                plan = StreamPlan(model=info.name, request_id=request_id, requests=requests, chat=chat, n=n,
                                  want_logprobs=want_logprobs,
                                  include_usage=bool(parsed.stream_options and parsed.stream_options.include_usage),
                                  echo_texts=echo_texts)

                def done() -> None:
                    release()
                    on_done()

                events = stream_events(plan, streams, outcome, engine.abort, done)
                return StreamingResponse(events, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Request-Id": request_id})
            accumulators = [OutputTotals() for _ in requests]

            async def collect() -> None:
                async for i, output in merged(streams):
                    accumulators[i].add(output)

            try:
                completed, _ = await unless_disconnected(collect(), receive)
            except (EngineInputError, EngineUnavailableError) as exc:
                raise engine_error(exc) from exc
            outcome.prompt_tokens = sum(a.prompt_tokens for a in accumulators)
            outcome.completion_tokens = sum(a.completion_tokens for a in accumulators)
            if not completed:  # the client left: stop spending engine time on an answer nobody will read
                for req in requests:
                    await engine.abort(req.request_id)
                outcome.status, outcome.failure = 499, "CANCELED"
                release()
                return Response(status_code=499)
        except BaseException:
            release()
            raise
        release()
        if chat:
            return JSONResponse(translate.chat_response(request_id, info.name, accumulators[0], want_logprobs))
        combined = OutputTotals(prompt_tokens=outcome.prompt_tokens)
        prefixes = {}
        for i, acc in enumerate(accumulators):
            for index, state in acc.choices.items():
                combined.choices[i * n + index] = state
                if echo_texts is not None:
                    prefixes[i * n + index] = echo_texts[i]
        return JSONResponse(translate.completion_response(request_id, info.name, combined, want_logprobs,
                                                          prefixes))

    # -- embeddings and scoring --------------------------------------------------------------------------------

    async def embeddings(parsed: EmbeddingRequest, request_id: str, outcome: Outcome, started: float,
                         on_done, receive: Receive) -> Response:
        if info.embedding_dim is None:
            raise bad_request(f"model {info.name} does not serve embeddings (its package's engine.tasks has no "
                              "'embed')", param="model", code="embeddings_not_served")
        if parsed.dimensions is not None and parsed.dimensions != info.embedding_dim:
            raise bad_request(f"dimensions {parsed.dimensions}: this model's embeddings have "
                              f"{info.embedding_dim} dimensions and are not truncated", param="dimensions")
        raw = parsed.input
        items = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
        for i, item in enumerate(items):
            if isinstance(item, list) and any(not 0 <= t < info.vocab_size for t in item):
                name = f"input[{i}]" if len(items) > 1 else "input"
                raise bad_request(f"{name}: token ids must be in 0..{info.vocab_size - 1}", param=name)
        tokens = admission.admit(sum(len(i) if isinstance(i, list) else len(i) // 2 + 1 for i in items))
        try:
            vectors = await engine.embed(items, request_id)
        except (EngineInputError, EngineUnavailableError) as exc:
            raise engine_error(exc) from exc
        finally:
            admission.release(tokens)
        outcome.prompt_tokens = sum(v.prompt_tokens for v in vectors)
        data = []
        for i, vector in enumerate(vectors):
            if parsed.encoding_format == "base64":
                value = base64.b64encode(struct.pack(f"<{len(vector.vector)}f", *vector.vector)).decode()
            else:
                value = list(vector.vector)
            data.append({"object": "embedding", "index": i, "embedding": value})
        return JSONResponse({"object": "list", "data": data, "model": info.name,
                             "usage": {"prompt_tokens": outcome.prompt_tokens,
                                       "total_tokens": outcome.prompt_tokens}})

    async def score(parsed: ScoreRequest, request_id: str, outcome: Outcome, started: float,
                    on_done, receive: Receive) -> Response:
        tokens = admission.admit(len(parsed.prompt) // 2 + sum(len(c) for c in parsed.candidates))
        try:
            scores = await engine.score(parsed.prompt, parsed.candidates, request_id)
        except (EngineInputError, EngineUnavailableError) as exc:
            raise engine_error(exc) from exc
        finally:
            admission.release(tokens)
        return JSONResponse({
            "id": request_id, "object": "score", "model": info.name,
            "data": [{"index": i, "candidate": c, "logprob": s.logprob, "tokens": s.tokens}
                     for i, (c, s) in enumerate(zip(parsed.candidates, scores, strict=True))],
        })

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await run(request, "chat", generate)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await run(request, "completion", generate)

    @app.post("/v1/embeddings")
    async def embeddings_route(request: Request) -> Response:
        return await run(request, "embedding", embeddings)

    @app.post("/v1/score")
    async def score_route(request: Request) -> Response:
        return await run(request, "score", score)

    install_openapi(app, {kind: (path, model) for kind, (path, model, _) in ENDPOINTS.items()})
    return app
