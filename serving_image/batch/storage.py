"""Where the Batch API keeps everything: one object store (llm_serving/object_store.py; S3 in production, a
directory locally), in a bucket or prefix of its own that does not replicate and is not on the model cache.

Layout (docs/batch.md, "Where the data lives"):

    files/<file id>.json                     the file's record (StoredFile)
    files/<file id>.jsonl                    its content
    batches/<batch id>/batch.json            the batch's record (StoredBatch): written by the API once, then only
                                             by the worker
    batches/<batch id>/cancel                the API's cancel request (a marker, so the API never rewrites the
                                             record the worker owns)
    batches/<batch id>/results/<first index>-<id>.jsonl
                                             a chunk of line results (LineResult per line), written as they are
                                             known (the worker's result_writer.py: up to a few dozen lines or a
                                             fraction of a second each)
    owners/<owner>/files/<file id>           per-key indexes: listing, per-key limits
    owners/<owner>/batches/<batch id>
    active/<batch id>                        a batch not yet in a terminal state: what the worker picks up
    cache/...                                the result cache (llm_serving/batch_cache.py)

Why results in small chunks: a killed worker loses at most the lines in flight and the chunk not yet written (those
lines are sent again), never a written one; a resumed worker skips every index that has a result, and finalize merges
the results by index (the first one stored wins), so every custom_id is answered exactly once however often the
worker was killed. Chunks rather than one object per line: a put is an S3 request (a file created and synced
locally), and one a line was most of the worker's CPU (docs/batch.md, "Measured"). Results of one object per line
(`<index>.json`, the layout before chunks) are still read, so a batch resumed across that change loses nothing.

The output and error files get ids derived from the batch (records.py), so a finalize run twice writes the same
files.
"""

from __future__ import annotations

import json
import uuid

from pydantic import BaseModel

from llm_serving.object_store import ObjectStore
from serving_image.batch.records import TERMINAL, LineResult, StoredBatch, StoredFile


def _dump(model: BaseModel) -> bytes:
    return model.model_dump_json(exclude_none=False).encode()


class BatchStorage:
    def __init__(self, store: ObjectStore):
        self.store = store

    # -- files ------------------------------------------------------------------------------------------------------

    def put_file(self, record: StoredFile, content: bytes) -> None:
        # Content first: a record is the file's presence, so no reader finds a record without its content.
        self.store.put(f"files/{record.file.id}.jsonl", content, content_type="application/jsonl")
        self.store.put(f"files/{record.file.id}.json", _dump(record), content_type="application/json")
        self.store.put(f"owners/{record.owner}/files/{record.file.id}", b"")

    def get_file(self, file_id: str) -> StoredFile | None:
        raw = self.store.get(f"files/{file_id}.json") if _safe_id(file_id) else None
        return StoredFile.model_validate_json(raw) if raw is not None else None

    def file_content(self, file_id: str) -> bytes | None:
        return self.store.get(f"files/{file_id}.jsonl") if _safe_id(file_id) else None

    def delete_file(self, record: StoredFile) -> None:
        self.store.delete(f"owners/{record.owner}/files/{record.file.id}")
        self.store.delete(f"files/{record.file.id}.json")
        self.store.delete(f"files/{record.file.id}.jsonl")

    def file_ids(self, owner: str | None) -> list[str]:
        """The files of one owner, or of everyone (owner None: the admin key)."""
        if owner is not None:
            return [k.rsplit("/", 1)[1] for k in self.store.list(f"owners/{owner}/files/")]
        return [k.removeprefix("files/").removesuffix(".json") for k in self.store.list("files/")
                if k.endswith(".json")]

    # -- batches ----------------------------------------------------------------------------------------------------

    def create_batch(self, record: StoredBatch) -> None:
        self.save_batch(record)
        self.store.put(f"owners/{record.owner}/batches/{record.batch.id}", b"")
        self.store.put(f"active/{record.batch.id}", b"")

    def save_batch(self, record: StoredBatch) -> None:
        self.store.put(f"batches/{record.batch.id}/batch.json", _dump(record), content_type="application/json")
        if record.batch.status in TERMINAL:
            self.store.delete(f"active/{record.batch.id}")

    def get_batch(self, batch_id: str) -> StoredBatch | None:
        """The batch as a client sees it: a cancel requested but not yet acted on reads as `cancelling`."""
        raw = self.store.get(f"batches/{batch_id}/batch.json") if _safe_id(batch_id) else None
        if raw is None:
            return None
        record = StoredBatch.model_validate_json(raw)
        if record.batch.status not in TERMINAL and record.batch.status != "cancelling":
            requested = self.cancel_requested_at(batch_id)
            if requested is not None:
                record.batch.status = "cancelling"
                record.batch.cancelling_at = requested
        return record

    def request_cancel(self, batch_id: str, at: int) -> None:
        if self.cancel_requested_at(batch_id) is None:
            self.store.put(f"batches/{batch_id}/cancel", json.dumps({"at": at}).encode())

    def cancel_requested_at(self, batch_id: str) -> int | None:
        raw = self.store.get(f"batches/{batch_id}/cancel")
        return json.loads(raw)["at"] if raw is not None else None

    def batch_ids(self, owner: str | None) -> list[str]:
        if owner is not None:
            return [k.rsplit("/", 1)[1] for k in self.store.list(f"owners/{owner}/batches/")]
        return [k.split("/")[1] for k in self.store.list("batches/") if k.endswith("/batch.json")]

    def active_batch_ids(self) -> list[str]:
        return [k.removeprefix("active/") for k in self.store.list("active/")]

    # -- per-line results -------------------------------------------------------------------------------------------

    def put_results(self, batch_id: str, results: list[LineResult]) -> None:
        """One chunk of results, as one object (its key unique: two chunks never overwrite each other)."""
        if not results:
            raise ValueError("put_results: no results to store")
        first = min(r.index for r in results)
        self.store.put(f"batches/{batch_id}/results/{first:08d}-{uuid.uuid4().hex[:12]}.jsonl",
                       b"".join(_dump(r) + b"\n" for r in results), content_type="application/jsonl")

    def done_indexes(self, batch_id: str) -> set[int]:
        return {r.index for r in self.results(batch_id)}

    def results(self, batch_id: str) -> list[LineResult]:
        """Every stored result once, by line index: where an index was stored twice (two workers on one batch), the
        first by key wins."""
        by_index: dict[int, LineResult] = {}
        for key in self.store.list(f"batches/{batch_id}/results/"):
            raw = self.store.get(key)
            if raw is None:
                continue
            lines = raw.splitlines() if key.endswith(".jsonl") else [raw]  # a chunk, or one line (.json)
            for line in lines:
                result = LineResult.model_validate_json(line)
                by_index.setdefault(result.index, result)
        return [by_index[i] for i in sorted(by_index)]


def _safe_id(value: str) -> bool:
    """An id from a URL becomes part of a key: letters, digits, '-' and '_' only."""
    return bool(value) and all(c.isalnum() or c in "-_" for c in value)
