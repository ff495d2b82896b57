"""The Batch API's limits and access on the real app (create_app with the Batch API on a directory store), through
the official `openai` client over an in-process ASGI transport, with the scripted engine of
test_openai_request_scope.py in place of vLLM (fast: no engine starts). Limits that the shared server cannot take
(they are the server's settings: a tiny line limit, two files a key, an admin key) are tested here; the whole path
on the real engine is test_batch_api.py.

The worker runs here too, in this process, against the same app: the state machine end to end in milliseconds.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from serving_image.batch.api import mounted
from serving_image.batch.config import BatchConfig
from serving_image.batch.endpoint import Answer
from serving_image.batch.storage import BatchStorage
from serving_image.batch.worker import BatchWorker, WorkerConfig
from serving_image.openai_api.admission import PRIORITY_HEADER, APIConfig
from serving_image.openai_api.app import create_app
from tests.serving.test_openai_request_scope import MODEL, Generation, ScriptedModel

KEYS = ("key-a", "key-b")
ADMIN = "admin-key"


@pytest.fixture
def app(tmp_path):
    batch = BatchConfig(store_uri=str(tmp_path / "store"), admin_keys=(ADMIN,), max_lines=3, max_file_bytes=4000,
                        max_files_per_key=3, max_active_batches_per_key=1)
    return create_app(ScriptedModel(Generation(3)), config=APIConfig(api_keys=KEYS), extensions=(mounted(batch),))



class AsgiEndpoint:
    """The worker's Endpoint (serving_image/batch/endpoint.py) over the app in this process (httpx's ASGI transport):
    the production endpoint speaks HTTP to a server; here the same requests reach the same app without a socket."""

    def __init__(self, app, headers: dict[str, str]):
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", headers=headers)

    async def post(self, path: str, body: dict) -> Answer:
        response = await self.http.post(path, json=body)
        return Answer(response.status_code, response.content, response.headers.get("retry-after"))

    async def get(self, path: str) -> Answer:
        response = await self.http.get(path)
        return Answer(response.status_code, response.content, response.headers.get("retry-after"))

    async def aclose(self) -> None:
        await self.http.aclose()


def _client(app, key: str) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key=key, http_client=http, max_retries=0)


def _lines(n: int, **body) -> bytes:
    return "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                               "body": {"model": MODEL.name, "prompt": f"p{i}", "max_tokens": 3, "temperature": 0,
                                        **body}}) + "\n" for i in range(n)).encode()


async def test_upload_limits_are_named(app):
    client = _client(app, KEYS[0])
    with pytest.raises(openai.BadRequestError, match="4 lines; the limit is 3") as lines:
        await client.files.create(file=("f.jsonl", _lines(4)), purpose="batch")
    assert lines.value.body["param"] == "file" and lines.value.body["code"] == "too_many_lines"
    with pytest.raises(openai.APIStatusError, match="exceeds 4000 bytes") as size:
        await client.files.create(file=("f.jsonl", b'{"x": "' + b"y" * 5000 + b'"}\n'), purpose="batch")
    assert size.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match="expires_after"):
        await client.files.create(file=("f.jsonl", _lines(1)), purpose="batch",
                                  expires_after={"anchor": "created_at", "seconds": 3600})
    with pytest.raises(openai.AuthenticationError):
        await _client(app, "wrong-key").files.list()


async def test_per_key_limits_on_files_and_batches_in_flight(app):
    client = _client(app, KEYS[0])
    files = [await client.files.create(file=("f.jsonl", _lines(1)), purpose="batch") for _ in range(3)]
    with pytest.raises(openai.RateLimitError, match="holds 3 files") as files_full:
        await client.files.create(file=("f.jsonl", _lines(1)), purpose="batch")
    assert files_full.value.body["code"] == "file_limit_reached"
    await _client(app, KEYS[1]).files.create(file=("f.jsonl", _lines(1)), purpose="batch")  # another key's own
    await client.batches.create(input_file_id=files[0].id, endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.RateLimitError, match="1 batches in flight") as batches_full:
        await client.batches.create(input_file_id=files[1].id, endpoint="/v1/completions", completion_window="24h")
    assert batches_full.value.body["code"] == "batch_limit_reached"


async def test_only_the_creating_key_and_an_admin_see_a_batch(app):
    owner, other, admin = _client(app, KEYS[0]), _client(app, KEYS[1]), _client(app, ADMIN)
    uploaded = await owner.files.create(file=("f.jsonl", _lines(2)), purpose="batch")
    batch = await owner.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        await other.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):  # nor may another key run a batch on someone else's file
        await other.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    assert (await admin.batches.retrieve(batch.id)).id == batch.id
    assert batch.id in [b.id async for b in admin.batches.list()]
    assert [f.id async for f in other.files.list()] == []
    assert [f.id async for f in admin.files.list()] == [uploaded.id]


async def test_the_worker_runs_a_batch_through_the_apps_own_endpoint(app, tmp_path):
    client = _client(app, KEYS[0])
    uploaded = await client.files.create(file=("f.jsonl", _lines(2) + b'{"custom_id": "bad", "method": "POST", '
                                                                      b'"url": "/v1/completions", "body": '
                                                                      b'{"model": "fake", "prompt": "x", '
                                                                      b'"best_of": 2}}\n'), purpose="batch")
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    http = AsgiEndpoint(app, {"Authorization": f"Bearer {KEYS[0]}", PRIORITY_HEADER: "batch"})
    storage = BatchStorage(app.state.batch.storage.store)
    await BatchWorker(storage, WorkerConfig(endpoint_url="http://test", concurrency=2, progress_every_s=0.01),
                      http=http).run_forever(exit_when_idle=True)
    done = await client.batches.retrieve(batch.id)
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 1)
    output = [json.loads(x) for x in (await client.files.content(done.output_file_id)).text.splitlines()]
    assert sorted(x["custom_id"] for x in output) == ["c0", "c1"]
    assert output[0]["response"]["body"]["choices"][0]["text"] == "t0 t1 t2 "
    (error,) = [json.loads(x) for x in (await client.files.content(done.error_file_id)).text.splitlines()]
    assert error["custom_id"] == "bad" and error["response"]["body"]["error"]["param"] == "best_of"
    # The admission counters are back to nothing: the batch share was taken and given back.
    admission = app.state.server.admission
    assert (admission.requests, admission.batch_requests, admission.tokens) == (0, 0, 0)
    # Results are in the output files' owner's listing, as OpenAI's batch_output files.
    assert done.output_file_id in [f.id async for f in client.files.list(purpose="batch_output")]


async def test_an_expired_batch_keeps_what_it_answered_and_errors_the_rest(app):
    client = _client(app, KEYS[0])
    uploaded = await client.files.create(file=("f.jsonl", _lines(3)), purpose="batch")
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    storage = BatchStorage(app.state.batch.storage.store)
    http = AsgiEndpoint(app, {"Authorization": f"Bearer {KEYS[0]}"})

    class OneLineThenExpire(BatchWorker):
        """Answers one line, then the window ends (the record's expires_at moves into the past)."""

        async def _run_line(self, run, parsed):
            answered = await super()._run_line(run, parsed)
            run.record.batch.expires_at = 0
            return answered

    worker = OneLineThenExpire(storage, WorkerConfig(endpoint_url="http://test", concurrency=1,
                                                     progress_every_s=0.01), http=http)
    await worker.run_forever(exit_when_idle=True)
    done = await client.batches.retrieve(batch.id)
    assert done.status == "expired" and done.expired_at is not None
    output = [json.loads(x) for x in (await client.files.content(done.output_file_id)).text.splitlines()]
    errors = [json.loads(x) for x in (await client.files.content(done.error_file_id)).text.splitlines()]
    assert [x["custom_id"] for x in output] == ["c0"]
    assert sorted(x["custom_id"] for x in errors) == ["c1", "c2"]
    assert {x["error"]["code"] for x in errors} == {"batch_expired"}


class FirstBatchAttemptHangs(ScriptedModel):
    """Batch lines' prompts start with 'B': the first of them to reach the engine stays there (a long generation)
    until something stops it; every other request is answered at once."""

    def __init__(self):
        super().__init__(Generation(3))
        self.batch_attempts = 0
        self.batch_running = asyncio.Event()  # set while the first attempt is deep in the engine

    async def generate(self, request):
        if request.prompt[0] == self.encode_prompt("B", add_special_tokens=False)[0]:
            self.batch_attempts += 1
            if self.batch_attempts == 1:
                self.batch_running.set()
                await asyncio.Event().wait()
        async for output in super().generate(request):
            yield output


async def test_a_real_time_request_preempts_batch_work_which_is_sent_again_and_answered_once(tmp_path):
    engine = FirstBatchAttemptHangs()
    app = create_app(engine, config=APIConfig(api_keys=KEYS),
                     extensions=(mounted(BatchConfig(store_uri=str(tmp_path / "store"), admin_keys=(ADMIN,))),))
    client = _client(app, KEYS[0])
    line = {"custom_id": "only", "method": "POST", "url": "/v1/completions",
            "body": {"model": MODEL.name, "prompt": "Bline", "max_tokens": 3, "temperature": 0}}
    uploaded = await client.files.create(file=("f.jsonl", (json.dumps(line) + "\n").encode()), purpose="batch")
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    http = AsgiEndpoint(app, {"Authorization": f"Bearer {KEYS[0]}", PRIORITY_HEADER: "batch"})
    worker = asyncio.create_task(BatchWorker(BatchStorage(app.state.batch.storage.store),
                                             WorkerConfig(endpoint_url="http://test", concurrency=1,
                                                          progress_every_s=0.01),
                                             http=http).run_forever(exit_when_idle=True))
    await engine.batch_running.wait()  # the batch line holds the engine
    admission = app.state.server.admission
    assert (admission.batch_requests, admission.preempted) == (1, 0)
    realtime = await client.completions.create(model=MODEL.name, prompt="rt", max_tokens=3, temperature=0)
    assert realtime.choices[0].text == "t0 t1 t2 "
    await worker
    # The batch attempt was stopped in the engine (aborted), answered 503, and the worker sent the line again.
    assert admission.preempted == 1 and engine.batch_attempts == 2
    assert len(engine.aborted) == 1 and engine.aborted[0].startswith("cmpl-")
    done = await client.batches.retrieve(batch.id)
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (1, 0)
    output = [json.loads(x) for x in (await client.files.content(done.output_file_id)).text.splitlines()]
    assert [x["custom_id"] for x in output] == ["only"]
    assert output[0]["response"]["body"]["choices"][0]["text"] == "t0 t1 t2 "
    assert (admission.requests, admission.batch_requests, admission.tokens) == (0, 0, 0)


async def test_batch_work_is_not_preempted_when_the_server_says_so(tmp_path):
    engine = FirstBatchAttemptHangs()
    app = create_app(engine, config=APIConfig(batch_preempted_by_realtime=False))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    body = {"model": MODEL.name, "prompt": "Bline", "max_tokens": 3}
    batch = asyncio.create_task(http.post("/v1/completions", json=body, headers={PRIORITY_HEADER: "batch"}))
    await engine.batch_running.wait()
    realtime = await http.post("/v1/completions", json={**body, "prompt": "rt"})
    assert realtime.status_code == 200 and not batch.done()
    assert app.state.server.admission.preempted == 0 and engine.aborted == []
    batch.cancel()
