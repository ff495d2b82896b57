"""Pods fit nodes: the instance facts table and the memory capacity the kubelet reports, the pod sizes derived from
them, the schema's checks (weights and KV cache in GPU memory, load time at FSx's throughput) and the
`model-pod-fits-nodes` policy (docs/first-update.md, "Pods fit nodes")."""

from __future__ import annotations

import copy

import pytest

from infra import instances
from infra.config import ConfigError, parse_stack_config
from infra.instances import (
    INSTANCE_FACTS,
    KARPENTER_MEASURED,
    NODE_CAPACITY,
    RULE_ONLY,
    allocatable,
    karpenter_memory_mib,
    parse_quantity,
    pod_share,
)
from infra.mockrun import shipped_run
from infra.naming import CPU_NODE_GROUP_LABEL, GPU_NODE_GROUP_LABEL
from policies.offline import evaluate
from policies.rules.capacity import node_room, pod_needs, pools
from policies.rules.gpu_nodes import APPROVED_INSTANCE_TYPES
from tests.infra.conftest import config_of
from tests.infra.policy_support import compliant_stack, container, fired, inputs_of, messages, pod, write_compat

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
        for itype in types:  # by the kubelet's numbers, as the policy computes them (not the sizing code)
            node = node_room(itype)
            assert needs["cpu"] * 1000 <= node.cpu_millis and needs["memory"] <= node.memory_mib * 2**20
            assert needs["memory_limit"] <= node.memory_mib * 2**20 and needs["gpus"] <= node.gpus
            # ... and below the nominal size by at least Karpenter's 7.5 %, which is what its simulation assumes
            assert needs["memory"] <= karpenter_memory_mib(INSTANCE_FACTS[itype].memory_gib) * 2**20


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
    # 28 GiB fitted the nominal 32 GiB; by the kubelet's capacity a one-GPU g6.2xlarge pod gets 26.5 GiB.
    container(stack)["resources"]["requests"].update(cpu="6900m", memory="28Gi")
    container(stack)["resources"]["limits"].update(memory="28Gi")
    (shown,) = messages(stack.evaluate(compat), "model-pod-fits-nodes")
    assert "28.00 GiB memory requested, 26.63 GiB allocatable (kubelet memory capacity 30310 MiB" in shown
    container(stack)["resources"]["requests"].update(cpu="6900m", memory="27136Mi")
    container(stack)["resources"]["limits"].update(memory="27136Mi")
    assert stack.evaluate(compat) == []


def test_memory_limit_and_gpus_count(compat):
    stack = compliant_stack()
    container(stack)["resources"]["limits"].update(memory="400Gi")
    assert any("memory limit 400.00 GiB" in m for m in messages(stack.evaluate(compat), "model-pod-fits-nodes"))
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
    (server,) = [r for r in run.of_type(DEPLOYMENT) if "chat-small" in r.name
                 and r.inputs["metadata"]["labels"].get("app.kubernetes.io/component") == "model-server"]
    assert server.inputs["spec"]["template"]["spec"]["containers"][0]["resources"] == \
        pod_share(["g6.2xlarge", "g6.4xlarge"], 1, 1).resources()
    findings = evaluate(run.resources, run.stack, run.project, run.config)
    assert "model-pod-fits-nodes" not in fired(findings)


# -- memory capacity as the kubelet reports it ---------------------------------------------------------------------


