"""`llm-serving rollout start` refuses a package that has not replicated to every named region yet, checked against
the store (moto's S3 in place of the real buckets), and changes nothing (infra/rollout/replication.py)."""

from __future__ import annotations

import boto3
import pytest
from moto import mock_aws

from infra.rollout.orchestrate import Options, Rollout, RolloutError
from infra.rollout.replication import regional_location, s3_replica_check
from infra.rollout.runner import GraphRunner
from llm_serving import cache_state
from tests.infra.conftest import config_of
from tests.infra.rollout_support import copy_stacks

PACKAGE = "s3://acme-llm-prod-us-east-1/models/model-cache/chat-large/2.5.0/"
STACKS = ["prod-us-east-1", "prod-us-west-2"]


@pytest.fixture
def s3(monkeypatch):
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(key, "testing")
    with mock_aws():
        for stack in STACKS:
            cfg = config_of(stack)
            client = boto3.client("s3", region_name=cfg.region)
            kwargs = {} if cfg.region == "us-east-1" else {
                "CreateBucketConfiguration": {"LocationConstraint": cfg.region}}
            client.create_bucket(Bucket=cfg.bucket_name(), **kwargs)
        yield lambda region: boto3.client("s3", region_name=region)


FINGERPRINT = "sha256:" + "1" * 64


def _manifest(fingerprint: str = FINGERPRINT, tensor: int = 8) -> bytes:
    return (f'manifest_version = 1\n[model]\nid = "chat-large"\nversion = "2.5.0"\nbackend = "vllm"\n'
            f'io_fingerprint = "{fingerprint}"\n[engine.parallel]\ntensor = {tensor}\n').encode()


def _marker(region: str, manifest: bytes) -> bytes:
    return cache_state.dump(cache_state.ResidentMarker(
        model_id="chat-large", version="2.5.0", region=region, file_system_id="fs-0123456789abcdef0",
        package_sha256=cache_state.package_checksum(manifest), files=3, bytes=1 << 30,
        verified_at="2026-12-03T09:00:00Z"))


def _put(s3, stack: str, fingerprint: str = FINGERPRINT, warm: bool = True, tensor: int = 8) -> None:
    """What `llm-serving publish` leaves on the bucket for a package (its manifest inside the package directory) and,
    with `warm`, the marker the region's cache warmer writes once every file is resident on its FSx."""
    cfg = config_of(stack)
    bucket, key = regional_location(cfg, PACKAGE)
    manifest = _manifest(fingerprint, tensor)
    s3(cfg.region).put_object(Bucket=bucket, Key=key, Body=manifest)
    if warm:
        s3(cfg.region).put_object(Bucket=bucket, Key=cache_state.resident_key(cfg.region, "chat-large", "2.5.0"),
                                  Body=_marker(cfg.region, manifest))


def test_the_replica_is_looked_up_in_each_regions_own_bucket(s3):
    check = s3_replica_check(s3)
    home, west = config_of("prod-us-east-1"), config_of("prod-us-west-2")
    assert regional_location(west, PACKAGE) == ("acme-llm-prod-us-west-2",
                                                "models/model-cache/chat-large/2.5.0/package.toml")
    assert "is not published" in check(home, PACKAGE)
    _put(s3, "prod-us-east-1")
    assert check(home, PACKAGE) is None
    why = check(west, PACKAGE)
    assert why.startswith(f"{PACKAGE} has not replicated to us-west-2 yet: "
                          "s3://acme-llm-prod-us-west-2/models/model-cache/chat-large/2.5.0/package.toml does not "
                          "exist")
    _put(s3, "prod-us-west-2")
    assert check(west, PACKAGE) is None


