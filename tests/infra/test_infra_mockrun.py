"""The mock runner's contract (infra/mockrun.py), which the policies and the rollout tool code against."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from infra.mockrun import MockedResource, StackRunError, run_stack, shipped_run, stack_config_path


def test_records_carry_type_urn_inputs_parent_dependencies_timeouts_and_provider():
    run = shipped_run("prod-us-east-1")
    assert run.stack == "prod-us-east-1" and run.project == "llm-serving"
    assert run.config["aws:region"] == "us-east-1" and run.config["llm-serving:environment"] == "prod"
    by_urn = run.by_urn()
    assert len(by_urn) == len(run.resources)  # URNs are unique
    for r in run.resources:
        assert isinstance(r, MockedResource)
        assert r.urn.startswith("urn:pulumi:prod-us-east-1::llm-serving::") and r.urn.endswith(f"::{r.name}")
        assert r.parent is None or r.parent in by_urn, r
        assert all(d in by_urn for d in r.dependencies), r
    components = {r.name: r for r in run.resources if not r.custom}
    assert {"network", "eks", "storage", "serving-image", "platform", "chat-large", "embed-base"} <= set(components)
    assert components["eks"].parent is None  # the stack's direct children have no parent
    node_group = run.find("aws:eks/nodeGroup:NodeGroup", "eks-gpu-h100")
    assert node_group.parent == components["eks"].urn
    assert node_group.inputs["amiType"] == "AL2023_x86_64_NVIDIA"  # camelCase keys, as the engine receives them
    assert run.find("aws:eks/cluster:Cluster", "eks").urn in node_group.dependencies  # implicit, from cluster.name
    deployment = run.find("kubernetes:apps/v1:Deployment", "chat-large-2-4-0-deployment")
    assert deployment.custom_timeouts and set(deployment.custom_timeouts) == {"create", "update", "delete"}
    assert deployment.provider and "::eks-k8s::" in deployment.provider
    assert deployment.inputs["spec"]["replicas"] == 1 and isinstance(deployment.inputs["spec"]["replicas"], int)
    assert node_group.custom_timeouts is None


def test_a_config_file_other_than_the_shipped_one(tmp_path: Path):
    doc = yaml.safe_load(stack_config_path("prod-us-east-1").read_text())
    chat = next(m for m in doc["config"]["llm-serving:models"] if m["id"] == "chat-large")
    chat["weight"] = 50
    edited = tmp_path / "Pulumi.prod-us-east-1.yaml"
    edited.write_text(yaml.safe_dump(doc))
    run = run_stack("prod-us-east-1", config_file=edited)
    assert run.outputs["models"]["chat-large"]["routeWeights"] == {"2.3.0": 50, "2.4.0": 50}
    assert run.config["llm-serving:models"][0]["weight"] == 50


def test_a_stack_that_does_not_exist_is_an_error_naming_the_shipped_ones():
    with pytest.raises(StackRunError) as info:
        run_stack("staging-mars-1")
    assert "staging-mars-1" in str(info.value) and "prod-us-east-1" in str(info.value)
