"""Pods fit nodes: the instance facts table, the pod sizes derived from it, the schema's checks and the
`model-pod-fits-nodes` policy (issue 18, "Pods fit nodes")."""

from __future__ import annotations

import copy

import pytest

from infra.config import ConfigError, parse_stack_config
from infra.instances import INSTANCE_FACTS, allocatable, parse_quantity, pod_share
from infra.mockrun import shipped_run
from infra.naming import CPU_NODE_GROUP_LABEL, GPU_NODE_GROUP_LABEL
from policies.offline import evaluate
from policies.rules.capacity import pod_needs, pools
from policies.rules.gpu_nodes import APPROVED_INSTANCE_TYPES
from policies.synthetic import compliant_stack, container, fired, inputs_of, messages, pod, write_compat
from tests.infra.conftest import config_of

DEPLOYMENT = "kubernetes:apps/v1:Deployment"


def test_table_covers_every_approved_and_shipped_type(stack):
    run, cfg = stack
    approved = set().union(*APPROVED_INSTANCE_TYPES.values())
    assert approved - set(INSTANCE_FACTS) == set()
    launched = {t for r in run.of_type("aws:eks/nodeGroup:NodeGroup") for t in r.inputs["instanceTypes"]}
    launched |= {t for p in pools_of(run).values() for t in p}
    assert launched and launched <= set(INSTANCE_FACTS)
    for group in cfg.cluster.gpu_node_groups:
        assert {INSTANCE_FACTS[t].gpus for t in group.instance_types} == {group.gpus_per_node}


def pools_of(run, label: str = GPU_NODE_GROUP_LABEL):
    from policies.index import StackIndex
    from policies.offline import to_policy_resources

    return pools(StackIndex(to_policy_resources(run.resources)), label)


def test_every_model_pod_fits_every_type_of_its_pool(stack):
    run, cfg = stack
    by_pool = pools_of(run)
    servers = [r for r in run.of_type(DEPLOYMENT)
               if r.inputs["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component")
               == "model-server"]
    assert len(servers) >= len(cfg.models)
    cpu_pools = pools_of(run, CPU_NODE_GROUP_LABEL)
    for deployment in servers:
        selector = deployment.inputs["spec"]["template"]["spec"]["nodeSelector"]
        needs = pod_needs(deployment.inputs)
        model = next(m for m in cfg.models if deployment.name.startswith(f"{m.id}-"))
        if model.gpu is None:  # a model without GPUs: its CPU node group, no GPU
            assert GPU_NODE_GROUP_LABEL not in selector and needs["gpus"] == 0
            types = cpu_pools[selector[CPU_NODE_GROUP_LABEL]]
        else:
            assert needs["gpus"] >= 1
            types = by_pool[selector[GPU_NODE_GROUP_LABEL]]
        assert types
        for itype in types:
            node = allocatable(itype)
            assert needs["cpu"] * 1000 <= node.cpu_millis and needs["memory"] <= node.memory_mib * 2**20
            assert needs["memory_limit"] <= node.memory_mib * 2**20 and needs["gpus"] <= node.gpus


def test_shares_pack_a_node():
    # Four one-GPU pods of a g6e.12xlarge fit its allocatable; one pod per GPU of a mixed pool fits the smallest.
    share = pod_share(["g6e.12xlarge"], 4, 1)
    node = allocatable("g6e.12xlarge")
    assert 4 * share.cpu_millis <= node.cpu_millis and 4 * share.memory_mib <= node.memory_mib
    mixed = pod_share(["g6.4xlarge", "g6.2xlarge"], 1, 1)
    assert mixed == pod_share(["g6.2xlarge"], 1, 1)
    assert mixed.cpu_millis < 8000 and mixed.memory_mib < 32 * 1024  # what the old fixed 8 CPU / 64 GiB exceeded
    assert parse_quantity("6900m") == pytest.approx(6.9) and parse_quantity("2Gi") == 2**31


def _dev_values():
    cfg = config_of("dev-us-east-1")
    return cfg.model_dump(by_alias=True, exclude={"region"}, exclude_none=True)


