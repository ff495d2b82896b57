"""A caller's API key from the environment, read one way by every caller the platform ships: the client library
(llm_serving_client) and the batch worker (serving_image/batch/worker.py). Fails closed: a key file that is named
but missing, unreadable or empty is an error naming it, never a call without the key."""

from __future__ import annotations

import os
from collections.abc import Mapping


def key_from_env(file_env: str, value_env: str, whose: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The content of the file `file_env` names, else `value_env`'s value; None when neither is set. `whose`
    names the key in errors ("the API key", "the worker's key")."""
    environ = os.environ if environ is None else environ
    path = environ.get(file_env)
    if path:
        try:
            with open(path) as handle:
                key = handle.read().strip()
        except OSError as exc:
            raise ValueError(f"{file_env}={path}: cannot read {whose} ({exc})") from exc
        if not key:
            raise ValueError(f"{file_env}={path}: the file holds no key")
        return key
    return environ.get(value_env) or None
