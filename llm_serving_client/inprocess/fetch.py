"""Fetch a published package directory from S3 (the stack outputs' `inProcess.versions[<v>].package`, the model
bucket's `model-cache/<id>/<version>/` in the caller's region) into a local directory, for the in-process loader,
which then verifies every file against the package's checksums: nothing fetched is trusted before that."""

from __future__ import annotations

from pathlib import Path, PurePosixPath


class FetchError(ValueError):
    pass


def fetch_package(uri: str, dest: Path, s3=None) -> Path:
    """Every object under `uri` (an `s3://bucket/prefix/` directory) to the same relative path under `dest`."""
    if not uri.startswith("s3://") or not uri.endswith("/"):
        raise FetchError(f"{uri}: a published package directory is s3://<bucket>/<prefix>/ (ending in /)")
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    if s3 is None:
        import boto3

        s3 = boto3.client("s3")
    dest.mkdir(parents=True, exist_ok=True)
    count = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            rel = PurePosixPath(item["Key"][len(prefix):])
            if rel.is_absolute() or ".." in rel.parts or not rel.parts:
                raise FetchError(f"{uri}: object {item['Key']!r} would land outside the package directory")
            target = dest.joinpath(*rel.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, item["Key"], str(target))
            count += 1
    if not count:
        raise FetchError(f"{uri}: no package there (no object under the prefix)")
    return dest
