"""Publishing model packages to a model store: a local directory, or S3 (docs/architecture.md §3.4).

Layout, the same in both (the keys come from llm_serving.pod_contract, which the Pulumi program uses too):
    <store>/packages/<model id>/<version>.tar.gz        the package archive; its presence means "published"
    <model cache>/<model id>/<version>/                  the unpacked package (weights included), what pods read

On S3 the model cache is the `model-cache/` prefix of the same store (`s3://<bucket>/<model prefix>`), which FSx
for Lustre's data repository association presents to the pods (`model-cache/<id>/<version>/` below the association's
path); pods read that directory in place, never the archive. Locally the model cache is a directory.

Order: verify the package, materialise it on the model
cache, then upload the package under a temporary key, check its checksum, and only then copy it to its final key.
An interrupted publish therefore never replaces or half-writes a published version; versions are immutable (a
second publish of the same version must carry identical bytes).
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import tempfile
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from llm_serving.cache_state import (
    CacheStateError,
    WarmRequest,
    dump,
    load_marker,
    marker_problem,
    package_checksum,
    request_key,
    resident_key,
)
from llm_serving.manifest import MANIFEST_NAME
from llm_serving.package import PackageError, VerifiedPackage, open_package, sha256_file, write_tarball
from llm_serving.pod_contract import MODEL_CACHE_PREFIX, PACKAGES_PREFIX, model_cache_key, package_archive_key


class PublishError(RuntimeError):
    pass


@dataclass(frozen=True)
class PublishedPackage:
    model_id: str
    version: str
    package_uri: str  # where the package archive lives
    model_cache_uri: str  # where the unpacked package lives (what a rollout names)
    sha256: str
    already_published: bool = False
    manifest_sha256: str = ""  # of package.toml: what a region's resident marker records (llm_serving.cache_state)


def _as_tarball(package: Path, scratch: Path) -> Path:
    if package.is_dir():
        out = scratch / "package.tar.gz"
        write_tarball(package, out)
        return out
    return package


class ModelStore(ABC):
    """The publish procedure, the same for every store: verify the package, refuse a version already published with
    other bytes, materialise it on the model cache, then write the package (unless it was already there). A store
    supplies only the storage: where the package lives, how it is read back, written and unpacked."""

    def publish(self, package: Path) -> PublishedPackage:
        with self._scratch() as tmp:
            scratch = Path(tmp)
            tarball = _as_tarball(Path(package), scratch)
            verified = open_package(tarball, scratch / "verify")
            ident = verified.manifest.model
            digest = sha256_file(tarball)
            package_uri = self._package_uri(ident.id, ident.version)
            existing = self.published_sha256(ident.id, ident.version)
            if existing is not None and existing != digest:
                raise PublishError(
                    f"{ident.id} {ident.version} is already published with different content at {package_uri} "
                    f"(sha256 {existing[:12]}..., this package {digest[:12]}...); versions are immutable, "
                    "publish a new version"
                )
            cache_uri = self._materialise(verified, ident.id, ident.version)
            if existing is None:
                self._put_package(tarball, ident.id, ident.version, digest)
            manifest_sha256 = package_checksum((verified.root / MANIFEST_NAME).read_bytes())
            return PublishedPackage(ident.id, ident.version, package_uri, cache_uri, digest, existing is not None,
                                    manifest_sha256)

    @abstractmethod
    def published_sha256(self, model_id: str, version: str) -> str | None:
        """The SHA-256 of the published package, or None if the version is not published."""

    @abstractmethod
    def _scratch(self) -> tempfile.TemporaryDirectory:
        """A scratch directory for the package's verification."""

    @abstractmethod
    def _package_uri(self, model_id: str, version: str) -> str:
        """Where the package of this version lives (or will)."""

    @abstractmethod
    def _materialise(self, verified: VerifiedPackage, model_id: str, version: str) -> str:
        """Put the unpacked package on the model cache, replacing any earlier attempt; return its URI."""

    @abstractmethod
    def _put_package(self, tarball: Path, model_id: str, version: str, sha256: str) -> None:
        """Write the package under its final name all at once, checked against `sha256`: never half-written."""