def test_schema_refuses_unknown_type_and_wrong_gpu_count():
    values = _dev_values()
    values["cluster"]["gpuNodeGroups"][0]["instanceTypes"] = ["g6.2xlarge", "g6.16xlarge"]
    with pytest.raises(ConfigError, match=r"instanceTypes: \['g6.16xlarge'\] not in the instance facts table"):
        parse_stack_config(values, "us-east-1")
    values = _dev_values()
    values["cluster"]["gpuNodeGroups"][0]["instanceTypes"] = ["g6.2xlarge", "g6.12xlarge"]
    with pytest.raises(ConfigError, match=r"gpusPerNode: 1, but \{'g6.12xlarge': 4\}"):
        parse_stack_config(values, "us-east-1")
    values = _dev_values()
    values["cluster"]["systemNodeGroup"]["instanceTypes"] = ["t3.nano"]
    with pytest.raises(ConfigError, match="systemNodeGroup.instanceTypes: .*not in the instance facts table"):
        parse_stack_config(values, "us-east-1")


# -- the policy on the synthetic stack -----------------------------------------------------------------------------


@pytest.fixture
def compat(tmp_path):
    return write_compat(tmp_path)


def test_old_fixed_requests_do_not_fit_a_small_type_of_the_pool(compat):
    stack = compliant_stack("dev-us-east-1")
    inputs_of(stack, "gpu")["instanceTypes"] = ["g6.4xlarge", "g6.2xlarge"]
    findings = stack.evaluate(compat)
    assert fired(findings) == {"model-pod-fits-nodes"}
    shown = [m for m in messages(findings, "model-pod-fits-nodes") if "g6.2xlarge" in m]
    assert len(shown) == 1 and "does not fit a g6.2xlarge node of pool 'gpu'" in shown[0]
    assert "8 CPU requested, 6.91 allocatable" in shown[0]
    container(stack)["resources"]["requests"].update(cpu="6900m", memory="28Gi")
    container(stack)["resources"]["limits"].update(memory="28Gi")
    assert stack.evaluate(compat) == []


def test_memory_limit_and_gpus_count(compat):
    stack = compliant_stack()
    container(stack)["resources"]["limits"].update(memory="400Gi")
    assert any("memory limit 400.0 GiB" in m for m in messages(stack.evaluate(compat), "model-pod-fits-nodes"))
    stack = compliant_stack()
    for section in ("requests", "limits"):
        container(stack)["resources"][section]["nvidia.com/gpu"] = "8"
    shown = messages(stack.evaluate(compat), "model-pod-fits-nodes")
    assert any("8 GPUs requested, the node has 4" in m for m in shown)


def test_pod_without_pool_or_pool_without_nodes(compat):
    stack = compliant_stack()
    del pod(stack)["nodeSelector"]
    assert any("has no nodeSelector" in m for m in messages(stack.evaluate(compat), "model-pod-fits-nodes"))
    stack = compliant_stack()
    pod(stack)["nodeSelector"]["llm-serving/gpu-node-group"] = "h200"
    assert any("selects GPU pool 'h200', but no node group or NodePool" in m
               for m in messages(stack.evaluate(compat), "model-pod-fits-nodes"))


def test_karpenter_node_pool_types_count(compat):
    stack = compliant_stack()
    inputs_of(stack, "gpu-pool")["spec"]["template"]["spec"]["requirements"][0]["values"].append("g6e.xlarge")
    shown = messages(stack.evaluate(compat), "model-pod-fits-nodes")
    assert len(shown) == 1 and "g6e.xlarge" in shown[0]


def test_shipped_pods_are_the_program_derived_share():
    run = copy.deepcopy(shipped_run("dev-us-east-1"))
    (server,) = [r for r in run.of_type(DEPLOYMENT) if "chat-small" in r.name]
    assert server.inputs["spec"]["template"]["spec"]["containers"][0]["resources"] == \
        pod_share(["g6.2xlarge", "g6.4xlarge"], 1, 1).resources()
    findings = evaluate(run.resources, run.stack, run.project, run.config)
    assert "model-pod-fits-nodes" not in fired(findings)
