"""The Batch API's objects, in OpenAI's shapes (the official `openai` client parses them unchanged), and what the
platform keeps beside them (the owner, the model). docs/batch.md describes them for client teams."""

from __future__ import annotations

import hashlib
import secrets
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                      "cancelled"]
TERMINAL = ("failed", "completed", "expired", "cancelled")
# The endpoints a batch may drive: the real-time ones of this front-end (serving_image/openai_api/protocol.py).
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/score")
COMPLETION_WINDOW_S = {"24h": 24 * 3600}  # OpenAI accepts only 24h

ANONYMOUS = "anonymous"  # the owner when the server has no API keys


def owner_of(api_key: str | None) -> str:
    """Who owns what a key creates: a digest of the key, so that the store never holds a key itself."""
    return ANONYMOUS if not api_key else "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:24]


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def output_file_id(batch_id: str, kind: Literal["output", "error"]) -> str:
    """Derived from the batch, so that a finalize interrupted and run again writes the same file, not a second one."""
    return f"file-{kind}-{batch_id.removeprefix('batch_')}"


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FileObject(_Record):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class StoredFile(_Record):
    """A file's record in the store: OpenAI's object plus its owner and line count."""

    file: FileObject
    owner: str
    lines: int


class RequestCounts(_Record):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchErrorItem(_Record):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(_Record):
    object: Literal["list"] = "list"
    data: list[BatchErrorItem] = Field(default_factory=list)


class BatchObject(_Record):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None
    model: str | None = None


class StoredBatch(_Record):
    """A batch's record in the store. After creation only the worker writes it (the API writes a separate cancel
    marker), so two processes never race on one object."""

    batch: BatchObject
    owner: str


class LineResult(_Record):
    """One input line's result, stored under its line index as soon as it is known: what a resumed worker skips, and
    what finalize merges (each index once, so each custom_id once)."""

    index: int
    custom_id: str | None
    kind: Literal["output", "error"]
    line: dict[str, Any]  # the output or error file's line, in OpenAI's format


class CreateBatchBody(_Record):
    """POST /v1/batches. Unknown fields are refused naming them, as the real-time endpoints do."""

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
