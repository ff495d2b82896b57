"""Reaching a private cluster's API server on the update that creates it (docs/first-update.md): the runner's
security group rule, the bootstrap window's restricted public endpoint, and the policies around them."""

from __future__ import annotations

import copy

import pytest

from infra.config import ConfigError
from infra.mockrun import run_stack, shipped_run
from policies.offline import evaluate
from tests.infra.conftest import config_of
from tests.infra.policy_support import compliant_stack, fired, inputs_of, messages, write_compat

CLUSTER = "aws:eks/cluster:Cluster"
RULE = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"


def test_private_clusters_admit_their_runner_on_443(stack):
    run, cfg = stack
    (cluster,) = run.of_type(CLUSTER)
    runner_rules = [r for r in run.of_type(RULE) if "-api-runner-" in r.name]
    assert [r.inputs["cidrIpv4"] for r in runner_rules] == cfg.cluster.api_access.runner_cidrs
    for rule in runner_rules:
        assert (rule.inputs["fromPort"], rule.inputs["toPort"], rule.inputs["ipProtocol"]) == (443, 443, "tcp")
        assert cluster.urn in rule.dependencies
    if cfg.environment == "prod":
        assert cluster.inputs["vpcConfig"]["endpointPublicAccess"] is False and runner_rules
        findings = evaluate(run.resources, run.stack, run.project, run.config)
        assert "eks-api-reachable-from-runner" not in fired(findings)


def _bootstrap_overrides(cidrs):
    cluster = config_of("prod-us-east-1").cluster.model_dump(by_alias=True, exclude_none=True)
    cluster["apiAccess"]["bootstrapPublicCidrs"] = cidrs
    return {"cluster": cluster}


def test_first_update_opens_the_public_endpoint_to_the_runner_only():
    run = run_stack("prod-us-east-1", config_overrides=_bootstrap_overrides(["203.0.113.7/32"]))
    (cluster,) = run.of_type(CLUSTER)
    assert cluster.inputs["vpcConfig"]["endpointPublicAccess"] is True
    assert cluster.inputs["vpcConfig"]["publicAccessCidrs"] == ["203.0.113.7/32"]
    assert cluster.inputs["vpcConfig"]["endpointPrivateAccess"] is True
    findings = evaluate(run.resources, run.stack, run.project, run.config)
    assert [f for f in findings if f.blocking] == []


def test_bootstrap_window_must_name_the_runner():
    with pytest.raises(ConfigError, match=r"bootstrapPublicCidrs.*'0.0.0.0/0' is wider than /24"):
        run_stack("prod-us-east-1", config_overrides=_bootstrap_overrides(["0.0.0.0/0"]))


@pytest.fixture
def compat(tmp_path):
    return write_compat(tmp_path)


def test_public_prod_endpoint_outside_a_bootstrap_window(compat):
    stack = compliant_stack()
    inputs_of(stack, "cluster")["vpcConfig"].update(endpointPublicAccess=True, publicAccessCidrs=["203.0.113.7/32"])
    assert "eks-private-endpoint-in-prod" in fired(stack.evaluate(compat))
    stack.config["llm-serving:cluster"] = {"apiAccess": {"bootstrapPublicCidrs": ["203.0.113.7/32"]}}
    assert "eks-private-endpoint-in-prod" not in fired(stack.evaluate(compat))
    inputs_of(stack, "cluster")["vpcConfig"]["publicAccessCidrs"] = ["0.0.0.0/0"]
    assert "eks-private-endpoint-in-prod" in fired(stack.evaluate(compat))


def test_private_endpoint_nobody_can_reach(compat):
    stack = compliant_stack()
    stack.remove("cluster-api-runner")
    findings = stack.evaluate(compat)
    assert fired(findings) == {"eks-api-reachable-from-runner"}
    assert "no security group rule lets a runner reach it on TCP 443" in messages(
        findings, "eks-api-reachable-from-runner")[0]


def test_shipped_prod_run_without_runner_rule_is_reported():
    run = copy.deepcopy(shipped_run("prod-us-east-1"))
    run.resources[:] = [r for r in run.resources if "-api-runner-" not in r.name]
    findings = evaluate(run.resources, run.stack, run.project, run.config)
    assert "eks-api-reachable-from-runner" in fired(findings)
