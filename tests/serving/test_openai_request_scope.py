"""The request scope of the OpenAI front-end (serving_image/openai_api/request_scope.py): whatever ends a request, its
admission is released and its log record written exactly once. (The request metrics are embedded Triton's own, not
the scope's: test_openai_embedded.py reads them through the metrics proxy.)

No engine: the scope on its own first, then the streaming response that takes it over, then the whole app (plain
ASGI calls) on a scripted fake engine, for the exits only the app has (the client leaving a non-streaming request,
the server cancelling a request, an engine refusing or dying).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from starlette.requests import ClientDisconnect

from serving_image.openai_api.admission import Admission, APIConfig
from serving_image.openai_api.app import create_app
from serving_image.openai_api.errors import APIError, bad_request
from serving_image.openai_api.protocol import CHAT_COMPLETIONS, COMPLETIONS, ChatCompletionRequest
from serving_image.openai_api.request_scope import RequestScope, trace_id_from
from serving_image.openai_api.streaming import EventStreamResponse, StreamPlan
from serving_image.served_model import (
    ChoiceDelta,
    GenerationOutput,
    GenerationRequest,
    ModelInfo,
    ModelUnavailableError,
    SamplingSpec,
    ServedModel,
)

MODEL = ModelInfo(name="fake", version="3", max_model_len=64, vocab_size=100, eos_token_id=0)


@dataclass
class Held:
    """What requests hold on the server: admission's counts."""

    requests: int
    tokens: int


NOTHING_HELD = Held(0, 0)


class Bookkeeping:
    """The admission counters and request log records one test's requests write into."""

    def __init__(self, caplog: pytest.LogCaptureFixture, config: APIConfig | None = None):
        self.admission = Admission(config or APIConfig(max_inflight_tokens=100))
        self._caplog = caplog
        caplog.set_level(logging.INFO, logger="llm_serving.requests")

    def scope(self, endpoint=COMPLETIONS) -> RequestScope:
        return RequestScope(endpoint, MODEL, self.admission)

    def held(self) -> Held:
        return Held(self.admission.requests, self.admission.tokens)

    def records(self) -> list[dict]:
        return [json.loads(r.getMessage()) for r in self._caplog.records if r.name == "llm_serving.requests"]

    def assert_released_once(self, status: int) -> dict:
        """Nothing held any more, and one log record (returned) with `status`."""
        assert self.held() == NOTHING_HELD
        records = self.records()
        assert [r["status"] for r in records] == [status], records
        return records[0]


@pytest.fixture
def books(caplog) -> Bookkeeping:
    return Bookkeeping(caplog)


# -- the scope on its own ------------------------------------------------------------------------------------------


def test_an_answered_request_is_released_once_with_its_record(books):
    body = ChatCompletionRequest.model_validate({"model": "fake", "messages": [{"role": "user", "content": "x"}],
                                                 "user": "u-1", "metadata": {"team": "a"}})
    with books.scope(CHAT_COMPLETIONS) as scope:
        assert books.held() == NOTHING_HELD  # nothing before admission
        scope.body = body
        scope.admit(30)
        assert books.held() == Held(1, 30)
        scope.outcome.prompt_tokens, scope.outcome.completion_tokens = 7, 5
    record = books.assert_released_once(200)
    assert list(record) == ["request_id", "endpoint", "model", "version", "status", "prompt_tokens",
                            "completion_tokens", "duration_s", "first_output_s", "last_output_s", "trace_id",
                            "experiment", "user", "metadata"]
    assert record["request_id"] == scope.request_id and scope.request_id.startswith("chatcmpl-")
    assert (record["endpoint"], record["model"], record["version"]) == ("chat", "fake", "3")
    assert (record["prompt_tokens"], record["completion_tokens"]) == (7, 5)
    assert record["user"] == "u-1" and record["metadata"] == {"team": "a"}
    assert record["duration_s"] >= 0
    # No output arrived and no traceparent was given: null, not zero.
    assert (record["first_output_s"], record["last_output_s"], record["trace_id"], record["experiment"]) == (
        None, None, None, None)


