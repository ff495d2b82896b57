"""The batch path's parts without a server (fast): the admission share, the limits and settings, the line envelope,
and the store's records. The whole path, on the shared server, is test_batch_api.py."""

from __future__ import annotations

import json

import pytest

from llm_serving.object_store import DirectoryStore
from serving_image.batch.api import count_lines
from serving_image.batch.config import BatchConfig
from serving_image.batch.lines import BadLine, RequestLine, parse_line
from serving_image.batch.records import (
    BatchObject,
    LineResult,
    StoredBatch,
    output_file_id,
    owner_of,
)
from serving_image.batch.storage import BatchStorage
from serving_image.openai_api.admission import Admission, APIConfig
from serving_image.openai_api.errors import APIError

CHAT = "/v1/chat/completions"


def test_batch_work_waits_while_real_time_requests_are_in_flight():
    admission = Admission(APIConfig(max_concurrent_requests=8, max_inflight_tokens=1000))
    admission.admit(10, batch=True)
    admission.admit(10)  # real time is admitted beside batch work already in flight
    with pytest.raises(APIError, match="1 real-time requests in flight") as waits:
        admission.admit(10, batch=True)
    assert waits.value.status == 429
    admission.release(10)
    admission.admit(10, batch=True)  # idle again: batch work goes on
    assert APIConfig.from_env({"LLM_SERVING_BATCH_YIELDS_TO_REALTIME": "0"}).batch_yields_to_realtime is False
    with pytest.raises(ValueError, match="LLM_SERVING_BATCH_YIELDS_TO_REALTIME"):
        APIConfig.from_env({"LLM_SERVING_BATCH_YIELDS_TO_REALTIME": "yes"})


def test_a_real_time_admission_stops_each_watched_batch_request_once():
    admission = Admission(APIConfig(max_concurrent_requests=20, max_inflight_tokens=1000))
    stopped: list[str] = []
    for name in ("b1", "b2", "b3"):
        admission.admit(10, batch=True)
        admission.watch_preemption(name, lambda name=name: stopped.append(name))
    admission.unwatch_preemption("b3")  # ended before real time came: nothing to stop
    admission.admit(10, batch=True)  # batch work neither stops batch work ...
    assert stopped == []
    admission.admit(10)  # ... nor is it stopped by anything but a real-time admission
    assert stopped == ["b1", "b2"] and admission.preempted == 2
    admission.admit(10)  # each is told once
    assert stopped == ["b1", "b2"] and admission.preempted == 2
    error = admission.preempted_error()
    assert (error.status, error.code, error.headers["Retry-After"]) == (503, "preempted_by_realtime", "1")


def test_batch_preemption_can_be_turned_off():
    assert APIConfig.from_env({}).batch_preempted_by_realtime is True
    config = APIConfig.from_env({"LLM_SERVING_BATCH_PREEMPTED_BY_REALTIME": "0"})
    admission = Admission(config)
    stopped: list[str] = []
    admission.admit(10, batch=True)
    admission.watch_preemption("b1", lambda: stopped.append("b1"))
    admission.admit(10)
    assert stopped == [] and admission.preempted == 0
    with pytest.raises(ValueError, match="LLM_SERVING_BATCH_PREEMPTED_BY_REALTIME"):
        APIConfig.from_env({"LLM_SERVING_BATCH_PREEMPTED_BY_REALTIME": "true"})


def test_batch_work_takes_only_its_share_of_admission():
    admission = Admission(APIConfig(max_concurrent_requests=8, max_inflight_tokens=1000, batch_admission_share=0.25,
                                    batch_yields_to_realtime=False))
    assert admission.batch_limits == (2, 250)
    admission.admit(10, batch=True)
    admission.admit(10, batch=True)
    with pytest.raises(APIError, match="batch requests in flight") as busy:
        admission.admit(10, batch=True)
    assert busy.value.status == 429 and busy.value.headers["Retry-After"]
    for _ in range(6):  # real-time traffic still has the rest of the budget
        admission.admit(10)
    admission.release(10, batch=True)
    assert (admission.requests, admission.batch_requests, admission.tokens) == (7, 1, 70)


def test_batch_token_share_lets_one_request_through_when_none_holds_it():
    admission = Admission(APIConfig(max_concurrent_requests=20, max_inflight_tokens=1000, batch_admission_share=0.1,
                                    batch_yields_to_realtime=False))
    admission.admit(300, batch=True)  # more than the share, but nothing else of batch's in flight: never stuck
    with pytest.raises(APIError, match="batch tokens"):
        admission.admit(10, batch=True)


@pytest.mark.parametrize("value", ["0", "1.5", "half"])
def test_a_bad_batch_share_names_the_variable(value):
    with pytest.raises(ValueError, match="LLM_SERVING_BATCH_ADMISSION_SHARE"):
        APIConfig.from_env({"LLM_SERVING_BATCH_ADMISSION_SHARE": value})


def test_batch_config_from_env():
    assert BatchConfig.from_env({}) is None  # no store, no Batch API (nowhere durable to keep client files)
    config = BatchConfig.from_env({"LLM_SERVING_BATCH_STORE": "s3://b/batch", "LLM_SERVING_BATCH_MAX_LINES": "5",
                                   "LLM_SERVING_BATCH_ADMIN_KEYS": "a, b"})
    assert (config.store_uri, config.max_lines, config.admin_keys) == ("s3://b/batch", 5, ("a", "b"))
    with pytest.raises(ValueError, match="LLM_SERVING_BATCH_MAX_FILE_BYTES"):
        BatchConfig.from_env({"LLM_SERVING_BATCH_STORE": "/x", "LLM_SERVING_BATCH_MAX_FILE_BYTES": "-1"})


