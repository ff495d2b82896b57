"""Engine streams to OpenAI server-sent events (the response that sends them owns its request's scope), and the
helpers both response styles share."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from serving_image.openai_api import openai_bodies
from serving_image.openai_api.errors import APIError, bad_request
from serving_image.openai_api.request_scope import Outcome, RequestScope
from serving_image.served_model import (
    GenerationOutput,
    GenerationRequest,
    ModelUnavailableError,
    OutputTotals,
    RequestInputError,
)


def api_error_from(exc: Exception) -> APIError:
    if isinstance(exc, RequestInputError):
        return bad_request(str(exc), param=exc.param)
    if isinstance(exc, ModelUnavailableError):
        return APIError(503, str(exc), type_="service_unavailable", code="engine_unavailable")
    return APIError(500, f"internal error: {exc}", type_="server_error")


async def first_then_rest(stream: AsyncIterator[GenerationOutput]) -> AsyncIterator[GenerationOutput]:
    """Pull the first output now, so that a refusal (400) or an unavailable engine (503) is reported before a 200
    and its event stream have been sent; return a stream that yields it again, then the rest."""
    first = await stream.__anext__()

    async def rest() -> AsyncIterator[GenerationOutput]:
        yield first
        async for item in stream:
            yield item

    return rest()


async def merged(streams: list[AsyncIterator[GenerationOutput]]) -> AsyncIterator[tuple[int, GenerationOutput]]:
    """Interleave several engine streams (a completions request with a list of prompts) as outputs arrive."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[GenerationOutput]) -> None:
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


async def until_disconnected(receive: Callable[[], Awaitable[dict]]) -> None:
    """Returns when the client closes its connection. Only for after the request body has been read: every other
    message on the ASGI channel is then dropped."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(work: Awaitable, receive: Callable[[], Awaitable[dict]],
                              stop: asyncio.Event | None = None) -> tuple[bool, object]:
    """Run `work` until it finishes or the client leaves (or `stop` is set: batch work preempted), whichever is
    first: (True, its result), or (False, None) with `work` cancelled. A non-streaming request has no write to fail
    on, so without this a client that gave up would keep the engine busy until the whole answer was generated."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(until_disconnected(receive))
    watchers = {task, listener}
    if stop is not None:
        watchers.add(asyncio.ensure_future(stop.wait()))
    try:
        await asyncio.wait(watchers, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this request itself cancelled (the server stopping): take the work down with it
        task.cancel()
        raise
    finally:
        for watcher in watchers - {task}:
            watcher.cancel()
    if task.done():
        return True, task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return False, None


_background: set[asyncio.Task] = set()  # aborts in flight (the loop keeps only weak references to tasks)


def sse(body: dict) -> bytes:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n".encode()


@dataclass
class StreamPlan:
    model: str
    request_id: str
    requests: list[GenerationRequest]
    chat: bool
    n: int
    want_logprobs: bool
    include_usage: bool
    echo_texts: list[str] | None  # completions with echo: the prompt text per prompt


async def stream_events(plan: StreamPlan, streams: list[AsyncIterator[GenerationOutput]],
                        outcome: Outcome) -> AsyncIterator[bytes]:
    """The engine's outputs as OpenAI server-sent events, ending with `data: [DONE]`; usage and an engine error
    met on the way are recorded in `outcome`. What happens when the client leaves is EventStreamResponse's."""
    created = int(time.time())
    accumulators = [OutputTotals() for _ in plan.requests]
    chunk = openai_bodies.chat_chunk if plan.chat else openai_bodies.completion_chunk
    extra = {"usage": None} if plan.include_usage else {}
    n = plan.n
    try:
        if plan.chat:
            yield sse(dict(chunk(plan.request_id, plan.model, created, [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(n)]), **extra))
        elif plan.echo_texts is not None:
            yield sse(dict(chunk(plan.request_id, plan.model, created, [
                {"index": p * n + i, "text": text, "logprobs": None, "finish_reason": None}
                for p, text in enumerate(plan.echo_texts) for i in range(n)]), **extra))
        async for p, output in merged(streams):
            outcome.output_arrived()
            accumulators[p].add(output)
            outcome.completion_tokens = sum(a.completion_tokens for a in accumulators)
            choices = []
            for delta in output.choices:
                finish = openai_bodies.openai_finish_reason(delta.finish_reason)
                if not delta.text and finish is None and not delta.token_ids:
                    continue
                logprobs = None
                if plan.want_logprobs and delta.logprobs is not None:
                    logprobs = (openai_bodies.chat_logprobs(list(delta.logprobs)) if plan.chat
                                else openai_bodies.completion_logprobs(list(delta.logprobs)))
                if plan.chat:
                    choices.append({"index": p * n + delta.index,
                                    "delta": {"content": delta.text} if delta.text else {},
                                    "logprobs": logprobs, "finish_reason": finish})
                else:
                    choices.append({"index": p * n + delta.index, "text": delta.text, "logprobs": logprobs,
                                    "finish_reason": finish})
            if choices:
                yield sse(dict(chunk(plan.request_id, plan.model, created, choices), **extra))
        outcome.prompt_tokens = sum(a.prompt_tokens for a in accumulators)
        if plan.include_usage:
            yield sse(chunk(plan.request_id, plan.model, created, [],
                            openai_bodies.usage(outcome.prompt_tokens, outcome.completion_tokens)))
        yield b"data: [DONE]\n\n"
    except (RequestInputError, ModelUnavailableError) as exc:
        error = api_error_from(exc)
        outcome.status = error.status
        yield sse(error.body())
        yield b"data: [DONE]\n\n"


class EventStreamResponse(StreamingResponse):
    """A request's server-sent events; the response owns the request's scope, and closes it when sending ends,
    however it ends.

    Closing here rather than in the events generator's `finally` is what makes the release prompt: when the client
    disconnects while a chunk is being sent, Starlette cancels the sending task with the generator suspended at its
    `yield`. The generator's `finally` then runs only once the generator is garbage-collected, and the cancellation's
    traceback puts it in a reference cycle, so that waits for the cycle collector: until then the request kept its
    admission, went unlogged, and the engine generated on for nobody."""

    def __init__(self, plan: StreamPlan, streams: list[AsyncIterator[GenerationOutput]], request_scope: RequestScope,
                 abort: Callable[[str], Awaitable[None]]):
        super().__init__(stream_events(plan, streams, request_scope.outcome), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Request-Id": plan.request_id})
        self.request_scope = request_scope
        self._engine_request_ids = [req.request_id for req in plan.requests]
        self._abort = abort
        self._sent_all = False

    async def stream_response(self, send: Send) -> None:
        await super().stream_response(send)
        self._sent_all = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._sent_all:
                # The client went away mid-stream (or the server is stopping): stop spending engine time on it. Not
                # awaited: a cancelled task's await here could be cancelled too, and the scope must close regardless.
                self.request_scope.outcome.canceled()
                for request_id in self._engine_request_ids:
                    task = asyncio.get_running_loop().create_task(self._abort(request_id))
                    _background.add(task)
                    task.add_done_callback(_background.discard)
            self.request_scope.close()
