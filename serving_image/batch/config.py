"""The Batch API's settings, from the environment the Deployment (or `make up`) gives the front-end and the worker.

The Batch API is on only when LLM_SERVING_BATCH_STORE names a store: without one there is nowhere durable to keep
client files, and an in-memory fallback would lose them on the first restart.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from llm_serving.pod_contract import ENV_BATCH_KMS_KEY, ENV_BATCH_STORE

ENV_ADMIN_KEYS = "LLM_SERVING_BATCH_ADMIN_KEYS"  # comma-separated keys that see every batch and file
ENV_LIMITS = {
    "max_file_bytes": "LLM_SERVING_BATCH_MAX_FILE_BYTES",
    "max_lines": "LLM_SERVING_BATCH_MAX_LINES",
    "max_files_per_key": "LLM_SERVING_BATCH_MAX_FILES_PER_KEY",
    "max_active_batches_per_key": "LLM_SERVING_BATCH_MAX_ACTIVE_PER_KEY",
    "cache_retention_days": "LLM_SERVING_BATCH_CACHE_RETENTION_DAYS",
}


@dataclass(frozen=True)
class BatchConfig:
    store_uri: str
    kms_key_id: str | None = None
    admin_keys: tuple[str, ...] = ()
    max_file_bytes: int = 100 * 1024 * 1024  # OpenAI's limit is 200 MB; a pod's memory holds a file while it parses
    max_lines: int = 50_000  # OpenAI's
    max_files_per_key: int = 1000
    max_active_batches_per_key: int = 10
    cache_retention_days: int = 0  # 0: cached answers are kept until deleted

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> BatchConfig | None:
        uri = environ.get(ENV_BATCH_STORE, "").strip()
        if not uri:
            return None
        limits = {}
        for field, variable in ENV_LIMITS.items():
            if variable in environ:
                value = environ[variable]
                if not value.isdigit() or (int(value) < 1 and field != "cache_retention_days"):
                    raise ValueError(f"{variable}={value!r}: expected a positive integer")
                limits[field] = int(value)
        admin = tuple(k.strip() for k in environ.get(ENV_ADMIN_KEYS, "").split(",") if k.strip())
        return cls(store_uri=uri, kms_key_id=environ.get(ENV_BATCH_KMS_KEY) or None, admin_keys=admin, **limits)