def test_node_capacity_rows_are_their_source_and_never_above_karpenters_rule():
    assert set(NODE_CAPACITY) == set(INSTANCE_FACTS)
    for itype, node in NODE_CAPACITY.items():
        rule = karpenter_memory_mib(INSTANCE_FACTS[itype].memory_gib)
        assert rule == INSTANCE_FACTS[itype].memory_gib * 1024 * 925 // 1000  # nominal - 7.5 %, rounded down
        expected = rule if node.measured_mib is None else min(rule, node.measured_mib)
        assert node.kubelet_memory_mib == expected, itype
        assert node.source.startswith("rule, no measured source") == (node.measured_mib is None), itype
        if node.measured_mib is not None:
            assert node.source == KARPENTER_MEASURED and node.measured_mib < INSTANCE_FACTS[itype].memory_gib * 1024
    # The types with a published measurement (Karpenter's generated overheads): 2.6-3.6 % below nominal, above the
    # rule; every other type takes the rule and says so.
    assert {t for t, n in NODE_CAPACITY.items() if n.measured_mib} == {
        "g5.xlarge", "g5.2xlarge", "g5.4xlarge", "g5.8xlarge", "g5.12xlarge", "g5.48xlarge"}
    assert NODE_CAPACITY["p5.48xlarge"].source == RULE_ONLY
    # Max pods, the kubelet's kube-reserved basis: the ENI limits of eni-max-pods.txt, not a round 110/250.
    assert {t: NODE_CAPACITY[t].max_pods for t in ("p5.48xlarge", "g6e.48xlarge", "g5.12xlarge", "g6.2xlarge")} == {
        "p5.48xlarge": 100, "g6e.48xlarge": 492, "g5.12xlarge": 737, "g6.2xlarge": 58}


def test_policy_and_program_compute_the_same_room_independently():
    # Two computations from the same table columns (infra.instances for sizing, the policy's own restatement of the
    # kubelet's formulas): they agree on every type, so neither hides a slip of the other.
    for itype in INSTANCE_FACTS:
        room, program = node_room(itype), allocatable(itype)
        assert room.memory_mib == program.memory_mib and room.gpus == program.gpus, itype
        assert abs(room.cpu_millis - program.cpu_millis) < 1, itype
        assert room.memory_mib < INSTANCE_FACTS[itype].memory_gib * 1024 * 0.925


def _old_nominal_memory_mib(itype: str) -> int:
    """The pod memory the sizing once gave: nominal memory, max pods 110/250 (the defect)."""
    f = INSTANCE_FACTS[itype]
    pods = 110 if f.vcpus < 30 else 250
    return (f.memory_gib * 1024 - (255 + 11 * pods) - 100 - 2048) // 256 * 256


def test_a_pod_sized_from_nominal_memory_is_refused_naming_type_request_and_capacity():
    run = copy.deepcopy(shipped_run("prod-us-east-1"))
    servers = [r for r in run.of_type(DEPLOYMENT) if r.name.startswith("chat-large-")]
    assert servers
    old = _old_nominal_memory_mib("p5.48xlarge")
    assert old == 2091776  # 2042.75 Gi, a request that stayed Pending forever
    for server in servers:
        resources = server.inputs["spec"]["template"]["spec"]["containers"][0]["resources"]
        resources["requests"]["memory"] = resources["limits"]["memory"] = f"{old}Mi"
    findings = evaluate(run.resources, run.stack, run.project, run.config)
    shown = messages(findings, "model-pod-fits-nodes")
    assert len(shown) == len(servers)
    assert all("does not fit a p5.48xlarge node of pool 'h100'" in m for m in shown)
    assert all("2042.75 GiB memory requested, 1890.98 GiB allocatable (kubelet memory capacity 1939865 MiB "
               "(infra/instances.py NODE_CAPACITY) - kube-reserved 1355 MiB - eviction 100 MiB - DaemonSets 2048 MiB "
               "= 1936362 MiB)" in m for m in shown)
    assert all("memory limit 2042.75 GiB above" in m for m in shown)


def test_the_policy_does_not_use_the_sizing_code(compat, monkeypatch):
    # The policy must not agree with a sizing bug: with the program's allocatable() and pod_share() broken, it still
    # computes every node's room, passes the compliant pod and refuses a pod sized from nominal memory.
    def broken(*_args, **_kwargs):
        raise AssertionError("the policy called the sizing code")

    for name in ("allocatable", "pod_share", "cpu_pod_share", "kube_reserved_memory_mib", "kube_reserved_cpu_millis"):
        monkeypatch.setattr(instances, name, broken)
    stack = compliant_stack()
    assert stack.evaluate(compat) == []
    old = _old_nominal_memory_mib("g6e.12xlarge")  # the whole node's old, nominal share, on one pod
    container(stack)["resources"]["requests"]["memory"] = container(stack)["resources"]["limits"]["memory"] = \
        f"{old}Mi"
    (shown,) = messages(stack.evaluate(compat), "model-pod-fits-nodes")
    assert "does not fit a g6e.12xlarge node" in shown and "kubelet memory capacity 363724 MiB" in shown


