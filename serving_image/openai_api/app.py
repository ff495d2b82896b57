"""The OpenAI-compatible HTTP front-end (port 9000, ARCHITECTURE §3.2) over the engine interface."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from serving_image.engine.base import (
    Engine,
    EngineInputError,
    EngineOutput,
    EngineRequest,
    EngineUnavailableError,
)
from serving_image.metrics.frontend import FrontendMetrics
from serving_image.openai_api import translate
from serving_image.openai_api.errors import APIError, bad_request, from_validation_error
from serving_image.openai_api.protocol import ChatCompletionRequest, CompletionRequest

request_log = logging.getLogger("llm_serving.requests")
log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 1024 * 1024


@dataclass
class _Outcome:
    """What the request log and the Triton-named metrics record about one request."""

    status: int = 200
    failure: str = "OTHER"
    first_response_s: float | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0


async def _first_then_rest(stream: AsyncIterator[EngineOutput]) -> tuple[EngineOutput, AsyncIterator[EngineOutput]]:
    """Pull the first output so that refusals (400) and an unavailable engine (503) are reported before a 200 and
    its event stream have been sent."""
    first = await stream.__anext__()

    async def rest() -> AsyncIterator[EngineOutput]:
        yield first
        async for item in stream:
            yield item

    return first, rest()


def _engine_error(exc: Exception) -> APIError:
    if isinstance(exc, EngineInputError):
        return bad_request(str(exc), param=exc.param)
    if isinstance(exc, EngineUnavailableError):
        return APIError(503, str(exc), type_="service_unavailable", code="engine_unavailable")
    return APIError(500, f"internal error: {exc}", type_="server_error")


async def _merged(streams: list[AsyncIterator[EngineOutput]]) -> AsyncIterator[tuple[int, EngineOutput]]:
    """Interleave several engine streams (a completions request with a list of prompts) as outputs arrive."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[EngineOutput]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
        except BaseException as exc:  # handed to the consumer, which re-raises it
            await queue.put((i, exc))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


def create_app(engine: Engine, metrics: FrontendMetrics | None = None,
               is_draining: Callable[[], bool] = lambda: False) -> FastAPI:
    app = FastAPI(title="llm-serving OpenAI-compatible API", docs_url=None, redoc_url=None)
    info = engine.info
    if metrics is not None:
        metrics.register_model(info.name, info.version)

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.get("/health/live")
    async def live() -> Response:
        return Response(status_code=200)

    @app.get("/health/ready")
    async def ready() -> JSONResponse:
        if is_draining():
            return JSONResponse({"status": "draining"}, status_code=503)
        if engine.is_ready():
            return JSONResponse({"status": "ready", "model": info.name, "version": info.version})
        return JSONResponse({"status": "not ready", "reason": engine.dead_reason}, status_code=503)

    def model_card() -> dict:
        return {"id": info.name, "object": "model", "created": 0, "owned_by": "llm-serving",
                "version": info.version, "max_model_len": info.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str) -> dict:
        if model_id != info.name:
            raise APIError(404, f"The model '{model_id}' does not exist", param="model", code="model_not_found")
        return model_card()

    async def parse(request: Request, model_cls):
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise APIError(413, f"request body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}",
                           code="request_too_large")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        try:
            parsed = model_cls.model_validate(body)
        except ValidationError as exc:
            raise from_validation_error(exc) from exc
        if parsed.model != info.name:
            raise APIError(404, f"The model '{parsed.model}' does not exist; this server serves '{info.name}'",
                           param="model", code="model_not_found")
        return parsed

    async def run(request: Request, kind: str, handler) -> Response:
        started = time.perf_counter()
        outcome = _Outcome()
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        user = None
        try:
            parsed = await parse(request, ChatCompletionRequest if kind == "chat" else CompletionRequest)
            user = parsed.user
            response = await handler(parsed, request_id, outcome, started)
        except APIError as exc:
            outcome.status = exc.status
            outcome.failure = "REJECTED" if exc.status < 500 else "BACKEND"
            response = exc.response()
        if not isinstance(response, StreamingResponse):
            _finish(request_id, kind, user, outcome, started)
        else:
            response.background = _Finisher(request_id, kind, user, outcome, started)
        return response

    def _finish(request_id: str, kind: str, user: str | None, outcome: _Outcome, started: float) -> None:
        duration = time.perf_counter() - started
        request_log.info(json.dumps({
            "request_id": request_id, "endpoint": kind, "model": info.name, "version": info.version,
            "user": user, "status": outcome.status, "prompt_tokens": outcome.prompt_tokens,
            "completion_tokens": outcome.completion_tokens, "duration_s": round(duration, 4),
        }))
        if metrics is not None:
            metrics.observe(info.name, info.version, success=outcome.status == 200, duration_s=duration,
                            failure_reason=outcome.failure, first_response_s=outcome.first_response_s)

    class _Finisher:
        def __init__(self, *args):
            self.args = args

        async def __call__(self) -> None:
            _finish(*self.args)

    def engine_requests(parsed, request_id: str) -> list[EngineRequest]:
        spec = translate.sampling_spec(parsed, info)
        if isinstance(parsed, ChatCompletionRequest):
            try:
                prompt = engine.render_chat(translate.chat_messages(parsed))
            except EngineInputError as exc:
                raise bad_request(str(exc), param=exc.param) from exc
            return [EngineRequest(request_id, prompt, spec, add_special_tokens=False)]
        prompts = parsed.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        requests = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, list) and any(not 0 <= t < info.vocab_size for t in prompt):
                raise bad_request(f"prompt: token ids must be in 0..{info.vocab_size - 1}", param="prompt")
            if prompt == "":
                raise bad_request(f"prompt[{i}] is empty", param=f"prompt[{i}]" if len(prompts) > 1 else "prompt")
            requests.append(EngineRequest(f"{request_id}-{i}", prompt, spec))
        return requests

    async def start_streams(requests: list[EngineRequest]) -> list[AsyncIterator[EngineOutput]]:
        streams = []
        try:
            for req in requests:
                _first, stream = await _first_then_rest(engine.generate(req))
                streams.append(stream)
        except (EngineInputError, EngineUnavailableError) as exc:
            for req in requests:
                await engine.abort(req.request_id)
            raise _engine_error(exc) from exc
        return streams

    def echo_text(req: EngineRequest) -> str:
        if isinstance(req.prompt, str):
            return req.prompt
        return engine.decode(list(req.prompt))

    async def handle(parsed, request_id: str, outcome: _Outcome, started: float) -> Response:
        chat = isinstance(parsed, ChatCompletionRequest)
        requests = engine_requests(parsed, request_id)
        streams = await start_streams(requests)
        outcome.first_response_s = time.perf_counter() - started
        n = requests[0].sampling.n
        want_logprobs = requests[0].sampling.logprobs is not None
        echo = (not chat) and bool(parsed.echo)
        if parsed.stream:
            include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
            events = _stream_events(parsed.model if chat else info.name, request_id, requests, streams, chat, n,
                                    want_logprobs, include_usage, echo, outcome, echo_text, engine.abort)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": request_id})
        accumulators = [translate.Accumulator(n=n) for _ in requests]
        try:
            async for i, output in _merged(streams):
                accumulators[i].add(output)
        except (EngineInputError, EngineUnavailableError) as exc:
            raise _engine_error(exc) from exc
        outcome.prompt_tokens = sum(a.prompt_tokens for a in accumulators)
        outcome.completion_tokens = sum(a.completion_tokens for a in accumulators)
        if chat:
            return JSONResponse(translate.chat_response(request_id, info.name, accumulators[0], want_logprobs))
        merged = translate.Accumulator(n=n, prompt_tokens=outcome.prompt_tokens)
        prefixes = {}
        for i, acc in enumerate(accumulators):
            for index, state in acc.choices.items():
                merged.choices[i * n + index] = state
                if echo:
                    prefixes[i * n + index] = echo_text(requests[i])
        return JSONResponse(translate.completion_response(request_id, info.name, merged, want_logprobs, prefixes))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await run(request, "chat", handle)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await run(request, "completion", handle)

    return app


