"""Which package versions are resident on a region's model cache (docs/first-update.md, "A warm model cache").

FSx for Lustre's data repository association imports only *metadata* when a package lands in S3: every file's data
is loaded from S3 on its first read, which would be inside the first pod's startup budget (multi-hundred-GB weights).
The region's cache warmer (serving_image/cache_warmer.py, a CronJob the stack renders) restores every file of every
package requested for its region and reads it back against the manifest's checksums, then writes a marker **in
S3**: the association writes nothing back, so S3 is where the rollout tool (infra/rollout/replication.py) and
`llm-serving publish --wait-materialised` can see that a version is warm.

Keys (in each region's own bucket, outside the association's prefix so the markers never appear on the file system):

    cache-state/requests/<id>/<version>.json        published with the package: which regions must hold it warm
    cache-state/resident/<region>/<id>/<version>.json   written by that region's warmer once every file is resident

A request lives in the home bucket and replicates with the package; a marker is keyed by its region, so a replicated
copy can never stand for another region's cache. Standard library and pydantic only (both planes import it).
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime

from pydantic import BaseModel, ConfigDict, Field

from llm_serving.pod_contract import key_segment

CACHE_STATE_PREFIX = "cache-state"
MARKER_SCHEMA = 1


class CacheStateError(ValueError):
    """A request or marker object that cannot be read; the message names the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WarmRequest(_Strict):
    """Written by `llm-serving publish`: the regions whose model caches must hold this version before a rollout."""

    schema_: int = Field(default=MARKER_SCHEMA, alias="schema")
    model_id: str
    version: str
    regions: list[str] = Field(min_length=1)
    package_sha256: str  # of the published package.toml (it lists every file's SHA-256: one digest for all)


class ResidentMarker(_Strict):
    """Written by a region's cache warmer once every file of the package is resident and verified there."""

    schema_: int = Field(default=MARKER_SCHEMA, alias="schema")
    model_id: str
    version: str
    region: str
    file_system_id: str
    package_sha256: str
    files: int = Field(ge=1)
    bytes: int = Field(ge=0)
    verified_at: str  # ISO 8601, UTC


def package_checksum(manifest_bytes: bytes) -> str:
    """The package's checksum as markers record it: SHA-256 of its package.toml, which lists every file's digest."""
    return hashlib.sha256(manifest_bytes).hexdigest()


def request_key(model_id: str, version: str) -> str:
    return f"{CACHE_STATE_PREFIX}/requests/{key_segment('model id', model_id)}/{key_segment('version', version)}.json"


def resident_key(region: str, model_id: str, version: str) -> str:
    return (f"{CACHE_STATE_PREFIX}/resident/{key_segment('region', region)}/{key_segment('model id', model_id)}/"
            f"{key_segment('version', version)}.json")


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def dump(obj: BaseModel) -> bytes:
    return (json.dumps(obj.model_dump(mode="json", by_alias=True), indent=2, sort_keys=True) + "\n").encode()


def _load(cls: type[BaseModel], key: str, body: bytes):
    try:
        return cls.model_validate(json.loads(body))
    except (ValueError, TypeError) as err:
        raise CacheStateError(f"{key}: not a valid {cls.__name__} ({err})") from None


def load_request(key: str, body: bytes) -> WarmRequest:
    return _load(WarmRequest, key, body)


def load_marker(key: str, body: bytes) -> ResidentMarker:
    return _load(ResidentMarker, key, body)


def marker_problem(marker: ResidentMarker, region: str, model_id: str, version: str, expected: str) -> str | None:
    """Why this marker does not prove that the package whose package.toml has SHA-256 `expected` is warm in
    `region` (None when it does)."""
    if (marker.region, marker.model_id, marker.version) != (region, model_id, version):
        return (f"the marker names {marker.model_id} {marker.version} in {marker.region}, not {model_id} {version} "
                f"in {region}")
    if marker.package_sha256 != expected:
        return (f"the marker was written for package.toml {marker.package_sha256}, the published one is {expected} "
                f"(the package changed after it was warmed)")
    return None