def test_the_record_holds_when_the_first_and_last_output_arrived_and_the_callers_trace(books):
    with books.scope() as scope:
        scope.trace_id = trace_id_from("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        scope.admit(30)
        scope.outcome.output_arrived()
        first = scope.outcome.first_output_at
        scope.outcome.output_arrived()
        assert scope.outcome.first_output_at == first and scope.outcome.last_output_at >= first
    record = books.assert_released_once(200)
    assert record["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert 0 <= record["first_output_s"] <= record["last_output_s"] <= record["duration_s"]


def test_a_later_trace_context_version_is_read_by_its_version_00_prefix():
    assert trace_id_from("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-comes") == \
        "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.mark.parametrize("header", [None, "", "garbage", "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                                    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-more",
                                    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                                    "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
                                    "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01"])
def test_a_traceparent_not_in_w3c_form_is_ignored_as_trace_context_says(header):
    assert trace_id_from(header) is None


@pytest.mark.parametrize("error", [
    bad_request("no"),
    APIError(404, "no such model"),
    APIError(503, "engine died", type_="service_unavailable"),
])
def test_an_error_answer_is_recorded_with_its_status(books, error):
    with pytest.raises(APIError), books.scope() as scope:
        scope.admit(10)
        raise error
    books.assert_released_once(error.status)


def test_a_refused_admission_holds_nothing_and_leaves_others_admitted(books):
    with books.scope() as first:
        first.admit(90)
        with pytest.raises(APIError) as refused, books.scope() as second:
            second.admit(20)  # 110 tokens in flight would pass the limit of 100: 429
        assert refused.value.status == 429 and refused.value.headers == {"Retry-After": "1"}
        assert books.held() == Held(1, 90)
    assert books.held() == NOTHING_HELD
    assert [r["status"] for r in books.records()] == [429, 200]


def test_a_bug_is_recorded_as_a_500(books):
    with pytest.raises(ZeroDivisionError), books.scope() as scope:
        scope.admit(10)
        _ = 1 / 0
    books.assert_released_once(500)


def test_a_cancelled_request_is_released_and_recorded_as_499(books):
    async def main() -> None:
        admitted = asyncio.Event()

        async def handle() -> None:
            with books.scope() as scope:
                scope.admit(10)
                admitted.set()
                await asyncio.Event().wait()  # the engine's answer, which never comes

        task = asyncio.create_task(handle())
        await admitted.wait()
        assert books.held() == Held(1, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    books.assert_released_once(499)


def test_a_handed_over_scope_stays_open_until_its_new_owner_closes_it_once(books):
    with books.scope() as scope:
        scope.admit(10)
        owned = scope.hand_over()
    assert books.held() == Held(1, 10) and not scope.closed and books.records() == []
    owned.close()
    owned.close()  # a second close (two owners' cleanups) releases nothing twice
    books.assert_released_once(200)


def test_a_handed_over_scope_still_closes_when_the_block_raises(books):
    with pytest.raises(RuntimeError), books.scope() as scope:
        scope.admit(10)
        scope.hand_over()
        raise RuntimeError("the response was never returned")
    books.assert_released_once(500)


def test_a_scope_is_entered_once_and_admits_once(books):
    with books.scope() as scope:
        scope.admit(10)
        with pytest.raises(RuntimeError, match="already admitted"):
            scope.admit(10)
        with pytest.raises(RuntimeError, match="already entered"), scope:
            pass
    assert books.held() == NOTHING_HELD


# -- a streaming response owns its scope ---------------------------------------------------------------------------


class Generation:
    """An engine stream: `tokens` outputs, then it ends, raises `error`, or (`hang`) waits forever."""

    def __init__(self, tokens: int = 3, *, error: Exception | None = None, hang: bool = False):
        self.tokens, self.error, self.hang = tokens, error, hang
        self.hanging = asyncio.Event()  # set once a stream waits forever: the request is deep in the engine

    async def stream(self, request_id: str) -> AsyncIterator[GenerationOutput]:
        for i in range(self.tokens):
            await asyncio.sleep(0)
            last = i == self.tokens - 1 and not (self.error or self.hang)
            yield GenerationOutput(request_id, 4, (ChoiceDelta(0, f"t{i} ", (i,), None, "length" if last else None),),
                               finished=last)
        if self.error:
            raise self.error
        if self.hang:
            self.hanging.set()
            await asyncio.Event().wait()


def http_scope(path: str = "/v1/completions", body: bytes = b"", spec_version: str = "2.3") -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "headers": [(b"content-type", b"application/json"),
                                         (b"content-length", str(len(body)).encode())],
            "client": ("client", 1), "server": ("server", 80)}