def test_start_refuses_before_touching_any_stack(s3, tmp_path):
    config_dir = copy_stacks(tmp_path / "stacks")
    before = {p.name: p.read_text() for p in config_dir.iterdir()}
    runner = GraphRunner(config_dir, tmp_path / "state")
    rollout = Rollout(runner, "chat-large", STACKS, Options(), replicas=s3_replica_check(s3))
    _put(s3, "prod-us-east-1")
    version = {"version": "2.5.0", "package": PACKAGE, "ioFingerprint": FINGERPRINT}
    with pytest.raises(RolloutError, match=r"cannot be rolled out yet \(nothing was changed\):\n  prod-us-west-2: "
                                           r".* has not replicated to us-west-2 yet"):
        rollout.start(version)
    assert {p.name: p.read_text() for p in config_dir.iterdir()} == before


def test_start_refuses_a_fingerprint_that_differs_from_the_published_manifest(s3, tmp_path):
    """The stack's ioFingerprint is compared with the published manifest before any stack changes."""
    config_dir = copy_stacks(tmp_path / "stacks")
    before = {p.name: p.read_text() for p in config_dir.iterdir()}
    rollout = Rollout(GraphRunner(config_dir, tmp_path / "state"), "chat-large", STACKS, Options(),
                      replicas=s3_replica_check(s3))
    for stack in STACKS:
        _put(s3, stack)
    typed = "sha256:" + "2" * 64
    with pytest.raises(RolloutError) as err:
        rollout.start({"version": "2.5.0", "package": PACKAGE, "ioFingerprint": typed})
    assert f"the stack's ioFingerprint {typed} differs from the published manifest's model.io_fingerprint " \
           f"{FINGERPRINT}" in str(err.value)
    assert {p.name: p.read_text() for p in config_dir.iterdir()} == before


def test_the_command_checks_the_fingerprint_at_a_reachable_store(tmp_path, capsys, monkeypatch):
    """`llm-serving rollout start --store-endpoint URL` (any runner): the published manifest's fingerprint is compared
    before any stack file changes, naming both values."""
    from moto.server import ThreadedMotoServer

    from llm_serving_cli.main import main as llm_serving_main

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(key, "testing")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        cfg = config_of("prod-eu-west-1")
        manifest = _manifest()
        for region in ("us-east-1", "eu-west-1"):
            client = boto3.client("s3", region_name=region, endpoint_url=endpoint)
            bucket = cfg.bucket_name(region)
            kwargs = {} if region == "us-east-1" else {"CreateBucketConfiguration": {"LocationConstraint": region}}
            client.create_bucket(Bucket=bucket, **kwargs)
            client.put_object(Bucket=bucket, Key=regional_location(config_of("prod-eu-west-1"), PACKAGE)[1],
                              Body=manifest)
        config_dir = copy_stacks(tmp_path / "stacks")
        before = {p.name: p.read_text() for p in config_dir.iterdir()}
        typed = "sha256:" + "3" * 64
        with pytest.raises(SystemExit) as exited:
            llm_serving_main(["rollout", "start", "chat-large", "--stacks", "prod-eu-west-1", "--version", "2.5.0",
                              "--io-fingerprint", typed, "--runner", "mock", "--config-dir", str(config_dir),
                              "--state-dir", str(tmp_path / "state"), "--no-gate", "--store-endpoint", endpoint])
        assert exited.value.code != 0
        err = " ".join(capsys.readouterr().err.split())
        assert f"the stack's ioFingerprint {typed} differs from the published manifest's model.io_fingerprint " \
               f"{FINGERPRINT}" in err
        assert {p.name: p.read_text() for p in config_dir.iterdir()} == before
    finally:
        server.stop()


