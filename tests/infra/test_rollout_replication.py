"""`llm-serving rollout start` refuses a package that has not replicated to every named region yet, checked against
the store (moto's S3 in place of the real buckets), and changes nothing (infra/rollout/replication.py)."""

from __future__ import annotations

import boto3
import pytest
from moto import mock_aws

from infra.rollout.orchestrate import Options, Rollout, RolloutError
from infra.rollout.replication import regional_location, s3_replica_check
from infra.rollout.runner import GraphRunner
from tests.infra.conftest import config_of
from tests.infra.rollout_support import copy_stacks

PACKAGE = "s3://acme-llm-prod-us-east-1/models/chat-large/2.5.0.tar.gz"
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


def _put(s3, stack: str) -> None:
    cfg = config_of(stack)
    bucket, key = regional_location(cfg, PACKAGE)
    s3(cfg.region).put_object(Bucket=bucket, Key=key, Body=b"package")


def test_the_replica_is_looked_up_in_each_regions_own_bucket(s3):
    check = s3_replica_check(s3)
    home, west = config_of("prod-us-east-1"), config_of("prod-us-west-2")
    assert regional_location(west, PACKAGE) == ("acme-llm-prod-us-west-2", "models/chat-large/2.5.0.tar.gz")
    assert "is not published" in check(home, PACKAGE)
    _put(s3, "prod-us-east-1")
    assert check(home, PACKAGE) is None
    why = check(west, PACKAGE)
    assert why.startswith(f"{PACKAGE} has not replicated to us-west-2 yet: "
                          "s3://acme-llm-prod-us-west-2/models/chat-large/2.5.0.tar.gz does not exist")
    _put(s3, "prod-us-west-2")
    assert check(west, PACKAGE) is None


def test_start_refuses_before_touching_any_stack(s3, tmp_path):
    config_dir = copy_stacks(tmp_path / "stacks")
    before = {p.name: p.read_text() for p in config_dir.iterdir()}
    runner = GraphRunner(config_dir, tmp_path / "state")
    rollout = Rollout(runner, "chat-large", STACKS, Options(), replicas=s3_replica_check(s3))
    _put(s3, "prod-us-east-1")
    version = {"version": "2.5.0", "package": PACKAGE,
               "ioFingerprint": config_of("prod-us-east-1").models[0].versions[0].io_fingerprint}
    with pytest.raises(RolloutError, match=r"cannot be rolled out yet \(nothing was changed\):\n  prod-us-west-2: "
                                           r".* has not replicated to us-west-2 yet"):
        rollout.start(version)
    assert {p.name: p.read_text() for p in config_dir.iterdir()} == before