class Client:
    """The client side of one ASGI request: sends `body`, then disconnects at once, after the first response body
    chunk, or never (or sends 5 bytes of the body and disconnects); `slow` makes every body chunk take a while to
    send (a slow socket)."""

    def __init__(self, body: bytes = b"", *, leave: str = "never", slow: bool = False):
        assert leave in ("never", "at once", "after first chunk", "while sending the body")
        self.body, self.leave, self.slow = body, leave, slow
        self.messages: list[dict] = []
        self._body_sent = False
        self._got_chunk = asyncio.Event()

    async def receive(self) -> dict:
        if not self._body_sent:
            self._body_sent = True
            if self.leave == "while sending the body":
                return {"type": "http.request", "body": self.body[:5], "more_body": True}
            return {"type": "http.request", "body": self.body, "more_body": False}
        if self.leave == "never":
            await asyncio.Event().wait()
        if self.leave == "after first chunk":
            await self._got_chunk.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.messages.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            self._got_chunk.set()
            if self.slow:
                await asyncio.sleep(0.5)

    @property
    def status(self) -> int:
        return next(m["status"] for m in self.messages if m["type"] == "http.response.start")

    @property
    def events(self) -> list[str]:
        text = b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body").decode()
        return [line.removeprefix("data: ") for line in text.split("\n\n") if line]


def event_stream(books: Bookkeeping, generation: Generation, aborted: list[str]) -> EventStreamResponse:
    """What the completions handler returns for a streaming request: the scope handed over to the response."""
    request = GenerationRequest("cmpl-1", [1, 2, 3, 4], SamplingSpec(max_tokens=generation.tokens))
    plan = StreamPlan(model=MODEL.name, request_id="cmpl-1", requests=[request], chat=False, n=1,
                      want_logprobs=False, include_usage=False, echo_texts=None)

    async def abort(request_id: str) -> None:
        aborted.append(request_id)

    with books.scope() as scope:
        scope.admit(10)
        return EventStreamResponse(plan, [generation.stream("cmpl-1")], scope.hand_over(), abort)


def test_a_stream_sent_to_the_end_closes_its_scope_after_the_last_event(books):
    aborted: list[str] = []

    async def main() -> Client:
        response = event_stream(books, Generation(3), aborted)
        assert books.held() == Held(1, 10)  # open while the events are sent
        client = Client()
        await response(http_scope(), client.receive, client.send)
        return client

    client = asyncio.run(main())
    assert client.events[-1] == "[DONE]" and len(client.events) == 4
    record = books.assert_released_once(200)
    assert record["completion_tokens"] == 3 and aborted == []