# -- weights and KV cache in GPU memory; load time at FSx's throughput ---------------------------------------------


def _prod_values(stack: str = "prod-us-east-1"):
    cfg = config_of(stack)
    return cfg.model_dump(by_alias=True, exclude={"region"}, exclude_none=True)


def test_a_vllm_model_declares_its_sizes():
    values = _prod_values()
    del values["models"][0]["versions"][1]["weightsGib"]
    with pytest.raises(ConfigError, match=r"llm-serving:models\[0\]\.versions\[1\]\.weightsGib: a vllm model "
                                          r"declares each version's weights size in GiB"):
        parse_stack_config(values, "us-east-1")
    values = _prod_values()
    del values["models"][1]["kvCacheGib"]
    with pytest.raises(ConfigError, match=r"llm-serving:models\[1\]\.kvCacheGib: a vllm model declares the KV cache"):
        parse_stack_config(values, "us-east-1")
    values = _dev_values()
    ranker = next(m for m in values["models"] if m["id"] == "ranker")
    ranker["kvCacheGib"] = 1
    with pytest.raises(ConfigError, match=r"kvCacheGib: only a vllm model \(an LLM engine\) keeps a KV cache; this "
                                          r"model is kind: python"):
        parse_stack_config(values, "us-east-1")
    values = _prod_values()
    values["models"][0]["versions"][0]["weightsGib"] = 0
    with pytest.raises(ConfigError, match=r"models\[0\]\.versions\[0\]\.weightsGib: Input should be greater than 0"):
        parse_stack_config(values, "us-east-1")


def test_weights_and_kv_cache_must_fit_the_pods_gpu_memory():
    # chat-large on 8 x L40S (prod-eu-west-1): 132 + 160 = 292 GiB of 8 x 48 x 0.9 = 345.6 GiB; a 180B-class
    # version (360 GiB of weights) does not fit, and the message names every number.
    values = _prod_values("prod-eu-west-1")
    values["models"][0]["versions"][0]["weightsGib"] = 360
    with pytest.raises(ConfigError) as err:
        parse_stack_config(values, "eu-west-1")
    assert str(err.value) == (
        "llm-serving:models[0].versions[0].weightsGib: chat-large 2.3.0 does not fit its pod's GPUs: weightsGib 360 + "
        "kvCacheGib 160 = 520 GiB, the GPU memory the engine may use: 8 x 48 GiB (L40S, g6e.48xlarge, the pool's "
        "least GPU memory) x gpu_memory_utilization 0.9 = 345.6 GiB; give it more GPUs (gpu.count), a pool with more "
        "GPU memory, or a smaller kvCacheGib")
    # A KV cache too large for one L4 (dev's chat-small: 6 + 16 > 24 x 0.9 = 21.6).
    values = _dev_values()
    values["models"][0]["kvCacheGib"] = 16
    with pytest.raises(ConfigError, match=r"weightsGib 6 \+ kvCacheGib 16 = 22 GiB, .* 1 x 24 GiB \(L4, g6.2xlarge, "
                                          r".* = 21.6 GiB"):
        parse_stack_config(values, "us-east-1")