class LocalStore(ModelStore):
    """A directory store with a local model cache, for `make up` and development."""

    def __init__(self, root: Path, model_cache: Path):
        self.root = Path(root)
        self.model_cache = Path(model_cache)

    def _package_path(self, model_id: str, version: str) -> Path:
        return self.root / package_archive_key(model_id, version)

    def cache_path(self, model_id: str, version: str) -> Path:
        return self.model_cache / model_cache_key(model_id, version).removeprefix(f"{MODEL_CACHE_PREFIX}/")

    def published_sha256(self, model_id: str, version: str) -> str | None:
        path = self._package_path(model_id, version)
        return sha256_file(path) if path.exists() else None

    def _scratch(self) -> tempfile.TemporaryDirectory:
        self.root.mkdir(parents=True, exist_ok=True)
        return tempfile.TemporaryDirectory(dir=self.root, prefix=".publish-")

    def _package_uri(self, model_id: str, version: str) -> str:
        return str(self._package_path(model_id, version))

    def _put_package(self, tarball: Path, model_id: str, version: str, sha256: str) -> None:
        final = self._package_path(model_id, version)
        final.parent.mkdir(parents=True, exist_ok=True)
        partial = final.with_name(f".{final.name}.{uuid.uuid4().hex}.partial")
        shutil.copyfile(tarball, partial)
        with open(partial, "rb") as handle:
            os.fsync(handle.fileno())
        if sha256_file(partial) != sha256:
            partial.unlink()
            raise PublishError(f"{final}: checksum changed while copying; nothing published")
        partial.replace(final)  # atomic on one file system: readers see all of it or none

    def _materialise(self, verified: VerifiedPackage, model_id: str, version: str) -> str:
        cache = self.cache_path(model_id, version)
        cache.parent.mkdir(parents=True, exist_ok=True)
        staging = cache.parent / f".{cache.name}.{uuid.uuid4().hex}"
        try:
            shutil.copytree(verified.root, staging, symlinks=True)
            open_package(staging)  # the copy is what pods will read: verify it, not the source
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        if cache.exists():
            shutil.rmtree(cache)
        staging.rename(cache)
        return str(cache)


def _b64_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return base64.b64encode(digest.digest()).decode()