@pytest.mark.parametrize("leave", ["at once", "after first chunk"])
@pytest.mark.parametrize("slow", [False, True], ids=["fast socket", "slow socket"])
def test_a_client_leaving_a_stream_releases_it_at_once_and_aborts_the_engine(books, leave, slow):
    """Also when the client leaves while a chunk is being sent (a slow socket), which cancels the sending task with
    the events generator suspended at its `yield`: no wait for the garbage collector to close the generator (it is
    switched off here to show it)."""
    aborted: list[str] = []

    async def main() -> None:
        response = event_stream(books, Generation(hang=True), aborted)
        client = Client(leave=leave, slow=slow)
        await response(http_scope(), client.receive, client.send)
        books.assert_released_once(499)
        # The abort runs in a background task: wait for it (a deadline, not one turn of the loop assumed enough).
        async with asyncio.timeout(10):
            while not aborted:
                await asyncio.sleep(0.001)
        assert aborted == ["cmpl-1"]

    gc.disable()
    try:
        asyncio.run(main())
    finally:
        gc.enable()


def test_a_client_gone_on_asgi_2_4_releases_the_stream(books):
    """ASGI 2.4 servers report a gone client as an OSError from `send` instead of a disconnect message."""
    aborted: list[str] = []

    async def main() -> None:
        response = event_stream(books, Generation(hang=True), aborted)

        async def send(message: dict) -> None:
            if message["type"] == "http.response.body":
                raise OSError("connection reset")

        with pytest.raises(ClientDisconnect):
            await response(http_scope(spec_version="2.4"), Client().receive, send)
        books.assert_released_once(499)

    asyncio.run(main())


def test_an_engine_dying_mid_stream_is_an_error_event_recorded_as_503(books):
    aborted: list[str] = []

    async def main() -> Client:
        response = event_stream(books, Generation(2, error=ModelUnavailableError("vLLM engine died")), aborted)
        client = Client()
        await response(http_scope(), client.receive, client.send)
        return client

    client = asyncio.run(main())
    assert json.loads(client.events[-2])["error"]["code"] == "engine_unavailable" and client.events[-1] == "[DONE]"
    record = books.assert_released_once(503)
    assert record["completion_tokens"] == 2 and aborted == []


def test_a_stream_cancelled_by_the_server_is_released(books):
    aborted: list[str] = []

    async def main() -> None:
        response = event_stream(books, Generation(hang=True), aborted)
        client = Client()
        task = asyncio.create_task(response(http_scope(), client.receive, client.send))
        while not client.messages:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        books.assert_released_once(499)

    asyncio.run(main())


# -- the whole app on a scripted engine ----------------------------------------------------------------------------


