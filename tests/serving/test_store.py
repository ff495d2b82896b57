"""Publishing to the model store: local directory and S3 (moto's S3-compatible server, over HTTP, through boto3).

moto's server stands in for S3 because no AWS account is reachable here; it speaks the S3 wire protocol, so boto3
runs its real request path (checksums included).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from llm_serving.package import PackageError, PackageSpec, build_package, open_package
from llm_serving.store import LocalStore, PublishError, S3Store


@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    root = tmp_path / "hf-model"
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (root / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    return root


@pytest.fixture(scope="module")
def s3_endpoint():
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture()
def s3(s3_endpoint, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    bucket = f"models-{abs(hash(monkeypatch)) % 10**8}"
    client.create_bucket(Bucket=bucket)
    return client, bucket


def test_local_publish_materialises_the_package_on_the_model_cache(model_dir: Path, tmp_path: Path):
    package = build_package(PackageSpec(model_dir, "demo", "1"), tmp_path / "demo-1.tar.gz")
    store = LocalStore(tmp_path / "store", tmp_path / "cache")
    published = store.publish(package)
    assert Path(published.package_uri) == tmp_path / "store" / "packages" / "demo" / "1.tar.gz"
    assert Path(published.package_uri).read_bytes() == package.read_bytes()
    cached = open_package(Path(published.model_cache_uri))
    assert cached.root == tmp_path / "cache" / "demo" / "1"
    assert (cached.weights_path / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()
    # Nothing temporary is left behind.
    assert [p.name for p in (tmp_path / "store").iterdir()] == ["packages"]
    assert [p.name for p in (tmp_path / "cache" / "demo").iterdir()] == ["1"]


def test_local_publish_is_idempotent_but_versions_are_immutable(model_dir: Path, tmp_path: Path):
    store = LocalStore(tmp_path / "store", tmp_path / "cache")
    first = store.publish(build_package(PackageSpec(model_dir, "demo", "1"), tmp_path / "a.tar.gz"))
    again = store.publish(build_package(PackageSpec(model_dir, "demo", "1"), tmp_path / "b.tar.gz"))
    assert again.already_published and again.sha256 == first.sha256
    (model_dir / "model.safetensors").write_bytes(b"different weights")
    changed = build_package(PackageSpec(model_dir, "demo", "1"), tmp_path / "c.tar.gz")
    with pytest.raises(PublishError, match="demo 1 is already published with different content"):
        store.publish(changed)
    assert Path(first.package_uri).read_bytes() == (tmp_path / "a.tar.gz").read_bytes()


def test_local_publish_refuses_a_corrupt_package_before_writing(model_dir: Path, tmp_path: Path):
    package = build_package(PackageSpec(model_dir, "demo", "1"), tmp_path / "pkg")
    (package / "weights" / "config.json").write_text("{}")
    store = LocalStore(tmp_path / "store", tmp_path / "cache")
    with pytest.raises(PackageError, match="weights/config.json: checksum mismatch"):
        store.publish(package)
    assert not (tmp_path / "cache").exists()
    assert list((tmp_path / "store").rglob("*.tar.gz")) == []


def test_s3_publish_uploads_package_and_model_cache(model_dir: Path, tmp_path: Path, s3):
    client, bucket = s3
    package = build_package(PackageSpec(model_dir, "demo", "2"), tmp_path / "demo-2.tar.gz")
    published = S3Store(f"s3://{bucket}/llm", client=client).publish(package)
    assert published.package_uri == f"s3://{bucket}/llm/packages/demo/2.tar.gz"
    body = client.get_object(Bucket=bucket, Key="llm/packages/demo/2.tar.gz")
    assert body["Body"].read() == package.read_bytes()
    assert body["Metadata"]["sha256"] == published.sha256
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="llm/")["Contents"]}
    assert keys == {
        "llm/packages/demo/2.tar.gz",
        "llm/model-cache/demo/2/package.toml",
        "llm/model-cache/demo/2/weights/config.json",
        "llm/model-cache/demo/2/weights/model.safetensors",
    }
    weights = client.get_object(Bucket=bucket, Key="llm/model-cache/demo/2/weights/model.safetensors")["Body"].read()
    assert weights == (model_dir / "model.safetensors").read_bytes()


def test_s3_versions_are_immutable(model_dir: Path, tmp_path: Path, s3):
    client, bucket = s3
    store = S3Store(f"s3://{bucket}", client=client)
    store.publish(build_package(PackageSpec(model_dir, "demo", "3"), tmp_path / "a.tar.gz"))
    assert store.publish(build_package(PackageSpec(model_dir, "demo", "3"), tmp_path / "b.tar.gz")).already_published
    (model_dir / "config.json").write_text('{"model_type": "mistral"}')
    with pytest.raises(PublishError, match="already published with different content"):
        store.publish(build_package(PackageSpec(model_dir, "demo", "3"), tmp_path / "c.tar.gz"))


def test_s3_interrupted_publish_leaves_the_previous_version_intact(model_dir: Path, tmp_path: Path, s3):
    """The upload dies between the temporary key and the final copy: version 4 stays unpublished, 3 untouched."""
    client, bucket = s3
    store = S3Store(f"s3://{bucket}", client=client)
    previous = store.publish(build_package(PackageSpec(model_dir, "demo", "3"), tmp_path / "a.tar.gz"))

    class Interrupted(Exception):
        pass

    real_copy = client.copy_object

    def dying_copy(**kwargs):
        raise Interrupted("connection lost")

    client.copy_object = dying_copy
    try:
        with pytest.raises(Interrupted):
            store.publish(build_package(PackageSpec(model_dir, "demo", "4"), tmp_path / "b.tar.gz"))
    finally:
        client.copy_object = real_copy
    assert store.published_sha256("demo", "4") is None
    assert store.published_sha256("demo", "3") == previous.sha256
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="packages/")["Contents"]}
    assert keys == {"packages/demo/3.tar.gz"}  # the temporary key was cleaned up too


def _cache_objects(client, bucket: str, prefix: str) -> dict[str, bytes]:
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])]
    return {k: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}


def test_s3_publish_dying_mid_weights_upload_leaves_the_previous_version_servable(model_dir: Path, tmp_path: Path,
                                                                                  s3):
    """The connection dies after some of version 4's files reached the model cache: version 3's package and model
    cache are byte for byte what they were, and version 4 is not published (a rollout cannot name it)."""
    client, bucket = s3
    store = S3Store(f"s3://{bucket}", client=client)
    store.publish(build_package(PackageSpec(model_dir, "demo", "3"), tmp_path / "a.tar.gz"))
    before = _cache_objects(client, bucket, "model-cache/demo/3/")
    package_before = client.get_object(Bucket=bucket, Key="packages/demo/3.tar.gz")["Body"].read()
    real_put, calls = client.put_object, []

    def dying_put(**kwargs):
        calls.append(kwargs["Key"])
        if len(calls) == 2:
            raise ConnectionError("connection reset by peer")
        return real_put(**kwargs)

    client.put_object = dying_put
    try:
        with pytest.raises(ConnectionError):
            store.publish(build_package(PackageSpec(model_dir, "demo", "4"), tmp_path / "b.tar.gz"))
    finally:
        client.put_object = real_put
    assert calls[0].startswith("model-cache/demo/4/")
    assert store.published_sha256("demo", "4") is None
    assert _cache_objects(client, bucket, "model-cache/demo/3/") == before
    assert client.get_object(Bucket=bucket, Key="packages/demo/3.tar.gz")["Body"].read() == package_before
    # And publishing version 4 again completes: the half-written cache prefix is simply overwritten.
    again = store.publish(build_package(PackageSpec(model_dir, "demo", "4"), tmp_path / "c.tar.gz"))
    assert not again.already_published and store.published_sha256("demo", "4") == again.sha256


def test_local_publish_dying_mid_copy_leaves_the_previous_version_servable(model_dir: Path, tmp_path: Path,
                                                                           monkeypatch):
    """The disk fills while version 2 is copied onto the model cache: version 1 still opens and verifies."""
    store = LocalStore(tmp_path / "store", tmp_path / "cache")
    first = store.publish(build_package(PackageSpec(model_dir, "demo", "1"), tmp_path / "a.tar.gz"))
    (model_dir / "model.safetensors").write_bytes(b"version two weights")
    second = build_package(PackageSpec(model_dir, "demo", "2"), tmp_path / "b.tar.gz")
    real_copyfile = shutil.copyfile

    def dying_copy(src, dst, *args, **kwargs):
        if os.fspath(src).endswith("model.safetensors"):
            raise OSError(28, "No space left on device")
        return real_copyfile(src, dst, *args, **kwargs)

    monkeypatch.setattr(shutil, "copyfile", dying_copy)
    with pytest.raises(OSError):
        store.publish(second)
    monkeypatch.undo()
    assert store.published_sha256("demo", "2") is None
    assert not (tmp_path / "cache" / "demo" / "2").exists()
    assert open_package(Path(first.model_cache_uri)).manifest.model.version == "1"
    assert [p.name for p in (tmp_path / "cache" / "demo").iterdir()] == ["1"]  # no half-copied staging left
