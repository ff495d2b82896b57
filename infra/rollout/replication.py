"""Has a package reached every region a rollout names? (docs/first-update.md, "Regions").

Packages are published once, in the home region's bucket, and S3 replicates them to the same key of each other
region's bucket (`<bucketPrefix>-<env>-<region>`, infra/storage.py) asynchronously. A stack names the package by
its home URI; its FSx cache imports the region's own bucket. A rollout that writes the version into a region's stack
before the replica exists starts pods whose package is missing from the cache: `llm-serving rollout start` asks the
store first, for every stack, and changes nothing while any region lacks it.

A stack names the unpacked package on the model cache (`.../model-cache/<id>/<version>/`, llm_serving.pod_contract);
the check reads its manifest (`package.toml`), which is also where the published I/O fingerprint is: a stack whose
`ioFingerprint` differs from the published manifest's is refused with both values named (docs/architecture.md
§3.10b), before any stack file changes.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from typing import Any

from infra.config import StackConfig
from llm_serving.pod_contract import manifest_key

# (the stack's typed config, the package's home URI, the stack's I/O fingerprint or None) -> why the package is not
# usable there yet, or None.
ReplicaCheck = Callable[[StackConfig, str, "str | None"], "str | None"]


def regional_location(cfg: StackConfig, package: str) -> tuple[str, str]:
    """(bucket, key of the package's manifest) where `package` (an s3:// URI of a published package directory in
    the home bucket) lives in this stack's region."""
    key = package.removeprefix("s3://").split("/", 1)[1]
    return cfg.bucket_name(), manifest_key(key)


def fingerprint_mismatch(package: str, manifest_text: str, io_fingerprint: str) -> str | None:
    """Why the stack's `ioFingerprint` cannot name this package (both values), or None when they agree."""
    try:
        published = tomllib.loads(manifest_text)["model"]["io_fingerprint"]
    except (tomllib.TOMLDecodeError, KeyError, TypeError) as err:
        return f"{package}: its package.toml has no readable model.io_fingerprint ({type(err).__name__}: {err})"
    if published != io_fingerprint:
        return (f"{package}: the stack's ioFingerprint {io_fingerprint} differs from the published manifest's "
                f"model.io_fingerprint {published}")
    return None


def s3_replica_check(client_for: Callable[[str], Any] | None = None) -> ReplicaCheck:
    """A check against S3 itself: HEAD the package in the stack's own bucket (boto3, one client per region)."""
    clients: dict[str, Any] = {}

    def client(region: str):
        if region not in clients:
            if client_for is not None:
                clients[region] = client_for(region)
            else:
                import boto3

                clients[region] = boto3.client("s3", region_name=region)
        return clients[region]

    def check(cfg: StackConfig, package: str, io_fingerprint: str | None = None) -> str | None:
        from botocore.exceptions import ClientError

        bucket, key = regional_location(cfg, package)
        try:
            head = client(cfg.region).head_object(Bucket=bucket, Key=key)
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") not in ("404", "NoSuchKey", "NotFound"):
                raise
            if cfg.is_home_region:
                return f"{package} is not published: s3://{bucket}/{key} does not exist in the home region"
            return (f"{package} has not replicated to {cfg.region} yet: s3://{bucket}/{key} does not exist "
                    f"(S3 replicates from {cfg.home_region} asynchronously; check the source object's "
                    f"ReplicationStatus, wait, and run the rollout again)")
        if not cfg.is_home_region and head.get("ReplicationStatus") not in (None, "REPLICA", "COMPLETED"):
            return (f"{package} is still replicating to {cfg.region} (s3://{bucket}/{key}: ReplicationStatus "
                    f"{head.get('ReplicationStatus')})")
        if io_fingerprint is not None:
            body = client(cfg.region).get_object(Bucket=bucket, Key=key)["Body"].read()
            return fingerprint_mismatch(package, body.decode("utf-8", "replace"), io_fingerprint)
        return None

    return check


def missing_replicas(configs: dict[str, StackConfig], package: str, check: ReplicaCheck,
                     io_fingerprint: str | None = None) -> list[str]:
    """One line per stack where `package` cannot be used yet (or does not carry `io_fingerprint`)."""
    out = []
    for stack, cfg in configs.items():
        why = check(cfg, package, io_fingerprint)
        if why:
            out.append(f"{stack}: {why}")
    return out