def test_line_limit_and_encoding_are_named():
    limits = BatchConfig(store_uri="/x", max_lines=2)
    assert count_lines(b'{"a":1}\n\n{"b":2}\n', limits, "f.jsonl") == 2
    with pytest.raises(APIError, match="3 lines; the limit is 2") as too_many:
        count_lines(b"1\n2\n3\n", limits, "f.jsonl")
    assert too_many.value.param == "file" and too_many.value.code == "too_many_lines"
    with pytest.raises(APIError, match="not UTF-8"):
        count_lines(b"\xff\n", limits, "f.jsonl")


@pytest.mark.parametrize(("line", "param"), [
    ("not json", None),
    ('{"method": "POST", "url": "/v1/chat/completions", "body": {}}', "custom_id"),
    ('{"custom_id": "a", "method": "GET", "url": "/v1/chat/completions", "body": {}}', "method"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}', "url"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": []}', "body"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}, "x": 1}', "x"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"stream": true}}', "body.stream"),
])
def test_a_bad_envelope_names_the_field(line, param):
    parsed = parse_line(2, line, CHAT)
    assert isinstance(parsed, BadLine) and parsed.param == param and parsed.message.startswith("line 3")


def test_a_good_envelope_leaves_the_body_to_the_endpoint():
    line = {"custom_id": "a", "method": "POST", "url": CHAT, "body": {"model": "m", "anything": 1}}
    assert parse_line(0, json.dumps(line), CHAT) == RequestLine(0, "a", line["body"])


def test_cancel_is_a_marker_beside_the_workers_record(tmp_path):
    storage = BatchStorage(DirectoryStore(tmp_path))
    batch = BatchObject(id="batch_abc", endpoint=CHAT, input_file_id="file-x", completion_window="24h",
                        status="in_progress", created_at=1)
    storage.create_batch(StoredBatch(batch=batch, owner=owner_of("k")))
    assert storage.active_batch_ids() == ["batch_abc"] and storage.batch_ids(owner_of("k")) == ["batch_abc"]
    assert storage.batch_ids(owner_of("other")) == []
    storage.request_cancel("batch_abc", at=5)
    seen = storage.get_batch("batch_abc")
    assert (seen.batch.status, seen.batch.cancelling_at) == ("cancelling", 5)
    raw = json.loads((tmp_path / "batches/batch_abc/batch.json").read_text())
    assert raw["batch"]["status"] == "in_progress"  # the worker's record is untouched


def test_results_are_stored_in_chunks_and_read_once_per_line_index(tmp_path):
    storage = BatchStorage(DirectoryStore(tmp_path))

    def result(index: int, text: str) -> LineResult:
        return LineResult(index=index, custom_id=f"c{index}", kind="output", line={"text": text})

    storage.put_results("batch_abc", [result(3, "first"), result(0, "first")])
    storage.put_results("batch_abc", [result(3, "again"), result(1, "first")])  # line 3 twice: two workers on a batch
    # A result of the layout before chunks (one object per line), as a worker of the earlier image left it.
    (tmp_path / "batches/batch_abc/results/00000002.json").write_bytes(result(2, "per line").model_dump_json().encode())
    assert [(r.index, r.line["text"]) for r in storage.results("batch_abc")] == \
        [(0, "first"), (1, "first"), (2, "per line"), (3, "first")]  # each index once, the first stored wins
    assert storage.done_indexes("batch_abc") == {0, 1, 2, 3}
    assert len(list((tmp_path / "batches/batch_abc/results").iterdir())) == 3  # one object per chunk
    with pytest.raises(ValueError, match="no results"):
        storage.put_results("batch_abc", [])
    assert output_file_id("batch_abc", "error") == "file-error-abc"


def test_owner_never_holds_the_key():
    assert "secret" not in owner_of("secret") and owner_of("a") != owner_of("b") and owner_of(None) == "anonymous"
    assert storage_ids_refuse_paths()


def storage_ids_refuse_paths() -> bool:
    from serving_image.batch.storage import _safe_id

    return not _safe_id("../x") and not _safe_id("a/b") and _safe_id("batch_abc-1")


def test_the_workers_key_comes_from_its_secret_file_when_there_is_one(tmp_path, monkeypatch):
    from llm_serving.pod_contract import ENV_BATCH_WORKER_API_KEY, ENV_BATCH_WORKER_API_KEY_FILE
    from serving_image.batch.worker import _api_key

    monkeypatch.setenv(ENV_BATCH_WORKER_API_KEY, "from-env")
    monkeypatch.delenv(ENV_BATCH_WORKER_API_KEY_FILE, raising=False)
    assert _api_key() == "from-env"  # a local run
    monkeypatch.setenv(ENV_BATCH_WORKER_API_KEY_FILE, str(tmp_path / "absent"))  # its Secret missing: fails closed
    with pytest.raises(ValueError, match="cannot read the worker's key"):
        _api_key()
    (tmp_path / "api-key").write_text("\n")
    monkeypatch.setenv(ENV_BATCH_WORKER_API_KEY_FILE, str(tmp_path / "api-key"))
    with pytest.raises(ValueError, match="holds no key"):
        _api_key()
    (tmp_path / "api-key").write_text("from-file\n")
    assert _api_key() == "from-file"
