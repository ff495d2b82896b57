"""The result cache: answers computed once (by a batch, docs/batch.md) and read later by content address.

Key:

    cache/<model id>/<version>/<sha256 of the canonical request>.json

- The model id and version are path segments, so a version's cache never answers for another version: a lookup
  for 1.0.1 reads only 1.0.1's keys, and deleting a version's cache is deleting its prefix.
- The canonical request is the endpoint plus the request body without the fields that cannot change the answer
  (`ANSWER_NEUTRAL_FIELDS`: the model, which is in the key already; the metadata fields of
  serving_image/openai_api/fields.py; streaming, which changes the framing only), with explicit nulls dropped (null
  is the default of every optional field), object keys sorted and integral floats written as integers (`0` and
  `0.0` are the same temperature). A test keeps `ANSWER_NEUTRAL_FIELDS` equal to fields.py's metadata fields.
- Only deterministic requests are cached (`is_deterministic`): embeddings and scores always (no sampling),
  completions and chat completions when greedy (temperature 0) or seeded. A cached answer is what one computation
  gave; batch invariance (the same answer whatever else ran beside it) is not claimed.

A record (`CacheRecord`) holds the canonical request it answers (a reader re-checks it: a hash collision or a
corrupted object is a miss, not a wrong answer), the response body as the real-time endpoint returned it, when it
was computed, when it expires (retention, `expires_at`; None keeps it until deleted) and where it came from.

Standard library and pydantic only, plus an `ObjectStore` (llm_serving/object_store.py): the serving image writes
the cache and client code reads it.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from llm_serving.object_store import ObjectStore
from llm_serving.pod_contract import key_segment

CACHE_PREFIX = "cache"
RECORD_SCHEMA = 1

# Endpoints whose answers can be cached, and which of them sample (the others are functions of their input).
SAMPLING_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
CACHEABLE_ENDPOINTS = (*SAMPLING_ENDPOINTS, "/v1/embeddings", "/v1/score")

# Request fields that do not change the answer's content. The metadata fields must equal fields.py's "metadata"
# kind (tests/serving/test_batch_cache.py checks it).
METADATA_FIELDS = ("user", "metadata", "safety_identifier", "prompt_cache_key")
ANSWER_NEUTRAL_FIELDS = ("model", "stream", "stream_options", *METADATA_FIELDS)


class CacheError(ValueError):
    """A request that cannot be cached, or a record that cannot be read; the message says which."""


def _normalise(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _normalise(v) for k, v in sorted(value.items()) if v is not None}
    if isinstance(value, list):
        return [_normalise(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def canonical_request(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """What the cache key hashes: the endpoint and the body's answer-changing fields, in one canonical form."""
    if endpoint not in CACHEABLE_ENDPOINTS:
        raise CacheError(f"endpoint {endpoint!r} is not cacheable (one of {', '.join(CACHEABLE_ENDPOINTS)})")
    if not isinstance(body, dict):
        raise CacheError("the request body must be a JSON object")
    kept = {k: v for k, v in body.items() if k not in ANSWER_NEUTRAL_FIELDS}
    return {"endpoint": endpoint, "body": _normalise(kept)}


def request_sha256(endpoint: str, body: dict[str, Any]) -> str:
    canonical = canonical_request(endpoint, body)
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def is_deterministic(endpoint: str, body: dict[str, Any]) -> bool:
    """Whether one computation's answer stands for every later one: greedy or seeded sampling, or no sampling.
    The default temperature is 1 (OpenAI's, serving_image/openai_api/openai_bodies.py), so an unset one samples."""
    if endpoint not in CACHEABLE_ENDPOINTS:
        return False
    if endpoint not in SAMPLING_ENDPOINTS:
        return True
    return body.get("temperature") == 0 or body.get("seed") is not None


def cache_key(model_id: str, version: str, endpoint: str, body: dict[str, Any]) -> str:
    return (f"{CACHE_PREFIX}/{key_segment('model id', model_id)}/{key_segment('version', version)}/"
            f"{request_sha256(endpoint, body)}.json")


