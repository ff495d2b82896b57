"""The Files and Batches API (OpenAI's) on the OpenAI front-end's port: what a client uploads, the batches
it creates, their progress and their output files. Executing a batch is the worker's job (worker.py); this module
only reads and writes the store (storage.py), so any number of front-end pods can serve it.

Every store call runs on a worker thread (sync endpoints, which FastAPI runs in its thread pool, or
`run_in_threadpool`), never on the event loop: the loop is the real-time path's, and a store call is an S3 round
trip (an fsync on a directory store) that would stall every request in flight while it waits.

Access: every object belongs to the key that created it (records.owner_of), and another key gets 404 for it, as
for an object that does not exist (no existence leak); an admin key (config.ENV_ADMIN_KEYS) sees everything.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from llm_serving.object_store import open_object_store
from serving_image.batch.config import BatchConfig
from serving_image.batch.records import (
    BATCH_ENDPOINTS,
    COMPLETION_WINDOW_S,
    TERMINAL,
    BatchObject,
    CreateBatchBody,
    FileObject,
    StoredBatch,
    StoredFile,
    new_id,
    owner_of,
)
from serving_image.batch.storage import BatchStorage
from serving_image.openai_api.admission import check_api_key
from serving_image.openai_api.errors import APIError, bad_request, from_validation_error, json_object
from serving_image.openai_api.state import server_state

router = APIRouter()


def mounted(config: BatchConfig) -> Callable[[FastAPI], None]:
    """The Files and Batches API as an extension of the OpenAI front-end's app (`create_app(extensions=...)`): the
    service on `app.state.batch`, the routes on the app, under its keys, admission and errors. The app takes it as
    an extension rather than importing this package, so that the Batch API (which uses the front-end's admission)
    sits above the front-end and the two never import each other."""
    def mount(app: FastAPI) -> None:
        app.state.batch = BatchService.open(config)
        app.include_router(router)

    return mount


@dataclass(frozen=True)
class BatchService:
    config: BatchConfig
    storage: BatchStorage

    @classmethod
    def open(cls, config: BatchConfig) -> BatchService:
        return cls(config, BatchStorage(open_object_store(config.store_uri, kms_key_id=config.kms_key_id)))


@dataclass(frozen=True)
class Caller:
    owner: str
    admin: bool

    def sees(self, owner: str) -> bool:
        return self.admin or owner == self.owner


def _service(request: Request) -> BatchService:
    return request.app.state.batch


def _caller(request: Request, service: BatchService) -> Caller:
    authorization = request.headers.get("authorization") or ""
    scheme, _, token = authorization.partition(" ")
    token = token.strip() if scheme.lower() == "bearer" else ""
    if token and token in service.config.admin_keys:
        return Caller(owner=owner_of(token), admin=True)
    config = server_state(request).config
    check_api_key(config, authorization or None)
    return Caller(owner=owner_of(token if config.api_keys else None), admin=False)


def _not_found(kind: str, object_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"No {kind} found with id '{object_id}'", param=param, code="not_found")


def _page(items: list[dict], after: str | None, limit: int) -> dict:
    """OpenAI's cursor page: items after the one whose id is `after`, at most `limit`, and whether more follow."""
    if not 1 <= limit <= 10_000:
        raise bad_request(f"limit {limit}: must be in 1..10000", param="limit")
    start = 0
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise bad_request(f"after '{after}': no such object in this list", param="after")
        start = ids.index(after) + 1
    page = items[start:start + limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(items)}


# -- files ---------------------------------------------------------------------------------------------------------


def count_lines(content: bytes, limits: BatchConfig, filename: str) -> int:
    """The number of request lines, once the file is UTF-8 and within the line limit. The lines themselves are
    validated when the batch runs, each as the real-time endpoint validates it: a bad line is an error line, not a
    refused upload."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"file '{filename}' is not UTF-8 (byte {exc.start}); a batch file is JSONL",
                          param="file", code="invalid_file") from exc
    lines = sum(1 for line in text.splitlines() if line.strip())
    if lines == 0:
        raise bad_request(f"file '{filename}' holds no request line", param="file", code="invalid_file")
    if lines > limits.max_lines:
        raise bad_request(f"file '{filename}' has {lines} lines; the limit is {limits.max_lines} requests a file",
                          param="file", code="too_many_lines")
    return lines


@router.post("/v1/files")
async def create_file(request: Request) -> JSONResponse:
    service = _service(request)
    caller = _caller(request, service)
    limits = service.config
    declared = request.headers.get("content-length")
    # The multipart envelope adds a little; 64 KiB is far more than its headers ever take.
    if declared and declared.isdigit() and int(declared) > limits.max_file_bytes + 64 * 1024:
        raise APIError(413, f"upload is {declared} bytes; a file may have at most {limits.max_file_bytes}",
                       param="file", code="file_too_large")
    form = await request.form(max_files=1, max_fields=8)
    unknown = sorted(set(form.keys()) - {"file", "purpose"})
    if unknown:
        raise bad_request(f"Unsupported parameter: '{unknown[0]}' is not supported by this server; it would be "
                          "ignored, so the upload is refused", param=unknown[0], code="unsupported_parameter")
    purpose = form.get("purpose")
    if purpose != "batch":
        raise bad_request(f"purpose {purpose!r}: this server accepts files for purpose 'batch' only",
                          param="purpose", code="invalid_value")
    upload = form.get("file")
    if upload is None or isinstance(upload, str):
        raise bad_request("Missing required parameter: 'file' (a JSONL file)", param="file",
                          code="missing_required_parameter")
    content = await upload.read(limits.max_file_bytes + 1)
    filename = upload.filename or "upload.jsonl"
    if len(content) > limits.max_file_bytes:
        raise APIError(413, f"file '{filename}' exceeds {limits.max_file_bytes} bytes", param="file",
                       code="file_too_large")
    return await run_in_threadpool(_store_file, service, caller, content, filename)


def _store_file(service: BatchService, caller: Caller, content: bytes, filename: str) -> JSONResponse:
    limits = service.config
    lines = count_lines(content, limits, filename)
    if not caller.admin and len(service.storage.file_ids(caller.owner)) >= limits.max_files_per_key:
        raise APIError(429, f"this key holds {limits.max_files_per_key} files, its limit; delete some first",
                       type_="rate_limit_error", code="file_limit_reached")
    record = StoredFile(file=FileObject(id=new_id("file-"), bytes=len(content), created_at=int(time.time()),
                                        filename=filename, purpose="batch"), owner=caller.owner, lines=lines)
    service.storage.put_file(record, content)
    return JSONResponse(record.file.model_dump())


def _visible_file(request: Request, file_id: str) -> tuple[BatchService, StoredFile]:
    service = _service(request)
    caller = _caller(request, service)
    record = service.storage.get_file(file_id)
    if record is None or not caller.sees(record.owner):
        raise _not_found("file", file_id, param="file_id")
    return service, record


@router.get("/v1/files")
def list_files(request: Request, purpose: str | None = None, limit: int = 10_000, after: str | None = None,
                     order: Literal["asc", "desc"] = "desc") -> dict:
    service = _service(request)
    caller = _caller(request, service)
    records = [r for r in map(service.storage.get_file, service.storage.file_ids(None if caller.admin
                                                                                  else caller.owner)) if r]
    files = [r.file.model_dump() for r in records if purpose is None or r.file.purpose == purpose]
    files.sort(key=lambda f: (f["created_at"], f["id"]), reverse=order == "desc")
    return _page(files, after, limit)


@router.get("/v1/files/{file_id}")
def get_file(file_id: str, request: Request) -> dict:
    return _visible_file(request, file_id)[1].file.model_dump()


@router.get("/v1/files/{file_id}/content")
def file_content(file_id: str, request: Request) -> Response:
    service, record = _visible_file(request, file_id)
    content = service.storage.file_content(record.file.id)
    if content is None:
        raise _not_found("file content", file_id, param="file_id")
    return Response(content, media_type="application/jsonl")


@router.delete("/v1/files/{file_id}")
def delete_file(file_id: str, request: Request) -> dict:
    service, record = _visible_file(request, file_id)
    service.storage.delete_file(record)
    return {"id": file_id, "object": "file", "deleted": True}


# -- batches -------------------------------------------------------------------------------------------------------


@router.post("/v1/batches")
async def create_batch(request: Request) -> JSONResponse:
    service = _service(request)
    caller = _caller(request, service)
    try:
        body = CreateBatchBody.model_validate(json_object(await request.body()))
    except ValidationError as exc:
        raise from_validation_error(exc, "/v1/batches") from exc
    if body.endpoint not in BATCH_ENDPOINTS:
        raise bad_request(f"endpoint '{body.endpoint}': a batch here drives one of {', '.join(BATCH_ENDPOINTS)}",
                          param="endpoint", code="invalid_value")
    if body.completion_window not in COMPLETION_WINDOW_S:
        raise bad_request(f"completion_window '{body.completion_window}': only "
                          f"{', '.join(COMPLETION_WINDOW_S)} is supported", param="completion_window",
                          code="invalid_value")
    for key, value in (body.metadata or {}).items():
        if len(key) > 64 or len(value) > 512:
            raise bad_request(f"metadata '{key[:64]}': keys hold at most 64 characters, values 512",
                              param="metadata", code="invalid_value")
    return await run_in_threadpool(_store_batch, service, caller, body, server_state(request).model.name)


def _store_batch(service: BatchService, caller: Caller, body: CreateBatchBody, model: str) -> JSONResponse:
    source = service.storage.get_file(body.input_file_id)
    if source is None or not caller.sees(source.owner):
        raise _not_found("file", body.input_file_id, param="input_file_id")
    if source.file.purpose != "batch":
        raise bad_request(f"file '{body.input_file_id}' has purpose '{source.file.purpose}'; a batch reads a file "
                          "uploaded with purpose 'batch'", param="input_file_id", code="invalid_value")
    if not caller.admin:
        active = [b for b in map(service.storage.get_batch, service.storage.batch_ids(caller.owner))
                  if b is not None and b.batch.status not in TERMINAL]
        if len(active) >= service.config.max_active_batches_per_key:
            raise APIError(429, f"this key has {len(active)} batches in flight, its limit "
                                f"({service.config.max_active_batches_per_key}); wait for one to end",
                           type_="rate_limit_error", code="batch_limit_reached")
    now = int(time.time())
    batch = BatchObject(id=new_id("batch_"), endpoint=body.endpoint, input_file_id=body.input_file_id,
                        completion_window=body.completion_window, status="validating", created_at=now,
                        expires_at=now + COMPLETION_WINDOW_S[body.completion_window], metadata=body.metadata,
                        model=model)
    batch.request_counts.total = source.lines
    service.storage.create_batch(StoredBatch(batch=batch, owner=caller.owner))
    return JSONResponse(batch.model_dump())


def _visible_batch(request: Request, batch_id: str) -> tuple[BatchService, StoredBatch]:
    service = _service(request)
    caller = _caller(request, service)
    record = service.storage.get_batch(batch_id)
    if record is None or not caller.sees(record.owner):
        raise _not_found("batch", batch_id, param="batch_id")
    return service, record


@router.get("/v1/batches")
def list_batches(request: Request, limit: int = 20, after: str | None = None) -> dict:
    service = _service(request)
    caller = _caller(request, service)
    ids = service.storage.batch_ids(None if caller.admin else caller.owner)
    batches = [r.batch.model_dump() for r in map(service.storage.get_batch, ids) if r is not None]
    batches.sort(key=lambda b: (b["created_at"], b["id"]), reverse=True)  # newest first, as OpenAI lists them
    return _page(batches, after, limit)


@router.get("/v1/batches/{batch_id}")
def get_batch(batch_id: str, request: Request) -> dict:
    return _visible_batch(request, batch_id)[1].batch.model_dump()


@router.post("/v1/batches/{batch_id}/cancel")
def cancel_batch(batch_id: str, request: Request) -> dict:
    service, record = _visible_batch(request, batch_id)
    if record.batch.status in TERMINAL:
        raise APIError(409, f"batch '{batch_id}' is {record.batch.status}; only a batch not yet ended can be "
                            "cancelled", param="batch_id", code="batch_not_cancellable")
    service.storage.request_cancel(batch_id, int(time.time()))
    return service.storage.get_batch(batch_id).batch.model_dump()
