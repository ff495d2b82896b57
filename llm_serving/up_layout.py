"""Where `llm-serving up` (`make up`) keeps its state on this machine: one rule for the CLI that writes there and for
the processes beside the server that look there (a client service's local discovery, llm_serving_client/local.py,
reads the Batch API's result cache from the same store the server and its batch worker write).

Both are relative to the working directory (the repository root for `make up`) unless the environment names them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

ENV_CACHE = "LLM_SERVING_CACHE"  # up's packages, model store, model cache, run directory and batch store
ENV_BATCH_STORE = "LLM_SERVING_BATCH_STORE"  # the Batch API's store (serving_image/batch/config.py reads it)


def up_cache(environ: Mapping[str, str] = os.environ) -> Path:
    return Path(environ.get(ENV_CACHE) or Path.cwd() / ".cache" / "llm-serving")


def up_batch_store(environ: Mapping[str, str] = os.environ) -> str:
    """The batch store `up` runs its Batch API and worker on: $LLM_SERVING_BATCH_STORE (a directory or an s3://
    URI), else a directory beside the model store."""
    return environ.get(ENV_BATCH_STORE) or str(up_cache(environ) / "batch-store")
