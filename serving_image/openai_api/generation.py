"""/v1/completions and /v1/chat/completions: a request body to generation requests (one per prompt), and the engine's
outputs back to one JSON answer or to server-sent events."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, Response
from starlette.types import Receive

from serving_image.openai_api import openai_bodies
from serving_image.openai_api.errors import bad_request
from serving_image.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from serving_image.openai_api.request_scope import CLIENT_CLOSED_REQUEST, RequestScope
from serving_image.openai_api.state import ServerState
from serving_image.openai_api.streaming import (
    EventStreamResponse,
    StreamPlan,
    api_error_from,
    first_then_rest,
    merged,
    unless_disconnected,
)
from serving_image.served_model import (
    GenerationOutput,
    GenerationRequest,
    ModelInfo,
    ModelUnavailableError,
    OutputTotals,
    PromptText,
    RequestInputError,
    ServedModel,
    context_window_error,
)


async def generate(server: ServerState, scope: RequestScope, body: ChatCompletionRequest | CompletionRequest,
                   receive: Receive) -> Response:
    served, model = server.served_model, server.model
    chat = isinstance(body, ChatCompletionRequest)
    requests = generation_requests(served, body, scope.request_id)
    scope.admit(token_budget(requests, model))
    n = requests[0].sampling.n
    want_logprobs = requests[0].sampling.logprobs is not None
    echo_texts = [served.decode(list(r.prompt)) for r in requests] if not chat and body.echo else None
    if body.stream:
        # Until the first output the response has not started, so no write can fail: watch the client meanwhile, as
        # for a non-streaming request (a client may give up while its request waits behind others).
        started, streams = await unless_disconnected(start_streams(served, requests), receive)
        if not started:
            return await _client_left(served, requests, scope)
        plan = StreamPlan(model=model.name, request_id=scope.request_id, requests=requests, chat=chat, n=n,
                          want_logprobs=want_logprobs,
                          include_usage=bool(body.stream_options and body.stream_options.include_usage),
                          echo_texts=echo_texts)
        return EventStreamResponse(plan, streams, scope.hand_over(), served.abort)

    totals = [OutputTotals() for _ in requests]

    async def answer() -> None:
        streams = await start_streams(served, requests)
        async for i, output in merged(streams):
            scope.outcome.output_arrived()
            totals[i].add(output)

    # Watched from the start, not from the first token on: a client may give up while its request still waits for
    # the engine (queued behind others), and then the engine should not start on it. Batch work is also watched
    # for preemption by a real-time request (admission.py): it stops and is sent again later.
    preempted = scope.preemptible()
    try:
        completed, _ = await unless_disconnected(answer(), receive, stop=preempted)
    except (RequestInputError, ModelUnavailableError) as exc:
        raise api_error_from(exc) from exc
    scope.outcome.prompt_tokens = sum(t.prompt_tokens for t in totals)
    scope.outcome.completion_tokens = sum(t.completion_tokens for t in totals)
    if not completed and preempted is not None and preempted.is_set():
        for req in requests:
            await served.abort(req.request_id)
        raise scope.preempted()
    if not completed:
        return await _client_left(served, requests, scope)
    if chat:
        return JSONResponse(openai_bodies.chat_response(scope.request_id, model.name, totals[0], want_logprobs))
    # One answer for all the prompts: prompt i's choices are numbered i * n .. i * n + n - 1.
    combined = OutputTotals(prompt_tokens=scope.outcome.prompt_tokens)
    echo_prefixes = {}
    for i, prompt_totals in enumerate(totals):
        for index, choice in prompt_totals.choices.items():
            combined.choices[i * n + index] = choice
            if echo_texts is not None:
                echo_prefixes[i * n + index] = echo_texts[i]
    return JSONResponse(openai_bodies.completion_response(scope.request_id, model.name, combined, want_logprobs,
                                                      echo_prefixes))


async def _client_left(served: ServedModel, requests: list[GenerationRequest], scope: RequestScope) -> Response:
    """The client left before its answer: stop spending engine time on an answer nobody will read (499)."""
    for req in requests:
        await served.abort(req.request_id)
    scope.outcome.canceled()
    return Response(status_code=CLIENT_CLOSED_REQUEST)


def generation_requests(served: ServedModel, body: ChatCompletionRequest | CompletionRequest,
                    request_id: str) -> list[GenerationRequest]:
    """One generation request per prompt (a chat has one; a completion may list several), each checked against the
    vocabulary and the context window so that the client hears which field is wrong."""
    model = served.info
    spec = openai_bodies.sampling_spec(body, model)
    chat = isinstance(body, ChatCompletionRequest)
    try:
        if chat:
            text = served.render_chat(openai_bodies.chat_messages(body))
            # the chat template holds BOS already
            prompts = [(served.encode_prompt(text, add_special_tokens=False), PromptText(text, False))]
        else:
            prompts = _completion_prompts(served, body)
    except RequestInputError as exc:
        raise bad_request(str(exc), param=exc.param) from exc
    max_tokens_field = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
    requests = []
    for i, (ids, source) in enumerate(prompts):
        prompt_field = "messages" if chat else _prompt_field(i, len(prompts))
        if error := context_window_error(len(ids), spec.max_tokens, model.max_model_len, prompt_field=prompt_field,
                                         max_tokens_field=max_tokens_field):
            raise bad_request(str(error), param=error.param, code="context_length_exceeded")
        engine_request_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
        requests.append(GenerationRequest(engine_request_id, ids, spec, add_special_tokens=False, source=source))
    return requests


def _prompt_field(i: int, count: int) -> str:
    return f"prompt[{i}]" if count > 1 else "prompt"


def _completion_prompts(served: ServedModel, body: CompletionRequest) -> list[tuple[list[int], PromptText | None]]:
    """`prompt` as token ids per prompt, with the text they came from: a string, a list of token ids (no text), or
    a list of either."""
    raw = body.prompt
    items = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else raw
    vocab_size = served.info.vocab_size
    prompts = []
    for i, item in enumerate(items):
        name = _prompt_field(i, len(items))
        if isinstance(item, list):
            bad = [t for t in item if not 0 <= t < vocab_size]
            if bad:
                raise bad_request(f"{name}: token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})",
                                  param=name)
            prompts.append((list(item), None))
        elif item == "":
            raise bad_request(f"{name} is empty", param=name)
        else:
            prompts.append((served.encode_prompt(item, add_special_tokens=True), PromptText(item, True)))
    return prompts


def token_budget(requests: list[GenerationRequest], model: ModelInfo) -> int:
    """What admission counts for a request: its prompts plus the most every choice may generate."""
    total = 0
    for req in requests:
        out = req.sampling.max_tokens or (model.max_model_len - len(req.prompt))
        total += len(req.prompt) + out * req.sampling.n
    return total


async def start_streams(served: ServedModel,
                        requests: list[GenerationRequest]) -> list[AsyncIterator[GenerationOutput]]:
    """Start every generation request and wait for each one's first output, so that a refusal (400) or an unavailable
    engine (503) is answered as such, before any 200; on one, abort them all."""
    streams = []
    try:
        for req in requests:
            streams.append(await first_then_rest(served.generate(req)))
    except (RequestInputError, ModelUnavailableError) as exc:
        for req in requests:
            await served.abort(req.request_id)
        raise api_error_from(exc) from exc
    return streams
