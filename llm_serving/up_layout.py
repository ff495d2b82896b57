"""Where `llm-serving up` (`make up`) keeps its state on this machine: one rule for the CLI that writes there and for
the processes beside the server that look there (a client service's local discovery, llm_serving_client/local.py,
reads the Batch API's result cache from the same store the server and its batch worker write, and finds the
packages it serves, to run one in the caller's process).

Both are relative to the working directory (the repository root for `make up`) unless the environment names them.
"""

from __future__ import annotations

import json
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


def served_file(cache: Path) -> Path:
    """The packages `up` with this cache serves now, written before its server starts: {model: {"version",
    "package"}} (beside the run directory, `<cache>/run`)."""
    return cache / "run" / "served.json"


def write_served(cache: Path, packages: Mapping[str, tuple[str, Path]]) -> Path:
    """Record what `up` serves: model id -> (version, its package directory on the local model cache)."""
    path = served_file(cache)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({model: {"version": version, "package": str(package)}
                                for model, (version, package) in sorted(packages.items())}, indent=1) + "\n")
    return path


def served_package(model: str, environ: Mapping[str, str] = os.environ) -> tuple[str, Path]:
    """The version and package directory `up` serves for `model`, or ValueError saying why not."""
    path = served_file(up_cache(environ))
    try:
        served = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file; `make up` writes it when it starts serving") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: unreadable ({exc})") from exc
    if model not in served:
        raise ValueError(f"{path}: `make up` does not serve {model!r}; it serves {', '.join(sorted(served))}")
    return served[model]["version"], Path(served[model]["package"])
