"""A small key/value object store: a local directory, or an S3 prefix (docs/batch.md, "Where the data lives").

The batch path (serving_image/batch/) and the result cache (llm_serving/batch_cache.py) keep everything in one of
these: client files, batch records, per-line results, cached answers. It is deliberately smaller than the model
store (llm_serving/store.py): whole objects, written at once, read back whole; no multipart, no partial reads.

Every write is all-or-nothing for a reader (a directory store writes a temporary file and renames it; S3 makes a
PUT visible only when complete), which is what lets a killed writer leave nothing half-written. On S3 every object
is written with server-side encryption (SSE-KMS with the stack's key when one is given, else SSE-S3): client data is
never stored in the clear.

The URI names the store: `s3://bucket/prefix` or a directory path. The batch prefix must not lie under the model
store's `models/`-style association path nor in the replicated model bucket (infra renders a bucket of its own);
`open_object_store` refuses a URI whose prefix is the model cache's (`model-cache/`), the one place we can check here.
"""

from __future__ import annotations

import os
import uuid
from abc import ABC, abstractmethod
from pathlib import Path

from llm_serving.pod_contract import MODEL_CACHE_PREFIX, PACKAGES_PREFIX


class ObjectStoreError(RuntimeError):
    pass


class ObjectStore(ABC):
    """Keys are `/`-separated relative paths of safe segments (checked by `_check_key`)."""

    uri: str

    @abstractmethod
    def put(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> None:
        """Write `data` under `key` at once, replacing what was there."""

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The object's bytes, or None when there is none."""

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Every key that starts with `prefix` (a folder: end it with '/'), sorted."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; removing one that is not there is not an error."""

    def delete_prefix(self, prefix: str) -> int:
        keys = self.list(prefix)
        for key in keys:
            self.delete(key)
        return len(keys)


def _check_key(key: str) -> str:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts[:-1]) or parts[-1] in (".", ".."):
        raise ObjectStoreError(f"{key!r}: not a valid object key (relative, '/'-separated, no '.' or '..')")
    return key


class DirectoryStore(ObjectStore):
    def __init__(self, root: Path):
        self.root = Path(root)
        self.uri = str(self.root)

    def _path(self, key: str) -> Path:
        return self.root / _check_key(key)

    def put(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> None:
        path = self._path(key)
        partial = path.with_name(f".{path.name}.{uuid.uuid4().hex}.partial")
        try:
            handle = open(partial, "wb")  # noqa: SIM115 (closed below; the directory is made only when missing)
        except FileNotFoundError:  # its directory is new: made here, not checked on every put (a batch worker's
            path.parent.mkdir(parents=True, exist_ok=True)  # puts are most of its CPU)
            handle = open(partial, "wb")  # noqa: SIM115
        with handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        partial.replace(path)  # atomic on one file system: a reader sees the old object or the new one

    def get(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def list(self, prefix: str) -> list[str]:
        base = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        if not base.is_dir():
            return []
        keys = []
        for path in base.rglob("*"):
            if path.is_file() and not path.name.endswith(".partial"):
                key = path.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


class S3ObjectStore(ObjectStore):
    """`s3://bucket/prefix`, through boto3; every PUT encrypted at rest."""

    def __init__(self, uri: str, client=None, kms_key_id: str | None = None):
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        if not uri.startswith("s3://") or not bucket:
            raise ObjectStoreError(f"{uri}: an S3 URI is s3://bucket/prefix")
        self.uri = uri
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.kms_key_id = kms_key_id
        if client is None:
            import boto3

            client = boto3.client("s3")
        self.s3 = client

    def _key(self, key: str) -> str:
        _check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> None:
        encryption = ({"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": self.kms_key_id} if self.kms_key_id
                      else {"ServerSideEncryption": "AES256"})
        self.s3.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, ContentType=content_type, **encryption)

    def get(self, key: str) -> bytes | None:
        from botocore.exceptions import ClientError

        try:
            return self.s3.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise

    def list(self, prefix: str) -> list[str]:
        full = self._key(prefix) if prefix else (f"{self.prefix}/" if self.prefix else "")
        if prefix.endswith("/") and not full.endswith("/"):
            full += "/"
        strip = len(self.prefix) + 1 if self.prefix else 0
        keys = []
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
            keys += [item["Key"][strip:] for item in page.get("Contents", [])]
        return sorted(keys)

    def delete(self, key: str) -> None:
        self.s3.delete_object(Bucket=self.bucket, Key=self._key(key))


def open_object_store(uri: str, client=None, kms_key_id: str | None = None) -> ObjectStore:
    """The store a URI names. A prefix that is the model store's own (packages/, model-cache/) is refused: those
    replicate to every region and model-cache/ is what FSx presents to every pod, where client data must not go."""
    if not uri:
        raise ObjectStoreError("no store URI given (a directory or s3://bucket/prefix)")
    if uri.startswith("s3://"):
        store = S3ObjectStore(uri, client=client, kms_key_id=kms_key_id)
        first = store.prefix.split("/", 1)[0]
        if first in (MODEL_CACHE_PREFIX, PACKAGES_PREFIX):
            raise ObjectStoreError(f"{uri}: the batch store must not lie under the model store's {first}/ prefix "
                                   "(it replicates to every region, and model-cache/ is on every pod's file system)")
        return store
    if "://" in uri:
        raise ObjectStoreError(f"{uri}: unsupported store (use a directory or s3://bucket/prefix)")
    return DirectoryStore(Path(uri))