def test_every_engine_a_packages_tasks_start_is_budgeted():
    """Chat-large on 8 x L40S fits with one engine (132 + 160 of 345.6 GiB); serving `generate` and `embed` it
    starts two engines, each loading the 132 GiB of weights, in shares of 0.45: refused, naming the tasks. Each
    engine's share is what the Deployment renders for the serving side (pc.ENV_ENGINE_MEMORY)."""
    values = _prod_values("prod-eu-west-1")
    values["models"][0]["tasks"] = ["generate", "embed"]
    with pytest.raises(ConfigError) as err:
        parse_stack_config(values, "eu-west-1")
    assert str(err.value) == (
        "llm-serving:models[0].versions[0].weightsGib: chat-large 2.3.0 does not fit its pod's GPUs: tasks generate, "
        "embed start 2 engines, each loading the weights: 2 x weightsGib 132 + kvCacheGib 160 = 424 GiB, the GPU "
        "memory the engines may use: 8 x 48 GiB (L40S, g6e.48xlarge, the pool's least GPU memory) x "
        "gpu_memory_utilization 0.9 (0.45 per engine) = 345.6 GiB; give it more GPUs (gpu.count), a pool with more "
        "GPU memory, a smaller kvCacheGib or fewer tasks")
    values["models"][0]["kvCacheGib"] = 64  # 2 x 132 + 64 = 328 GiB: fits the two shares
    config = parse_stack_config(values, "eu-west-1")
    assert config.models[0].engine_tasks == ("generate", "embed")
    for bad, message in ((["embed", "embed"], "lists a task twice"), (["score"], "'score' needs 'generate'")):
        values["models"][0]["tasks"] = bad
        with pytest.raises(ConfigError, match=rf"models\[0\]\.tasks: .*{message}"):
            parse_stack_config(values, "eu-west-1")
    values = _dev_values()
    ranker = next(m for m in values["models"] if m["id"] == "ranker")
    ranker["tasks"] = ["generate"]
    with pytest.raises(ConfigError, match=r"tasks: only a vllm model starts engines per task; this model is kind: "
                                          r"python"):
        parse_stack_config(values, "us-east-1")


def test_the_smallest_gpu_memory_of_the_pool_counts():
    values = _prod_values()
    group = next(g for g in values["cluster"]["gpuNodeGroups"] if g["name"] == "h100")
    group["instanceTypes"] = ["p5e.48xlarge", "p5.48xlarge"]  # H200 141 GiB and H100 80 GiB, 8 each
    values["models"][0]["kvCacheGib"] = 500  # 132 + 500 > 8 x 80 x 0.9 = 576 (it would fit 8 x 141 x 0.9)
    with pytest.raises(ConfigError, match=r"8 x 80 GiB \(H100, p5.48xlarge, the pool's least GPU memory\)"):
        parse_stack_config(values, "us-east-1")


def test_weights_must_be_readable_from_fsx_within_load_time():
    # prod-us-west-2: FSx 2400 GiB x 250 MB/s/TiB = 585.9 MB/s; chat-large's 2 replicas read 132 GiB each at once:
    # 484 s + 120 s of engine start = 604 s, within 1200 s. At loadTimeSeconds 600 it is refused with the numbers.
    values = _prod_values("prod-us-west-2")
    values["models"][0]["loadTimeSeconds"] = 600
    with pytest.raises(ConfigError) as err:
        parse_stack_config(values, "us-west-2")
    assert str(err.value) == (
        "llm-serving:models[0].loadTimeSeconds: chat-large 2.3.0: 2 pod(s) reading weightsGib 132 at once from FSx at "
        "585.938 MB/s (perUnitStorageThroughput 250 MB/s/TiB x storageCapacityGib 2400 / 1024) take 484 s, plus 120 s "
        "for the engine's start: 604 s needed, loadTimeSeconds 600; the startup probe would restart the pods before "
        "they are ready. Raise loadTimeSeconds or the model cache's throughput (modelStorage.fsx)")
    # More throughput makes the same budget enough; KEDA's maximum counts as pods starting at once.
    values["modelStorage"]["fsx"]["perUnitStorageThroughput"] = 500
    parse_stack_config(values, "us-west-2")
    values["models"][0]["autoscaling"] = {"maxReplicas": 6}
    with pytest.raises(ConfigError, match=r"6 pod\(s\) reading weightsGib 132 at once"):
        parse_stack_config(values, "us-west-2")