class CacheSource(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    batch_id: str | None = None
    custom_id: str | None = None


class CacheRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = RECORD_SCHEMA
    model: str
    version: str
    request_sha256: str
    request: dict[str, Any]  # canonical_request(endpoint, body): what the answer answers
    response: dict[str, Any]  # the endpoint's response body, as the real-time endpoint returned it
    created_at: datetime
    expires_at: datetime | None = None
    source: CacheSource = CacheSource()


class CacheLookup(BaseModel):
    """A reader's answer: `hit` says whether `response` came from the cache."""

    model_config = ConfigDict(frozen=True)

    hit: bool
    key: str
    response: dict[str, Any] | None = None
    record: CacheRecord | None = None
    why_miss: str | None = None  # "absent", "expired", "not deterministic", "mismatch: ..."


class ResultCache:
    """Writes and reads cached answers in an object store (the batch store's `cache/` prefix)."""

    def __init__(self, store: ObjectStore, retention: timedelta | None = None):
        self.store = store
        self.retention = retention  # None: kept until deleted

    def put(self, model_id: str, version: str, endpoint: str, body: dict[str, Any], response: dict[str, Any], *,
            source: CacheSource | None = None, now: datetime | None = None) -> str | None:
        """Store one answer; returns its key, or None for a request that is not deterministic (never cached)."""
        if not is_deterministic(endpoint, body):
            return None
        now = now or datetime.now(UTC)
        key = cache_key(model_id, version, endpoint, body)
        record = CacheRecord(model=model_id, version=version, request_sha256=request_sha256(endpoint, body),
                             request=canonical_request(endpoint, body), response=response, created_at=now,
                             expires_at=now + self.retention if self.retention else None,
                             source=source or CacheSource())
        self.store.put(key, record.model_dump_json().encode(), content_type="application/json")
        return key

    def get(self, model_id: str, version: str, endpoint: str, body: dict[str, Any], *,
            now: datetime | None = None) -> CacheLookup:
        key = cache_key(model_id, version, endpoint, body)
        if not is_deterministic(endpoint, body):
            return CacheLookup(hit=False, key=key, why_miss="not deterministic: only greedy (temperature 0) or "
                                                            "seeded requests are cached")
        raw = self.store.get(key)
        if raw is None:
            return CacheLookup(hit=False, key=key, why_miss="absent")
        try:
            record = CacheRecord.model_validate_json(raw)
        except ValidationError as exc:
            return CacheLookup(hit=False, key=key, why_miss=f"mismatch: unreadable record ({exc.errors()[0]['msg']})")
        expected = canonical_request(endpoint, body)
        if (record.model, record.version, record.request) != (model_id, version, expected):
            return CacheLookup(hit=False, key=key, why_miss="mismatch: the record answers another request")
        if record.expires_at is not None and record.expires_at <= (now or datetime.now(UTC)):
            return CacheLookup(hit=False, key=key, record=record, why_miss="expired")
        return CacheLookup(hit=True, key=key, response=record.response, record=record)

    def delete_version(self, model_id: str, version: str) -> int:
        """Delete every cached answer of one version; returns how many."""
        prefix = f"{CACHE_PREFIX}/{key_segment('model id', model_id)}/{key_segment('version', version)}/"
        return self.store.delete_prefix(prefix)

    def purge_expired(self, now: datetime | None = None) -> int:
        """Delete every record past its `expires_at` (retention); returns how many."""
        now = now or datetime.now(UTC)
        purged = 0
        for key in self.store.list(f"{CACHE_PREFIX}/"):
            raw = self.store.get(key)
            try:
                record = CacheRecord.model_validate_json(raw) if raw is not None else None
            except ValidationError:
                continue  # not ours to judge: a reader treats it as a miss
            if record is not None and record.expires_at is not None and record.expires_at <= now:
                self.store.delete(key)
                purged += 1
        return purged
