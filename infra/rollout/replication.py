"""Has a package reached every region a rollout names? (docs/first-update.md, "Regions").

Packages are published once, in the home region's bucket, and S3 replicates them to the same key of each other
region's bucket (`<bucketPrefix>-<env>-<region>`, infra/storage.py) asynchronously. A stack names the package by
its home URI; its FSx cache imports the region's own bucket. A rollout that writes the version into a region's stack
before the replica exists starts pods whose package is missing from the cache: `llm-serving rollout start` asks the
store first, for every stack, and changes nothing while any region lacks it.

A stack names the unpacked package on the model cache (`.../model-cache/<id>/<version>/`, llm_serving.pod_contract);
the check reads its manifest (`package.toml`), which is also where the published I/O fingerprint is: a stack whose
`ioFingerprint` differs from the published manifest's is refused with both values named (docs/architecture.md
§3.10b), before any stack file changes. The same goes for the engine's parallel layout the stack declares for the
model (`models[].parallel` against the manifest's `[engine.parallel]`).

A replica in S3 is not yet a warm cache: FSx loads a file's data on its first read. The region's cache warmer writes
a marker once every file is resident (llm_serving.cache_state); a region without a marker for this exact package
(the manifest's checksum) is refused too, naming the region.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from typing import Any

from infra.config import ModelConfig, StackConfig
from llm_serving import cache_state
from llm_serving.pod_contract import manifest_key, parse_package_uri

# (the stack's typed config, the package's home URI, the stack's I/O fingerprint or None, the stack's model or None)
# -> why the package is not usable there yet, or None.
ReplicaCheck = Callable[[StackConfig, str, "str | None", "ModelConfig | None"], "str | None"]


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


def layout_mismatch(package: str, manifest_text: str, model: ModelConfig) -> str | None:
    """Why the stack's declared engine layout cannot run this package (both values), or None when they agree."""
    from llm_serving.manifest import ManifestError, parse_manifest

    if model.kind != "vllm":
        return None
    try:
        engine = parse_manifest(manifest_text).engine
    except ManifestError as err:
        return f"{package}: its package.toml cannot be read ({err})"
    if engine is not None and engine.parallel != model.layout:
        return (f"{package}: the stack declares parallel {model.layout.describe()} for {model.id}, the published "
                f"manifest's engine.parallel is {engine.parallel.describe()}")
    return None


def dependencies_mismatch(package: str, manifest_text: str, model: ModelConfig) -> str | None:
    """Why the stack's `pythonDependencies` for `model` do not state what this Python-backend package imports (the
    policy serving-python-dependencies-in-image checks the stack's list against the image, so a dependency the
    stack leaves out would reach production unchecked), or None. A package with its own execution_env brings its
    dependencies itself."""
    from llm_serving.manifest import ManifestError, parse_manifest
    from llm_serving.python_deps import DependencyError, parse_requirements

    if model.kind not in ("python", "ensemble"):
        return None
    try:
        python = parse_manifest(manifest_text).python
    except ManifestError as err:
        return f"{package}: its package.toml cannot be read ({err})"
    if python is None or python.execution_env is not None or not python.dependencies:
        return None
    try:
        declared = {str(r) for r in parse_requirements(model.python_dependencies, "pythonDependencies")}
        needed = [str(r) for r in parse_requirements(python.dependencies, "python.dependencies")]
    except DependencyError as err:
        return f"{package}: {err}"
    missing = [r for r in needed if r not in declared]
    if missing:
        return (f"{package}: the published manifest's python.dependencies need {', '.join(missing)}, which the "
                f"stack's pythonDependencies for {model.id} do not state ({model.python_dependencies or 'none'}): "
                f"add them so the policy checks them against the image")
    return None


def s3_replica_check(client_for: Callable[[str], Any] | None = None, require_warm: bool = True) -> ReplicaCheck:
    """A check against S3 itself: HEAD the package in the stack's own bucket (boto3, one client per region), read
    its manifest for what the stack declares about it, and (`require_warm`) the region's resident marker."""
    clients: dict[str, Any] = {}

    def client(region: str):
        if region not in clients:
            if client_for is not None:
                clients[region] = client_for(region)
            else:
                import boto3

                clients[region] = boto3.client("s3", region_name=region)
        return clients[region]

    def get(region: str, bucket: str, key: str) -> bytes | None:
        from botocore.exceptions import ClientError

        try:
            return client(region).get_object(Bucket=bucket, Key=key)["Body"].read()
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") not in ("404", "NoSuchKey", "NotFound"):
                raise
            return None

    def check(cfg: StackConfig, package: str, io_fingerprint: str | None = None,
              model: ModelConfig | None = None) -> str | None:
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
        manifest = get(cfg.region, bucket, key) or b""
        text = manifest.decode("utf-8", "replace")
        if io_fingerprint is not None:
            why = fingerprint_mismatch(package, text, io_fingerprint)
            if why:
                return why
        if model is not None:
            why = layout_mismatch(package, text, model) or dependencies_mismatch(package, text, model)
            if why:
                return why
        return warm_problem(cfg, package, manifest, get) if require_warm else None

    return check


def warm_problem(cfg: StackConfig, package: str, manifest: bytes,
                 get: Callable[[str, str, str], bytes | None]) -> str | None:
    """Why `package` is not warm on the region's model cache (no marker, or one for other bytes), or None."""
    _, model_id, version = parse_package_uri(package, cfg.model_storage.model_prefix)
    key = cache_state.resident_key(cfg.region, model_id, version)
    body = get(cfg.region, cfg.bucket_name(), key)
    if body is None:
        return (f"{package} is not materialised on {cfg.region}'s model cache: s3://{cfg.bucket_name()}/{key} does "
                f"not exist (the region's cache warmer writes it once every file is resident on FSx; FSx would "
                f"otherwise load the weights from S3 inside the first pod's startup budget). Wait for "
                f"`llm-serving publish --wait-materialised` or the warmer's Job in {cfg.region}, then run the "
                f"rollout again")
    try:
        marker = cache_state.load_marker(key, body)
    except cache_state.CacheStateError as err:
        return f"{package}: {err}"
    why = cache_state.marker_problem(marker, cfg.region, model_id, version, cache_state.package_checksum(manifest))
    return f"{package} is not materialised on {cfg.region}'s model cache: {why}" if why else None


def missing_replicas(configs: dict[str, StackConfig], package: str, check: ReplicaCheck,
                     io_fingerprint: str | None = None, model_id: str | None = None) -> list[str]:
    """One line per stack where `package` cannot be used yet (not there, not warm, or not what the stack declares
    for `model_id`: its I/O fingerprint, its engine layout)."""
    out = []
    for stack, cfg in configs.items():
        model = next((m for m in cfg.models if m.id == model_id), None)
        why = check(cfg, package, io_fingerprint, model)
        if why:
            out.append(f"{stack}: {why}")
    return out