class S3Store(ModelStore):
    """`s3://bucket/prefix`: packages under `<prefix>/packages/`, the model cache under `<prefix>/model-cache/`."""

    def __init__(self, uri: str, client=None):
        if not uri.startswith("s3://"):
            raise PublishError(f"{uri}: an S3 store URI starts with s3://")
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        if not bucket:
            raise PublishError(f"{uri}: no bucket in the S3 URI")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        if client is None:
            import boto3

            client = boto3.client("s3")
        self.s3 = client

    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def _package_key(self, model_id: str, version: str) -> str:
        return self._key(package_archive_key(model_id, version))

    def published_sha256(self, model_id: str, version: str) -> str | None:
        from botocore.exceptions import ClientError

        try:
            head = self.s3.head_object(Bucket=self.bucket, Key=self._package_key(model_id, version))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        return head.get("Metadata", {}).get("sha256")

    def _scratch(self) -> tempfile.TemporaryDirectory:
        return tempfile.TemporaryDirectory(prefix="llm-serving-publish-")

    def _package_uri(self, model_id: str, version: str) -> str:
        return f"s3://{self.bucket}/{self._package_key(model_id, version)}"

    def _materialise(self, verified: VerifiedPackage, model_id: str, version: str) -> str:
        cache_prefix = self._key(model_cache_key(model_id, version))
        for path in sorted(p for p in verified.root.rglob("*") if p.is_file()):
            rel = path.relative_to(verified.root).as_posix()
            self._put_checked(path, f"{cache_prefix}/{rel}")
        return f"s3://{self.bucket}/{cache_prefix}/"

    def _put_package(self, tarball: Path, model_id: str, version: str, sha256: str) -> None:
        temporary = self._key(PACKAGES_PREFIX, model_id, f".tmp-{version}-{uuid.uuid4().hex}")
        self._put_checked(tarball, temporary, metadata={"sha256": sha256})
        try:
            self.s3.copy_object(
                Bucket=self.bucket, Key=self._package_key(model_id, version),
                CopySource={"Bucket": self.bucket, "Key": temporary}, MetadataDirective="COPY",
                ChecksumAlgorithm="SHA256",
            )
        finally:
            self.s3.delete_object(Bucket=self.bucket, Key=temporary)

    def _put_checked(self, path: Path, key: str, metadata: dict | None = None) -> None:
        """Upload with S3's own SHA-256 check: S3 refuses the object if the bytes differ from the checksum."""
        checksum = _b64_sha256(path)
        with open(path, "rb") as body:
            self.s3.put_object(
                Bucket=self.bucket, Key=key, Body=body, ChecksumSHA256=checksum, Metadata=metadata or {},
            )
        head = self.s3.head_object(Bucket=self.bucket, Key=key, ChecksumMode="ENABLED")
        if head.get("ChecksumSHA256") not in (None, checksum) or head["ContentLength"] != path.stat().st_size:
            raise PublishError(f"s3://{self.bucket}/{key}: uploaded object does not match {path.name}")


    # -- a warm model cache in every region (docs/first-update.md, "A warm model cache") --------------------------

    def regional_bucket(self, home_region: str, region: str) -> str:
        """The region's own bucket under the platform's naming rule `<bucketPrefix>-<env>-<region>` (infra/config.py:
        every stack names its bucket so), from this store's home bucket."""
        if not self.bucket.endswith(f"-{home_region}"):
            raise PublishError(f"s3://{self.bucket} does not end with its home region -{home_region}: the platform's "
                               f"buckets are named <bucketPrefix>-<env>-<region>")
        return self.bucket[: -len(home_region)] + region

    def request_warm(self, published: PublishedPackage, regions: list[str]) -> str:
        """Ask the model caches of `regions` to hold this version resident (the request replicates with the package
        to every region's bucket; each region's cache warmer answers it). Returns the request's URI."""
        key = request_key(published.model_id, published.version)
        request = WarmRequest(model_id=published.model_id, version=published.version, regions=sorted(set(regions)),
                              package_sha256=published.manifest_sha256)
        self.s3.put_object(Bucket=self.bucket, Key=key, Body=dump(request), ContentType="application/json")
        return f"s3://{self.bucket}/{key}"


def resident_problem(s3_for_region, bucket: str, region: str, published: PublishedPackage) -> str | None:
    """Why `published` is not (yet) resident on `region`'s model cache, or None once its marker says so."""
    from botocore.exceptions import ClientError

    key = resident_key(region, published.model_id, published.version)
    try:
        body = s3_for_region(region).get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return f"no marker s3://{bucket}/{key} yet"
        raise
    try:
        marker = load_marker(key, body)
    except CacheStateError as err:
        return str(err)
    return marker_problem(marker, region, published.model_id, published.version, published.manifest_sha256)


def open_store(uri: str | None, model_cache: Path, default_root: Path) -> ModelStore:
    if uri and uri.startswith("s3://"):
        return S3Store(uri)
    if uri and "://" in uri:
        raise PublishError(f"{uri}: unsupported store (use a directory or s3://bucket/prefix)")
    return LocalStore(Path(uri) if uri else default_root, model_cache)


__all__ = ["LocalStore", "ModelStore", "S3Store", "PublishError", "PublishedPackage", "open_store", "PackageError"]
