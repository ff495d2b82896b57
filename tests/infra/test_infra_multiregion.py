"""Multi-region artifacts (docs/first-update.md, "Regions"): one serving image build in the home region, replicated
by ECR, so every region runs the same digest; and the `ecr-one-build-replicated` policy."""

from __future__ import annotations

import pytest

from infra.mockrun import shipped_run, shipped_stacks
from tests.infra.conftest import config_of
from tests.infra.policy_support import compliant_stack, fired, messages, write_compat

IMAGE = "docker-build:index:Image"
REPLICATION = "aws:ecr/replicationConfiguration:ReplicationConfiguration"
PROD = [s for s in shipped_stacks() if s.startswith("prod-")]


def _digest(ref: str) -> str:
    return ref.rsplit("@", 1)[1]


def test_every_prod_region_runs_the_home_regions_digest():
    home = shipped_run("prod-us-east-1")
    assert len(home.of_type(IMAGE)) == 1
    for stack in PROD:
        run, cfg = shipped_run(stack), config_of(stack)
        assert _digest(run.outputs["servingImage"]) == _digest(home.outputs["servingImage"]), stack
        # Each region pulls from its own registry (the replica), never across regions.
        assert f".dkr.ecr.{cfg.region}.amazonaws.com/" in run.outputs["servingImage"]
        if cfg.is_home_region:
            continue
        assert run.of_type(IMAGE) == []
        (ref,) = run.of_type("pulumi:pulumi:StackReference")
        assert ref.inputs["name"].endswith(f"/llm-serving/{cfg.environment}-{cfg.home_region}")
        for deployment in run.of_type("kubernetes:apps/v1:Deployment"):
            for container in deployment.inputs["spec"]["template"]["spec"]["containers"]:
                if "model-server" in container["image"]:
                    assert f".dkr.ecr.{cfg.region}.amazonaws.com/" in container["image"]


def test_home_region_replicates_its_repository_to_every_replica_region():
    run, cfg = shipped_run("prod-us-east-1"), config_of("prod-us-east-1")
    (replication,) = run.of_type(REPLICATION)
    (rule,) = replication.inputs["replicationConfiguration"]["rules"]
    assert {d["region"] for d in rule["destinations"]} == {r.region for r in cfg.model_storage.replica_regions}
    (repo,) = run.of_type("aws:ecr/repository:Repository")
    assert rule["repositoryFilters"] == [{"filter": repo.inputs["name"], "filterType": "PREFIX_MATCH"}]
    # The replica regions own their repository (same name, their key) before the home region replicates into it.
    for region_stack in ("prod-us-west-2", "prod-eu-west-1"):
        (replica_repo,) = shipped_run(region_stack).of_type("aws:ecr/repository:Repository")
        assert replica_repo.inputs["name"] == repo.inputs["name"]


@pytest.fixture
def compat(tmp_path):
    return write_compat(tmp_path)


def _multi_region(stack):
    stack.config["llm-serving:homeRegion"] = "us-east-1"
    stack.config["llm-serving:modelStorage"] = {"replicaRegions": [{"region": "us-west-2"}]}
    stack.add(REPLICATION, "image-replication", {"replicationConfiguration": {"rules": [{
        "destinations": [{"region": "us-west-2", "registryId": "123456789012"}],
        "repositoryFilters": [{"filter": "llm-serving", "filterType": "PREFIX_MATCH"}]}]}})
    return stack


def test_home_region_without_replication(compat):
    stack = _multi_region(compliant_stack("prod-us-east-1"))
    assert stack.evaluate(compat) == []
    stack.remove("image-replication")
    findings = stack.evaluate(compat)
    assert fired(findings) == {"ecr-one-build-replicated"}
    assert "does not replicate it to us-west-2" in messages(findings, "ecr-one-build-replicated")[0]


def test_other_region_building_its_own_image(compat):
    stack = compliant_stack("prod-us-west-2")
    stack.config["llm-serving:homeRegion"] = "us-east-1"
    findings = stack.evaluate(compat)
    shown = messages(findings, "ecr-one-build-replicated")
    assert any("builds its own serving image ('serving-image') outside the home region" in m for m in shown)
    assert any("does not read its home region's serving image" in m for m in shown)
