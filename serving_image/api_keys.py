"""The callers' API keys a server checks (docs/architecture.md §3.12): where they come from and how a presented key
is compared. Standard library and the pod contract only: the startup procedure reads the keys before anything else
loads (prometheus_client included, which must not be imported before its multiprocess directory is set)."""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping
from pathlib import Path

from llm_serving import pod_contract as pc

ENV_API_KEYS = pc.ENV_API_KEYS
ENV_API_KEYS_FILE = pc.ENV_API_KEYS_FILE
ENV_REQUIRE_API_KEYS = pc.ENV_REQUIRE_API_KEYS


def _keys_in(path: Path) -> list[str]:
    """The keys of a key file (one a line, '#' comments) or of a directory of them (a Secret volume: one key per
    file; the `..data` links and other dot-entries Kubernetes writes are skipped)."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if not p.name.startswith(".") and p.is_file())
        if not files:
            raise ValueError(f"{ENV_API_KEYS_FILE}={path}: the key directory holds no key file")
        return [key for file in files for key in _keys_in(file)]
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"{ENV_API_KEYS_FILE}={path}: cannot read the key file ({exc})") from exc
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def load_api_keys(environ: Mapping[str, str] = os.environ) -> tuple[tuple[str, ...], bool]:
    """(the keys, whether they are required), from ENV_API_KEYS, ENV_API_KEYS_FILE and ENV_REQUIRE_API_KEYS. Fails
    closed: a key file named but missing, unreadable or without a key, and a required key that nothing gives, are
    errors naming the variable, never "no authentication"."""
    flag = environ.get(ENV_REQUIRE_API_KEYS, "")
    if flag not in ("", "0", "1"):
        raise ValueError(f"{ENV_REQUIRE_API_KEYS}={flag!r}: expected 1 or 0")
    required = flag == "1"
    keys: list[str] = [k.strip() for k in environ.get(ENV_API_KEYS, "").split(",") if k.strip()]
    if ENV_API_KEYS_FILE in environ:
        value = environ[ENV_API_KEYS_FILE]
        if not value.strip():
            raise ValueError(f"{ENV_API_KEYS_FILE} is set but empty: name the key file or directory")
        path = Path(value)
        if not path.exists():
            raise ValueError(f"{ENV_API_KEYS_FILE}={path}: no such file or directory (in a pod: the "
                             f"{pc.API_KEYS_SECRET} Secret's volume)")
        found = _keys_in(path)
        if not found:
            raise ValueError(f"{ENV_API_KEYS_FILE}={path}: holds no key")
        keys += found
    if required and not keys:
        raise ValueError(f"{ENV_REQUIRE_API_KEYS}=1 but no API key is given: set {ENV_API_KEYS_FILE} (a pod mounts "
                         f"the {pc.API_KEYS_SECRET} Secret at {pc.API_KEYS_MOUNT}) or {ENV_API_KEYS}")
    if any(any(c.isspace() or ord(c) < 0x21 or ord(c) > 0x7e for c in k) for k in keys):
        raise ValueError("an API key holds a character other than printable ASCII without spaces (keys are sent "
                         "in an HTTP header and gRPC metadata)")
    return tuple(dict.fromkeys(keys)), required


def bearer_token(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` value (HTTP header or gRPC metadata), or None."""
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def key_matches(keys: tuple[str, ...], token: str) -> bool:
    """Whether `token` is one of `keys`; every key is compared, each in constant time."""
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(token.encode(), key.encode())
    return matched
