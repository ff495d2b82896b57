"""The Batch API end to end: the official `openai` client's files and batches calls on the shared
`openai`-mode server, the batch worker (a process of its own, `python -m serving_image.batch.worker`, as its
Deployment runs it) driving that server's real-time endpoint, and the result cache read back through llm_serving's
reader.

The worker is killed mid-batch by its own test hook (ENV_KILL_AFTER: SIGKILL right after its Nth stored result), so
the point of the kill is exact, not a race; the next worker resumes. The server's Batch API keeps its data in a
directory store (`openai_server.batch_store`); the S3 store is tested in test_batch_cache.py against moto.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import openai
import pytest

from llm_serving.batch_cache import ResultCache
from llm_serving.object_store import DirectoryStore
from llm_serving.pod_contract import ENV_BATCH_WORKER_API_KEY
from serving_image.batch.storage import BatchStorage
from serving_image.batch.worker import ENV_KILL_AFTER
from tests.serving.conftest import OPENAI_KEY, OPENAI_KEYS

pytestmark = pytest.mark.slow

MODEL = "demo-tiny"
CHAT = "/v1/chat/completions"


def _chat_line(custom_id: str, content: str, **extra) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 6,
            **extra}
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}


GOOD = [_chat_line(f"ok-{i}", f"summary of title {i}") for i in range(10)]
BAD = [
    _chat_line("bad-tools", "x", tools=[{"type": "function", "function": {"name": "f"}}]),  # refused field
    _chat_line("bad-temperature", "x", temperature=5),  # out of range
    {**_chat_line("bad-url", "x"), "url": "/v1/embeddings"},
    _chat_line("bad-stream", "x", stream=True),
]
LINES = GOOD[:5] + BAD[:2] + GOOD[5:] + BAD[2:]


def _jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def _run_worker(server, *, kill_after: int | None = None) -> int:
    # The pod's metrics directory: the proxy merges the worker's counters into the server's /metrics.
    env = dict(os.environ, **{ENV_BATCH_WORKER_API_KEY: OPENAI_KEY,
                              "PROMETHEUS_MULTIPROC_DIR": str(server.multiproc_dir)})
    env.pop(ENV_KILL_AFTER, None)
    if kill_after is not None:
        env[ENV_KILL_AFTER] = str(kill_after)
    proc = subprocess.run([sys.executable, "-m", "serving_image.batch.worker", "--store", str(server.batch_store),
                           "--endpoint", server.url, "--concurrency", "3", "--exit-when-idle", "--poll-s", "0.1"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, -signal.SIGKILL), proc.stderr[-3000:]
    return proc.returncode


def _submit(client: openai.OpenAI, lines: list[dict], **kwargs):
    uploaded = client.files.create(file=("batch.jsonl", _jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h", **kwargs)


def _file_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_a_batch_killed_mid_run_resumes_and_answers_every_line_once(openai_server, openai_client):
    batch = _submit(openai_client, LINES, metadata={"team": "catalog"})
    assert batch.status == "validating" and batch.request_counts.total == len(LINES)

    assert _run_worker(openai_server, kill_after=5) == -signal.SIGKILL  # killed right after its 5th result
    midway = openai_client.batches.retrieve(batch.id)
    assert midway.status == "in_progress"
    stored = BatchStorage(DirectoryStore(openai_server.batch_store)).done_indexes(batch.id)
    assert len(stored) == 5

    assert _run_worker(openai_server) == 0  # a new worker resumes: only the other lines are sent
    done = openai_client.batches.retrieve(batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == \
        (len(LINES), len(GOOD), len(BAD))
    assert done.metadata == {"team": "catalog"} and done.completed_at >= done.in_progress_at

    outputs = _file_lines(openai_client, done.output_file_id)
    errors = _file_lines(openai_client, done.error_file_id)
    ids = [line["custom_id"] for line in outputs + errors]
    assert sorted(ids) == sorted(line["custom_id"] for line in LINES)  # every custom_id, each exactly once

    # Greedy outputs equal the real-time answers to the same requests.
    by_id = {line["custom_id"]: line for line in outputs}
    for line in GOOD:
        answer = by_id[line["custom_id"]]["response"]
        assert answer["status_code"] == 200
        realtime = openai_client.chat.completions.create(**line["body"])
        assert answer["body"]["choices"][0]["message"]["content"] == realtime.choices[0].message.content

    # Bad lines: error lines naming the field, as the real-time endpoint names it.
    errors_by_id = {line["custom_id"]: line for line in errors}
    tools = errors_by_id["bad-tools"]["response"]
    assert tools["status_code"] == 400 and tools["body"]["error"]["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as realtime_refusal:
        openai_client.chat.completions.create(**BAD[0]["body"])
    assert realtime_refusal.value.body["message"] == tools["body"]["error"]["message"]
    assert errors_by_id["bad-temperature"]["response"]["body"]["error"]["param"] == "temperature"
    assert errors_by_id["bad-url"]["error"]["param"] == "url" and errors_by_id["bad-url"]["response"] is None
    assert errors_by_id["bad-stream"]["error"]["param"] == "body.stream"

    # Every greedy answer is in the cache under this version, flagged as a hit; another version has none.
    cache = ResultCache(DirectoryStore(openai_server.batch_store))
    version = httpx.get(f"{openai_server.url}/health/ready", timeout=30).json()["version"]
    lookup = cache.get(MODEL, version, CHAT, {**GOOD[0]["body"], "user": "another caller"})
    assert lookup.hit and lookup.response == by_id["ok-0"]["response"]["body"]
    assert lookup.record.source.batch_id == batch.id
    assert not cache.get(MODEL, version + "-next", CHAT, GOOD[0]["body"]).hit

    # The batch shows on the server's merged /metrics, the killed worker's lines included.
    exposition = httpx.get(openai_server.metrics_url, timeout=30).text
    assert _sample(exposition, 'llm_serving_batch_batches_total{endpoint="/v1/chat/completions",status="completed"}') \
        >= 1
    assert _sample(exposition, 'llm_serving_batch_lines_total{endpoint="/v1/chat/completions",kind="output"}') \
        >= len(GOOD)


def _sample(exposition: str, series: str) -> float:
    for line in exposition.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{series} is not on /metrics")


def test_another_key_sees_nothing_of_a_batch(openai_server, openai_client):
    batch = _submit(openai_client, GOOD[:2])
    other = openai.OpenAI(base_url=f"{openai_server.url}/v1", api_key=OPENAI_KEYS[0], max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(batch.input_file_id)
    assert batch.id not in {b.id for b in other.batches.list()}
    assert batch.id in {b.id for b in openai_client.batches.list()}
    assert batch.input_file_id in {f.id for f in openai_client.files.list()}
    assert _run_worker(openai_server) == 0
    assert openai_client.batches.retrieve(batch.id).status == "completed"


def test_a_batch_cancelled_before_it_runs_ends_cancelled(openai_server, openai_client):
    batch = _submit(openai_client, GOOD[:3])
    cancelling = openai_client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
    assert _run_worker(openai_server) == 0
    cancelled = openai_client.batches.retrieve(batch.id)
    assert cancelled.status == "cancelled" and cancelled.output_file_id is None
    with pytest.raises(openai.ConflictError, match="cancelled"):
        openai_client.batches.cancel(batch.id)


def test_duplicate_custom_ids_fail_the_batch_naming_the_line(openai_server, openai_client):
    batch = _submit(openai_client, [GOOD[0], GOOD[1], GOOD[0]])
    assert _run_worker(openai_server) == 0
    failed = openai_client.batches.retrieve(batch.id)
    assert failed.status == "failed"
    assert failed.errors.data[0].code == "duplicate_custom_id" and failed.errors.data[0].line == 3


def test_bad_uploads_and_batch_bodies_are_refused_naming_the_field(openai_client):
    with pytest.raises(openai.BadRequestError, match="purpose"):
        openai_client.files.create(file=("x.jsonl", _jsonl(GOOD[:1])), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError, match="no request line"):
        openai_client.files.create(file=("x.jsonl", b"\n\n"), purpose="batch")
    uploaded = openai_client.files.create(file=("x.jsonl", _jsonl(GOOD[:1])), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        openai_client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="1h")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        openai_client.batches.create(input_file_id=uploaded.id, endpoint="/v1/responses", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="output_expires_after"):
        openai_client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h",
                                     output_expires_after={"anchor": "created_at", "seconds": 3600})
    with pytest.raises(openai.NotFoundError):
        openai_client.batches.create(input_file_id="file-nope", endpoint=CHAT, completion_window="24h")
    deleted = openai_client.files.delete(uploaded.id)
    assert deleted.deleted
    with pytest.raises(openai.NotFoundError):
        openai_client.files.retrieve(uploaded.id)


def test_the_cli_submits_reports_and_downloads(openai_server, openai_client, tmp_path):
    source = tmp_path / "titles.jsonl"
    lines = [{"custom_id": f"cli-{i}", "body": {"messages": [{"role": "user", "content": f"title {i}"}],
                                               "temperature": 0, "max_tokens": 4}} for i in range(3)]
    source.write_bytes(_jsonl(lines))
    env = dict(os.environ, LLM_SERVING_API_KEY=OPENAI_KEY)
    cli = [sys.executable, "-m", "llm_serving_cli", "batch", "--url", openai_server.url]
    submitted = subprocess.run([*cli, "submit", str(source), "--model", MODEL], env=env, capture_output=True,
                               text=True, timeout=120)
    assert submitted.returncode == 0, submitted.stderr
    batch_id = submitted.stdout.strip()
    assert openai_client.batches.retrieve(batch_id).request_counts.total == 3
    assert _run_worker(openai_server) == 0
    status = subprocess.run([*cli, "status", batch_id, "--wait"], env=env, capture_output=True, text=True,
                            timeout=120)
    assert status.returncode == 0 and "completed: 3 completed, 0 failed of 3" in status.stdout, status.stderr
    results = subprocess.run([*cli, "results", batch_id, "--out", str(tmp_path)], env=env, capture_output=True,
                             text=True, timeout=120)
    assert results.returncode == 0, results.stderr
    output = [json.loads(line) for line in (tmp_path / f"{batch_id}_output.jsonl").read_text().splitlines()]
    assert sorted(line["custom_id"] for line in output) == ["cli-0", "cli-1", "cli-2"]
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_bytes(_jsonl([{**lines[0], "body": {**lines[0]["body"], "model": "another-model"}}]))
    wrong = subprocess.run([*cli, "submit", str(mixed), "--model", MODEL], env=env, capture_output=True, text=True,
                           timeout=120)
    assert wrong.returncode == 2 and "line 1: body.model is 'another-model'" in wrong.stderr
