"""Reading resource inputs the way the engine hands them to a policy.

Inputs arrive wrapped in pulumi_policy's unknown-checking proxies (a Mapping and a Sequence, not dict and list;
reading a value unknown during preview raises UnknownValueError, which the analyzer reports), with camelCase
keys, numbers as floats (the mock runtime and the engine both send JSON numbers), and documents such as IAM
policies either as a JSON string or as an already-decoded object. These helpers read them without guessing: a
missing key is `None`, never a silently invented default.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

_DURATION = re.compile(r"^\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s)?\s*$")


def is_sequence(value: Any) -> bool:
    """A JSON array. Under `pulumi preview` the analyzer hands props wrapped in pulumi_policy's unknown-checking
    proxies, whose arrays are `Sequence`s but not lists: never test for `list` here."""
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)


def get(obj: Any, *path: str | int) -> Any:
    """Walk `obj` along `path` (mapping keys or list indices); `None` as soon as a step is missing."""
    cur = obj
    for step in path:
        if isinstance(step, int):
            if not is_sequence(cur) or not -len(cur) <= step < len(cur):
                return None
            cur = cur[step]
        else:
            if not isinstance(cur, Mapping) or step not in cur:
                return None
            cur = cur[step]
    return cur


def as_list(value: Any) -> list[Any]:
    """A JSON 'string or list' field (IAM Action/Resource, for example) as a list."""
    if value is None:
        return []
    if is_sequence(value):
        return list(value)
    return [value]


def as_number(value: Any) -> float | None:
    """A number that may arrive as int, float or numeric string (Kubernetes quantities like "2" for GPUs)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


def as_bool(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return None


def json_document(value: Any) -> Any:
    """Decode a policy document given as a JSON string; pass an already-decoded object through."""
    if isinstance(value, str):
        return json.loads(value)
    return value


def duration_seconds(value: Any) -> float | None:
    """Pulumi custom timeouts: "30m", "1h30m", "90s", or a number of seconds (the engine's own form)."""
    if value is None or value == "":
        return None
    number = as_number(value)
    if number is not None:
        return number
    if not isinstance(value, str):
        return None
    match = _DURATION.match(value)
    if not match or not any(match.groups()):
        return None
    hours, minutes, seconds = (float(g) if g else 0.0 for g in match.groups())
    return hours * 3600 + minutes * 60 + seconds


def labels(obj: Mapping[str, Any] | None) -> dict[str, str]:
    """`metadata.labels` of a Kubernetes object (or of a pod template), as a plain dict."""
    found = get(obj, "metadata", "labels")
    return dict(found) if isinstance(found, Mapping) else {}


def annotations(obj: Mapping[str, Any] | None) -> dict[str, str]:
    found = get(obj, "metadata", "annotations")
    return dict(found) if isinstance(found, Mapping) else {}


def k8s_name(props: Mapping[str, Any]) -> str | None:
    name = get(props, "metadata", "name")
    return name if isinstance(name, str) else None


def k8s_namespace(props: Mapping[str, Any]) -> str:
    namespace = get(props, "metadata", "namespace")
    return namespace if isinstance(namespace, str) and namespace else "default"


def iter_mappings(values: Any) -> Iterable[Mapping[str, Any]]:
    for value in as_list(values):
        if isinstance(value, Mapping):
            yield value