class ScriptedModel(ServedModel):
    """Generates `generation` for every request; is ready unless `dead`."""

    def __init__(self, generation: Generation):
        self.info = MODEL
        self.generation = generation
        self.aborted: list[str] = []
        self.dead = False

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        async for output in self.generation.stream(request.request_id):
            yield output

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def is_ready(self) -> bool:
        return not self.dead

    @property
    def dead_reason(self) -> str | None:
        return "engine died" if self.dead else None

    def encode_prompt(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return [ord(c) % MODEL.vocab_size for c in text]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(t) for t in token_ids)

    def render_chat(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        return "\n".join(m["content"] for m in messages)

    async def shutdown(self) -> None:
        pass


def call_app(books: Bookkeeping, engine: ScriptedModel, body: dict, client_leaves: str = "never",
             cancel_when_hanging: bool = False, tokens_in_flight: int = 0) -> Client:
    """One POST /v1/completions through the app. `cancel_when_hanging`: the server cancels the request's task once
    the engine's stream waits forever (a point the request reaches whatever the machine's speed, unlike a delay);
    `tokens_in_flight`: another request holds that many tokens meanwhile (released afterwards)."""
    app = create_app(engine, config=APIConfig(max_inflight_tokens=100))
    books.admission = admission = app.state.server.admission  # the app's own counters
    if tokens_in_flight:
        admission.admit(tokens_in_flight)
    raw = json.dumps({"model": MODEL.name, "prompt": "hello", **body}).encode()
    client = Client(raw, leave=client_leaves)

    async def main() -> None:
        task = asyncio.create_task(app(http_scope(body=raw), client.receive, client.send))
        if cancel_when_hanging:
            hanging = asyncio.create_task(engine.generation.hanging.wait())
            await asyncio.wait({task, hanging}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
            hanging.cancel()
            task.cancel()
        await asyncio.wait_for(task, timeout=30)  # a request that never ends fails instead of hanging the suite

    try:
        asyncio.run(main())
    finally:
        if tokens_in_flight:
            assert (admission.requests, admission.tokens) == (1, tokens_in_flight)  # the other request's, untouched
            admission.release(tokens_in_flight)
    return client


@pytest.mark.parametrize("stream", [False, True])
def test_app_an_answered_request_is_released_once(books, stream):
    client = call_app(books, ScriptedModel(Generation(3)), {"max_tokens": 3, "stream": stream})
    assert client.status == 200
    books.assert_released_once(200)


def test_app_a_refused_request_is_released_once(books):
    client = call_app(books, ScriptedModel(Generation(3)), {"max_tokens": 70})
    assert client.status == 400  # more than the context window
    books.assert_released_once(400)


def test_app_a_busy_server_answers_429_with_retry_after(books):
    client = call_app(books, ScriptedModel(Generation(3)), {"max_tokens": 10}, tokens_in_flight=90)
    assert client.status == 429
    assert [v for k, v in client.messages[0]["headers"] if k == b"retry-after"] == [b"1"]
    books.assert_released_once(429)


def test_app_an_engine_dying_before_the_first_token_is_a_503(books):
    engine = ScriptedModel(Generation(0, error=ModelUnavailableError("vLLM engine died")))
    client = call_app(books, engine, {"max_tokens": 3, "stream": True})
    assert client.status == 503  # before any 200: the first output is awaited before the stream starts
    record = books.assert_released_once(503)
    assert engine.aborted == [record["request_id"]]


@pytest.mark.parametrize("tokens", [0, 3], ids=["before the first token", "after tokens"])
def test_app_a_client_leaving_a_non_streaming_request_gets_it_aborted(books, tokens):
    engine = ScriptedModel(Generation(tokens, hang=True))
    client = call_app(books, engine, {"max_tokens": 30}, client_leaves="at once")
    assert client.status == 499
    record = books.assert_released_once(499)
    assert engine.aborted == [record["request_id"]]


def test_app_a_client_leaving_while_sending_its_body_is_a_499_not_an_error(books, caplog):
    engine = ScriptedModel(Generation(3))
    client = call_app(books, engine, {"max_tokens": 3}, client_leaves="while sending the body")
    assert client.status == 499
    books.assert_released_once(499)
    assert not [r for r in caplog.records if r.exc_info], "a client that left is not the server's error"


@pytest.mark.parametrize("stream", [False, True])
def test_app_a_request_cancelled_by_the_server_is_released(books, stream):
    with pytest.raises(asyncio.CancelledError):
        call_app(books, ScriptedModel(Generation(hang=True)), {"max_tokens": 30, "stream": stream},
                 cancel_when_hanging=True)
    books.assert_released_once(499)


def test_app_readiness_turns_false_and_requests_are_refused_once_the_engine_died():
    """What test_engine_faults' kill can only sample (the server exits moments after the engine died, so a probe may
    never land in between): from the moment the engine reports its death, /health/ready answers 503 with the reason,
    and a request is refused with 503 `not_ready` instead of reaching the dead engine."""
    import httpx

    engine = ScriptedModel(Generation(3))
    app = create_app(engine, config=APIConfig(max_inflight_tokens=100))

    async def main() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://server") as client:
            before = await client.get("/health/ready")
            engine.dead = True
            after = await client.get("/health/ready")
            refused = await client.post("/v1/completions", json={"model": MODEL.name, "prompt": "hi",
                                                                 "max_tokens": 2})
        return before, after, refused

    before, after, refused = asyncio.run(main())
    assert before.status_code == 200
    assert (after.status_code, after.json()) == (503, {"status": "not ready", "reason": "engine died"})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "not_ready"
    assert engine.aborted == []  # nothing reached the engine