def _sse(body: dict) -> bytes:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n".encode()


async def _stream_events(model: str, request_id: str, requests: list[EngineRequest],
                         streams: list[AsyncIterator[EngineOutput]], chat: bool, n: int, want_logprobs: bool,
                         include_usage: bool, echo: bool, outcome: _Outcome, echo_text,
                         abort) -> AsyncIterator[bytes]:
    created = int(time.time())
    accumulators = [translate.Accumulator(n=n) for _ in requests]
    chunk = translate.chat_chunk if chat else translate.completion_chunk
    extra = {"usage": None} if include_usage else {}
    finished = False
    try:
        if chat:
            yield _sse(dict(chunk(request_id, model, created, [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(n)]), **extra))
        elif echo:
            yield _sse(dict(chunk(request_id, model, created, [
                {"index": p * n + i, "text": echo_text(req), "logprobs": None, "finish_reason": None}
                for p, req in enumerate(requests) for i in range(n)]), **extra))
        async for p, output in _merged(streams):
            accumulators[p].add(output)
            choices = []
            for delta in output.choices:
                index = p * n + delta.index
                finish = translate.openai_finish_reason(delta)
                logprobs = None
                if want_logprobs and delta.logprobs is not None:
                    logprobs = (translate.chat_logprobs(list(delta.logprobs)) if chat
                                else translate.completion_logprobs(list(delta.logprobs)))
                if not delta.text and finish is None and not delta.token_ids:
                    continue
                if chat:
                    choices.append({"index": index, "delta": {"content": delta.text} if delta.text else {},
                                    "logprobs": logprobs, "finish_reason": finish})
                else:
                    choices.append({"index": index, "text": delta.text, "logprobs": logprobs,
                                    "finish_reason": finish})
            if choices:
                yield _sse(dict(chunk(request_id, model, created, choices), **extra))
        outcome.prompt_tokens = sum(a.prompt_tokens for a in accumulators)
        outcome.completion_tokens = sum(a.completion_tokens for a in accumulators)
        if include_usage:
            yield _sse(chunk(request_id, model, created, [],
                             translate.usage(outcome.prompt_tokens, outcome.completion_tokens)))
        yield b"data: [DONE]\n\n"
        finished = True
    except (EngineInputError, EngineUnavailableError) as exc:
        error = _engine_error(exc)
        outcome.status, outcome.failure = error.status, "BACKEND"
        yield _sse(error.body())
        yield b"data: [DONE]\n\n"
        finished = True
    finally:
        if not finished:
            # The client went away mid-stream: stop spending engine time on it.
            outcome.status, outcome.failure = 499, "CANCELED"
            for req in requests:
                await asyncio.shield(abort(req.request_id))