def test_a_replica_that_is_not_warm_on_the_regions_cache_is_refused_naming_the_region(s3, tmp_path):
    """S3 holding the package is not enough (FSx loads file data on first read): without the region's
    resident marker, or with one written for other bytes, the start is refused and no stack file changes."""
    config_dir = copy_stacks(tmp_path / "stacks")
    before = {p.name: p.read_text() for p in config_dir.iterdir()}
    rollout = Rollout(GraphRunner(config_dir, tmp_path / "state"), "chat-large", STACKS, Options(),
                      replicas=s3_replica_check(s3))
    _put(s3, "prod-us-east-1")
    _put(s3, "prod-us-west-2", warm=False)
    version = {"version": "2.5.0", "package": PACKAGE, "ioFingerprint": FINGERPRINT, "weightsGib": 132}
    with pytest.raises(RolloutError) as err:
        rollout.start(version)
    text = str(err.value)
    assert (f"prod-us-west-2: {PACKAGE} is not materialised on us-west-2's model cache: s3://acme-llm-prod-us-west-2/"
            f"cache-state/resident/us-west-2/chat-large/2.5.0.json does not exist") in text
    assert "prod-us-east-1:" not in text  # the home region is warm: only the cold region is named
    west = config_of("prod-us-west-2")
    s3(west.region).put_object(Bucket=west.bucket_name(),
                               Key=cache_state.resident_key(west.region, "chat-large", "2.5.0"),
                               Body=_marker(west.region, _manifest(tensor=4)))
    with pytest.raises(RolloutError, match=r"us-west-2's model cache: the marker was written for package.toml "
                                           r"[0-9a-f]{64}, the published one is [0-9a-f]{64}"):
        rollout.start(version)
    assert {p.name: p.read_text() for p in config_dir.iterdir()} == before
    _put(s3, "prod-us-west-2")
    assert s3_replica_check(s3)(west, PACKAGE, FINGERPRINT) is None  # warm with the published bytes: accepted


def test_a_package_whose_engine_layout_differs_from_the_stacks_declaration_is_refused(s3, tmp_path):
    """Chat-large declares tensor 8 over its 8 GPUs; a package built for tensor 4 is refused with both."""
    config_dir = copy_stacks(tmp_path / "stacks")
    rollout = Rollout(GraphRunner(config_dir, tmp_path / "state"), "chat-large", STACKS, Options(),
                      replicas=s3_replica_check(s3))
    for stack in STACKS:
        _put(s3, stack, tensor=4)
    with pytest.raises(RolloutError) as err:
        rollout.start({"version": "2.5.0", "package": PACKAGE, "ioFingerprint": FINGERPRINT})
    assert (f"{PACKAGE}: the stack declares parallel tensor 8 x pipeline 1 x data 1 = 8 GPU(s) for chat-large, the "
            f"published manifest's engine.parallel is tensor 4 x pipeline 1 x data 1 = 4 GPU(s)") in str(err.value)


def _python_manifest(dependencies: list[str], execution_env: str | None = None) -> str:
    env = f'execution_env = "{execution_env}"\nexecution_env_python = "3.11"\n' if execution_env else ""
    return (f'manifest_version = 1\n[model]\nid = "ranker"\nversion = "4.1.0"\nbackend = "python"\n'
            f'io_fingerprint = "{FINGERPRINT}"\n[python]\ndependencies = {dependencies!r}\n{env}').replace("'", '"')


def test_a_python_package_needing_what_the_stack_does_not_state_is_refused_naming_it():
    """The policy checks the stack's pythonDependencies against the image; a published package that imports
    more than the stack states would reach production unchecked, so the rollout's check names the requirement."""
    from infra.rollout.replication import dependencies_mismatch

    ranker = next(m for m in config_of("prod-us-west-2").models if m.id == "ranker")
    uri = "s3://acme-llm-prod-us-west-2/models/model-cache/ranker/4.1.0/"
    assert dependencies_mismatch(uri, _python_manifest(["xgboost==3.0.5", "numpy>=1.24"]), ranker) is None
    why = dependencies_mismatch(uri, _python_manifest(["xgboost==3.0.5", "lightgbm==4.5.0"]), ranker)
    assert why == (f"{uri}: the published manifest's python.dependencies need lightgbm==4.5.0, which the stack's "
                   f"pythonDependencies for ranker do not state ({ranker.python_dependencies}): add them so the "
                   f"policy checks them against the image")
    # a version the stack pins differently is not the stack's statement either
    assert "need xgboost==2.1.0" in dependencies_mismatch(uri, _python_manifest(["xgboost==2.1.0"]), ranker)
    # a package that brings its own environment is not the image's concern
    assert dependencies_mismatch(uri, _python_manifest(["lightgbm==4.5.0"], "python/env.tar.gz"), ranker) is None
