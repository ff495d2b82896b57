"""The region's model-cache warmer: makes every requested package resident on FSx before any pod reads it.

FSx for Lustre's data repository association imports a package's *metadata* when it lands in the region's bucket;
each file's data is loaded from S3 on its first read (docs/first-update.md, "A warm model cache"). Without this, that
first read is the first pod's startup step 1 (it verifies every file's checksum), inside its startup budget, for
hundreds of GB. The stack runs this module as a CronJob in each region (infra/cache_warmer.py), on the file system
the pods mount. Each run:

1. lists the warm requests in the region's bucket (`cache-state/requests/`, written by `llm-serving publish` and
   replicated with the package) that name this region and have no valid resident marker yet;
2. for each, waits for the package on the file system (the association may still be importing its metadata),
   asks Lustre to restore every file's data from S3 (`lfs hsm_restore`, when the Lustre client tools are in the
   image: a parallel bulk load), then reads every file back in full against the manifest's SHA-256 (which also
   loads any file the restore did not);
3. writes the region's resident marker (llm_serving.cache_state) with the manifest's checksum, so `llm-serving
   rollout start` and `llm-serving publish --wait-materialised` can see it in S3 (the association writes nothing
   back).

A package whose files do not match its manifest gets no marker: the run logs why and exits non-zero after the
others, so the CronJob's failed Job shows it. Nothing here deletes or releases data.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from llm_serving import cache_state
from llm_serving import pod_contract as pc
from llm_serving.manifest import MANIFEST_NAME, ManifestError, parse_manifest

log = logging.getLogger("llm_serving.cache_warmer")
READ_CHUNK = 8 << 20
READERS = 8  # files read at once: FSx serves each file's lazy load from S3 in parallel



class WarmError(RuntimeError):
    """A package that cannot be made resident as published (missing files, wrong bytes)."""


@dataclass(frozen=True)
class Warmed:
    files: int
    bytes: int


Restore = Callable[[list[Path]], None]


def lfs_restore(paths: list[Path]) -> None:
    """Ask Lustre's HSM to load the files' data from the data repository (asynchronous, in parallel on the file
    system's servers); the verifying read that follows waits for each file. Skipped where `lfs` is absent."""
    lfs = shutil.which("lfs")
    if lfs is None or not paths:
        return
    for start in range(0, len(paths), 256):  # bounded argument lists
        subprocess.run([lfs, "hsm_restore", *map(str, paths[start:start + 256])], check=True)


def _digest(path: Path) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    with path.open("rb") as f:
        while chunk := f.read(READ_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def materialise(package_dir: Path, manifest_bytes: bytes, restore: Restore = lfs_restore,
                on_file: Callable[[str, int], None] = lambda _path, _size: None) -> Warmed:
    """Make every file of the package resident and prove it: restore, then read each one in full against the
    manifest (the manifest given is the one published in S3; the one on the file system must be the same bytes)."""
    try:
        manifest = parse_manifest(manifest_bytes.decode())
    except (ManifestError, UnicodeDecodeError) as err:
        raise WarmError(f"{package_dir}: the published {MANIFEST_NAME} cannot be read ({err})") from None
    on_fs = package_dir / MANIFEST_NAME
    if not on_fs.is_file():
        raise WarmError(f"{package_dir}: no {MANIFEST_NAME} on the file system yet (the data repository association "
                        f"has not imported the package)")
    if on_fs.read_bytes() != manifest_bytes:
        raise WarmError(f"{on_fs} differs from the published {MANIFEST_NAME} in S3")
    paths = {rel: package_dir / rel for rel in manifest.files}
    missing = sorted(rel for rel, p in paths.items() if not p.is_file())
    if missing:
        raise WarmError(f"{package_dir}: {len(missing)} file(s) of the manifest are not on the file system, first "
                        f"{missing[0]}")
    restore(list(paths.values()))
    total = 0
    with ThreadPoolExecutor(READERS) as pool:
        for rel, (digest, size) in zip(paths, pool.map(_digest, paths.values()), strict=True):
            if digest != manifest.files[rel]:
                raise WarmError(f"{paths[rel]}: SHA-256 {digest} differs from the manifest's {manifest.files[rel]}")
            total += size
            on_file(rel, size)
    return Warmed(files=len(paths) + 1, bytes=total + len(manifest_bytes))


@dataclass(frozen=True)
class RegionBucket:
    """The region's bucket through boto3's S3 client (moto's in the tests)."""

    s3: object
    bucket: str

    def get(self, key: str) -> bytes | None:
        from botocore.exceptions import ClientError

        try:
            return self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise

    def put(self, key: str, body: bytes) -> None:
        self.s3.put_object(Bucket=self.bucket, Key=key, Body=body, ContentType="application/json")

    def keys(self, prefix: str) -> Iterable[str]:
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                yield item["Key"]


def run_once(store: RegionBucket, region: str, model_prefix: str, file_system_id: str, fs_models_root: Path,
             restore: Restore = lfs_restore) -> list[str]:
    """One pass over the requests for this region. Returns the problems (empty when every request is warm)."""
    problems = []
    prefix = model_prefix.strip("/")
    for key in sorted(store.keys(f"{cache_state.CACHE_STATE_PREFIX}/requests/")):
        try:
            request = cache_state.load_request(key, store.get(key) or b"")
        except cache_state.CacheStateError as err:
            problems.append(str(err))
            continue
        if region not in request.regions:
            continue
        marker_key = cache_state.resident_key(region, request.model_id, request.version)
        cache_key = pc.model_cache_key(request.model_id, request.version)
        manifest_bytes = store.get(pc.manifest_key(f"{prefix}/{cache_key}" if prefix else cache_key))
        if manifest_bytes is None:
            problems.append(f"{request.model_id} {request.version}: not in s3://{store.bucket} yet (replicating)")
            continue
        existing = store.get(marker_key)
        if existing is not None:
            try:
                marker = cache_state.load_marker(marker_key, existing)
                if cache_state.marker_problem(marker, region, request.model_id, request.version,
                                              cache_state.package_checksum(manifest_bytes)) is None:
                    continue
            except cache_state.CacheStateError:
                pass  # rewritten below once the package is verified again
        if cache_state.package_checksum(manifest_bytes) != request.package_sha256:
            problems.append(f"{request.model_id} {request.version}: the published {MANIFEST_NAME} is not the one "
                            f"the request names ({request.package_sha256})")
            continue
        package_dir = fs_models_root / cache_key
        try:
            warmed = materialise(package_dir, manifest_bytes, restore)
        except (WarmError, OSError, subprocess.CalledProcessError) as err:
            problems.append(f"{request.model_id} {request.version}: {err}")
            continue
        store.put(marker_key, cache_state.dump(cache_state.ResidentMarker(
            model_id=request.model_id, version=request.version, region=region, file_system_id=file_system_id,
            package_sha256=cache_state.package_checksum(manifest_bytes), files=warmed.files, bytes=warmed.bytes,
            verified_at=cache_state.now_iso())))
        log.info("%s %s resident on %s (%d files, %d bytes)", request.model_id, request.version, file_system_id,
                 warmed.files, warmed.bytes)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Make requested model packages resident on this region's FSx")
    parser.add_argument("--bucket", default=os.environ.get(pc.ENV_CACHE_BUCKET))
    parser.add_argument("--region", default=os.environ.get(pc.ENV_CACHE_REGION))
    parser.add_argument("--model-prefix", default=os.environ.get(pc.ENV_CACHE_MODEL_PREFIX, "models/"))
    parser.add_argument("--file-system-id", default=os.environ.get(pc.ENV_CACHE_FILE_SYSTEM_ID))
    parser.add_argument("--models-root", type=Path,
                        default=Path(pc.MODEL_CACHE_MOUNT) / pc.FSX_MODELS_PATH.lstrip("/"))
    parser.add_argument("--endpoint-url", default=None, help="an S3-compatible endpoint (tests, local stores)")
    args = parser.parse_args(argv)
    for flag, env in (("bucket", pc.ENV_CACHE_BUCKET), ("region", pc.ENV_CACHE_REGION),
                      ("file_system_id", pc.ENV_CACHE_FILE_SYSTEM_ID)):
        if not getattr(args, flag):
            parser.error(f"--{flag.replace('_', '-')} (or ${env}) is required")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import boto3

    s3 = boto3.client("s3", region_name=args.region, endpoint_url=args.endpoint_url)
    problems = run_once(RegionBucket(s3, args.bucket), args.region, args.model_prefix, args.file_system_id,
                        args.models_root)
    for problem in problems:
        log.error("not resident: %s", problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
