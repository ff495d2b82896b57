"""Local package versions derived from content: the version of every package `llm-serving up` (`make up`) builds.

A published version is immutable (llm_serving/store.py): a second publish must carry the same bytes. So a local
version is a digest of exactly what the package holds: its manifest, which lists the SHA-256 of every file it carries
(weights, model code, config.pbtxt, plugins) beside everything else that decides the package's bytes (serving mode,
engine arguments, backend, I/O fingerprint, an ensemble's step versions). Same content, same version, and publishing
it again is a no-op; any change (`make up` then `make up MODE=standalone`) is a new version.

The manifest also holds the version itself, so the digest is taken over the manifest as built with a fixed
placeholder version; the package is then given its version by rewriting only the manifest. It is not built twice: a
model given to `up --model` can be gigabytes, and the result is byte for byte what build_package writes for that
version (tests/serving/test_cli_local_versions.py checks it).
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from llm_serving.manifest import MANIFEST_NAME, Manifest, parse_manifest
from llm_serving.package import PackageError, PackageSpec, build_package, write_tarball

# What a PackageSpec names as its version when the version is to be derived from its content (a valid version, so
# the draft package builds and its manifest parses like any other).
CONTENT_VERSION = "local-content"
LOCAL_PREFIX = "local-"
DIGEST_CHARS = 10


@dataclass(frozen=True)
class LocalPackage:
    """A package built with a content-derived version."""

    path: Path
    model_id: str
    version: str


def content_version(draft_manifest: str) -> str:
    """The version of a package whose manifest, built with CONTENT_VERSION, is `draft_manifest`."""
    return f"{LOCAL_PREFIX}{hashlib.sha256(draft_manifest.encode()).hexdigest()[:DIGEST_CHARS]}"


def build_local_package(spec: PackageSpec, out_dir: Path, *, packed: bool = True) -> LocalPackage:
    """Build `spec` (whose version must be CONTENT_VERSION) under `out_dir` as `<id>-<version>[.tar.gz]`, its version
    a digest of its content."""
    if spec.version != CONTENT_VERSION:
        raise PackageError(f"{spec.model_id}: version {spec.version!r} given, but a local package's version is "
                           f"derived from its content (build it with version {CONTENT_VERSION!r})")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".local-version-", dir=out_dir) as tmp:
        draft = build_package(spec, Path(tmp) / "draft")
        manifest_path = draft / MANIFEST_NAME
        text = manifest_path.read_text()
        version = content_version(text)
        manifest_path.write_text(_with_version(parse_manifest(text), version).to_toml())
        out = out_dir / f"{spec.model_id}-{version}{'.tar.gz' if packed else ''}"
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        if packed:
            write_tarball(draft, out)
        else:
            draft.rename(out)
    return LocalPackage(out, spec.model_id, version)


def _with_version(manifest: Manifest, version: str) -> Manifest:
    # Validated again (model_validate, not model_copy): the version goes through the manifest's own check.
    data = manifest.model_dump(mode="json", exclude_none=True)
    data["model"]["version"] = version
    return Manifest.model_validate(data)


__all__ = ["CONTENT_VERSION", "LocalPackage", "build_local_package", "content_version"]
