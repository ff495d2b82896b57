"""The result cache's key, record and reader (llm_serving/batch_cache.py), on a directory store and on moto's S3."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import boto3
import pytest
from moto.server import ThreadedMotoServer

from llm_serving.batch_cache import (
    ANSWER_NEUTRAL_FIELDS,
    METADATA_FIELDS,
    CacheError,
    ResultCache,
    cache_key,
    is_deterministic,
    request_sha256,
)
from llm_serving.object_store import DirectoryStore, ObjectStoreError, open_object_store

CHAT = "/v1/chat/completions"
GREEDY = {"model": "demo-tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 4}
ANSWER = {"id": "chatcmpl-1", "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}}]}


def test_metadata_fields_are_the_field_tables_metadata():
    from serving_image.openai_api.fields import TABLES
    from serving_image.openai_api.request_scope import METADATA_FIELDS as LOGGED

    table = {name for t in TABLES.values() for name, f in t.items() if f.kind == "metadata"}
    assert set(METADATA_FIELDS) == table == set(LOGGED)


def test_key_ignores_answer_neutral_fields_and_spelling():
    same = {**GREEDY, "temperature": 0.0, "user": "u1", "metadata": {"team": "a"}, "stream": False,
            "top_p": None, "model": "other-name"}
    reordered = dict(reversed(list(GREEDY.items())))
    assert request_sha256(CHAT, same) == request_sha256(CHAT, GREEDY) == request_sha256(CHAT, reordered)
    assert set(ANSWER_NEUTRAL_FIELDS) >= {"user", "metadata", "stream", "model"}


@pytest.mark.parametrize("change", [{"max_tokens": 5}, {"temperature": 0.5, "seed": 1}, {"stop": ["x"]},
                                    {"messages": [{"role": "user", "content": "ho"}]}, {"logprobs": True}])
def test_key_changes_with_every_answer_changing_field(change):
    assert request_sha256(CHAT, {**GREEDY, **change}) != request_sha256(CHAT, GREEDY)


def test_key_separates_endpoints_models_and_versions():
    body = {"model": "demo-tiny", "prompt": "hi", "temperature": 0}
    assert request_sha256("/v1/completions", body) != request_sha256(CHAT, body)
    keys = {cache_key("demo-tiny", "1.0.0", CHAT, GREEDY), cache_key("demo-tiny", "1.0.1", CHAT, GREEDY),
            cache_key("demo-other", "1.0.0", CHAT, GREEDY)}
    assert len(keys) == 3
    assert cache_key("demo-tiny", "1.0.0", CHAT, GREEDY).startswith("cache/demo-tiny/1.0.0/")


def test_uncacheable_endpoint_is_named():
    with pytest.raises(CacheError, match="/v1/files"):
        request_sha256("/v1/files", {})


@pytest.mark.parametrize(("endpoint", "body", "expected"), [
    (CHAT, GREEDY, True),
    (CHAT, {**GREEDY, "temperature": 0.7, "seed": 3}, True),
    (CHAT, {**GREEDY, "temperature": 0.7}, False),
    (CHAT, {k: v for k, v in GREEDY.items() if k != "temperature"}, False),  # default temperature 1 samples
    ("/v1/embeddings", {"model": "m", "input": "x"}, True),
    ("/v1/score", {"model": "m", "prompt": "x", "candidates": ["a"]}, True),
])
def test_only_deterministic_requests_are_cached(tmp_path, endpoint, body, expected):
    assert is_deterministic(endpoint, body) is expected
    cache = ResultCache(DirectoryStore(tmp_path))
    key = cache.put("demo-tiny", "1.0.0", endpoint, body, ANSWER)
    assert (key is not None) is expected
    lookup = cache.get("demo-tiny", "1.0.0", endpoint, body)
    assert lookup.hit is expected
    if not expected:
        assert lookup.why_miss.startswith("not deterministic")


def test_hit_miss_and_versions(tmp_path):
    cache = ResultCache(DirectoryStore(tmp_path))
    assert cache.get("demo-tiny", "1.0.0", CHAT, GREEDY).why_miss == "absent"
    cache.put("demo-tiny", "1.0.0", CHAT, GREEDY, ANSWER)
    hit = cache.get("demo-tiny", "1.0.0", CHAT, {**GREEDY, "user": "someone else"})
    assert hit.hit and hit.response == ANSWER and hit.record.version == "1.0.0"
    other = cache.get("demo-tiny", "1.0.1", CHAT, GREEDY)  # a version's cache never answers for another
    assert not other.hit and other.why_miss == "absent"
    assert cache.delete_version("demo-tiny", "1.0.0") == 1
    assert not cache.get("demo-tiny", "1.0.0", CHAT, GREEDY).hit


def test_a_record_for_another_request_is_a_miss(tmp_path):
    store = DirectoryStore(tmp_path)
    cache = ResultCache(store)
    key = cache.put("demo-tiny", "1.0.0", CHAT, GREEDY, ANSWER)
    other_key = cache_key("demo-tiny", "1.0.0", CHAT, {**GREEDY, "max_tokens": 9})
    store.put(other_key, store.get(key))  # as a collision or a misplaced copy would
    lookup = cache.get("demo-tiny", "1.0.0", CHAT, {**GREEDY, "max_tokens": 9})
    assert not lookup.hit and lookup.why_miss.startswith("mismatch")
    store.put(key, b"{not json")
    assert cache.get("demo-tiny", "1.0.0", CHAT, GREEDY).why_miss.startswith("mismatch: unreadable")


def test_retention(tmp_path):
    cache = ResultCache(DirectoryStore(tmp_path), retention=timedelta(days=1))
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    cache.put("demo-tiny", "1.0.0", CHAT, GREEDY, ANSWER, now=t0)
    assert cache.get("demo-tiny", "1.0.0", CHAT, GREEDY, now=t0 + timedelta(hours=23)).hit
    assert cache.get("demo-tiny", "1.0.0", CHAT, GREEDY, now=t0 + timedelta(days=2)).why_miss == "expired"
    assert cache.purge_expired(now=t0 + timedelta(hours=1)) == 0
    assert cache.purge_expired(now=t0 + timedelta(days=2)) == 1


@pytest.fixture(scope="module")
def s3():
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    client = boto3.client("s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1",
                          aws_access_key_id="test", aws_secret_access_key="test")
    client.create_bucket(Bucket="batch-us-east-1")
    try:
        yield client
    finally:
        server.stop()


def test_cache_on_s3_is_encrypted(s3):
    store = open_object_store("s3://batch-us-east-1/batch", client=s3)
    cache = ResultCache(store)
    key = cache.put("demo-tiny", "1.0.0", CHAT, GREEDY, ANSWER)
    assert cache.get("demo-tiny", "1.0.0", CHAT, GREEDY).hit
    head = s3.head_object(Bucket="batch-us-east-1", Key=f"batch/{key}")
    assert head["ServerSideEncryption"] == "AES256"
    assert store.list("cache/") == [key]


@pytest.mark.parametrize("uri", ["s3://models-us-east-1/model-cache/x", "s3://models-us-east-1/packages"])
def test_store_refuses_the_model_stores_prefixes(uri):
    with pytest.raises(ObjectStoreError, match="must not lie under"):
        open_object_store(uri, client=object())


def test_store_refuses_bad_keys(tmp_path):
    with pytest.raises(ObjectStoreError, match="not a valid object key"):
        DirectoryStore(tmp_path).put("../escape", b"x")
