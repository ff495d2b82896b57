"""A warm model cache before traffic: publish writes a warm request, each region's cache warmer makes
every file resident and writes its marker in S3, `publish --wait-materialised` waits for the markers and the
rollout's check accepts exactly what the warmer wrote.

Stand-ins, because nothing real can run here: moto's S3 server (over HTTP, through boto3) for the buckets; S3's
cross-region replication is played by copying the objects (moto does not replicate); the FSx file system is a
directory holding what the data repository association would present, and `lfs hsm_restore` is a recorder (no
Lustre client here). The warmer's verifying read, its markers and the rollout's reading of them are the real code.
"""

from __future__ import annotations

import json
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer
from rich.console import Console

from llm_serving import cache_state
from llm_serving import pod_contract as pc
from llm_serving.package import PackageSpec, build_package
from llm_serving.store import S3Store
from llm_serving_cli.warm_wait import wait_resident
from serving_image import cache_warmer

HOME, WEST = "us-east-1", "us-west-2"
BUCKETS = {HOME: "acme-llm-prod-us-east-1", WEST: "acme-llm-prod-us-west-2"}


@pytest.fixture(scope="module")
def endpoint():
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture()
def s3(endpoint, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    clients = {r: boto3.client("s3", endpoint_url=endpoint, region_name=r) for r in BUCKETS}
    for region, bucket in BUCKETS.items():
        for item in clients[region].list_objects_v2(Bucket=bucket).get("Contents", []) if _exists(
                clients[region], bucket) else []:
            clients[region].delete_object(Bucket=bucket, Key=item["Key"])
        if not _exists(clients[region], bucket):
            kwargs = {} if region == HOME else {"CreateBucketConfiguration": {"LocationConstraint": region}}
            clients[region].create_bucket(Bucket=bucket, **kwargs)
    return clients


def _exists(client, bucket: str) -> bool:
    return any(b["Name"] == bucket for b in client.list_buckets()["Buckets"])


@pytest.fixture()
def published(s3, tmp_path: Path):
    model = tmp_path / "hf-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    package = build_package(PackageSpec(model, "chat", "1.0.0"), tmp_path / "chat-1.0.0.tar.gz")
    store = S3Store(f"s3://{BUCKETS[HOME]}/models", client=s3[HOME])
    return store, store.publish(package)


def _replicate(s3) -> None:
    """S3 replication's effect, home bucket to the west bucket, every object (the bucket's rule replicates all)."""
    for item in s3[HOME].list_objects_v2(Bucket=BUCKETS[HOME])["Contents"]:
        body = s3[HOME].get_object(Bucket=BUCKETS[HOME], Key=item["Key"])["Body"].read()
        s3[WEST].put_object(Bucket=BUCKETS[WEST], Key=item["Key"], Body=body)


def _associate(s3, region: str, fs_root: Path) -> None:
    """What the data repository association presents on FSx: the bucket's model prefix, as files."""
    for item in s3[region].list_objects_v2(Bucket=BUCKETS[region], Prefix="models/model-cache/")["Contents"]:
        target = fs_root / item["Key"].removeprefix("models/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(s3[region].get_object(Bucket=BUCKETS[region], Key=item["Key"])["Body"].read())


def test_publish_requests_and_the_warmer_of_each_region_answers_with_its_marker(s3, published, tmp_path):
    store, pkg = published
    request_uri = store.request_warm(pkg, [HOME, WEST])
    assert request_uri == f"s3://{BUCKETS[HOME]}/cache-state/requests/chat/1.0.0.json"
    restored: list[Path] = []
    home_fs = tmp_path / "fsx-home"
    _associate(s3, HOME, home_fs)
    problems = cache_warmer.run_once(cache_warmer.RegionBucket(s3[HOME], BUCKETS[HOME]), HOME, "models/",
                                     "fs-home", home_fs, restore=restored.extend)
    assert problems == []
    package_dir = home_fs / pc.model_cache_key("chat", "1.0.0")
    assert sorted(restored) == sorted(p for p in package_dir.rglob("*") if p.is_file() and p.name != "package.toml")
    marker = cache_state.load_marker("k", s3[HOME].get_object(
        Bucket=BUCKETS[HOME], Key=cache_state.resident_key(HOME, "chat", "1.0.0"))["Body"].read())
    assert (marker.region, marker.file_system_id, marker.package_sha256, marker.files) == (
        HOME, "fs-home", pkg.manifest_sha256, 3)
    # The west region's warmer sees the request only once it has replicated, and the package with it.
    west_store = cache_warmer.RegionBucket(s3[WEST], BUCKETS[WEST])
    assert cache_warmer.run_once(west_store, WEST, "models/", "fs-west", tmp_path / "fsx-west") == []
    _replicate(s3)
    west_fs = tmp_path / "fsx-west"
    west_fs.mkdir()
    (problem,) = cache_warmer.run_once(west_store, WEST, "models/", "fs-west", west_fs, restore=lambda p: None)
    assert problem.startswith("chat 1.0.0: ") and "no package.toml on the file system yet" in problem
    _associate(s3, WEST, west_fs)
    assert cache_warmer.run_once(west_store, WEST, "models/", "fs-west", west_fs, restore=lambda p: None) == []
    # A marker replicated from the home region never stands for the west region's cache: keys carry the region.
    assert {o["Key"] for o in s3[WEST].list_objects_v2(Bucket=BUCKETS[WEST], Prefix="cache-state/resident/")[
        "Contents"]} == {"cache-state/resident/us-east-1/chat/1.0.0.json",
                         "cache-state/resident/us-west-2/chat/1.0.0.json"}


def test_a_file_that_does_not_match_the_manifest_gets_no_marker(s3, published, tmp_path):
    store, pkg = published
    store.request_warm(pkg, [HOME])
    fs = tmp_path / "fsx"
    _associate(s3, HOME, fs)
    weights = fs / pc.model_cache_key("chat", "1.0.0") / "weights" / "model.safetensors"
    weights.write_bytes(b"truncated")
    (problem,) = cache_warmer.run_once(cache_warmer.RegionBucket(s3[HOME], BUCKETS[HOME]), HOME, "models/", "fs-home",
                                       fs, restore=lambda p: None)
    assert f"{weights}: SHA-256 " in problem and "differs from the manifest's" in problem
    assert "Contents" not in s3[HOME].list_objects_v2(Bucket=BUCKETS[HOME], Prefix="cache-state/resident/")


def test_publish_waits_for_every_region_and_names_the_cold_ones(s3, published, tmp_path):
    store, pkg = published
    store.request_warm(pkg, [HOME, WEST])
    fs = tmp_path / "fsx"
    _associate(s3, HOME, fs)
    cache_warmer.run_once(cache_warmer.RegionBucket(s3[HOME], BUCKETS[HOME]), HOME, "models/", "fs-home", fs,
                          restore=lambda p: None)
    now = [0.0]
    console = Console(file=open(tmp_path / "progress.txt", "w"), width=120)  # noqa: SIM115 (closed by the test)
    cold = wait_resident(store, pkg, HOME, [HOME, WEST], timeout_s=60, poll_s=15, console=console,
                         s3_for_region=s3.__getitem__, sleep=lambda s: now.__setitem__(0, now[0] + s),
                         clock=lambda: now[0])
    console.file.close()
    assert cold == {WEST: f"no marker s3://{BUCKETS[WEST]}/cache-state/resident/us-west-2/chat/1.0.0.json yet"}
    assert now[0] == 60  # polled until the timeout, not longer
    _replicate(s3)
    west_fs = tmp_path / "fsx-west"
    _associate(s3, WEST, west_fs)
    cache_warmer.run_once(cache_warmer.RegionBucket(s3[WEST], BUCKETS[WEST]), WEST, "models/", "fs-west", west_fs,
                          restore=lambda p: None)
    assert wait_resident(store, pkg, HOME, [HOME, WEST], timeout_s=0, poll_s=15, console=Console(quiet=True),
                         s3_for_region=s3.__getitem__) == {}


def test_the_rollouts_check_accepts_exactly_what_the_warmer_wrote(s3, published, tmp_path):
    """The seam: the marker the warmer writes (serving image) is what `llm-serving rollout start` reads (infra)."""
    from infra.rollout.replication import warm_problem
    from tests.infra.conftest import config_of

    store, pkg = published
    cfg = config_of("prod-us-east-1")
    uri = pc.package_uri(BUCKETS[HOME], "models/", "chat", "1.0.0")

    def get(region: str, bucket: str, key: str) -> bytes | None:
        try:
            return s3[region].get_object(Bucket=bucket, Key=key)["Body"].read()
        except s3[region].exceptions.NoSuchKey:
            return None

    manifest = get(HOME, BUCKETS[HOME], pc.manifest_key(f"models/{pc.model_cache_key('chat', '1.0.0')}"))
    assert "is not materialised on us-east-1's model cache" in warm_problem(cfg, uri, manifest, get)
    store.request_warm(pkg, [HOME])
    fs = tmp_path / "fsx"
    _associate(s3, HOME, fs)
    cache_warmer.run_once(cache_warmer.RegionBucket(s3[HOME], BUCKETS[HOME]), HOME, "models/", "fs-home", fs,
                          restore=lambda p: None)
    assert warm_problem(cfg, uri, manifest, get) is None
